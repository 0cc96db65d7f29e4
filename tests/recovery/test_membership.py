"""The survivors' agreement on a new membership, through a real TCPStore, in one process.

Proves: survivors that race to decide agree on one member list (the first decision wins, every
rank reads it); a rank that the others counted as gone is told so and stops; a side holding no
majority of the ranks not known dead stops instead of training on its own (a partition), while
ranks the launcher marked dead do not count against the majority; silence longer than the
heartbeat timeout counts as gone, and a rank waiting in the re-form longer than that for a
live peer keeps beating (neither silent to the others nor cut off in its own eyes); survivors
whose last committed steps differ by one (a split vote) settle on the newest, the same verdict
on every rank; a rank leaves its own state in the store only when it changed, and wherever a
survivor may settle it finds the state that step left (a property test over runs of changed,
unchanged, failed and redone steps).
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.doctor import mismatch
from tandem.recovery import (
    OWN_SLOTS,
    PREFIX,
    Membership,
    MembershipError,
    newest_slot,
    slot_to_write,
)
from tandem.recovery.heartbeat import _Heartbeat
from tests.harness import free_port


@pytest.fixture
def store_address():
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield "127.0.0.1", port
    del server


def client(address) -> dist.TCPStore:
    return dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=30))


def beat(address, ranks, at=None) -> None:
    store = client(address)
    for r in ranks:
        store.set(f"{PREFIX}hb/{r}", repr(time.time() if at is None else at))


def mark_dead(address, rank) -> None:
    client(address).set(f"{PREFIX}dead/{rank}", json.dumps({"how": "SIGKILL", "at": time.time()}))


def reform_all(address, ranks, members, timeout=2.0):
    """Every rank of ``ranks`` re-forms at once, each on its own thread and store client."""
    results: dict[int, object] = {}

    def one(r: int) -> None:
        m = Membership(client(address), r, members, heartbeat_timeout=timeout)
        try:
            lost = m.reform()
            results[r] = (m.members, lost, m.rank, m.generation)
        except MembershipError as e:
            results[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_survivors_agree_on_one_membership(store_address):
    beat(store_address, [0, 1, 2, 3])
    mark_dead(store_address, 1)
    results = reform_all(store_address, [0, 2, 3], [0, 1, 2, 3])
    assert results == {
        0: ([0, 2, 3], [1], 0, 1),
        2: ([0, 2, 3], [1], 1, 1),
        3: ([0, 2, 3], [1], 2, 1),
    }


def test_silence_counts_as_gone_and_a_left_out_rank_stops(store_address):
    # Rank 2 beat long ago (hung): the others decide without it. When it wakes and joins,
    # the decision stands and it is told it was left out.
    beat(store_address, [0, 1])
    beat(store_address, [2], at=time.time() - 60)
    first = reform_all(store_address, [0, 1], [0, 1, 2], timeout=1.0)
    assert first == {0: ([0, 1], [2], 0, 1), 1: ([0, 1], [2], 1, 1)}
    (late,) = reform_all(store_address, [2], [0, 1, 2], timeout=1.0).values()
    assert isinstance(late, MembershipError)
    assert "rank 2 was left out of generation 1 (members [0, 1])" in str(late)


def test_a_side_without_majority_stops(store_address):
    # 4 ranks, 2 silent and not marked dead (a partition 2|2): neither side holds a majority.
    beat(store_address, [0, 1])
    beat(store_address, [2, 3], at=time.time() - 60)
    results = reform_all(store_address, [0, 1], [0, 1, 2, 3], timeout=1.0)
    for r in (0, 1):
        assert isinstance(results[r], MembershipError), results
        assert "without a majority" in str(results[r])


def test_ranks_marked_dead_do_not_count_against_the_majority(store_address):
    beat(store_address, [0, 1, 2, 3])
    mark_dead(store_address, 2)
    mark_dead(store_address, 3)
    results = reform_all(store_address, [0, 1], [0, 1, 2, 3])
    assert results == {0: ([0, 1], [2, 3], 0, 1), 1: ([0, 1], [2, 3], 1, 1)}


def test_survivors_settle_on_the_newest_step_any_of_them_committed(store_address):
    """A vote that completed on rank 0 and not on rank 2 (rank 1 lost): rank 0 joins with step
    5, rank 2 with step 4; every survivor reads the same verdict: go on from 5, rank 2 behind."""
    beat(store_address, [0, 1, 2])
    mark_dead(store_address, 1)
    results: dict[int, object] = {}

    def one(r: int, committed: int) -> None:
        # A long timeout: the beats above are written once, and nobody here is to be silent.
        m = Membership(client(store_address), r, [0, 1, 2], heartbeat_timeout=30.0)
        m.reform(committed)
        results[r] = (m.members, m.settled, m.behind)

    threads = [threading.Thread(target=one, args=a) for a in ((0, 5), (2, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: ([0, 2], 5, [2]), 2: ([0, 2], 5, [2])}


def test_a_rank_writes_its_state_only_when_it_changed_and_a_survivor_reads_it(store_address):
    class Counting:  # the store, counting the writes
        def __init__(self, store: dist.Store) -> None:
            self.store, self.writes = store, 0

        def set(self, key: str, value: str) -> None:
            self.writes += 1
            self.store.set(key, value)

    counting = Counting(client(store_address))
    m = Membership(counting, 3, [0, 3], heartbeat_timeout=5.0)  # type: ignore[arg-type]
    probe = client(store_address)
    m.publish(0, "a", committed=None)
    m.publish(1, "a", committed=0)  # unchanged: no store call at all
    m.publish(2, "b", committed=1)
    assert counting.writes == 2
    reader = Membership(probe, 0, [0, 3], heartbeat_timeout=5.0)
    assert [reader.own_value(3, k) for k in (0, 1, 2)] == ["a", "a", "b"]
    with pytest.raises(RuntimeError, match="rank 3 left no state of step -1"):
        reader.own_value(3, -1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=25))
def test_a_reader_finds_the_newest_changed_value_at_any_step_it_may_settle_on(events):
    """A rank's own state over a run: each step it may draw (its state changes) or not, its
    vote may fail and the step be redone (with a new draw or not). At every vote, a survivor
    may settle on the step voted on, the one this rank committed last, or the one before
    (:func:`slot_to_write`'s doc): whichever, it reads the state that step left, i.e. the
    newest changed one <= it. Three slots hold them; with two the test fails."""
    slots: list = [None] * OWN_SLOTS
    truth: dict[int, str] = {}  # the committed steps' states
    state, committed, counter = "s0", None, 0

    def write(step: int, value: str) -> None:
        slot = slot_to_write(slots, step, value, committed)
        if slot is not None:
            slots[slot] = (step, value)

    def read(step: int) -> str | None:
        i = newest_slot(slots, step)
        return None if i is None else slots[i][1]

    step = 0
    for draws, fails, redraws in events:
        if draws:
            counter += 1
            state = f"s{counter}"
        write(step, state)
        # The reads a survivor may make while this rank votes on `step`.
        assert read(step) == state
        if committed is not None:
            assert read(committed) == truth[committed]
            if committed - 1 in truth:
                assert read(committed - 1) == truth[committed - 1]
        if fails:  # the vote failed everywhere: back to the last committed state, redo
            state = truth[committed] if committed is not None else "s0"
            if redraws:
                counter += 1
                state = f"s{counter}"
            write(step, state)
            assert read(step) == state
        truth[step], committed = state, step
        step += 1
    # At the end, either of the last two steps (those a survivor may still settle on).
    for k in range(max(0, step - 2), step):
        assert read(k) == truth[k]


def test_a_rank_waiting_in_the_reform_for_a_live_peer_keeps_beating(store_address, monkeypatch):
    """The re-form holds the heartbeat's lock while the members agree, which lasts as long as
    the slowest takes to notice the loss (a peer still in a long step): the beat goes on, so
    that the others do not count the waiting rank silent and its watchdog does not take the
    wait for the store's silence (it did, and the rank stopped as cut off: found by the soak)."""
    monkeypatch.setenv("MASTER_ADDR", store_address[0])
    monkeypatch.setenv("MASTER_PORT", str(store_address[1]))
    me = Membership(client(store_address), 0, [0, 1], heartbeat_timeout=1.0)
    late = Membership(client(store_address), 1, [0, 1], heartbeat_timeout=1.0)
    heartbeat = _Heartbeat(me)

    def slow_peer() -> None:  # alive and beating; joins the re-form 1.8 s late
        until = time.monotonic() + 1.8
        while time.monotonic() < until:
            beat(store_address, [1])
            time.sleep(0.2)
        late.reform()

    peer = threading.Thread(target=slow_peer)
    heartbeat.start()
    peer.start()
    try:
        with heartbeat.lock:  # as Recoverer.reform holds it
            assert me.reform() == []
        peer.join(10)
        assert heartbeat.cut_off is None
        assert late.silent() == set()
    finally:
        heartbeat.stopped.set()
        heartbeat.join(5)
        mismatch.reset()
