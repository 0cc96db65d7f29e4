"""Where a training run stands, in one object that a checkpoint saves and a resume loads.

What a resumed run needs to end bitwise where the uninterrupted one would, beyond the model and
the optimizer (the engine's, see :mod:`tandem.parallel.engine`):

- the epoch, the optimizer steps taken and the batches of the epoch handed out: checkpoints are
  taken only at step boundaries, so no gradient accumulation is cut in half;
- the sampler's position, counted as batches consumed x batch size, not the sampler's own count
  (a DataLoader draws indices ahead of the batch it yields);
- every rank's RNG states, restored by each rank just before training goes on (nothing between
  the load and that point may draw);
- every rank's running loss sums of the epoch, so even the reported losses repeat;
- the metrics history and the run's clock.

The shared part is :meth:`RunState.state_dict`; the per-rank part (RNG, loss sums) is
:meth:`RunState.rank_state_dict`, which the checkpointer gathers from every rank and hands back
with :meth:`RunState.load_rank_state_dicts`. Stop and checkpoint requests
(:class:`tandem.train.stop_and_save.Requests`) live here too, but are never saved: a request is for
this session.

Resuming at another world size (a run saved by ``W`` processes continued by ``W'``) maps the
state by these rules; the run continues, but **not bitwise**: the global batch, the batches'
composition and the order of the gradient sums all change with ``W'``.

- **Samples**: the ranks had trained on a prefix of the epoch's order (``position * W``
  places, the sampler deals like cards); the rest of the epoch is dealt to the ``W'`` ranks
  (:class:`tandem.data.DistributedSampler`), so no sample is repeated or skipped (apart from
  the padding that makes the rest a multiple of ``W'``). The epoch's batch count restarts from
  ``batches per epoch at W' - batches the rest makes``, so the loop's arithmetic holds.
- **Steps, epoch, history, clock**: unchanged (they count the run, not the ranks).
- **Loss sums**: the saved ranks' sums and counts are added up and given to rank 0, the other
  ranks start from zero: the epoch's reported loss still averages every sample trained on.
- **RNG**: rank ``r < W`` continues with saved rank ``r``'s generators; a rank ``r >= W`` seeds
  Python's, NumPy's and torch's generators from ``(seed, step, r)`` (:func:`derived_seed`), so
  a resumed run is deterministic too.
- **Batch size and accumulation** may change along with the world size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.checkpoint.rng import capture_rng_state, derived_seed, restore_rng_state, seed_rng
from tandem.data.lookahead import position_vouched
from tandem.data.sampler import DistributedSampler
from tandem.train.stop_and_save import Requests


class RunState:
    """Epoch, step, sampler position, RNG states, metrics history and requests of one run.

    Args:
        sampler: the training sampler (its state is saved with the run's).
        world_size: processes in the run.
        batch_size: samples per rank per micro-batch.
        grad_accum_steps: micro-batches per optimizer step.

    Example::

        run = RunState(sampler, world_size=2, batch_size=32, grad_accum_steps=1)
        saved = run.state_dict(), [run.rank_state_dict()]      # every rank's, gathered
        run.load_state_dict(saved[0])
        run.load_rank_state_dicts(saved[1], rank)
        run.restore_rng()          # just before training goes on
    """

    def __init__(
        self, sampler: DistributedSampler, *, world_size: int, batch_size: int,
        grad_accum_steps: int,
    ) -> None:  # fmt: skip
        self.sampler = sampler
        self.world_size = world_size
        self.batch_size = batch_size
        self.grad_accum_steps = grad_accum_steps
        self.epoch = 0  # epochs completed = index of the epoch in progress
        self.step = 0  # optimizer steps taken
        self.batch = 0  # batches of the epoch in progress handed out
        # The epoch in progress as the sampler deals it: the batch at which its dealing began
        # and the places of its order trained on before (both 0 unless the epoch was resumed
        # at another world size; see the module doc).
        self.dealt_from = 0
        self.offset = 0
        self.epoch_loss: list[float] = [0.0, 0]  # this rank's loss sum and sample count
        self.epoch_seconds = 0.0  # training time of the epoch in progress
        self.history: list[dict[str, Any]] = []
        self.last_checkpoint: Path | None = None
        self.saved_world_size: int | None = None  # of the checkpoint resumed from, if any
        self.requests = Requests()
        self._elapsed_before = 0.0  # seconds of training in earlier sessions of the run
        self._session_start = time.monotonic()
        # Restored by restore_rng(): saved generator states, or a seed to derive them from.
        self._rng: dict[str, Any] | int | None = None

    # -- the clock ------------------------------------------------------------------------

    def start_session(self) -> None:
        """Count training time from now on (``train()`` starts)."""
        self._session_start = time.monotonic()

    def end_session(self) -> None:
        """Stop counting: the time so far is kept (``train()`` returns)."""
        self._elapsed_before = self.elapsed_seconds()
        self._session_start = time.monotonic()

    def elapsed_seconds(self) -> float:
        """Seconds of training in this run, over all its sessions (resumes)."""
        return self._elapsed_before + time.monotonic() - self._session_start

    # -- the epoch ------------------------------------------------------------------------

    def end_epoch(self, record: dict[str, Any]) -> None:
        """Close the epoch in progress: ``record`` joins the history; counts start over."""
        self.history.append(record)
        self.epoch, self.batch = self.epoch + 1, 0
        self.dealt_from = self.offset = 0
        self.epoch_loss, self.epoch_seconds = [0.0, 0], 0.0

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The part every rank shares (rank 0's is saved)."""
        # The one rule for where the sampler stands: the batches the run has consumed of the
        # sampler's dealing (its own count runs ahead by what the loader prefetched).
        consumed = (self.batch - self.dealt_from) * self.batch_size
        position = min(consumed, self.sampler.current_len())
        with position_vouched():
            sampler = self.sampler.state_dict()
        sampler.update(epoch=self.epoch, position=position, offset=self.offset)
        return {
            "world_size": self.world_size,
            "epoch": self.epoch,
            "step": self.step,
            "batch": self.batch,
            "dealt_from": self.dealt_from,
            "batch_size": self.batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "epoch_seconds": self.epoch_seconds,
            "elapsed": self.elapsed_seconds(),
            "sampler": sampler,
            "history": list(self.history),
        }

    def rank_state_dict(
        self, capture: Callable[[], dict[str, Any]] = capture_rng_state
    ) -> dict[str, Any]:
        """This rank's own part: its RNG states (as ``capture`` takes them) and its loss sums
        of the epoch."""
        return {"rng": capture(), "epoch_loss": list(self.epoch_loss)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; ValueError (on every rank alike) if this run cannot.

        At the same world size an epoch saved in its middle must be finished with the same
        batch size and accumulation, or its rest would be split differently from the
        uninterrupted run's. At another world size the rest of the epoch is dealt anew (see
        the module doc): nothing there could be bitwise, so those may change too.
        """
        resized = state["world_size"] != self.world_size
        if state["batch"] and not resized:
            for name in ("batch_size", "grad_accum_steps"):
                if state[name] != getattr(self, name):
                    raise ValueError(
                        f"was written mid-epoch with {name}={state[name]}; this run has "
                        f"{name}={getattr(self, name)}, which would split the rest of the epoch "
                        "differently. Resume with the same value, or from a checkpoint written "
                        "at an epoch's end"
                    )
        self.sampler.load_state_dict(state["sampler"])
        with position_vouched():
            self.offset = self.sampler.state_dict()["offset"]
        self.epoch, self.step = state["epoch"], state["step"]
        if resized:
            # The loop counts batches up to the epoch's count at this world size: start it
            # where the batches the rest of the epoch makes here are exactly those left.
            per_epoch = -(-len(self.sampler) // self.batch_size)
            left = -(-self.sampler.current_len() // self.batch_size)
            self.batch = self.dealt_from = per_epoch - left
        else:
            self.batch, self.dealt_from = state["batch"], state.get("dealt_from", 0)
        self.saved_world_size = state["world_size"]
        self.epoch_seconds = state["epoch_seconds"]
        self._elapsed_before, self._session_start = state["elapsed"], time.monotonic()
        self.history = list(state["history"])

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's own part; its RNG states wait for :meth:`restore_rng`."""
        self.epoch_loss = list(state["epoch_loss"])
        self._rng = state["rng"]

    def load_rank_state_dicts(self, states: list[dict[str, Any]], rank: int) -> None:
        """Take this rank's part of every saved rank's, in rank order, at any world size.

        The saved world's size is ``len(states)``; at this world size each rank takes its own
        entry, at another one the module doc's rules apply (loss sums added up on rank 0,
        generators continued or derived). Call after :meth:`load_state_dict`.

        Example::

            run.load_rank_state_dicts(checkpoint["trainer"]["ranks"], tandem.world().rank)
        """
        if len(states) == self.world_size:
            self.load_rank_state_dict(states[rank])
            return
        # Sums over ranks are what the epoch's end reduces: rank 0 carries the saved ones.
        sums = [sum(values) for values in zip(*(s["epoch_loss"] for s in states), strict=True)]
        self.epoch_loss = sums if rank == 0 else [type(v)(0) for v in sums]
        if rank < len(states):
            self._rng = states[rank]["rng"]
        else:
            self._rng = derived_seed("tandem-rng", self.sampler.seed, self.step, rank)

    def restore_rng(self) -> None:
        """Put back the loaded RNG states, once: call just before training goes on."""
        if isinstance(self._rng, int):
            seed_rng(self._rng)
        elif self._rng is not None:
            restore_rng_state(self._rng)
        self._rng = None
