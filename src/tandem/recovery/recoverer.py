"""One rank's side of recovery in memory (:class:`Recoverer`): it starts the heartbeat, makes
the vote, commits each step, and, after a loss or for an admission, decides the next generation
with the others, takes the old process group down (:func:`_abandon_group`) and forms the new one.

It puts together :mod:`tandem.recovery.membership`, :mod:`tandem.recovery.heartbeat` and
:mod:`tandem.recovery.vote`; the loops that use it are :class:`tandem.recovery.Run` and the
Trainer's :mod:`tandem.train.in_memory`.

Example::

    recoverer = Recoverer()
    recoverer.attach(ddp_model, own=rng_text.value)
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout

from tandem._dist import group_rank, group_size
from tandem.doctor import mismatch, records
from tandem.files import write_atomic
from tandem.job import join
from tandem.parallel.ddp import out_of_step
from tandem.recovery.commits import CommitKey
from tandem.recovery.heartbeat import _BEAT_S, _Heartbeat, cut_off_message
from tandem.recovery.membership import _POLL_S, Membership, MembershipError, Recovery, _Lost
from tandem.recovery.store import (
    ABLE,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    HEARTBEAT_TIMEOUT_VARIABLE,
    _job_store,
    _text,
    enabled,
)
from tandem.recovery.vote import StateAfterVoteError, _BucketVote, _voted, commit_off_path
from tandem.world import reformed

log = logging.getLogger(__name__)


class Recoverer:
    """One rank's side of recovery in memory, for a loop that can redo its step (:class:`Run`,
    the Trainer): the membership, the heartbeat, the commit, and the re-forming of the group.

    Inactive (:attr:`active` False, :meth:`commit` a no-op, :meth:`lost`
    always False) unless the job runs under ``tandem run --recover in-memory`` with more than
    one process.

    Example::

        recoverer = Recoverer()
        recoverer.attach(ddp_model, own=lambda: what_others_need_if_this_rank_is_lost)
        try:
            loss = forward_backward()    # the vote rides in its gradient all-reduce
            recoverer.commit(step, value=what_others_need_if_this_rank_is_lost)
        except Exception as error:
            if not recoverer.lost(error):
                raise
            old_members = recoverer.reform(step, release=drop_the_old_wrapper)
            ...  # wrap anew, deal the samples anew, redo the step
        optimizer.step()
        recoverer.committed()
    """

    def __init__(self, heartbeat_timeout: float | None = None, admits: bool = False) -> None:
        self.members: Membership | None = None
        self._heartbeat: _Heartbeat | None = None
        self.recoveries: list[Recovery] = []
        self._pending: list[Recovery] = []  # re-formed, the redo not committed yet
        # A generation decided whose group did not form: its losses, detection time and start.
        self._unformed: tuple[list[int], float | None, float] | None = None
        # The last commit: its step and members (whose states a recovery loads).
        self.last_commit: tuple[int, list[int]] | None = None
        self.voting: int | None = None  # the step of the vote this rank entered last
        self._vote = _BucketVote(self)  # the vote that rides in a DDP backward (attach)
        # After a re-form: whether this rank rolled forward to the step the others committed,
        # and what :meth:`reform`'s ``ahead`` sent it then.
        self.behind = False
        self.caught_up: Any = None
        self.joined = False
        self._backend = "gloo"  # the groups' backend, as the last group formed had it
        size = group_size()
        if size > 1 and enabled():
            timeout = heartbeat_timeout or float(
                os.environ.get(HEARTBEAT_TIMEOUT_VARIABLE, DEFAULT_HEARTBEAT_TIMEOUT_S)
            )
            self.members = Membership(_job_store(), group_rank(), list(range(size)), timeout)
            self.joined = join.admitted is not None  # a replacement, admitted at a step
            if join.admitted is not None:
                me = join.joining()
                assert me is not None
                self.members.me, self.members.members = me, list(join.admitted["members"])
                self.members.generation = int(join.admitted["generation"])
                self.members.admitted = int(join.admitted["admitted"])
                # Those the members hand the run to, this rank among them.
                self.members.newcomers = [int(r) for r in join.admitted["newcomers"]]
            # The launcher recovers in memory only if every worker said it would, and starts a
            # replacement only if every one admits it (hands it the state: Run does).
            self.members.store.set(self.members.key("able", self.members.me), ABLE)
            self.members.admits = admits
            if admits:
                self.members.store.set(self.members.key("admits", self.members.me), ABLE)
            self._heartbeat = _Heartbeat(self.members)
            self._heartbeat.start()
            # Stopped before the interpreter exits: a daemon thread still inside the store's
            # C++ client while the process is torn down aborts it.
            atexit.register(self.close)
            # A peer that left is a member lost: no survey of where the others are.
            out_of_step.survey_lost_peers = False

    @property
    def active(self) -> bool:
        return self.members is not None

    @property
    def rank(self) -> int:
        return self.members.rank if self.members is not None else group_rank()

    @property
    def world_size(self) -> int:
        return self.members.world_size if self.members is not None else group_size()

    def attach(
        self, model: nn.Module, own: Callable[[], str], off_path: bool | None = None
    ) -> None:
        """Let each step's vote ride in ``model``'s gradient all-reduce (a tandem.DDP over the
        current group; after a re-form, the new one): ``own()`` gives this rank's own state as
        the step will leave it (:meth:`commit` then checks that the step left it so). A no-op
        when inactive.

        ``off_path`` True: ``own()`` is called on a thread of its own as the backward starts,
        and its result sent to the store from there; the backward's last bucket only checks
        that the generators did not move since (else takes and sends the state again itself).
        So ``own()`` must be safe to call while the backward runs, and give then what the step
        will leave once the generators are as the last bucket finds them. False: it is called
        right before the last bucket is reduced, on the step's path. None (the default):
        :func:`commit_off_path` decides, by the cores each rank of this node has (the thread
        only pays where a core is spare; on a rank per core it takes its CPU from the
        backward).

        Example::

            recoverer.attach(ddp_model, own=rng_text.value)
        """
        reducer = getattr(model, "reducer", None)
        if self.members is None or reducer is None:
            return
        self._vote.own = own
        self._vote.off_path = commit_off_path() if off_path is None else off_path
        reducer.end_of_backward.vote = self._vote

    def _set_commit(self, step: int, members: list[int], generation: int) -> None:
        """This rank's last commit is now ``step`` of ``generation``, with ``members`` (in
        their rank order then)."""
        assert self.members is not None
        self.last_commit = (step, members)
        self.members.record_commit((step, generation))

    @property
    def commit_key(self) -> CommitKey | None:
        """The last commit's identity (step, generation); None before any."""
        if self.last_commit is None:
            return None
        assert self.members is not None
        commits = self.members.commits
        if commits and commits[-1][0] == self.last_commit[0]:
            return commits[-1]
        return (self.last_commit[0], 0)  # set by hand, as a one-process test does

    def commit(self, step: int, value: str | Callable[[], str] = "1") -> int:
        """Commit ``step`` on every member or on none (see the package doc). ``value``: this
        rank's own state as the step leaves it (or a function that gives it, called only when
        needed), which the rank that takes its place loads if this one is lost
        (:meth:`committed_states`). Returns the count of replacements to admit after this step
        (:meth:`grow`), else 0: the same on every member.

        When the step's DDP backward carried the vote (:meth:`attach`) and it passed here, the
        step commits with no communication at all; ``value`` is then checked against what
        ``own()`` gave at the vote (a function is not called: the caller vouches for it, see
        :meth:`passed`): where it differs, the true one is left in the store at once and the
        next vote tells every member, which all raise :class:`StateAfterVoteError` then.
        Otherwise (no DDP backward in the step) ``value`` is left in the store if it changed
        and the members vote in a small all-gather.

        Raises:
            _Lost: the vote did not complete here (a member gone); the caller re-forms.
            StateAfterVoteError: on every member, at the step after one whose vote passed while
                some member's state moved after it (the step drew random numbers after its
                backward, say). That member left its true state for the step at its commit,
                before its next vote (so the store held the step's state, except if it was
                lost in between), and told the others in that vote.
        """
        if self.members is None:
            return 0
        members = self.members
        vote = self._vote
        vote.settle()  # the sender's store calls and slots are done before ours
        before = None if self.last_commit is None else self.last_commit[0]
        if vote.passed_step == step:
            vote.passed_step = None
            if vote.moved:
                raise StateAfterVoteError(self._moved_message(step, vote.moved))
            if isinstance(value, str) and value != vote.published:
                self._republish(step, value, before)
            self._set_commit(step, list(members.members), members.generation)
            return vote.admit
        with self._reachable():
            members.publish(step, value if isinstance(value, str) else value(), before)
        # What the members must agree on: the step (a check), the replacements queued that
        # this rank has seen (the fewest seen are admitted: every member knows of them), and
        # whether this rank's state moved after an earlier vote.
        moved_here = int(vote.moved_here is not None)
        mine = torch.tensor([step, self._seen(), moved_here], dtype=torch.int64)
        self.voting = step
        if members.world_size == 1:
            votes = [mine]
        else:
            votes = [torch.empty_like(mine) for _ in range(members.world_size)]
            # The group's own all-gather: torch's Python wrapper around it costs as much again
            # as the collective on a small tensor.
            group = dist.distributed_c10d._get_default_group()
            mismatch.wait_in_slices(group.allgather([votes], [mine]))
        _voted(step)
        steps = {int(v[0]) for v in votes}
        if steps != {step}:  # our invariant: every member votes on the step it has done
            raise RuntimeError(f"the members voted on different steps: {sorted(steps)}")
        moved = sum(int(v[2]) for v in votes)
        if moved:
            raise StateAfterVoteError(self._moved_message(step, moved))
        self._set_commit(step, list(members.members), members.generation)
        queued = min(int(v[1]) for v in votes)
        return queued if queued > members.admitted else 0

    def _republish(self, step: int, value: str, before: int | None) -> None:
        """This rank's state moved after ``step``'s vote passed (its generators: the step drew
        random numbers after its backward): leave its true state for the step now, before the
        next vote, which tells every member (they all raise :class:`StateAfterVoteError`
        there). Meanwhile a survivor would load the true state, unless this rank is lost
        between the vote and here."""
        assert self.members is not None
        members = self.members
        log.error(
            "rank %d: its own state moved after step %d's vote (random numbers drawn after the "
            "backward?): its true state is left in the store, and every rank stops at the next "
            "step", members.me, step,
        )  # fmt: skip
        with self._reachable():
            members.publish(step, value, before)
            members.store.set(members.key("moved", members.me), str(step))
        self._vote.moved_here = step

    def _moved_message(self, step: int, count: int) -> str:
        """:class:`StateAfterVoteError`'s text, the same on every member: the ranks (launch
        ranks) whose state moved after a vote, and at which step, as they left it in the store
        before the vote that told of them (looked for briefly: the keys come over other
        connections than the vote)."""
        assert self.members is not None
        members = self.members
        found: dict[int, int] = {}
        deadline = time.monotonic() + 2.0
        with self._reachable():
            while True:
                for r in members.members:
                    key = members.key("moved", r)
                    if r not in found and members.store.check([key]):
                        found[r] = int(_text(members.store.get(key)))
                if len(found) >= count or time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
        named = ", ".join(f"rank {r} after step {s}" for r, s in sorted(found.items()))
        if len(found) < count:
            named += f" ({count - len(found)} more not named in the store)"
        return (
            f"tandem.recovery: the state of {named} moved after that step's commit vote, which "
            "rides in the backward's last gradient bucket: the step drew random numbers (or "
            "set the generators) after its backward, so a rank taking its place after a loss "
            f"would not start from the state the step left. Every rank stops at step {step}. "
            "Draw the step's random numbers before loss.backward() (in the forward), not after"
        )

    def passed(self, step: int) -> bool:
        """Whether ``step``'s vote rode in a DDP backward and passed on this rank (its commit
        then needs no communication, nor this rank's state again).

        Example::

            if recoverer.passed(step):   # the state left at the vote is this step's
                recoverer.commit(step, own)  # own() is not called: nothing to send
        """
        return self._vote.passed_step == step

    def settle(self) -> None:
        """Wait for this rank's own state still being sent off the step's path (after a failed
        step, before the state of the generators is set anew). A no-op when inactive.

        Raises:
            MembershipError: this rank is cut off from the store.

        Example::

            except Exception as error:
                recoverer.settle()
                if recoverer.lost(error): ...
        """
        sender = self._vote._sender
        if sender is None:
            return

        def cut_off() -> None:
            if self._heartbeat is not None and self._heartbeat.cut_off:
                raise MembershipError(self._heartbeat.cut_off)

        sent = sender.wait(cut_off)
        if isinstance(sent, BaseException):
            sender.result = None  # a failed step's: the step is redone, its state sent again
            log.debug("sending this rank's state of a failed step: %s", sent)

    def _seen(self) -> int:
        """The replacements this rank has seen queued, if it admits any."""
        assert self.members is not None
        return self.members.joiners_seen if self.members.admits else self.members.admitted

    def grow(
        self,
        step: int,
        count: int,
        release: Callable[[], None],
        ahead: Callable[[], Any] | None = None,
    ) -> list[int]:
        """Admit the replacements queued up to ``count`` after step ``step`` (every member
        calls it at the same step boundary): the next generation is decided as a re-form's is
        (:meth:`reform`, with ``admit``), so a member lost meanwhile, or one that did not
        commit the step, makes it a re-form instead; then the group is formed anew with the
        newcomers appended. Returns the launch ranks the caller hands the run to (the
        newcomers; none when it became a re-form: ``Membership.lost`` or ``behind``
        then say so, and the caller goes on as after :meth:`reform`)."""
        assert self.members is not None
        self.reform(step, release, ahead, admit=count)
        return list(self.members.newcomers)

    def hand_over(self, state: Any, own: Any = None) -> tuple[Any, list[Any]]:
        """Admitting replacements, over the group :meth:`grow` formed (a collective: the members
        call it once they have grown and wrapped their model anew, a newcomer as it takes over):
        rank 0's ``state`` to every rank, and every rank's ``own`` (a newcomer's: None) to every
        rank, in rank order. Returns both.

        Example::

            state, owns = recoverer.hand_over({"optimizer": opt.state_dict()}, own=mine)
        """
        members = self.members
        assert members is not None
        # The first member that holds the run (rank 0 but where every member holding it was
        # lost, which the decision refuses: the newcomers come last).
        source = next(i for i, r in enumerate(members.members) if r not in members.newcomers)
        handed: list[Any] = [state if members.rank == source else None]
        dist.broadcast_object_list(handed, src=source)
        owns: list[Any] = [None] * members.world_size
        dist.all_gather_object(owns, own)
        return handed[0], owns

    def committed_states(self) -> list[str]:
        """Every member's value of the last commit, in the order of the members then (new rank
        r of a re-formed group takes entry r, as a resume at another world size maps saved
        ranks): each one's newest in the store with a step <= that commit's. A recovery cut
        short by another loss before its redo committed goes back to the same states.

        Raises:
            RuntimeError: no commit yet, or a member's value is missing (it cannot be, for a
                step every member voted on).
        """
        assert self.members is not None
        key = self.commit_key
        if self.last_commit is None or key is None:
            raise RuntimeError("no step has been committed: there is no state to go back to")
        members = self.last_commit[1]
        with self._reachable():
            return [self.members.own_value(r, key) for r in members]

    def lost(self, error: BaseException) -> bool:
        """Whether ``error`` came from a member being gone (waiting up to a heartbeat timeout
        for the launcher's mark or the silence to show). Always False when inactive."""
        if self.members is None:
            return False
        if self._heartbeat is not None and self._heartbeat.cut_off:
            raise MembershipError(self._heartbeat.cut_off) from error
        if isinstance(error, _Lost):
            return True
        deadline = time.monotonic() + self.members.heartbeat_timeout + 2 * _BEAT_S
        while time.monotonic() < deadline:
            with self._reachable():
                if self.members.gone() or _any_key(
                    self.members.store,
                    self.members.key(f"gen{self.members.generation + 1}", "join"),
                    self.members.members,
                ):
                    return True
            time.sleep(0.02)
        log.error("a step failed and no member is gone: %s", error)
        return False

    def reform(
        self,
        step: int,
        release: Callable[[], None],
        ahead: Callable[[], Any] | None = None,
        admit: int = 0,
    ) -> list[int]:
        """Agree on the next generation (the survivors of a loss, or with ``admit``, the
        members and the replacements their last commit's vote admitted: :meth:`grow`), take
        the old group down and form the new one, and settle the step they go on from; returns
        the old generation's members (launch ranks, in their old rank order). The newcomers
        the decision names (``Membership.newcomers``: admitted now, or admitted by a
        generation that failed before they had the run) are then handed the run by the
        caller (:meth:`hand_over`); a newcomer calls this too when its take-over fails.

        ``release`` drops everything of the old group the caller holds (its DDP wrapper, the
        reducer's hooks): the old group's sockets close only when its last reference goes, and
        a survivor still blocked in the failed step's collective on a live peer that left it
        is released only by that peer's sockets closing.

        The survivors go on from the newest step any of them committed (the vote may have
        completed on some and not on others). A survivor that had not committed it is
        ``behind``: it entered that step's vote, but its gradients of it may be partial sums
        (the vote rides in their all-reduce), so the caller rolls it forward with
        ``caught_up``, what ``ahead()`` returned on the first member that had committed it
        (the state that step left; a collective over the new group, only when some member
        is behind).

        Raises:
            MembershipError: this rank cannot go on.
            _Lost: a member of the new generation was lost before its group formed (the
                caller re-forms again).
        """
        assert self.members is not None and self._heartbeat is not None
        noticed, now = time.monotonic(), time.time()
        fresh = self.joined and self.last_commit is None  # a newcomer never handed the run
        with self._heartbeat.lock, self._reachable():
            dead, beats = self.members.dead(), self.members.last_beats()
            old_members = list(self.members.members)
            lost = self.members.reform(self.commit_key, admit=admit, fresh=fresh)
            mismatch.reset()  # the new group starts with no failure
        # Detection time: from the launcher's record of the death, else from the last beat.
        since = [float(dead[r]["at"]) if r in dead else beats.get(r) for r in lost]
        known = [s for s in since if s is not None]
        detected = now - max(known) if known else None
        if self._unformed is not None:
            # The last generation decided never formed (a member lost meanwhile): its losses,
            # detection and start are this one's.
            before, first, noticed = self._unformed
            lost = [*before, *lost]
            detected = first if first is not None else detected
        try:
            g = self._form_group(release)
        except _Lost:
            self._unformed = (lost, detected, noticed)
            raise
        self._unformed = None
        self.behind, self.caught_up = self._roll_forward(ahead)
        if self.behind:
            step += 1  # the others committed the step this rank was in: the redo is the next
        newcomers = list(self.members.newcomers)
        if not lost and not newcomers:
            # The last group did not form (a member slow to): the same members formed it
            # again. No recovery of its own: the one whose redo it delays, if any, counts it.
            log.warning(
                "formed generation %d's group again with the same members, at step %d",
                g, step,
            )  # fmt: skip
            return old_members
        self._pending.append(  # after another one whose redo this loss cut short
            Recovery(
                generation=g,
                lost=lost,
                members=list(self.members.members),
                step=step,
                detected_s=detected,
                joined=newcomers,
                started=noticed,
            )
        )
        if lost:
            log.warning(
                "lost rank(s) %s at step %d: going on as rank %d of %d",
                lost, step, self.members.rank, self.members.world_size,
            )  # fmt: skip
        if newcomers:
            log.warning(
                "admitting replacement(s) %s after step %d: going on as rank %d of %d",
                newcomers, step, self.members.rank, self.members.world_size,
            )  # fmt: skip
        return old_members

    def _roll_forward(self, ahead: Callable[[], Any] | None) -> tuple[bool, Any]:
        """After a re-form: when some member had not committed the settled commit, the first
        member that had sends every member its last commit and ``ahead()`` (one broadcast over
        the new group). Whether this rank was behind by a step (its state is then that of the
        step it was in: what ``ahead()`` gave), and what ``ahead()`` gave if so. A member that
        committed the same step in an older generation (the new generation's start commit
        completed on others, not here) takes the newer commit alone: that commit moved no
        state, only which members, in which places, the step's states are read of."""
        members = self.members
        assert members is not None
        if not members.behind:
            return False, None
        me_behind = members.me in members.behind
        if me_behind and self.voting != members.settled:
            # Our invariant: the vote on the settled commit completed on some member, so every
            # member entered it (and left its state for it first).
            raise RuntimeError(
                f"rank {members.me} is behind step {members.settled} without having voted on "
                f"it (last vote: {self.voting})"
            )
        # The first member that committed it (not one behind, nor a newcomer).
        without = set(members.behind) | set(members.newcomers)
        source = next(i for i, r in enumerate(members.members) if r not in without)
        sent: list[Any] = [None]
        if members.rank == source:
            sent = [(self.last_commit, self.commit_key, None if ahead is None else ahead())]
        dist.broadcast_object_list(sent, src=source)
        if not me_behind:
            return False, None
        before = self.last_commit
        (step, committed_members), key, caught_up = sent[0]
        assert key == members.settled_key, (key, members.settled_key)
        self._set_commit(step, list(committed_members), key[1])
        if before is not None and before[0] == step:
            log.warning("rolling forward to generation %d's commit of step %s", key[1], step)
            return False, None
        log.warning("rolling forward to step %s, which others committed", members.settled)
        return True, caught_up

    @contextlib.contextmanager
    def _reachable(self) -> Iterator[None]:
        """Store calls of the protocol: one that fails (it waited the client's timeout, or the
        connection broke) means this rank is cut off from the store: a
        :class:`MembershipError` that says so."""
        try:
            yield
        except (dist.DistNetworkError, dist.DistStoreError) as error:
            assert self.members is not None
            raise MembershipError(cut_off_message(self.members.me)) from error

    def _form_group(self, release: Callable[[], None]) -> int:
        """Leave the old group (``release`` first drops the caller's hold on it) and form the
        current generation's over its key prefix of the job's store; the generation."""
        members = self.members
        assert members is not None
        g = members.generation
        # The backend of the group being left: none is left when a formation failed before.
        backend = dist.get_backend() if dist.is_initialized() else self._backend
        self._backend = backend
        release()
        records.clear()
        _abandon_group()
        gc.collect()
        # Every member says it is here first, right before the formation: one lost since the
        # decision is noticed in store calls that return (a re-form follows).
        with self._reachable():
            gone = join.meet(
                members.store, members.key(f"gen{g}", ""), members.me, members.members,
                members.gone, timeout_s=max(60.0, 6 * members.heartbeat_timeout),
            )  # fmt: skip
        if gone:
            raise _Lost(f"rank(s) {sorted(gone)} of generation {g} left before its group formed")
        # One lost between its word and its part of the formation leaves the others waiting
        # for its address or its connections: bounded by the formation's own timeout, not by
        # the collectives' (set once formed), and a re-form follows. A member merely slow
        # to form makes that re-form keep every member.
        formation = join.formation_timeout(members.heartbeat_timeout)
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(members.key(f"gen{g}", "pg") + "/", _job_store()),
                rank=members.rank,
                world_size=members.world_size,
                timeout=timedelta(seconds=formation),
            )
        except dist.DistError as error:
            raise _Lost(
                f"the group of generation {g} ({members.members}) did not form within "
                f"{formation:g} s ({str(error).splitlines()[0] if str(error) else error!r})"
            ) from error
        _set_pg_timeout(timedelta(seconds=max(60.0, 6 * members.heartbeat_timeout)))
        reformed(members.rank, members.world_size)
        return g

    def committed(self) -> None:
        """A step committed: a recovery in progress is done (its record written)."""
        for pending in self._pending:
            pending.recovered_s = time.monotonic() - pending.started
            self.recoveries.append(pending)
            self._report(pending)
        self._pending = []

    def close(self) -> None:
        """Stop the heartbeat (the loop is done); returns once its thread has ended."""
        if self._heartbeat is not None:
            self._heartbeat.stopped.set()
            if self._heartbeat.is_alive() and self._heartbeat is not threading.current_thread():
                self._heartbeat.join(timeout=5)

    def _report(self, recovery: Recovery) -> None:
        """The new rank 0 writes the recovery's record for the launcher's exit summary."""
        if self.rank != 0:
            return
        directory = os.environ.get("TANDEM_REPORT_DIR")
        if not directory:
            return
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "job")
        path = Path(directory) / f"tandem-recovery-{run_id}-gen{recovery.generation}.json"
        try:
            write_atomic(path, json.dumps(recovery.record()).encode())
        except OSError as error:
            log.warning("could not write the recovery record %s: %s", path, error)


def _abandon_group() -> None:
    """Take down every process group without waiting for its collectives (one may be blocked on
    a hung peer): torch forgets them at once (``_abort_process_group``'s bookkeeping), the
    sockets of their Gloo devices are shut down from this side, so that a wait on a peer cut
    off by the network fails now rather than at the group's timeout, and the groups are freed
    on a thread of their own (:mod:`tandem._groups_reaper`: torch 2.13's Gloo has no abort of
    its own, and its destructor waits for the blocked work)."""
    from torch.distributed import distributed_c10d as c10d

    from tandem import _groups_reaper

    world = c10d._world
    tables = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag",
              "tags_to_pg", "pg_coalesce_state")  # fmt: skip
    known = all(hasattr(world, t) for t in tables) and hasattr(c10d, "_update_default_pg")
    if not known or not hasattr(c10d, "_unregister_all_process_groups"):
        # Another torch than those this bookkeeping was written for: its own abort (which
        # waits for work blocked on a cut-off peer until the work's timeout).
        log.warning("this torch keeps its groups otherwise: aborting the old group in place")
        c10d._abort_process_group()
        return
    groups = list(world.pg_names)
    c10d._update_default_pg(None)
    for table in tables:
        getattr(world, table).clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
    # Every group of the process is let go and the next one does not exist yet: whatever a
    # Gloo device still watches belongs to an old group.
    if _groups_reaper.cut_gloo_connections() is None:
        _groups_reaper.keep(groups)
    else:
        _groups_reaper.reap(groups)  # takes the last references: none may stay in this frame


def _any_key(store: dist.Store, prefix: str, ranks: list[int]) -> bool:
    return any(store.check([f"{prefix}/{r}"]) for r in ranks)
