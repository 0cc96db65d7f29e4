"""The oracle chains' cache (:mod:`tests.recovery.chains`) shares only what was run alike.

Proves, in one process (the launch replaced by a stand-in that records each batch and writes
its segments' results):

- a chain's key changes with anything that makes its result: the worker, the arguments every
  segment takes, a segment's size, its stop, its own arguments, a segment more; and is the same
  for the same description (a wrong hit would compare a recovered run with another run's
  oracle);
- a batch runs each missing segment once, in order: a chain asked for again runs nothing, one
  that begins like a chain run before runs only its segments past the shared prefix, resuming
  from that prefix's result (the file it wrote, or a copy of its run directory);
- a failed launch leaves none of its batch's results behind, so a later test cannot take a
  segment cut short for one; a chain that cannot be run is refused, naming it.

The chains themselves run, against real recovered runs, in every test that asks for an
oracle (test_recovery.py, test_trainer_recovery.py, ...).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.recovery import chains as chains_module
from tests.recovery.chains import RECORD_WORKER, TRAINER_WORKER, Chain, Chains, Segment, resumes


class Launches:
    """Stands in for ``run_job``: records each batch's segments, writes their results."""

    def __init__(self, fail: bool = False) -> None:
        self.batches: list[list[dict]] = []
        self.fail = fail

    def __call__(self, nproc: int, flags: list[str], module: str, spec: str, **_: object):
        assert module == "tests.recovery.chains"
        segments = json.loads(Path(spec).read_text())["segments"]
        assert nproc == max(s["size"] for s in segments)
        self.batches.append(segments)
        for segment in segments:
            out = Path(segment["argv"][0])
            if segment["copy"] is not None:
                out.mkdir()
            else:
                out.write_text("result")
        return subprocess.CompletedProcess([], 1 if self.fail else 0, "", "a segment failed")


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Launches:
    made = Launches()
    monkeypatch.setattr(chains_module, "run_job", made)
    return made


def test_a_key_changes_with_anything_that_makes_the_result():
    base = Chain(RECORD_WORKER, (Segment(4, 3, ("--x",)), Segment(3)), ("--epochs", "2"))
    assert (
        base.key()
        == Chain(RECORD_WORKER, (Segment(4, 3, ("--x",)), Segment(3)), ("--epochs", "2")).key()
    )
    others = [
        Chain(TRAINER_WORKER, base.segments, base.args),
        Chain(RECORD_WORKER, base.segments, ("--epochs", "3")),
        Chain(RECORD_WORKER, base.segments, ()),
        Chain(RECORD_WORKER, (Segment(3, 3, ("--x",)), Segment(3)), base.args),
        Chain(RECORD_WORKER, (Segment(4, 2, ("--x",)), Segment(3)), base.args),
        Chain(RECORD_WORKER, (Segment(4, 3), Segment(3)), base.args),
        Chain(RECORD_WORKER, (Segment(4, 3, ("--x",)), Segment(2)), base.args),
        Chain(RECORD_WORKER, (Segment(4, 3, ("--x",)), Segment(3, 5), Segment(3)), base.args),
        base.prefix(1),
    ]
    keys = {chain.key() for chain in others}
    assert len(keys) == len(others) and base.key() not in keys


def test_a_chain_that_cannot_run_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"worker 'tests\.nope': chains know"):
        Chain("tests.nope", (Segment(2),))
    with pytest.raises(ValueError, match=r"segment 0 .* runs to the end: none can follow"):
        Chain(RECORD_WORKER, (Segment(2), Segment(1)))
    with pytest.raises(ValueError, match="a segment's size must be >= 1"):
        Chain(RECORD_WORKER, (Segment(0, 1), Segment(1)))


def test_each_segment_runs_once_and_a_shared_prefix_is_resumed_from(tmp_path, launches):
    cache = Chains(tmp_path)
    first = resumes(4, [(3, 3)], ("--epochs", "2"))
    longer = resumes(4, [(3, 3), (5, 2)], ("--epochs", "2"))
    end, again = cache.get(first, first)
    assert end == again == cache.result(first)
    assert [len(batch) for batch in launches.batches] == [2]  # 4 ranks to 3, 3 ranks on
    cache.get(first)
    assert len(launches.batches) == 1  # nothing ran again
    cache.get(longer)
    (batch,) = launches.batches[1:]
    shared = cache.result(first.prefix(1))
    assert [s["size"] for s in batch] == [3, 2]  # 4 ranks to step 3: run before
    assert batch[0]["argv"] == [
        str(cache.result(longer.prefix(2))), "--epochs", "2", "--stop-after", "5",
        "--resume", str(shared),
    ]  # fmt: skip
    assert batch[1]["argv"][-2:] == ["--resume", str(cache.result(longer.prefix(2)))]


def test_a_trainer_segment_resumes_a_copy_of_the_run_before(tmp_path, launches):
    cache = Chains(tmp_path)
    chain = Chain(TRAINER_WORKER, (Segment(3, 6), Segment(2, None, ("--mutant",))), ("--e",))
    cache.get(chain)
    first, second = launches.batches[0]
    assert first["argv"] == [str(cache.result(chain.prefix(1))), "--e", "--max-steps", "6"]
    assert first["copy"] is None
    assert second["argv"] == [str(cache.result(chain)), "--e", "--mutant", "--resume"]
    assert second["copy"] == [str(cache.result(chain.prefix(1))), str(cache.result(chain))]


def test_a_failed_launch_leaves_no_result_of_its_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(chains_module, "run_job", Launches(fail=True))
    cache = Chains(tmp_path)
    records = resumes(3, [(2, 2)])
    trainer = Chain(TRAINER_WORKER, (Segment(3, 6), Segment(2)))
    with pytest.raises(AssertionError, match="the oracle chains' launch failed"):
        cache.get(records)
    with pytest.raises(AssertionError, match="a segment failed"):
        cache.get(trainer)
    for chain in (records, trainer):
        assert not cache.result(chain).exists() and not cache.result(chain.prefix(1)).exists()
