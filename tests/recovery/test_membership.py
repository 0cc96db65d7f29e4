"""The survivors' agreement on a new membership, through a real TCPStore, in one process.

Proves: survivors that race to decide agree on one member list (the first decision wins, every
rank reads it); a rank that the others counted as gone is told so and stops; a side holding no
majority of the ranks not known dead stops instead of training on its own (a partition), while
ranks the launcher marked dead do not count against the majority; silence longer than the
heartbeat timeout counts as gone.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tandem.recovery import PREFIX, Membership, MembershipError
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
