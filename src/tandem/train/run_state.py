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
to each rank with :meth:`RunState.load_rank_state_dict`. Stop and checkpoint requests
(:class:`tandem.train.requests.Requests`) live here too, but are never saved: a request is for
this session.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tandem.data.sampler import DistributedSampler
from tandem.train.requests import Requests
from tandem.train.rng import capture_rng_state, restore_rng_state


class RunState:
    """Epoch, step, sampler position, RNG states, metrics history and requests of one run.

    Args:
        sampler: the training sampler (its state is saved with the run's).
        world_size: processes in the run.
        batch_size: samples per rank per micro-batch.
        grad_accum_steps: micro-batches per optimizer step.

    Example::

        run = RunState(sampler, world_size=2, batch_size=32, grad_accum_steps=1)
        saved = run.state_dict(), run.rank_state_dict()
        run.load_state_dict(saved[0])
        run.load_rank_state_dict(saved[1])
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
        self.epoch_loss: list[float] = [0.0, 0]  # this rank's loss sum and sample count
        self.epoch_seconds = 0.0  # training time of the epoch in progress
        self.history: list[dict[str, Any]] = []
        self.last_checkpoint: Path | None = None
        self.requests = Requests()
        self._elapsed_before = 0.0  # seconds of training in earlier sessions of the run
        self._session_start = time.monotonic()
        self._rng: dict[str, Any] | None = None  # restored by restore_rng()

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
        self.epoch_loss, self.epoch_seconds = [0.0, 0], 0.0

    # -- state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The part every rank shares (rank 0's is saved)."""
        # The one rule for where the sampler stands: the batches the run has consumed.
        position = min(self.batch * self.batch_size, len(self.sampler))
        return {
            "world_size": self.world_size,
            "epoch": self.epoch,
            "step": self.step,
            "batch": self.batch,
            "batch_size": self.batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "epoch_seconds": self.epoch_seconds,
            "elapsed": self.elapsed_seconds(),
            "sampler": {**self.sampler.state_dict(), "epoch": self.epoch, "position": position},
            "history": list(self.history),
        }

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own part: its RNG states and its loss sums of the epoch."""
        return {"rng": capture_rng_state(), "epoch_loss": list(self.epoch_loss)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; ValueError (on every rank alike) if this run cannot.

        Another world size cannot continue (the sampler's position and the RNG states are per
        rank of the saved world), and an epoch saved in its middle must be finished with the
        same batch size and accumulation, or its rest would be split differently.
        """
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"was written by a run of {state['world_size']} process(es); this run has "
                f"{self.world_size}. Resume with {state['world_size']} processes, or start a "
                "new run (resume=None) from its weights"
            )
        if state["batch"]:
            for name in ("batch_size", "grad_accum_steps"):
                if state[name] != getattr(self, name):
                    raise ValueError(
                        f"was written mid-epoch with {name}={state[name]}; this run has "
                        f"{name}={getattr(self, name)}, which would split the rest of the epoch "
                        "differently. Resume with the same value, or from a checkpoint written "
                        "at an epoch's end"
                    )
        self.sampler.load_state_dict(state["sampler"])
        self.epoch, self.step, self.batch = state["epoch"], state["step"], state["batch"]
        self.epoch_seconds = state["epoch_seconds"]
        self._elapsed_before, self._session_start = state["elapsed"], time.monotonic()
        self.history = list(state["history"])

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's own part; its RNG states wait for :meth:`restore_rng`."""
        self.epoch_loss = list(state["epoch_loss"])
        self._rng = state["rng"]

    def restore_rng(self) -> None:
        """Put back the loaded RNG states, once: call just before training goes on."""
        if self._rng is not None:
            restore_rng_state(self._rng)
            self._rng = None
