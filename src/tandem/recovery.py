"""Recovery in memory: a rank that dies costs the step in flight, not a restart from disk.

Under ``tandem run --recover in-memory`` the launcher keeps the other workers running when one
dies, hosts the job's store itself (so rank 0's death does not take it along) and marks the
dead rank there (``tandem/recover/dead/<rank>``). A hand-written loop written with :class:`Run`
then goes on by itself:

1. Every step ends with a **commit**, a vote that rides in the step's own gradient
   all-reduce. Right before a member reduces the last gradient bucket of its backward, it
   leaves its own state as the step leaves it (its generators; a Trainer's loss sums) in the
   store, in one of three keys of its own and only when it changed (:func:`slot_to_write`).
   Once every bucket's all-reduce has completed on a rank, every member contributed to the
   last one, so every member had left its state: that completion is the vote, and the step
   commits there and its optimizer steps, with no collective and no store round trip of its
   own. The replacements a member has seen queued ride in the same all-reduce, as counts that
   are zero while none is queued (:class:`tandem.parallel.ddp.end_of_backward.Vote`). A step
   that made no DDP backward (or one on NCCL, whose waits do not block the host) votes in a
   collective of its own instead: one small all-gather. Every wait is in slices
   (:func:`tandem.doctor.mismatch.wait_in_slices`, the reducer's alike), so a dead or hung
   member makes it raise within the heartbeat's notice.
2. A survivor learns of the loss from its collective's error (Gloo's connection to the dead
   peer breaks), or from the launcher's mark, or from a heartbeat (``hb/<rank>``, every 0.5 s)
   older than ``heartbeat_timeout`` (a hung rank): the heartbeat thread reads the last two and
   makes every sliced wait, the vote's included, raise.
3. The survivors **agree on the new membership** through the store: each joins generation
   ``g + 1`` with its last commit; once every member of ``g`` has joined or is known
   to be gone, the first to decide writes the members (``compare_set``: one decision, the same
   on every rank). A rank left out, or a side that does not hold a majority of the ranks not
   known dead, stops with a :class:`MembershipError`.
4. A collective can complete on some ranks and not on others (a member dies in the middle of
   Gloo's ring), so the survivors may disagree on the last commit. They **roll forward**:
   the newest commit any survivor made is the one all go on from. A survivor that did not
   make it entered its vote (it had left its state), but its last bucket may hold a partial
   sum: it takes the state the step left from a survivor that committed it
   (:meth:`Recoverer.reform`'s ``ahead``: the parameters and the optimizer's state).
   A commit is known by its **key, (step, generation)**: the step, and the generation whose
   members voted on it, compared in that order. A new generation's start commit (7.) commits
   again the step it starts from, among other members in other places, so one step can have
   two commits: a member that made only the older one is behind as well, and takes the newer
   key and member list alone (that commit moved no parameters; it says which members, in
   which places, hold the step's states). Each rank's own state is left in the store under
   the key it votes on, and the states of its last two commits stay readable until it votes
   again (:func:`slot_to_write`): a member still reading the states of the commit a generation
   starts from finds them even after the others left theirs for that generation's start.
5. They build a **new process group** over a fresh key prefix of the same store (the old one
   is destroyed off the path: :func:`_abandon_group`), wrap the module in a new tandem.DDP,
   and **redo the next step** at the smaller
   world size from the state they hold: the sampler deals the samples of the epoch not yet
   trained on to the new world, as a resume at another world size does, and each rank starts
   the redo from the random generators of the rank whose place it takes (as of the last
   commit). So the run ends where "train to the failed step, save, resume at the
   new size" ends, bitwise.

**Growing back, and a loss during an admission.** A replacement queued in the store
(:mod:`tandem.job.join`) is admitted after a step whose vote says every member has seen it
queued (its counts ride in the same all-reduce). Every generation is decided once, the same
way whatever brought the members to it:

6. Each member goes to generation ``g + 1`` through one decision (:meth:`Membership.reform`):
   it joins with its last commit's key and, after a commit that admits, the queue place the
   vote admitted up to. The first member that sees every member of ``g`` joined or gone
   writes ``g + 1``'s members by ``compare_set``, so a member whose vote passed (it admits)
   and one whose vote failed (it re-forms) read one membership, and the same join values,
   whichever wrote first. The decision admits the replacements only when no member of ``g``
   was lost and none is behind; else it is a re-form, and the replacements stay queued for the
   next commit's vote. Every member writes each newcomer's admission, the same text.
7. Before anyone forms the group, every member says it is here (:func:`tandem.job.join.meet`):
   a member lost since the decision is noticed there, in store calls that return, and the
   survivors decide ``g + 2``. Then the group forms, within :func:`formation_timeout` (one
   lost in between stops it there: the survivors decide ``g + 2``, whose record counts the
   losses of ``g + 1``), a member behind rolls forward (4.), the
   first member that holds the run hands it to the newcomers (:meth:`Recoverer.hand_over`),
   every rank starts its generators where a resume at the new size from the last commit starts
   them (new rank r continues rank r's of that commit; a rank beyond them is seeded by
   :func:`newcomer_seed`), and with newcomers the new generation's start is committed.
8. A loss anywhere in this (the hand-over, the start commit; a newcomer's own included) is a
   loss like any: the survivors decide ``g + 2``. A newcomer that has not got the run yet
   joins that decision as a *fresh* member (it is behind nobody, and the next generation hands
   it the run again), one that has it as any member; a newcomer whose generation lost a member
   before its group formed joins the re-form from its wait to be admitted. One left out stops
   with a :class:`MembershipError` (the launcher kills and counts it), as any member left out.

So a run with losses during admissions ends where the chain of saves and resumes at each
generation's size, at each step where a group was formed, ends.

A rank cut off from the store (a partition, or the store's node down: its heartbeat's store
calls go unanswered for ``heartbeat_timeout``; a watchdog thread notices, since such a call
waits rather than fails) stops with a :class:`MembershipError` that says so
(:func:`cut_off_message`), and exits one heartbeat timeout later if it is blocked where the
error cannot reach it. The old group of a re-form is taken down without waiting for it: its
Gloo connections are shut down from this side (a wait blocked on a peer that only silence tells
gone then fails at once) and the group is freed on a thread of its own
(:mod:`tandem._groups_reaper`).

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
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout
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
from tandem.job.join import replacing  # noqa: F401 (public here: tandem.recovery.replacing)
from tandem.job.secret import key_scope
from tandem.parallel.adapters import model_state, optimizer_state
from tandem.parallel.ddp import out_of_step
from tandem.parallel.ddp.wrapper import DistributedDataParallel
from tandem.world import reformed
from tandem.world import world as current_world

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
#: How many store keys hold a rank's own state (:func:`slot_to_write` says why three).
OWN_SLOTS = 3
#: A test's hook, called with the step right after a vote completed on this rank (inside the
#: backward, for a vote in the gradient all-reduce): a test makes it raise, as if the vote had
#: failed here while it completed elsewhere (a split vote).
_after_vote: Callable[[int], None] | None = None
#: How many queued replacements one backward's vote can admit at once (its counts: one per
#: threshold; more are admitted by the commit of the new generation's start).
_ADMIT_AT_ONCE = 4

#: A commit's identity: its step and the generation whose members voted on it. A new
#: generation's start commits again the step it starts from, with other members in other places
#: (so other states): the generation tells the two commits of one step apart.
CommitKey = tuple[int, int]
#: One key of a rank's own state: the commit (or the attempt at one) whose state it holds, and
#: that state. A bare step stands for that step's commit in generation 0 (a run never re-formed).
Slot = tuple[CommitKey | int, str]


def commit_key(key: CommitKey | int) -> CommitKey:
    """``key`` as (step, generation): a bare step is that step's commit in generation 0.

    Example::

        >>> commit_key(4), commit_key((4, 2))
        ((4, 0), (4, 2))
    """
    return (key, 0) if isinstance(key, int) else (int(key[0]), int(key[1]))


def newest_slot(slots: Sequence[Slot | None], key: CommitKey | int) -> int | None:
    """The slot a survivor that settled on the commit ``key`` reads: the newest with a key <=
    ``key``, ordered by step, then generation (None if there is none).

    Example::

        >>> newest_slot([(4, "a"), (6, "b"), None], 5)
        0
        >>> newest_slot([((4, 1), "a"), ((4, 3), "b"), None], (4, 2))  # 4 again in gen 3
        0
    """
    target = commit_key(key)
    readable = [i for i, slot in enumerate(slots) if slot is not None and _key_of(slot) <= target]
    return max(readable, key=lambda i: _key_of(slots[i]), default=None)


def _key_of(slot: Slot | None) -> CommitKey:
    assert slot is not None
    return commit_key(slot[0])


def slot_to_write(
    slots: Sequence[Slot | None],
    key: CommitKey | int,
    value: str,
    committed: CommitKey | int | None,
    previous: CommitKey | int | None = None,
) -> int | None:
    """Where this rank writes its own state ``value`` as the commit ``key`` (a step, and the
    generation voting on it) leaves it, before it votes on that commit; None when a reader
    settling on ``key`` already finds ``value`` (the state did not change: no store call at
    all). ``committed``: this rank's last commit (None: none yet); ``previous``: the one before
    (for bare steps, ``committed - 1`` unless given; None for a key: this rank has no other).

    A survivor settles on a commit S and reads every old member's newest value with a key <= S
    (:func:`newest_slot`). When this rank votes on ``key``, S may be ``key`` (the vote
    completes somewhere), ``committed`` (it completes nowhere), or ``previous``: this rank's
    vote on ``committed`` completed, which proves only that every member entered that vote,
    not that it completed anywhere else (when this rank dies, the survivors may all have failed
    it). So the slots holding the newest value <= ``committed`` and the newest <= ``previous``
    are kept, and the third is written: three slots, not two. A slot of an attempt after
    ``committed`` that did not commit (its vote failed, the step is redone) is the one
    overwritten first. A new generation's start commits the step it starts from again, under
    its own key: the slot of that step's first commit is kept, so a member that reads the
    states of the first commit still finds them after the others wrote those of the second.

    Example::

        >>> slot_to_write([(4, "a"), (6, "b"), None], 7, "c", committed=6)
        2
        >>> slot_to_write([(4, "a"), (6, "b"), (7, "c")], 8, "c", committed=7)  # unchanged
        >>> slot_to_write([((4, 1), "a"), ((6, 1), "b"), None], (6, 2), "c", committed=(6, 1))
        2
    """
    new = commit_key(key)
    assert all(s is None or _key_of(s) <= new for s in slots), (slots, key)
    current = newest_slot(slots, new)
    if current is not None and cast(Slot, slots[current])[1] == value:
        return None
    last = None if committed is None else commit_key(committed)
    if previous is None and isinstance(committed, int):
        previous = committed - 1  # bare steps: consecutive commits
    keep = set()
    if last is not None:
        assert last < new, (committed, key)
        keep.add(newest_slot(slots, last))
        if previous is not None:
            keep.add(newest_slot(slots, previous))
        keep.discard(None)
    free = [i for i in range(len(slots)) if i not in keep]
    assert free, (slots, key, committed, previous)

    def order(i: int) -> tuple[int, CommitKey]:
        slot = slots[i]
        if slot is None:
            return (1, (0, 0))  # then an empty slot
        if last is None or _key_of(slot) > last:
            return (0, (0, 0))  # an attempt that never committed: its step is redone
        return (2, _key_of(slot))  # then the oldest

    return min(free, key=order)


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
        # What this rank wrote to its own state's keys (:meth:`publish`), as the store holds it.
        self.own: list[Slot | None] = [None] * OWN_SLOTS
        # This rank's last two commits, oldest first (:meth:`record_commit`).
        self.commits: list[CommitKey] = []
        # The last re-form's verdict: the commit every member goes on from (the newest any of
        # them committed, by step, then generation; ``settled`` is its step), and the members
        # that had not committed it (they roll forward).
        self.settled: int | None = None
        self.settled_key: CommitKey | None = None
        self.behind: list[int] = []
        # Replacements that asked to join (the heartbeat thread counts them) and admitted.
        self.joiners_seen = 0
        self.admitted = 0
        self.admits = False  # whether this loop can hand a replacement the state
        # The last decision's newcomers (replacements admitted by it, and those of a failed
        # admission that still wait for the run's state: the members hand it to them) and the
        # members it left out.
        self.newcomers: list[int] = []
        self.lost: list[int] = []

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

    def record_commit(self, key: CommitKey) -> None:
        """This rank committed ``key`` (voted, rolled forward to it, or was handed it): the
        commits its next :meth:`publish` keeps the states of.

        Example::

            members.record_commit((5, members.generation))
        """
        self.commits = [*self.commits[-1:], key]

    def publish(
        self, step: int, value: str, committed: int | None, store: dist.Store | None = None
    ) -> None:
        """Leave this rank's own state as the vote on ``step`` in this generation leaves it
        (``value``) where a survivor finds it if this rank is lost: in one of its
        :data:`OWN_SLOTS` keys, under the commit's key (``step``, generation), and only if it
        changed (:func:`slot_to_write`; a model that draws no random numbers makes no store
        call). ``committed``: the step of this rank's last commit, the last one
        :meth:`record_commit` recorded (without any recorded, bare steps of generation 0:
        ``committed - 1`` before it). ``store``: another client of the job's store (the vote's
        sender thread has its own); one thread publishes at a time."""
        key = (step, self.generation)
        last: CommitKey | int | None = committed
        previous: CommitKey | None = None
        if self.commits:
            last = self.commits[-1]
            assert committed == last[0], (committed, self.commits)
            previous = self.commits[0] if len(self.commits) > 1 else None
        slot = slot_to_write(self.own, key, value, last, previous)
        if slot is None:
            return
        (store or self.store).set(self.key("own", self.me, slot), f"{step} {key[1]} {value}")
        self.own[slot] = (key, value)

    def own_value(self, rank: int, key: CommitKey | int) -> str:
        """The own state that launch rank ``rank`` left for the commit ``key`` (step,
        generation; a bare step: of generation 0): its newest with a key <= ``key``
        (:func:`newest_slot`).

        Raises:
            RuntimeError: it left none (it cannot be, for a commit every member voted on).
        """
        slots: list[Slot | None] = []
        for i in range(OWN_SLOTS):
            name = self.key("own", rank, i)
            if self.store.check([name]):
                step, generation, value = _text(self.store.get(name)).split(" ", 2)
                slots.append(((int(step), int(generation)), value))
            else:
                slots.append(None)
        found = newest_slot(slots, key)
        if found is None:
            what = f"step {key}" if isinstance(key, int) else f"step {key[0]} (generation {key[1]})"
            raise RuntimeError(f"rank {rank} left no state of {what} or before: {slots}")
        return cast(Slot, slots[found])[1]

    def grow(self, count: int, committed: CommitKey | int | None = None) -> list[int]:
        """Admit the replacements queued up to ``count`` (the commit's vote said so), through
        the same decision as a re-form (:meth:`reform`: the first to decide wins everywhere,
        so a member lost meanwhile makes it a re-form instead). Returns the launch ranks the
        new generation hands the run to (``newcomers``: none when it became a re-form)."""
        self.reform(committed, admit=count)
        return list(self.newcomers)

    def reform(
        self, committed: CommitKey | int | None = None, admit: int = 0, fresh: bool = False
    ) -> list[int]:
        """Agree on the next generation's members; returns the launch ranks that left.
        ``committed``: the last commit of this rank (step, generation; a bare step: of
        generation 0), which it joins with; the newest of the members' (by step, then
        generation) is then ``settled_key`` (``settled``: its step), and those behind it
        ``behind``: a member that committed the same step in an older generation (a new
        generation's start commit that completed on others and not on it) is behind too.
        ``admit``: the queued replacements (up to that place in the queue) the last commit's
        vote admitted on this rank (0: none). ``fresh``: this rank is a replacement that holds
        no state of the run yet (its admission's hand-over did not complete).

        The decision (the module doc, 6.): the first member to
        see every member of the generation joined or gone writes the members by compare_set,
        the survivors in their order, then, only when none was lost and none is behind, the
        replacements admitted; every member reads the same join values and derives the same
        verdict (``settled``, ``behind``, ``newcomers``, ``admitted``).

        Raises:
            MembershipError: this rank was left out, or holds no majority, or no agreement
                came within three heartbeat timeouts, or no member that holds the run's state
                is left.
        """
        old, g = self.members, self.generation + 1
        last = None if committed is None else commit_key(committed)
        mine = {
            "committed": None if last is None else last[0],
            "generation": None if last is None else last[1],
            "admit": admit,
            "fresh": fresh,
        }
        self.store.set(self.key(f"gen{g}", "join", self.me), json.dumps(mine))
        deadline = time.monotonic() + 3 * self.heartbeat_timeout
        decided_key = self.key(f"gen{g}", "members")
        while not self.store.check([decided_key]):
            joined = {r for r in old if self.store.check([self.key(f"gen{g}", "join", r)])}
            dead = set(self.dead())
            if joined | dead | self.silent() >= set(old):
                survivors = [r for r in old if r in joined and r not in dead]
                proposal = survivors + self._admissible(g, old, survivors)
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
        survivors = [r for r in members if r in old]
        if 2 * len(survivors) <= len(counted):
            raise MembershipError(
                f"rank {self.me}: only {len(survivors)} of the {len(counted)} ranks not known "
                f"dead ({counted}) are reachable: without a majority this side of a partition "
                "stops rather than train on its own"
            )
        lost = [r for r in old if r not in members]
        # Every member joined before the decision named it: the same values, read by every
        # member, give the same verdict everywhere.
        joins = {r: self._joined(g, r) for r in survivors}
        settled, behind, count = _verdict(joins)
        new = [r for r in members if r not in old]
        if not any(r in joins and not joins[r]["fresh"] for r in members):
            raise MembershipError(
                f"rank {self.me}: no member of generation {g} ({members}) holds the run's "
                f"state: every member that did was lost ({lost}); the job cannot go on"
            )
        if not lost and not behind and count > self.admitted:
            # The queue up to the vote's place is settled, admitted or (marked dead while
            # queued) passed over, as the decider's proposal did (:meth:`_admissible`).
            self.admitted = count
        self.newcomers = [r for r in members if r in new or joins[r]["fresh"]]
        self._write_admissions(g, members, new, self.newcomers)
        self.settled_key, self.behind = settled, behind
        self.settled = None if settled is None else settled[0]
        self.lost = lost
        self.members, self.generation = members, g
        return lost

    def _joined(self, g: int, rank: int) -> dict[str, Any]:
        """What ``rank`` joined generation ``g`` with (:meth:`reform`'s ``mine``)."""
        return cast(dict[str, Any], json.loads(self.store.get(self.key(f"gen{g}", "join", rank))))

    def _admissible(self, g: int, old: list[int], survivors: list[int]) -> list[int]:
        """The decider's part: the replacements generation ``g`` admits. None when a member of
        the generation was lost or a survivor is behind (the queue stays: the next commit's
        vote names them again), else those queued up to the place the vote admitted, less
        any marked dead while it waited."""
        _, behind, count = _verdict({r: self._joined(g, r) for r in survivors})
        if behind or len(survivors) < len(old) or count <= self.admitted:
            return []
        queued = [
            int(_text(self.store.get(self.key("joiner", n))))
            for n in range(self.admitted + 1, count + 1)
        ]
        return [r for r in queued if not self.store.check([self.key("dead", r)])]

    def _write_admissions(
        self, g: int, members: list[int], new: list[int], newcomers: list[int]
    ) -> None:
        """Each newcomer's admission (``admit/<launch rank>``, :mod:`tandem.job.join`): written
        by every member, the same text, so that any member lost after the decision leaves it
        written all the same."""
        for r in new:
            admission = {
                "generation": g,
                "members": members,
                "admitted": self.admitted,
                "rank": members.index(r),
                "world_size": len(members),
                "prefix": self.key(f"gen{g}", "pg") + "/",
                "newcomers": newcomers,
            }
            self.store.set(self.key("admit", r), json.dumps(admission))


def _verdict(
    joins: Mapping[int, Mapping[str, Any]],
) -> tuple[CommitKey | None, list[int], int]:
    """From what each survivor joined a generation with (:meth:`Membership.reform`): the
    commit they go on from (the newest any of them committed, by step, then generation; a
    fresh replacement's counts not), the members behind it (not the fresh: they are handed the
    run instead), and the queue place the vote of that commit admitted up to (0: none)."""
    holding = {r: j for r, j in joins.items() if not j["fresh"]}
    keys = {r: _join_key(j) for r, j in holding.items()}
    known = [k for k in keys.values() if k is not None]
    settled = max(known) if known else None
    behind = [r for r in holding if keys[r] != settled]
    count = max((int(holding[r]["admit"]) for r in holding if keys[r] == settled), default=0)
    return settled, behind, count


def _join_key(joined: Mapping[str, Any]) -> CommitKey | None:
    """The commit a member joined a generation with (a join without a generation: 0)."""
    if joined["committed"] is None:
        return None
    return (int(joined["committed"]), int(joined.get("generation") or 0))


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
                self.members.joiners_seen = int(self.store.add(self.members.key("joiners"), 0))
                # A re-form holds the lock while the members agree, as long as the slowest of
                # them takes to notice the loss, and decides who is gone itself: the beat goes
                # on meanwhile, or the others would count this rank silent and its watchdog
                # would take the wait for the store's.
                if self.lock.acquire(blocking=False):
                    try:
                        gone = self.members.gone(self.store)
                        if gone and mismatch.failed is None:
                            # Every sliced wait raises it from now on: a collective with the
                            # member gone, the commit's vote included, is left at once.
                            mismatch.fail(
                                f"rank(s) {sorted(gone)} of the job left",
                                _Lost,
                                wait_for_others=False,
                            )
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
    :class:`tandem.parallel.ddp.end_of_backward.Vote`; see the module doc).

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

    def __init__(self, recoverer: Recoverer) -> None:
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
        if _after_vote is not None:
            _after_vote(step)


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
        """Commit ``step`` on every member or on none (see the module doc). ``value``: this
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
        if _after_vote is not None:
            _after_vote(step)
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
            before, detected, noticed = self._unformed
            lost = [*before, *lost]
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
        formation = formation_timeout(members.heartbeat_timeout)
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


class RngText:
    """This process's generators as a commit leaves them in the store
    (``encode(compact_rng_state())``), taken anew only when they may have changed.

    Taking them costs 0.15 to 0.4 ms (NumPy's ``get_state`` alone 0.06 to 0.18 ms), a step of a
    small model 20 ms: at every step that is most of a 2% budget, for a model that mostly draws
    nothing. So a cheap look first compares their raw words with the last time's (torch's
    state, NumPy's key and position read in place through its bit generator's ``ctypes``
    address, Python's through the object's memory once that reading was checked against
    ``random.getstate()``); the state is taken only when they differ. NumPy's cached Gaussian
    is not in those words: while one is cached, the state is taken every time.

    Example::

        rng = RngText()
        recoverer.commit(step, rng.value())   # the same text, and no work, while nothing draws
        restore_rng_state(...)
        rng.forget()                          # the generators were set: take them anew
    """

    def __init__(self) -> None:
        self._look: tuple[Any, ...] | None = None
        self._text: str | None = None

    def value(self) -> str:
        look = _rng_look()
        if self._text is None or look is None or look != self._look:
            compact = compact_rng_state()
            self._text = encode(compact)
            # A cached Gaussian of NumPy's is used up without moving the words looked at.
            self._look = look if not compact["numpy"][3] else None
        return self._text

    def forget(self) -> None:
        self._text = None


def _rng_look() -> tuple[Any, ...] | None:
    """The raw words of this process's generators, cheaply (see :class:`RngText`); None where
    they cannot be read so."""
    import numpy as np

    python = _python_words()
    if python is None:
        return None
    cuda: list[bytes] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    bits = np.random.mtrand._rand._bit_generator
    numpy = ctypes.string_at(bits.ctypes.state_address, _MT_WORDS * 4 + 4)
    return (torch.get_rng_state().numpy().tobytes(), numpy, python, cuda)


_MT_WORDS = 624  # Mersenne twister's state: 624 32-bit words, and a position
_python_offset: int | None = -1  # where Python's generator keeps its words (None: unknown)


def _python_words() -> tuple[bytes, Any] | None:
    """Python's global generator: its position and words, read from the object's memory, with
    its cached Gaussian; None where that reading does not give ``random.getstate()``'s."""
    import random

    global _python_offset
    inst: Any = random._inst  # type: ignore[attr-defined,unused-ignore]
    if _python_offset == -1:
        # CPython's RandomObject: the object's header, an int (the position), the words.
        _python_offset = None
        header = object.__basicsize__
        raw = ctypes.string_at(id(inst) + header, 4 + _MT_WORDS * 4)
        words = [*memoryview(raw[4:]).cast("I").tolist(), int.from_bytes(raw[:4], sys.byteorder)]
        if tuple(words) == inst.getstate()[1]:
            _python_offset = header
    if _python_offset is None:
        return None
    return ctypes.string_at(id(inst) + _python_offset, 4 + _MT_WORDS * 4), inst.gauss_next


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


def formation_timeout(heartbeat_timeout: float) -> float:
    """Seconds a generation's group may take to form (every member's address and connections)
    before the members re-form: twice the heartbeat timeout, 5 s at least. The group's
    collectives wait longer (six heartbeat timeouts, 60 s at least: a slow step is no loss).

    Example::

        >>> formation_timeout(2.0), formation_timeout(10.0)
        (5.0, 20.0)
    """
    return max(5.0, 2 * heartbeat_timeout)


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
