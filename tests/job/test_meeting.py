"""The rendezvous' judgement of who checked in (tandem.job.checkin.diagnose), as a property:
it finds nothing wrong exactly when every process agrees on WORLD_SIZE, has a RANK in range and
no RANK is taken twice, and otherwise names the first kind of fault in that order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.job.checkin import diagnose, rendezvous_timeout_s

entry = st.builds(
    lambda rank, size, pid: {"rank": rank, "world_size": size, "pid": pid, "host": "h"},
    st.integers(-1, 5),
    st.sampled_from([3, 3, 3, 4]),
    st.integers(1, 99999),
)


@given(st.lists(entry, max_size=6))
def test_diagnose_finds_exactly_the_faults(entries):
    world_size = 3
    sizes = {e["world_size"] for e in entries}
    ranks = [e["rank"] for e in entries]
    message = diagnose(entries, world_size)
    if len(sizes) > 1:
        assert message is not None and message.startswith("WORLD_SIZE differs")
        for e in entries:
            assert f"pid {e['pid']} on h" in message
    elif any(not 0 <= r < world_size for r in ranks):
        assert message is not None and "outside 0..2 for WORLD_SIZE=3" in message
    elif len(set(ranks)) < len(ranks):
        assert message is not None
        for r in {r for r in ranks if ranks.count(r) > 1}:
            assert f"rank {r} checked in" in message
    else:
        assert message is None


def test_a_process_with_a_bad_environment_is_always_outside():
    entries = [{"rank": 1, "world_size": 3, "pid": 5, "host": "h", "bad": True}]
    assert "RANK=1 (pid 5 on h) outside 0..2" in (diagnose(entries, 3) or "")


def test_rendezvous_timeout_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_RENDEZVOUS_TIMEOUT", "7.5")
    assert rendezvous_timeout_s() == 7.5
    assert rendezvous_timeout_s(2) == 2.0
    monkeypatch.setenv("TANDEM_RENDEZVOUS_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TANDEM_RENDEZVOUS_TIMEOUT='soon'"):
        rendezvous_timeout_s()
