"""The commit's vote as it rides in a DDP backward's last gradient bucket (:class:`_BucketVote`),
the thread that leaves a rank's own state in the store off the step's path (:class:`_Sender`,
where :func:`commit_off_path` says a core is spare), the error of a state that moved after its
vote (:class:`StateAfterVoteError`), and the tests' hook on a completed vote (:data:`_after_vote`:
set it on this module, ``tandem.recovery.vote._after_vote = f``; both votes call it through
:func:`_voted`).

The :class:`~tandem.recovery.Recoverer` makes the vote and attaches it to a model; the vote
publishes through the :class:`~tandem.recovery.membership.Membership`.

Example::

    vote = _BucketVote(recoverer)
    ddp_model.reducer.end_of_backward.vote = vote
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch.distributed as dist

from tandem.doctor import mismatch
from tandem.recovery.membership import Membership
from tandem.recovery.state import _rng_look
from tandem.recovery.store import _job_store
from tandem.world import world as current_world

#: A test's hook, called with the step right after a vote completed on this rank (inside the
#: backward, for a vote in the gradient all-reduce): a test makes it raise, as if the vote had
#: failed here while it completed elsewhere (a split vote).
_after_vote: Callable[[int], None] | None = None
#: How many queued replacements one backward's vote can admit at once (its counts: one per
#: threshold; more are admitted by the commit of the new generation's start).
_ADMIT_AT_ONCE = 4


def _voted(step: int) -> None:
    """A vote on ``step`` completed on this rank (in a backward, or in the all-gather of
    :meth:`Recoverer.commit`): the test's hook, if one is set. It is read from this module's
    globals at each call, so a test sets ``tandem.recovery.vote._after_vote``; a name set on
    the package would reach neither vote."""
    if _after_vote is not None:
        _after_vote(step)


class _Voter(Protocol):
    """What the vote reads and sets of the :class:`Recoverer` that made it (that class imports
    this module: named here by what it offers, not imported back)."""

    members: Membership | None
    last_commit: tuple[int, list[int]] | None
    voting: int | None

    def _seen(self) -> int: ...

    def _reachable(self) -> contextlib.AbstractContextManager[None]: ...


class StateAfterVoteError(RuntimeError):
    """A member's own state moved after a step's vote (its step function drew random numbers
    after its backward, say): the state a survivor would have loaded for that step was not the
    one the step left. Raised on every member at the next step's commit, naming the ranks.

    Example::

        try:
            run.step(train_step)
        except tandem.recovery.StateAfterVoteError as error:
            print(error)  # on every rank: the ranks, the step, and what to change
            raise
    """


class _Sender(threading.Thread):
    """Takes this rank's own state and leaves it in the store off the step's path: the vote
    hands it a step as the backward starts (:meth:`_BucketVote.starting`), and the last bucket
    waits for it only if it is not done by then (:meth:`_BucketVote.entering`).

    It has a store client of its own (a client serves one thread: the main thread's may be
    inside a re-form's calls while this one still sends), made on its first job, off the
    path. Jobs run in the order given; a job's result (the raw words of the generators when
    it started, and the state it left) or its error is kept for the vote."""

    def __init__(self, members: Membership) -> None:
        super().__init__(name="tandem-commit-sender", daemon=True)
        self.members = members
        self.store: dist.Store | None = None
        self.cond = threading.Condition()
        self.jobs: list[tuple[int, int, Callable[[], str]]] = []  # step, committed, own
        self.result: tuple[int, int, tuple[Any, ...] | None, str] | BaseException | None = None

    def give(self, step: int, committed: int, own: Callable[[], str]) -> None:
        with self.cond:
            self.jobs.append((step, committed, own))
            self.cond.notify()

    def run(self) -> None:
        while True:
            with self.cond:
                while not self.jobs:
                    self.cond.wait()
                step, committed, own = self.jobs[0]
            result: tuple[int, int, tuple[Any, ...] | None, str] | BaseException
            try:
                # The look first: the state is taken after it, so a draw at any time after the
                # look shows as words that moved when the last bucket looks again.
                look = _rng_look()
                value = own()
                if self.store is None:
                    self.store = _job_store()
                self.members.publish(step, value, committed, store=self.store)
                result = (step, committed, look, value)
            except BaseException as error:  # kept for the vote, which raises it on the path
                result = error
            with self.cond:
                self.jobs.pop(0)
                self.result = result
                self.cond.notify_all()

    def wait(self, check: Callable[[], None]) -> Any:
        """Every job given done: the last one's result. Waits in slices, calling ``check``
        between them (it raises when a member is gone, or this rank is cut off)."""
        with self.cond:
            while self.jobs:
                if not self.cond.wait(_SLICE_S):
                    self.cond.release()
                    try:
                        check()
                    finally:
                        self.cond.acquire()
            return self.result


_SLICE_S = 0.5


OFF_PATH_VARIABLE = "TANDEM_COMMIT_OFF_PATH"


def commit_off_path(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a rank's commit should take and send its state on a thread of its own, off the
    step's path (:meth:`Recoverer.attach`): True when this process has at least two cores for
    each rank of its node (``tandem.init()``'s placement: ``LOCAL_WORLD_SIZE``, SLURM's tasks per
    node; given ``environ``, its ``LOCAL_WORLD_SIZE``, 1 if unset), so the sender's few hundred
    microseconds of work run beside the backward. With a core per rank or fewer the thread
    takes its CPU from the backward, which then ends later than doing the same work on the
    path: measured on a 2-core machine with 2 ranks, 1.045 against 0.991 of a plain step
    (docs/performance/recovery.md). ``TANDEM_COMMIT_OFF_PATH=1`` (or ``0``) decides instead.

    Example::

        commit_off_path({"LOCAL_WORLD_SIZE": "8"})  # True on a 16-core node, False on 8
    """
    env = os.environ if environ is None else environ
    chosen = env.get(OFF_PATH_VARIABLE, "").strip()
    if chosen:
        if chosen not in ("0", "1"):
            raise ValueError(
                f"{OFF_PATH_VARIABLE}={chosen!r}: use 1 (the commit's state taken on a thread "
                "of its own) or 0 (on the step's path), or unset it to decide by the cores"
            )
        return chosen == "1"
    per_node = None
    if environ is None:
        # tandem.init()'s placement: torchrun's LOCAL_WORLD_SIZE, or SLURM's tasks per node.
        with contextlib.suppress(RuntimeError, ValueError):
            per_node = current_world().local_world_size
    if per_node is None:
        try:
            per_node = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            per_node = 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return cores >= 2 * per_node


class _BucketVote:
    """The commit vote as it rides in a DDP backward (a
    :class:`tandem.parallel.ddp.end_of_backward.Vote`; see the package doc).

    Off the step's path (``off_path``; by default where a core is spare,
    :func:`commit_off_path`): as the backward starts (its first gradient hook: the loss and
    the generators the forward left are known), a thread of its own (:class:`_Sender`) takes
    this rank's own state and leaves it in the store. Right before the last bucket the vote
    waits for that only if it is not done, and looks at the generators' raw words again
    (:func:`_rng_look`, some microseconds): if the backward moved them (a custom autograd
    Function that draws), the state is taken and sent again, there, on the path. So what the
    store holds for the step is what the backward's last bucket leaves, as before, and it is
    there before this rank enters the collective whose completion is the vote.

    Its counts: for each of the first :data:`_ADMIT_AT_ONCE` queued replacements not admitted
    yet, 1 if this rank has seen it queued; then 1 if this rank's state moved after an earlier
    vote (:meth:`Recoverer.commit` republished it, and every member then raises
    :class:`StateAfterVoteError`). Summed over the members, a count equal to the world size says
    every member has seen that replacement: the same number to admit on every member, and all
    zeros (so nothing but the bucket's own all-reduce) while none is queued and nothing moved."""

    def __init__(self, recoverer: _Voter) -> None:
        self.recoverer = recoverer
        self.own: Callable[[], str] = lambda: "1"
        self.off_path = False  # Recoverer.attach decides (commit_off_path)
        self.step: int | None = None  # the step whose vote this backward carries
        self.published: str | None = None  # what own() gave at it
        self.passed_step: int | None = None  # the step whose vote passed here, not committed
        self.admit = 0  # replacements to admit after that step (0: none)
        self.moved = 0  # members whose state moved after a vote (the vote that passed says)
        self.moved_here: int | None = None  # the step whose state moved here after its vote
        self._sums: list[int] = []
        self._given: tuple[int, int] | None = None  # the step and commit starting() gave
        self._sender: _Sender | None = None

    def values(self) -> list[int]:
        members = self.recoverer.members
        assert members is not None
        queued = self.recoverer._seen() - members.admitted
        return [int(queued > n) for n in range(_ADMIT_AT_ONCE)] + [int(self.moved_here is not None)]

    def deliver(self, sums: list[int]) -> None:
        self._sums = sums

    def starting(self) -> None:
        """The backward that will carry the vote started: the sender takes and sends the state
        meanwhile (off the path: a hand-over of some microseconds here)."""
        last = self.recoverer.last_commit
        self._given = None
        if not self.off_path or last is None:
            return
        if self._sender is None:
            members = self.recoverer.members
            assert members is not None
            self._sender = _Sender(members)
            self._sender.start()
        self._given = (last[0] + 1, last[0])
        self._sender.give(last[0] + 1, last[0], self.own)

    def entering(self) -> None:
        recoverer, members = self.recoverer, self.recoverer.members
        assert members is not None
        given, self._given = self._given, None
        if recoverer.last_commit is None:
            self.step = None  # a backward before the first commit: no step to vote on
            return
        committed = recoverer.last_commit[0]
        self.step = committed + 1
        self.passed_step, self._sums = None, []
        value = None
        if given == (self.step, committed):
            sent = self.settle()
            if isinstance(sent, tuple) and sent[:2] == given:
                look = sent[2]
                # Unmoved since the sender's look, which came before it took the state: the
                # store holds what the backward leaves.
                if look is not None and _rng_look() == look:
                    value = sent[3]
        if value is None:  # on the path: the old way, or the backward drew random numbers
            value = self.own()
            with recoverer._reachable():
                members.publish(self.step, value, committed)
        self.published = value
        recoverer.voting = self.step

    def settle(self) -> Any:
        """Wait for the sender's jobs (in slices: a member gone or the store cut off raises
        meanwhile); the last one's result. A store error there is this rank cut off."""
        if self._sender is None:
            return None
        sent = self._sender.wait(mismatch.raise_if_failed)
        if isinstance(sent, BaseException):
            self._sender.result = None
            with self.recoverer._reachable():
                raise sent
        return sent

    def passed(self) -> None:
        members = self.recoverer.members
        assert members is not None
        if self.step is None:
            return
        step, self.step = self.step, None
        everyone = members.world_size
        queued, moved = self._sums[:_ADMIT_AT_ONCE], self._sums[_ADMIT_AT_ONCE:]
        seen_by_all = sum(1 for total in queued if total == everyone)
        self.admit = members.admitted + seen_by_all if seen_by_all else 0
        self.moved = moved[0] if moved else 0
        self.passed_step = step
        _voted(step)
