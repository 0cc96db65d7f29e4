"""The survivors' agreement on a new membership, through a real TCPStore, in one process.

Proves: survivors that race to decide agree on one member list (the first decision wins, every
rank reads it); a rank that the others counted as gone is told so and stops; a side holding no
majority of the ranks not known dead stops instead of training on its own (a partition), while
ranks the launcher marked dead do not count against the majority; silence longer than the
heartbeat timeout counts as gone, and a rank waiting in the re-form longer than that for a
live peer keeps beating (neither silent to the others nor cut off in its own eyes).
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tandem.doctor import mismatch
from tandem.recovery import PREFIX, Membership, MembershipError, _Heartbeat
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


def test_a_commit_returns_on_every_member_once_all_have_set_their_key(store_address):
    results: dict[int, object] = {}

    def one(r: int) -> None:
        m = Membership(client(store_address), r, [0, 1, 2], heartbeat_timeout=5.0)
        m.wait_commit(0, value=f"state of {r}")
        results[r] = m.committed_values(0)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = {r: f"state of {r}" for r in range(3)}
    assert results == {0: expected, 1: expected, 2: expected}


def test_a_member_that_gave_up_on_a_silent_peer_aborts_the_step_for_everyone(store_address):
    """Rank 2 is silent (its last beat is old) when rank 0 waits: rank 0 gives up and proposes
    'abort'. Rank 2 then wakes and sets its key, and rank 1 sees every key: it must abort too
    (the first proposal wins), or rank 1 would step a step that rank 0 left."""
    beat(store_address, [0, 1])
    beat(store_address, [2], at=time.time() - 60)
    zero = Membership(client(store_address), 0, [0, 1, 2], heartbeat_timeout=1.0)
    client(store_address).set(f"{PREFIX}gen0/commit/4/1", "1")  # rank 1 is done
    with pytest.raises(RuntimeError, match="left during the commit of step 4"):
        zero.wait_commit(4)
    beat(store_address, [2])
    client(store_address).set(f"{PREFIX}gen0/commit/4/2", "1")  # rank 2 wakes, late
    one = Membership(client(store_address), 1, [0, 1, 2], heartbeat_timeout=1.0)
    with pytest.raises(RuntimeError, match="left during the commit of step 4"):
        one.wait_commit(4)


def test_a_member_that_sees_a_peer_gone_after_every_key_was_set_still_commits(store_address):
    """Rank 0's wait slice runs out just before rank 2 sets the last key; rank 2 then dies
    (its part is done: the others hold its gradients) and rank 0 sees it gone. Rank 0 must
    commit, as rank 1 (which saw every key) does, not leave the step alone."""
    beat(store_address, [0, 1, 2])
    client(store_address).set(f"{PREFIX}gen0/commit/3/1", "1")
    zero = Membership(client(store_address), 0, [0, 1, 2], heartbeat_timeout=1.0)
    real_gone = zero.gone

    def gone(store=None):  # between the slice's end and the look: the last key, the death
        client(store_address).set(f"{PREFIX}gen0/commit/3/2", "1")
        mark_dead(store_address, 2)
        return real_gone(store)

    zero.gone = gone  # type: ignore[method-assign]
    zero.wait_commit(3)
    one = Membership(client(store_address), 1, [0, 1, 2], heartbeat_timeout=1.0)
    one.store.delete_key(f"{PREFIX}gen0/commit/3/1")
    one.wait_commit(3)  # sees every key: commits, as rank 0 did


def test_the_keys_of_steps_every_member_is_past_are_deleted_off_the_steps_path(store_address):
    """A commit deletes nothing itself: it queues the keys two steps back, and tidy (the
    heartbeat thread's) deletes them; the last two steps' keys stay (a recovery reads them)."""
    members = [Membership(client(store_address), r, [0, 1], heartbeat_timeout=5.0) for r in (0, 1)]

    def commit(m: Membership) -> None:
        for step in range(4):
            m.wait_commit(step, value=f"{m.me}@{step}")

    threads = [threading.Thread(target=commit, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    probe = client(store_address)
    keys = [f"{PREFIX}gen0/commit/{s}/{r}" for s in range(4) for r in (0, 1)]
    assert all(probe.check([k]) for k in keys)  # nothing deleted on the step's path
    for m in members:
        m.tidy(probe)
    assert [s for s in range(4) if probe.check([f"{PREFIX}gen0/commit/{s}/0"])] == [2, 3]
    assert [s for s in range(4) if probe.check([f"{PREFIX}gen0/outcome/{s}"])] == [2, 3]
    assert members[1].committed_values(3) == {0: "0@3", 1: "1@3"}


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
