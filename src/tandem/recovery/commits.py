"""A commit's identity and where a rank keeps its own state of it: the commit key (step,
generation), and the three store slots a rank writes its state in (:func:`slot_to_write`) and a
survivor reads it from (:func:`newest_slot`).

Pure functions over values: :mod:`tandem.recovery.membership` keeps the slots in the store.

Example::

    >>> slot_to_write([(4, "a"), (6, "b"), None], 7, "c", committed=6)
    2
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

#: How many store keys hold a rank's own state (:func:`slot_to_write` says why three).
OWN_SLOTS = 3

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
