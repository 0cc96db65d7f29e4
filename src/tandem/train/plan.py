"""How long a Trainer run lasts and what it does at each step boundary, in one place.

A run is counted in epochs, in optimizer steps, or both (it ends at whichever limit comes
first). Periodic actions are counted in optimizer steps (``log_every``, ``eval_every``,
``save_every_steps``) or in epochs (``save_every``). Every rule is arithmetic on the step and
epoch counters, which every rank has alike, so every rank takes the same action at the same
step without asking the others; and a resumed run, whose counters continue from the
checkpoint, takes them at the same steps as the uninterrupted run did.

At a step boundary, in this order (so that a checkpoint taken there holds what came before)::

    agree       at every log step: one small all-reduce of the ranks' requests and loss sums
                (tandem.train.stop_and_save), waited for; at the other check_every steps the same,
                sent in the background and acted on at the next step boundary
    evaluate    every eval_every steps (exact, tandem.train.evaluation)
    log         every log_every steps: a record of the steps since the last one
    save        every save_every_steps steps, when asked, and when max_steps is reached

At an epoch's end the run also agrees, evaluates when it has evaluation data, and saves every
``save_every`` epochs; a step boundary that is also an epoch's end does each thing once.

Example::

    plan = RunPlan.from_args(max_epochs=None, max_steps=1000, save_every=None,
                             save_every_steps=200, eval_every=100, log_every=10, check_every=1)
    plan.total_steps(step=0, epoch=0, batch=0, per_epoch=120, accum=2)     # 1000
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


def _count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def _optional(name: str, value: Any, least: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r} (or None)")
    return value


def _every(step: int, every: int | None) -> bool:
    return every is not None and step % every == 0


@dataclass(frozen=True)
class RunPlan:
    """A run's limits and schedule (see the module doc); built by :meth:`from_args`.

    Attributes:
        max_epochs: epochs in all, or None (no limit: ``max_steps`` ends the run).
        max_steps: optimizer steps in all, or None (``max_epochs`` ends the run).
        save_every: a checkpoint every this many epochs, or None.
        save_every_steps: a checkpoint every this many optimizer steps, or None.
        eval_every: an evaluation every this many optimizer steps, or None (epoch ends only).
        log_every: a step log record every this many optimizer steps, or None (no records).
        check_every: agree on requests every this many optimizer steps.
    """

    max_epochs: int | None
    max_steps: int | None
    save_every: int | None
    save_every_steps: int | None
    eval_every: int | None
    log_every: int | None
    check_every: int

    @classmethod
    def from_args(
        cls,
        *,
        max_epochs: Any,
        max_steps: Any,
        save_every: Any,
        save_every_steps: Any,
        eval_every: Any,
        log_every: Any,
        check_every: Any,
    ) -> RunPlan:
        """The plan of a Trainer's arguments, checked (the same verdict on every rank).

        ``save_every`` None means every epoch, unless ``save_every_steps`` is given.

        Raises:
            ValueError: ``max_epochs`` and ``max_steps`` both None, or a value that is not an
                int in range (named, with the value).
        """
        if max_epochs is None and max_steps is None:
            raise ValueError(
                "neither max_epochs nor max_steps was given: the run would never end. Pass "
                "max_epochs=N (epochs), max_steps=N (optimizer steps), or both (the first "
                "reached ends the run)"
            )
        if save_every is None and save_every_steps is None:
            save_every = 1
        return cls(
            max_epochs=_optional("max_epochs", max_epochs, 0),
            max_steps=_optional("max_steps", max_steps, 0),
            save_every=_optional("save_every", save_every, 1),
            save_every_steps=_optional("save_every_steps", save_every_steps, 1),
            eval_every=_optional("eval_every", eval_every, 1),
            log_every=_optional("log_every", log_every, 1),
            check_every=_count("check_every", check_every, 1),
        )

    def limited(self, max_epochs: int | None, max_steps: int | None) -> RunPlan:
        """This plan with ``train()``'s own limits, where given (checked as the constructor's).

        Example::

            plan.limited(max_epochs=10, max_steps=None)   # max_steps stays the plan's
        """
        return replace(
            self,
            max_epochs=self.max_epochs
            if max_epochs is None
            else _count("max_epochs", max_epochs, 0),
            max_steps=self.max_steps if max_steps is None else _count("max_steps", max_steps, 0),
        )

    # -- the run's length ---------------------------------------------------------------

    def finished(self, *, epoch: int, step: int) -> bool:
        """Whether a run at ``epoch`` epochs and ``step`` steps done has reached a limit."""
        steps_done = self.max_steps is not None and step >= self.max_steps
        epochs_done = self.max_epochs is not None and epoch >= self.max_epochs
        return steps_done or epochs_done

    def total_steps(self, *, step: int, epoch: int, batch: int, per_epoch: int, accum: int) -> int:
        """Optimizer steps of the whole run, counted from where it stands.

        ``step`` steps are done and ``batch`` batches of epoch ``epoch`` (of ``per_epoch``,
        ``accum`` per step; an epoch's last step takes the batches left); what is left to
        ``max_epochs`` is added, and ``max_steps`` caps the sum. At the same world size this is
        the same number from any point of the run; a resume at another world size changes the
        steps per epoch, and so the epochs' part.
        """
        total = None
        if self.max_epochs is not None:
            total = step
            if epoch < self.max_epochs:
                per_step = -(-per_epoch // accum)
                left_now = -(-(per_epoch - batch) // accum)
                total += left_now + (self.max_epochs - epoch - 1) * per_step
        if self.max_steps is not None:
            total = self.max_steps if total is None else min(total, max(self.max_steps, step))
        assert total is not None, "from_args refuses a plan without limits"
        return total

    # -- what a step boundary does ------------------------------------------------------

    def agrees_at(self, step: int) -> bool:
        """Agree on requests (and reduce the loss sums) after optimizer step ``step``."""
        return _every(step, self.check_every) or _every(step, self.log_every)

    def evaluates_at(self, step: int) -> bool:
        """Evaluate after optimizer step ``step`` (besides every epoch's end)."""
        return _every(step, self.eval_every)

    def logs_at(self, step: int) -> bool:
        """Write a step log record after optimizer step ``step``."""
        return _every(step, self.log_every)

    def saves_at(self, step: int) -> bool:
        """Save after optimizer step ``step``: every ``save_every_steps``, and at
        ``max_steps`` (the run ends there)."""
        return _every(step, self.save_every_steps) or step == self.max_steps

    def saves_after_epoch(self, epoch: int) -> bool:
        """Save after ``epoch`` epochs: every ``save_every``, and at ``max_epochs``."""
        return _every(epoch, self.save_every) or epoch == self.max_epochs
