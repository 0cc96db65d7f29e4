"""The test harness itself: a port taken between choosing it and listening on it is retried."""

from __future__ import annotations

import socket

import pytest

from tests import harness


def _rank_sum() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item()


def test_free_port_is_below_the_ephemeral_range_and_free():
    low, _ = harness._ephemeral_range()
    for _ in range(20):
        port = harness.free_port()
        assert port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free: binding succeeds


@pytest.mark.distributed
def test_a_port_taken_before_rank_0_listens_is_retried_on_another(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        chosen = iter([busy, harness.free_port()])
        given: list[int] = []

        def choose() -> int:
            given.append(next(chosen))
            return given[-1]

        monkeypatch.setattr(harness, "free_port", choose)
        assert harness.run_ranks(_rank_sum, 2, timeout=30) == [3.0, 3.0]
        assert given[0] == busy and len(given) == 2


@pytest.mark.distributed
def test_a_port_taken_every_time_fails_with_the_reason(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(harness, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(harness.RankFailure, match="EADDRINUSE"):
            harness.run_ranks(_rank_sum, 2, timeout=30)
