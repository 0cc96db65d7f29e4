"""The job's members, agreed through the store (:class:`Membership`): who is gone (the
launcher's mark, a heartbeat gone silent), each generation decided once by compare_set (the
verdict: the commit the members go on from, who is behind, whom it admits), and each rank's own
state in its slots (:mod:`tandem.recovery.commits`). Its errors: :class:`MembershipError` (this
rank cannot go on) and :class:`_Lost` (a member is gone: re-form), and :class:`Recovery`, the
record of one re-form.

The heartbeat (:mod:`tandem.recovery.heartbeat`), the vote (:mod:`tandem.recovery.vote`) and
the :class:`~tandem.recovery.Recoverer` (:mod:`tandem.recovery.recoverer`) all act on a
:class:`Membership`.

Example::

    members = Membership(store, me=2, members=[0, 1, 2, 3], heartbeat_timeout=10.0)
    lost = members.reform(committed=(7, 0))   # [1]: rank 1 was marked dead
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch.distributed as dist

from tandem.recovery.commits import (
    OWN_SLOTS,
    CommitKey,
    Slot,
    commit_key,
    newest_slot,
    slot_to_write,
)
from tandem.recovery.store import PREFIX, _text

_POLL_S = 0.005


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

        The decision (the package doc, 6.): the first member to
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
