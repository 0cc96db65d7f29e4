"""Recovery in memory: a rank that dies costs the step in flight, not a restart from disk.

Under ``tandem run --recover in-memory`` the launcher keeps the other workers running when one
dies, hosts the job's store itself (so rank 0's death does not take it along) and marks the
dead rank there (``tandem/recover/dead/<rank>``). A hand-written loop written with :class:`Run`
then goes on by itself:

1. Every step ends with a **commit**: each member sets ``gen<g>/commit/<step>/<rank>`` in the
   store once its backward (and so its gradient all-reduce) is done, and waits for every
   member's key before its optimizer steps; the key's value is the rank's own state as the
   step leaves it (its generators), which the rank that takes its place loads if it is lost
   before the next commit. Each member then proposes the outcome (``ok`` once it saw every
   key, ``abort`` once it saw a member gone first) with ``compare_set``, and all follow the
   first proposal. A step therefore commits on every member or on none: a rank that died
   before its key was set makes every survivor leave the step with its parameters and
   optimizer state as they were.
2. A survivor learns of the loss from its collective's error (Gloo's connection to the dead
   peer breaks), or from the launcher's mark while it waits for the commit, or from a
   heartbeat (``hb/<rank>``, every 0.5 s) older than ``heartbeat_timeout`` (a hung rank).
3. The survivors **agree on the new membership** through the store: each joins generation
   ``g + 1``; once every member of ``g`` has joined or is known to be gone, the first to
   decide writes the members (``compare_set``: one decision, the same on every rank). A rank
   left out, or a side that does not hold a majority of the ranks not known dead, stops with a
   :class:`MembershipError`.
4. They build a **new process group** over a fresh key prefix of the same store (the old one
   is destroyed), wrap the module in a new tandem.DDP, and **redo the step** at the smaller
   world size from the state they hold: the sampler deals the samples of the epoch not yet
   trained on to the new world, as a resume at another world size does, and each rank starts
   the redo from the random generators of the rank whose place it takes (as of the last
   commit). So the run ends where "train to the failed step, save, resume at the
   new size" ends, bitwise.

A rank cut off from the store (a partition, or the store's node down: its heartbeat's store
calls go unanswered for ``heartbeat_timeout``; a watchdog thread notices, since such a call
waits rather than fails) stops with a :class:`MembershipError` that says so
(:func:`cut_off_message`), and exits one heartbeat timeout later if it is blocked where the
error cannot reach it. The old group of a re-form is abandoned, not destroyed: its abort runs on
a thread of its own, since Gloo's waits for work blocked on a peer that only silence tells gone.

Without ``--recover in-memory`` (or with one process) :class:`Run` is a plain DDP loop: the
same steps, no store traffic.

Example::

    tandem.init()
    run = tandem.recovery.Run(net, torch.optim.SGD(net.parameters(), lr=0.1), train_set,
                              batch_size=32, epochs=3)

    def train_step(model, batch):            # may be run again after a failure
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.item()

    while not run.finished:
        loss = run.step(train_step)
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import gc
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from tandem._dist import group_rank, group_size, initialized
from tandem.checkpoint.rng import (
    compact_rng_state,
    derived_seed,
    expand_rng_state,
    restore_rng_state,
    seed_rng,
)
from tandem.data.sampler import DistributedSampler
from tandem.doctor import mismatch, records
from tandem.files import write_atomic
from tandem.job import join
from tandem.job.secret import key_scope
from tandem.parallel.adapters import model_state, optimizer_state
from tandem.parallel.ddp import out_of_step
from tandem.parallel.ddp.wrapper import DistributedDataParallel
from tandem.world import reformed

log = logging.getLogger(__name__)

#: The environment variable ``tandem run --recover in-memory`` sets in every worker.
MODE_VARIABLE = "TANDEM_RECOVER"
#: Seconds without a heartbeat after which a rank counts as hung, unless the launcher says.
HEARTBEAT_TIMEOUT_VARIABLE = "TANDEM_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
#: Every key of the protocol lives under this prefix of the job's store (in the job secret's
#: scope, as the launcher writes its keys: a client without the secret can forge none).
PREFIX = f"tandem/{key_scope()}recover/"
#: The value of ``able/<rank>`` from a rank that recovers in memory (else ``no: <reason>``).
ABLE = "1"
_BEAT_S = 0.5
_POLL_S = 0.005
#: The commit's wait on its keys is a long one: the heartbeat thread ends it when a member is
#: gone (:meth:`Membership.end_commit`); these slices only look again for what it may not see.
#: (A short timeout of torch's ``TCPStore.wait`` can return seconds late when several clients
#: wait on the same keys: a commit must not lean on it.)
_COMMIT_SLICE_S = 1.0


class MembershipError(RuntimeError):
    """This rank cannot go on: it was left out of the new membership, or its side of the job
    holds no majority (a partition), or the survivors could not agree in time."""


@dataclass
class Recovery:
    """One recovery, as the exit summary lists it."""

    generation: int
    lost: list[int]  # launch ranks (RANK as started)
    members: list[int]  # launch ranks of the new generation, in new rank order
    step: int  # the step redone
    detected_s: float | None  # from the launcher's record of the death to this rank noticing
    recovered_s: float | None = None  # from noticing to the next committed step
    joined: list[int] = field(default_factory=list)  # replacements admitted (launch ranks)
    started: float = field(default=0.0, repr=False)  # monotonic, when noticed

    def record(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "lost": self.lost,
            "members": self.members,
            "step": self.step,
            "detected_s": self.detected_s,
            "recovered_s": self.recovered_s,
            "joined": self.joined,
        }


class _Lost(RuntimeError):
    """A member is gone (internal: the step is left and the group re-formed)."""


class Membership:
    """The job's members and this rank's place among them, agreed through the store.

    Members are named by their launch rank (``RANK`` as the launcher started them), which never
    changes; a generation's group ranks are their positions in its member list.

    Example::

        members = Membership(store, me=2, members=[0, 1, 2, 3], heartbeat_timeout=10.0)
        members.gone()              # {1}: the launcher marked rank 1 dead, or it went silent
        members.reform()            # generation 1: [0, 2, 3]; this rank is now rank 1 of 3
    """

    def __init__(
        self, store: dist.Store, me: int, members: list[int], heartbeat_timeout: float
    ) -> None:
        self.store = store
        self.me = me
        self.members = list(members)
        self.generation = 0
        self.heartbeat_timeout = heartbeat_timeout
        # Keys of steps every member is past, deleted by the heartbeat thread (:meth:`tidy`):
        # off the step's path.
        self.stale: deque[str] = deque()
        # Replacements that asked to join (the heartbeat thread counts them) and admitted.
        self.joiners_seen = 0
        self.admitted = 0
        self.admits = False  # whether this loop can hand a replacement the state
        # The commit this rank waits in (its keys, its outcome's key), for the heartbeat thread.
        self.in_commit: tuple[list[str], str] | None = None

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def key(self, *parts: object) -> str:
        return PREFIX + "/".join(str(p) for p in parts)

    def dead(self, store: dist.Store | None = None) -> dict[int, dict[str, Any]]:
        """Members the launcher marked dead: launch rank -> its record (``how``, ``at``).

        ``store``: another client of the job's store (a store client serves one thread)."""
        store = store or self.store
        found = {}
        for r in self.members:
            key = self.key("dead", r)
            if r != self.me and store.check([key]):
                found[r] = json.loads(store.get(key))
        return found

    def last_beats(self, store: dist.Store | None = None) -> dict[int, float]:
        """The time of each other member's last heartbeat (those that beat at all)."""
        store = store or self.store
        beats = {}
        for r in self.members:
            key = self.key("hb", r)
            if r != self.me and store.check([key]):
                beats[r] = float(store.get(key))
        return beats

    def silent(self, store: dist.Store | None = None) -> set[int]:
        """Members whose heartbeat is older than the timeout (hung, or cut off)."""
        now = time.time()
        beats = self.last_beats(store)
        return {r for r, at in beats.items() if now - at > self.heartbeat_timeout}

    def gone(self, store: dist.Store | None = None) -> set[int]:
        return set(self.dead(store)) | self.silent(store)

    def wait_commit(self, step: int, value: str = "1") -> int:
        """Return once ``step`` commits; :class:`_Lost` if it does not (a member gone first).
        Returns how many replacements have asked to join by then, if the members are to admit
        them after this step (the outcome says so, the same on every member), else 0.

        Every member sets its key (``value``: what the others may need of it if it is lost
        later) and waits for every member's. Seeing every key is not enough to step on its own:
        a member that gave up on a silent peer just before that peer's key landed must not
        leave the step while another member steps it. So each member also proposes the outcome
        (``ok`` once it saw every key, ``abort`` once it saw a member gone first) with
        ``compare_set`` and follows whichever came first: the step commits on every member or
        on none.
        """
        keys = [self.key(f"gen{self.generation}", "commit", step, r) for r in self.members]
        outcome = self.key(f"gen{self.generation}", "outcome", step)
        self.store.set(keys[self.rank], value)
        next_gen = self.key(f"gen{self.generation + 1}", "join")
        proposal = "ok"
        self.in_commit = (keys, outcome)
        slice_ = timedelta(seconds=max(_COMMIT_SLICE_S, self.heartbeat_timeout))
        try:
            while True:
                try:
                    # Returns the moment the last key is set: a member's, or the heartbeat
                    # thread's ending the commit once a member is gone (end_commit); a slice
                    # that runs out looks for a member gone itself before waiting again.
                    self.store.wait(keys, slice_)
                    break
                except dist.DistStoreError:
                    if self.gone() or _any_key(self.store, next_gen, self.members):
                        proposal = "ok" if self.store.check(keys) else "abort"
                        break
        finally:
            self.in_commit = None
        if proposal == "ok" and self.admits and self.joiners_seen > self.admitted:
            proposal = f"grow:{self.joiners_seen}"  # admit them after this step
        decided = _text(self.store.compare_set(outcome, "", proposal))
        if decided == "abort":
            raise _Lost(f"a member left during the commit of step {step}")
        if step >= 2:  # every member is past the commit before the last one: tidy it
            self.stale.append(self.key(f"gen{self.generation}", "commit", step - 2, self.me))
            if self.rank == 0:
                self.stale.append(self.key(f"gen{self.generation}", "outcome", step - 2))
        return int(decided.removeprefix("grow:")) if decided.startswith("grow:") else 0

    def end_commit(self, store: dist.Store) -> None:
        """A member is gone (the heartbeat thread calls it, with its own store client): end
        the commit this rank waits in, unless every member's key is there (then it commits).
        Its outcome is proposed ``abort`` (``compare_set``: a member that saw every key first
        decides it ``ok`` instead), and once ``abort`` is the outcome the keys still missing
        are set (to ``gone``), so that every member's wait returns at once and follows it; a
        member that is only late finds the outcome when it gets there."""
        pending = self.in_commit
        if pending is None:
            return
        keys, outcome = pending
        if store.check(keys) or _text(store.compare_set(outcome, "", "abort")) != "abort":
            return
        for key in keys:
            store.compare_set(key, "", "gone")

    def grow(self, count: int) -> list[int]:
        """Admit the replacements queued up to ``count`` (the commit's outcome said so): the
        next generation is the members then the newcomers, in the order they asked; rank 0
        writes it and each newcomer's admission. Returns the newcomers' launch ranks."""
        newcomers = [
            int(_text(self.store.get(self.key("joiner", n))))
            for n in range(self.admitted + 1, count + 1)
        ]
        members, g = self.members + newcomers, self.generation + 1
        if self.rank == 0:
            self.store.set(self.key(f"gen{g}", "members"), json.dumps(members))
            for r in newcomers:
                admission = {
                    "generation": g,
                    "members": members,
                    "admitted": count,
                    "rank": members.index(r),
                    "world_size": len(members),
                    "prefix": self.key(f"gen{g}", "pg") + "/",
                }
                self.store.set(self.key("admit", r), json.dumps(admission))
        self.members, self.generation, self.admitted = members, g, count
        return newcomers

    def tidy(self, store: dist.Store | None = None) -> None:
        """Delete the keys of steps every member is past (the heartbeat thread calls it, with
        its own store client; without one, on this thread's)."""
        store = store or self.store
        while self.stale:
            store.delete_key(self.stale.popleft())

    def committed_values(
        self, step: int, generation: int | None = None, members: list[int] | None = None
    ) -> dict[int, str]:
        """The values the members of ``generation`` (default: the current one) set when they
        committed ``step``, by launch rank (a committed step's keys stay until two steps
        later)."""
        g = self.generation if generation is None else generation
        found = {}
        for r in self.members if members is None else members:
            key = self.key(f"gen{g}", "commit", step, r)
            if self.store.check([key]):
                found[r] = _text(self.store.get(key))
        return found

    def reform(self) -> list[int]:
        """Agree on the next generation's members; returns the launch ranks that left.

        Raises:
            MembershipError: this rank was left out, or holds no majority, or no agreement
                came within three heartbeat timeouts.
        """
        old, g = self.members, self.generation + 1
        self.store.set(self.key(f"gen{g}", "join", self.me), "1")
        deadline = time.monotonic() + 3 * self.heartbeat_timeout
        decided_key = self.key(f"gen{g}", "members")
        while not self.store.check([decided_key]):
            joined = {r for r in old if self.store.check([self.key(f"gen{g}", "join", r)])}
            dead = set(self.dead())
            if joined | dead | self.silent() >= set(old):
                proposal = sorted(joined - dead)
                self.store.compare_set(decided_key, "", json.dumps(proposal))
                break
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"rank {self.me}: the members of generation {g} did not agree within "
                    f"{3 * self.heartbeat_timeout:.0f} s (joined: {sorted(joined)}, of "
                    f"{old})"
                )
            time.sleep(_POLL_S)
        members = json.loads(self.store.get(decided_key))
        if self.me not in members:
            raise MembershipError(
                f"rank {self.me} was left out of generation {g} (members {members}): the "
                "others counted it as gone; it stops here"
            )
        confirmed = set(self.dead())
        counted = [r for r in old if r not in confirmed]
        if 2 * len(members) <= len(counted):
            raise MembershipError(
                f"rank {self.me}: only {len(members)} of the {len(counted)} ranks not known "
                f"dead ({counted}) are reachable: without a majority this side of a partition "
                "stops rather than train on its own"
            )
        lost = [r for r in old if r not in members]
        self.members, self.generation = members, g
        return lost


class _Heartbeat(threading.Thread):
    """Every 0.5 s, on its own store connection: sets ``hb/<me>`` to the time, and looks for a
    member gone (the launcher's mark, or silence). Finding one, it makes this process's waits
    on collectives raise :class:`_Lost` within half a second (``tandem.doctor.mismatch``'s
    sliced waits), so that a survivor blocked in a collective with a dead or hung peer leaves
    it at once instead of at the collective's timeout."""

    def __init__(self, members: Membership) -> None:
        super().__init__(name="tandem-heartbeat", daemon=True)
        self.members = members
        self.store = _job_store()
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # held by a re-form: no stale verdict lands after it
        #: Why this rank stops, once the store stopped answering (:func:`cut_off_message`).
        self.cut_off: str | None = None
        self._answered = time.monotonic()  # the end of the last beat whose calls all returned
        self._once = threading.Lock()

    def run(self) -> None:
        # A store call on a cut link waits for an answer that never comes (the client's
        # timeout does not bound it): a watchdog notices the silence instead.
        threading.Thread(target=self._watch, name="tandem-heartbeat-watchdog", daemon=True).start()
        key = self.members.key("hb", self.members.me)
        while not self.stopped.is_set():
            try:
                self.store.set(key, repr(time.time()))
                self.members.tidy(self.store)
                self.members.joiners_seen = int(self.store.add(self.members.key("joiners"), 0))
                # A re-form holds the lock while the members agree, as long as the slowest of
                # them takes to notice the loss, and decides who is gone itself: the beat goes
                # on meanwhile, or the others would count this rank silent and its watchdog
                # would take the wait for the store's.
                if self.lock.acquire(blocking=False):
                    try:
                        gone = self.members.gone(self.store)
                        if gone and mismatch.failed is None:
                            mismatch.fail(
                                f"rank(s) {sorted(gone)} of the job left",
                                _Lost,
                                wait_for_others=False,
                            )
                        if gone:  # every beat: a commit begun since is ended too
                            self.members.end_commit(self.store)
                    finally:
                        self.lock.release()
                self._answered = time.monotonic()
            except Exception as error:  # the connection broke: the store's node is down
                if not self.stopped.is_set():  # else the loop is done and the job ending
                    self._cut_off(str(error).splitlines()[0] if str(error) else repr(error))
                return
            self.stopped.wait(_BEAT_S)

    def _watch(self) -> None:
        """Cut off once a beat's store calls have not returned for a heartbeat timeout: the
        others count this rank as silent after as long."""
        timeout = self.members.heartbeat_timeout
        while not self.stopped.wait(_BEAT_S / 2):
            if time.monotonic() - self._answered > timeout:
                self._cut_off(f"the store has not answered for {timeout:g} s")
                return

    def _cut_off(self, why: str) -> None:
        """The store does not answer (a partition, or its node is down): this process's
        collectives raise :class:`MembershipError` from now on; if it has not stopped within a
        heartbeat timeout (blocked in a store call, which nothing interrupts), it exits here."""
        if not self._once.acquire(blocking=False):
            return
        self.cut_off = cut_off_message(self.members.me)
        log.error("%s (%s)", self.cut_off, why)
        mismatch.reset()  # a member gone, seen before, is no longer the reason
        mismatch.fail(self.cut_off, MembershipError, wait_for_others=False)
        if not self.stopped.wait(self.members.heartbeat_timeout):
            print(f"tandem.recovery.MembershipError: {self.cut_off}", file=sys.stderr, flush=True)
            os._exit(1)


class Recoverer:
    """One rank's side of recovery in memory, for a loop that can redo its step (:class:`Run`,
    the Trainer): the membership, the heartbeat, the commit, and the re-forming of the group.

    Inactive (:attr:`active` False, :meth:`commit` a no-op, :meth:`lost`
    always False) unless the job runs under ``tandem run --recover in-memory`` with more than
    one process.

    Example::

        recoverer = Recoverer()
        try:
            loss = forward_backward()
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
        # The last commit: its step, generation and members (the states a recovery loads).
        self.last_commit: tuple[int, int, list[int]] | None = None
        self.joined = False
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

    def commit(self, step: int, value: str = "1") -> int:
        """Commit ``step`` on every member or on none (:meth:`Membership.wait_commit`);
        ``value``: this rank's own state as the step leaves it, which the rank that takes its
        place loads if this one is lost before the next commit (:meth:`committed_states`).
        Returns the count of replacements to admit after this step (:meth:`grow`), else 0."""
        if self.members is None:
            return 0
        with self._reachable():
            grow = self.members.wait_commit(step, value)
        self.last_commit = (step, self.members.generation, list(self.members.members))
        return grow

    def grow(self, step: int, count: int, release: Callable[[], None]) -> list[int]:
        """Admit the replacements queued up to ``count`` after step ``step`` (every member
        calls it at the same step boundary): the group is formed anew with them appended;
        ``release`` drops the caller's hold on the old group (as for :meth:`reform`). Returns
        the newcomers' launch ranks. The caller then hands them the state (a collective the
        newcomers join from their constructor)."""
        assert self.members is not None and self._heartbeat is not None
        started = time.monotonic()
        with self._heartbeat.lock, self._reachable():
            newcomers = self.members.grow(count)
        g = self._form_group(release)
        grown = Recovery(
            generation=g, lost=[], members=list(self.members.members), step=step,
            detected_s=None, joined=newcomers, started=started,
        )  # fmt: skip
        self._pending.append(grown)
        log.warning(
            "admitted replacement(s) %s after step %d: going on as rank %d of %d",
            newcomers, step, self.members.rank, self.members.world_size,
        )  # fmt: skip
        return newcomers

    def hand_over(self, state: Any, own: Any = None) -> tuple[Any, list[Any]]:
        """Admitting replacements, over the group :meth:`grow` formed (a collective: the members
        call it once they have grown and wrapped their model anew, a newcomer as it takes over):
        rank 0's ``state`` to every rank, and every rank's ``own`` (a newcomer's: None) to every
        rank, in rank order. Returns both.

        Example::

            state, owns = recoverer.hand_over({"optimizer": opt.state_dict()}, own=mine)
        """
        assert self.members is not None
        handed: list[Any] = [state if self.members.rank == 0 else None]
        dist.broadcast_object_list(handed, src=0)
        owns: list[Any] = [None] * self.members.world_size
        dist.all_gather_object(owns, own)
        return handed[0], owns

    def committed_states(self) -> list[str]:
        """Every member's value of the last commit, in the order of the members then (new rank
        r of a re-formed group takes entry r, as a resume at another world size maps saved
        ranks). From the generation that committed it: a recovery cut short by another loss
        before its redo committed goes back to the same states.

        Raises:
            RuntimeError: no commit yet, or a member's value is missing (it cannot be, for a
                step every member committed).
        """
        assert self.members is not None
        if self.last_commit is None:
            raise RuntimeError("no step has been committed: there is no state to go back to")
        step, generation, members = self.last_commit
        values = self.members.committed_values(step, generation, members)
        missing = [r for r in members if r not in values]
        if missing:
            raise RuntimeError(f"no committed state of rank(s) {missing} for step {step}")
        return [values[r] for r in members]

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

    def reform(self, step: int, release: Callable[[], None]) -> list[int]:
        """Agree on the survivors, take the old group down and form the new one; returns the
        old generation's members (launch ranks, in their old rank order).

        ``release`` drops everything of the old group the caller holds (its DDP wrapper, the
        reducer's hooks): the old group's sockets close only when its last reference goes, and
        a survivor still blocked in the failed step's collective on a live peer that left it
        is released only by that peer's sockets closing.

        Raises:
            MembershipError: this rank cannot go on.
        """
        assert self.members is not None and self._heartbeat is not None
        noticed, now = time.monotonic(), time.time()
        with self._heartbeat.lock, self._reachable():
            dead, beats = self.members.dead(), self.members.last_beats()
            old_members = list(self.members.members)
            lost = self.members.reform()
            mismatch.reset()  # the new group starts with no failure
        # Detection time: from the launcher's record of the death, else from the last beat.
        since = [float(dead[r]["at"]) if r in dead else beats.get(r) for r in lost]
        known = [s for s in since if s is not None]
        detected = now - max(known) if known else None
        g = self._form_group(release)
        self._pending.append(  # after another one whose redo this loss cut short
            Recovery(
                generation=g,
                lost=lost,
                members=list(self.members.members),
                step=step,
                detected_s=detected,
                started=noticed,
            )
        )
        log.warning(
            "lost rank(s) %s at step %d: going on as rank %d of %d",
            lost,
            step,
            self.members.rank,
            self.members.world_size,
        )
        return old_members

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
        assert self.members is not None
        backend = dist.get_backend()
        release()
        records.clear()
        _abandon_group()
        gc.collect()
        g = self.members.generation
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(self.members.key(f"gen{g}", "pg") + "/", _job_store()),
            rank=self.members.rank,
            world_size=self.members.world_size,
            timeout=timedelta(seconds=max(60.0, 6 * self.members.heartbeat_timeout)),
        )
        reformed(self.members.rank, self.members.world_size)
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


class Run:
    """A hand-written DDP training loop that survives the loss of a rank (see the module doc).

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
        the new world size. Its result (of the run that committed) is returned.

        Raises:
            MembershipError: this rank cannot go on (see :class:`MembershipError`).
        """
        if self.finished:
            raise RuntimeError(f"the run has trained its {self.epochs} epoch(s)")
        if self.recoverer.active and self.recoverer.last_commit is None:
            # The state the first step starts from (after a resume too) is the first one a
            # recovery can go back to.
            self._admit(self.recoverer.commit(self.step_count - 1, encode(compact_rng_state())))
        grow = 0
        while True:
            batch = self._next_batch()
            self.optimizer.zero_grad(set_to_none=True)
            lost = False
            try:
                result = fn(self.model, batch)
                # With this rank's generators as the next step starts (the optimizer draws
                # nothing): the rank that takes its place if it is lost before the next commit
                # starts from them.
                rng = encode(compact_rng_state()) if self.recoverer.active else ""
                grow = self.recoverer.commit(self.step_count, rng)
            except MembershipError:
                raise
            except Exception as error:
                if not self.recoverer.lost(error):
                    raise
                lost = True
            if lost:
                # Outside the except block: its traceback (the frames of the failed step, which
                # hold the old group's work) is gone before the old group is taken down.
                self._recover()
                continue
            break
        self.optimizer.step()
        self.step_count += 1
        self._committed = self.sampler.state_dict()
        self._after_commit()
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

    def _after_commit(self) -> None:
        self._peeked = None
        self.recoverer.committed()
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
        """Admit the replacements the commit's outcome named (``count`` queued; every member
        does it after the same step), hand them the run's state from rank 0, and commit the
        new generation's start (which may name more)."""
        while count:
            self.recoverer.grow(self.step_count, count, self._release)
            self.model = self._wrap()  # its constructor broadcasts rank 0's parameters
            self.recoverer.hand_over(
                {"optimizer": self.optimizer.state_dict(), "run": self.state_dict()}
            )
            self._start_sampler()
            count = self.recoverer.commit(self.step_count - 1, encode(compact_rng_state()))

    def _take_over(self) -> None:
        """A replacement, admitted: take the run's state from rank 0 (the parameters came with
        the wrapper's constructor), start its generators where a resume at this world size
        would (:func:`newcomer_seed`), and commit the new generation's start with the
        members."""
        state, _ = self.recoverer.hand_over(None)
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_state_dict(state["run"])
        seed_rng(newcomer_seed(self.seed, self.step_count, self.rank))
        self._admit(self.recoverer.commit(self.step_count - 1, encode(compact_rng_state())))

    def _recover(self) -> None:
        self.recoverer.reform(self.step_count, self._release)
        self.model = self._wrap()
        self._start_sampler()
        # New rank r continues rank r's generators of the last commit (as a resume at another
        # world size maps them): its own where it keeps its number.
        restore_rng_state(expand_rng_state(decode(self.recoverer.committed_states()[self.rank])))


def _abandon_group() -> None:
    """Take down the default group without waiting for its collectives: one may be blocked on
    a hung peer, and a plain ``destroy_process_group`` would wait for it forever. Torch forgets
    the groups at once (``_abort_process_group``'s bookkeeping) and the backends are aborted on
    a thread of their own: a Gloo abort waits for its blocked work, which a peer cut off by the
    network (no reset ever comes) holds until TCP gives up."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    tables = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag",
              "tags_to_pg", "pg_coalesce_state")  # fmt: skip
    known = all(hasattr(world, t) for t in tables) and hasattr(c10d, "_update_default_pg")
    if not known or not hasattr(c10d, "_unregister_all_process_groups"):
        # Another torch than those this bookkeeping was written for: its own abort (which
        # waits for work blocked on a cut-off peer until TCP gives up).
        log.warning("this torch keeps its groups otherwise: aborting the old group in place")
        c10d._abort_process_group()
        return
    groups = list(world.pg_names)
    for group in groups:  # never freed, not even as the interpreter exits: the destructor of a
        # group whose work waits on a peer cut off by the network would wait with it
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))

    def abort() -> None:
        for group in groups:
            try:
                group.abort()
            except Exception as error:  # an abort the backend refuses: it is forgotten anyway
                log.warning("aborting an old process group: %s", error)

    threading.Thread(target=abort, name="tandem-abort", daemon=True).start()
    c10d._update_default_pg(None)
    for table in tables:
        getattr(world, table).clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0


def _job_store(timeout: float = 60.0) -> dist.Store:
    """A new client of the job's store (the launcher's, at MASTER_ADDR:MASTER_PORT) whose
    calls give up after ``timeout`` seconds (a cut link makes a call wait, not fail)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
        use_libuv=True,
    )


def cut_off_message(rank: int, environ: Mapping[str, str] = os.environ) -> str:
    """Why a rank that cannot reach the job's store (``MASTER_ADDR:MASTER_PORT``) stops
    (:class:`MembershipError`'s text).

    Example::

        >>> print(cut_off_message(3, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}))
        rank 3: cut off from the job's store at 10.0.0.1:29500: this rank is on the side of a partition without the store, or the store's node is down; it stops
    """  # noqa: E501
    where = f"{environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')}"
    return (
        f"rank {rank}: cut off from the job's store at {where}: this rank is on the side of a "
        "partition without the store, or the store's node is down; it stops"
    )


def declare_unable(reason: str) -> None:
    """Tell the launcher that this rank will not recover in memory (``reason`` says why): a lost
    rank then makes it restart every worker (``--recover in-memory`` falls back to
    ``restart``). A no-op outside ``--recover in-memory``.

    Example::

        declare_unable("the model is sharded across ranks (FullyShardedDataParallel)")
    """
    if enabled() and group_size() > 1:
        _job_store().set(f"{PREFIX}able/{group_rank()}", f"no: {reason}")


def newcomer_seed(seed: int, step: int, rank: int) -> int:
    """The seed of the generators of a rank that a run had not before (a replacement admitted
    after ``step`` as ``rank``; a resume at a larger world size does the same for its ranks
    beyond the saved ones): Python's, NumPy's and torch's are seeded from it.

    Example::

        seed_rng(newcomer_seed(run.seed, run.step_count, tandem.world().rank))
    """
    return derived_seed("tandem.recovery.newcomer", seed, step, rank)


def enabled() -> bool:
    """Whether this process runs under ``tandem run --recover in-memory``."""
    return os.environ.get(MODE_VARIABLE) == "in-memory"


def encode(state: Any) -> str:
    """``state`` as text for the store: JSON, with each tensor as its dtype, shape and bytes
    (base64). Dicts with string keys, lists, tuples (read back as lists), numbers, strings,
    None and CPU tensors; a float comes back bitwise. Fast enough for every step (a rank's
    generators in about 0.1 ms), and nothing in it is code (unlike a pickle).

    Example::

        >>> decode(encode({"rng": torch.arange(3), "sums": [0.1, 2]}))
        {'rng': tensor([0, 1, 2]), 'sums': [0.1, 2]}
    """
    return json.dumps(_plain(state), separators=(",", ":"))


def decode(text: str | bytes) -> Any:
    """The state :func:`encode` made text of."""
    return _unplain(json.loads(text))


_TENSOR = "__tensor__"


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return {
            _TENSOR: str(data.dtype).removeprefix("torch."),
            "shape": list(data.shape),
            "data": base64.b64encode(raw).decode(),
        }
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"only string keys can be encoded, not {list(value)[:3]}")
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot encode a {type(value).__name__} for the store")


def _unplain(value: Any) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value:
            dtype = getattr(torch, value[_TENSOR])
            raw = bytearray(base64.b64decode(value["data"]))
            flat = (
                torch.frombuffer(raw, dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            return flat.view(dtype).reshape(value["shape"])
        return {k: _unplain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    return value


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _any_key(store: dist.Store, prefix: str, ranks: list[int]) -> bool:
    return any(store.check([f"{prefix}/{r}"]) for r in ranks)
