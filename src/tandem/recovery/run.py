"""The hand-written DDP loop that survives the loss of a rank (:class:`Run`): its steps are
redone after a re-form, and it hands the run to replacements; the protocol under it is the
:class:`~tandem.recovery.Recoverer`'s.

Example::

    run = Run(net, opt, train_set, batch_size=8)
    while not run.finished:
        run.step(lambda model, batch: loss_fn(model(batch[0]), batch[1]).backward())
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from tandem._dist import initialized
from tandem.checkpoint.rng import (
    expand_rng_state,
    restore_rng_state,
    seed_rng,
)
from tandem.data.sampler import DistributedSampler
from tandem.doctor import records
from tandem.parallel.adapters import model_state, optimizer_state
from tandem.parallel.ddp.wrapper import DistributedDataParallel
from tandem.recovery.membership import MembershipError, Recovery
from tandem.recovery.recoverer import Recoverer
from tandem.recovery.state import RngText, decode, newcomer_seed
from tandem.recovery.vote import StateAfterVoteError


class Run:
    """A hand-written DDP training loop that survives the loss of a rank (see the package doc).

    Args:
        module: the model, on its device; it is wrapped in tandem.DDP (anew after a recovery).
        optimizer: an optimizer over ``module``'s parameters.
        dataset: the training set (indexed), dealt by :class:`tandem.data.DistributedSampler`.
        batch_size: samples per rank and step (the global batch shrinks with the world).
        epochs: passes over the data set; :attr:`finished` after the last.
        seed, shuffle: the sampler's.
        collate_fn: turns a list of samples into a batch (torch's default collate).
        ddp_kwargs: more arguments for tandem.DDP.
        heartbeat_timeout: seconds of silence after which a rank counts as hung (default
            ``TANDEM_HEARTBEAT_TIMEOUT``, else 10).

    Example::

        run = Run(net, opt, train_set, batch_size=8)
        while not run.finished:
            run.step(lambda model, batch: loss_fn(model(batch[0]), batch[1]).backward())
    """

    @records.members_sequence  # a replacement's constructor meets the members' admission
    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset,
        *,
        batch_size: int,
        epochs: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        ddp_kwargs: dict[str, Any] | None = None,
        heartbeat_timeout: float | None = None,
    ) -> None:
        if batch_size < 1 or epochs < 1:
            raise ValueError(f"batch_size ({batch_size}) and epochs ({epochs}) must be >= 1")
        wrapped = model_state(module)
        if wrapped.sharded or wrapped.reducer is not None or wrapped.target is not module:
            raise ValueError(
                f"tandem.recovery.Run takes the plain module and wraps it in tandem.DDP itself "
                f"(anew after a recovery); this one is a {type(module).__name__}: pass the "
                "module inside it (a sharded model is not recovered in memory yet: use "
                "--recover restart with checkpoints)"
            )
        if optimizer_state(optimizer).sharded:
            raise ValueError(
                f"tandem.recovery.Run with a {type(optimizer).__name__}: its state is sharded "
                "across ranks, so a lost rank would take its shard along and the survivors "
                "would step without it. Use a plain optimizer (each rank holds the whole "
                "state), or --recover restart with checkpoints"
            )
        self.module, self.optimizer, self.dataset = module, optimizer, dataset
        self.batch_size, self.epochs = batch_size, epochs
        self.seed, self.shuffle, self.collate_fn = seed, shuffle, collate_fn
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.step_count = 0
        self.epoch = 0
        self.recoverer = Recoverer(heartbeat_timeout, admits=True)
        self.members = self.recoverer.members
        self._rng = RngText()
        self.model: nn.Module = self._wrap()
        self._committed: dict[str, Any] | None = None  # the sampler after the last commit
        self._start_sampler()
        if self.recoverer.joined:
            self._take_over()

    # -- what a loop reads ----------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Every epoch has been trained."""
        return self.epoch >= self.epochs

    @property
    def rank(self) -> int:
        return self.recoverer.rank

    @property
    def world_size(self) -> int:
        return self.recoverer.world_size

    @property
    def recoveries(self) -> list[Recovery]:
        """The recoveries this rank took part in, oldest first."""
        return self.recoverer.recoveries

    # -- the step -----------------------------------------------------------------------------

    def step(self, fn: Callable[[nn.Module, Any], Any]) -> Any:
        """Run ``fn(model, batch)`` (forward and backward), commit, and step the optimizer.

        ``fn`` may run more than once for one step: after a rank is lost it runs again, on the
        survivors, with the new model wrapper and this rank's share of the step's samples at
        the new world size. Its result (of the run that committed) is returned; None on a
        rank whose ``fn`` was cut short in the step's vote (its backward) while the vote
        passed on another member: that rank takes the step's state from it.

        Raises:
            MembershipError: this rank cannot go on (see :class:`MembershipError`).
        """
        if self.finished:
            raise RuntimeError(f"the run has trained its {self.epochs} epoch(s)")
        records.training_started()  # a replacement makes the members' collectives from here
        if self.recoverer.active and self.recoverer.last_commit is None:
            # The state the first step starts from (after a resume too) is the first one a
            # recovery can go back to.
            self._admit(self.recoverer.commit(self.step_count - 1, self._rng.value()))
        grow = 0
        while True:
            batch = self._next_batch()
            self.optimizer.zero_grad(set_to_none=True)
            lost, result = False, None
            try:
                result = fn(self.model, batch)  # its backward carries the vote (attach)
                # With this rank's generators as the next step starts (the optimizer draws
                # nothing): the rank that takes its place if it is lost before the next commit
                # starts from them. The vote took them as the backward's last bucket left.
                rng = self._rng.value() if self.recoverer.active else ""
                grow = self.recoverer.commit(self.step_count, rng)
            except (MembershipError, StateAfterVoteError):
                raise  # the same on every member: nothing to recover from
            except Exception as error:
                # The state of the failed step may still be on its way to the store: done
                # before the generators are set anew.
                self.recoverer.settle()
                if not self.recoverer.lost(error):
                    raise
                lost = True
            if lost:
                # Outside the except block: its traceback (the frames of the failed step, which
                # hold the old group's work) is gone before the old group is taken down.
                if self._recover():
                    return result  # others committed this step: this rank took its state
                continue
            break
        self._apply()
        self.recoverer.committed()
        self._admit(grow)
        return result

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run's position (step, epoch, sampler): with the model's and the optimizer's
        state, what a resume at any world size needs."""
        return {"step": self.step_count, "epoch": self.epoch, "sampler": self._committed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count, self.epoch = int(state["step"]), int(state["epoch"])
        self._committed = state["sampler"]
        self._start_sampler()

    def close(self) -> None:
        """Stop the heartbeat (the loop is done)."""
        self.recoverer.close()

    # -- inside --------------------------------------------------------------------------------

    def _wrap(self) -> nn.Module:
        """The module as the step calls it: in a new tandem.DDP over the current group (the
        previous wrapper's gradient hooks are released first)."""
        previous: DistributedDataParallel | None = getattr(self, "_ddp", None)
        if previous is not None:
            previous.reducer.release()
        self._ddp = None
        if self.world_size == 1 and not initialized():
            return self.module
        self._ddp = DistributedDataParallel(self.module, **self.ddp_kwargs)
        self.recoverer.attach(self._ddp, self._rng.value)
        return self._ddp

    def _start_sampler(self) -> None:
        self.sampler = DistributedSampler(
            cast(Sized, self.dataset),
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=self.shuffle,
            seed=self.seed,
        )
        if self._committed is not None:
            self.sampler.load_state_dict(self._committed)
        self.sampler.set_epoch(self.epoch)
        self._indices: Iterator[int] = iter(self.sampler)
        self._peeked: list[int] | None = None

    def _next_batch(self) -> Any:
        """This step's batch: taken once per step, kept for a re-run of the same step."""
        if self._peeked is None:
            left = self.sampler.current_len() - self.sampler.state_dict()["position"]
            # Never drawn past the share: an exhausted iterator would reset its position.
            self._peeked = [next(self._indices) for _ in range(min(self.batch_size, left))]
        return self.collate_fn([self.dataset[i] for i in self._peeked])

    def _apply(self, step_optimizer: bool = True) -> None:
        """The step committed: step the optimizer (the gradients are every member's; not when
        the optimizer's state after it came from a member ahead) and move the run's place past
        it."""
        if step_optimizer:
            self.optimizer.step()
        self.step_count += 1
        self._committed = self.sampler.state_dict()
        self._peeked = None
        # An epoch ends at a step boundary: the next step starts the next epoch.
        if self._committed is not None and (
            self._committed["position"] >= self.sampler.current_len()
        ):
            self.epoch += 1
            self._committed = None
            if not self.finished:
                self._start_sampler()

    def _release(self) -> None:
        """Let go of the old group's wrapper (its reducer's hooks first)."""
        if self._ddp is not None:
            self._ddp.reducer.release()
        self._ddp, self.model = None, self.module

    def _admit(self, count: int) -> None:
        """Admit the replacements the commit's vote named (``count``: up to that place in the
        queue; every member that committed the step does it after it): the next generation is
        decided as a re-form's is, so a member lost meanwhile, or one that did not commit the
        step, makes it a re-form, which this rank goes through as any (:meth:`_recover`)."""
        if count:
            self._recover(admit=count)

    def _take_over(self) -> None:
        """A replacement, admitted (its wrapper's constructor took the parameters): take the
        run from the members and commit the new generation's start with them
        (:meth:`_settle`). A member lost meanwhile (or this rank's take-over failing) makes
        it join the re-form as a member that holds nothing yet, or, once it holds the run, as
        any member."""
        try:
            count = self._settle()
        except MembershipError:
            raise
        except Exception as error:
            if not self.recoverer.lost(error):
                raise
            count = -1
        # Outside the except block: the failed collective's frames are gone first.
        if count < 0:
            self._recover()
        else:
            self._admit(count)

    def _recover(self, admit: int = 0) -> bool:
        """Go to the next generation: the survivors after a loss, or (``admit``) the members
        with the replacements their last commit's vote admitted, whichever the members decide
        first (:meth:`Recoverer.reform`). A member behind the step the others committed rolls
        forward to the state that step left on one that committed it (its own gradients may
        be partial sums, the vote riding in their all-reduce); the newcomers are handed the
        run; a loss meanwhile re-forms again. Whether this rank rolled forward to the step it
        was in (its vote completed elsewhere, not here)."""

        def ahead() -> dict[str, Any]:
            return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

        rolled, failed = False, False
        while True:
            try:
                self.recoverer.reform(self.step_count, self._release, ahead, admit=admit)
                settled = self.recoverer.last_commit
                behind = (
                    self.recoverer.behind and settled is not None and self.step_count == settled[0]
                )
                if behind:
                    caught_up = self.recoverer.caught_up
                    self.module.load_state_dict(caught_up["model"])
                    self.optimizer.load_state_dict(caught_up["optimizer"])
                    # With the old world's sampler: where that step left the epoch.
                    self._apply(step_optimizer=False)
                    rolled = True
                self.model = self._wrap()
                admit = self._settle()
            except MembershipError:
                raise
            except Exception as error:
                if not self.recoverer.lost(error):
                    raise
                failed = True
            # Outside the except block: the failed collective's frames are gone first.
            if failed:
                failed, admit = False, 0
                continue
            if not admit:
                return rolled

    def _settle(self) -> int:
        """A new generation, its wrapper made: hand the run to its newcomers (one of them:
        take it), deal the samples anew, and start every rank's generators where a resume at
        this world size from the last commit starts them: new rank r continues rank r's of
        that commit (its own where it keeps its number), a rank beyond them is seeded as such
        a resume seeds it (:func:`newcomer_seed`). With newcomers, the new generation's start
        is committed (a loss right after goes back to it); the count to admit next (0: none).
        """
        members = self.members
        assert members is not None
        newcomers = members.newcomers
        if newcomers:
            fresh = members.me in newcomers
            state: dict[str, Any] | None = None
            if not fresh:
                state = {
                    "optimizer": self.optimizer.state_dict(),
                    "run": self.state_dict(),
                    "commit": self.recoverer.last_commit,
                    "key": self.recoverer.commit_key,
                }
            handed, _ = self.recoverer.hand_over(state)
            if fresh:
                self.optimizer.load_state_dict(handed["optimizer"])
                self.load_state_dict(handed["run"])
                step, committed_members = handed["commit"]
                # Holding the run from here on: a loss re-forms it as any member, and the
                # states it starts from are those of that very commit (its key: a commit of
                # the same step by another generation holds others).
                self.recoverer._set_commit(step, list(committed_members), handed["key"][1])
        self._start_sampler()
        last = self.recoverer.last_commit
        assert last is not None
        if self.rank < len(last[1]):
            own = self.recoverer.committed_states()[self.rank]
            restore_rng_state(expand_rng_state(decode(own)))
        else:
            seed_rng(newcomer_seed(self.seed, self.step_count, self.rank))
        self._rng.forget()
        if not newcomers:
            return 0
        return self.recoverer.commit(self.step_count - 1, self._rng.value())
