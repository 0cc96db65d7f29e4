"""Bytes handed to collectives, without processes: the definition, the per-step sums, the summary.

Proves:

- what each collective counts as handed (``records.HANDED``): the input tensors' ``nbytes``, a
  list summed, whether passed by position or by keyword; an all-gather's shard, not its output;
  a reduce-scatter's whole input; nothing for a receive or a barrier;
- a clock's step holds what each group's sum grew by between its ticks, a quiet group left out;
- the step file carries them, and the exit summary prints a line per group: one number where
  the group's ranks agree, else each value with its ranks; exact bytes, with a readable unit;
  a step file without them (an older tandem's) still reads;
- the trace puts each group's collectives on a track of its own, with the bytes in its args.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from tandem.doctor import records, step_clock, stragglers, trace
from tandem.doctor.stragglers import RankSteps, handed_lines


def _handed(op: str, *args, **kwargs) -> int:
    params = list(inspect.signature(getattr(c10d, op)).parameters)
    measure = records._measurer(op, params)
    return 0 if measure is None else measure(args, kwargs, None)


def test_each_op_counts_the_tensors_it_is_handed():
    f32 = torch.ones(10)  # 40 bytes
    f64 = torch.ones(3, dtype=torch.float64)  # 24 bytes
    assert _handed("all_reduce", f32) == 40
    assert _handed("all_reduce", tensor=f64) == 24
    assert _handed("reduce", f32, 0) == 40
    assert _handed("all_gather", [torch.empty(3, dtype=torch.float64)] * 2, f64) == 24
    assert _handed("all_gather_single", torch.empty(20), f32) == 40  # the shard
    assert _handed("all_gather_single", output_tensor=torch.empty(20), input_tensor=f32) == 40
    assert _handed("reduce_scatter", torch.empty(3), [f32, f64]) == 64  # every rank's part
    assert _handed("reduce_scatter_single", torch.empty(5), f32) == 40
    assert _handed("all_to_all", [torch.empty(10)] * 2, [f32, f32]) == 80
    assert _handed("all_to_all_single", torch.empty(10), f32) == 40
    assert _handed("gather", f32, None, 0) == 40
    assert _handed("send", f64, 1) == _handed("isend", f64, 1) == 24
    assert _handed("recv", f64, 0) == _handed("irecv", f64, 0) == 0
    assert _handed("barrier") == 0
    assert _handed("all_gather_object", [None, None], {"a": 1}) == 0
    assert set(records.HANDED) <= set(records.OPS)


def test_a_step_holds_what_each_group_was_handed_between_ticks():
    clock = step_clock.Clock("test", priority=1)
    step_clock.handed("world", 1000)  # before the first tick: in no step
    clock.tick()
    step_clock.handed("world", 40)
    step_clock.handed("ranks 0,1", 8)
    step_clock.handed("world", 2)
    clock.tick()
    clock.tick()  # nothing handed in this step
    step_clock.handed("ranks 0,1", 3)
    clock.tick()
    assert list(clock.handed) == [{"world": 42, "ranks 0,1": 8}, {}, {"ranks 0,1": 3}]
    assert len(clock.handed) == len(clock.steps)
    assert step_clock.handed_so_far()["world"] >= 1042


def test_the_step_file_carries_the_bytes_to_the_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setattr(step_clock, "_clocks", [])
    clock = step_clock.clock("test", priority=0)
    for n in (7, 5, 7):  # the lower median of three steps' bytes: 7
        clock.tick()
        step_clock.handed("world", n)
    clock.tick()
    written = json.loads(step_clock.write(tmp_path).read_text())
    assert written["handed"] == [{"world": 7}, {"world": 5}, {"world": 7}]
    (one,) = stragglers.read(tmp_path, "r")
    assert one.median_handed("world") == 7
    assert "  world: 7 B on each of its ranks" in stragglers.summary(tmp_path, "r")
    # An older file, without bytes: the steps still read, no bytes line.
    del written["handed"]
    (tmp_path / step_clock.file_name("r", 1)).write_text(json.dumps(written))
    (old,) = stragglers.read(tmp_path, "r")
    assert len(old.steps) == 3 and old.handed == []
    assert "bytes handed" not in stragglers.summary(tmp_path, "r")


def test_the_summary_gives_a_line_per_group():
    steps = [(0.1, 0.0)] * 4
    alike = [{"world": 1_180_160, "ranks 2,3": 64}] * 4
    ranks = [
        RankSteps(0, steps, [{"world": 1_180_160}] * 4),
        RankSteps(1, steps, [{"world": 1_180_192}, {"world": 1_180_160}] * 2),  # median: lower
        RankSteps(2, steps, alike),
        RankSteps(3, steps, alike),
        RankSteps(4, steps, [{"world": 2_500_000_000}, {}, {}, {}]),  # mostly nothing: 0
    ]
    assert handed_lines(ranks) == [
        "bytes handed to collectives per step, per group (median step of each rank):",
        "  world: 1,180,160 B (1.18 MB) on ranks 0,1,2,3; 0 B on rank 4",
        "  ranks 2,3: 64 B on each of its ranks",
    ]
    assert handed_lines([RankSteps(0, steps)]) == []  # no bytes known: no lines
    assert stragglers._bytes(999) == "999 B"
    assert stragglers._bytes(12_345) == "12,345 B (12.35 kB)"
    assert stragglers._bytes(2_500_000_000) == "2,500,000,000 B (2.50 GB)"


def test_groups_are_listed_world_first_then_by_their_first_rank():
    steps = [(0.1, 0.0)]
    handed = [{"ranks 10,11": 1, "ranks 2,3 (shard)": 1, "world": 1, "ranks 2,3": 1}]
    lines = handed_lines([RankSteps(0, steps, handed)])
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "world", "ranks 2,3", "ranks 2,3 (shard)", "ranks 10,11",
    ]  # fmt: skip


def _record(op: str, group: str, start: float, end: float, nbytes: int) -> records.Record:
    return records.Record(
        seq=1, op=op, group=group, shapes=((3,),), dtypes=("float32",), context=None,
        site="train.py:1", thread="MainThread", start=start, end=end, nbytes=nbytes,
    )  # fmt: skip


def test_the_trace_puts_each_group_on_its_own_track(monkeypatch):
    kept = [
        _record("all_reduce", "world", 10.0, 12.0, 12),
        _record("all_reduce", "world", 11.0, 13.0, 12),  # overlaps: a second lane of world's
        _record("broadcast", "ranks 0,1", 11.5, 11.6, 4),
    ]
    monkeypatch.setattr(trace, "_collectives", kept)
    monkeypatch.setattr(trace, "spans", [])
    events = trace.events(rank=0)
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    collectives = [e for e in events if e.get("cat") == "collective"]
    assert [tracks[e["tid"]] for e in collectives] == [
        "collectives of world", "collectives of world, 2", "collectives of ranks 0,1",
    ]  # fmt: skip
    assert [e["args"]["bytes"] for e in collectives] == [12, 12, 4]
    assert [e["args"]["group"] for e in collectives] == ["world", "world", "ranks 0,1"]
    assert min(e["tid"] for e in collectives) == trace.COLLECTIVE_TID


@pytest.mark.parametrize(("n", "name"), [(2, "2nd"), (3, "3rd"), (11, "11th"), (23, "23rd")])
def test_ordinals(n, name):
    assert records._ordinal(n) == name
