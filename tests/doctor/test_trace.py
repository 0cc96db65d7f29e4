"""The timeline and the straggler summary of real 2-rank jobs, and the trace file's own rules.

Proves:

- ``tandem run --trace DIR`` with a Trainer writes ``DIR/trace.json`` that loads as Chrome trace
  JSON: every event has ph/ts/pid/tid/name, both ranks are processes named ``rank N``, the
  complete events of a track nest (as Perfetto requires), and it holds the forward, backward,
  each bucket's reduce and wait, the optimizer step, data loading, the checkpoint (and rank 0's
  write of it) and the all-reduces with what DDP was doing; the launcher says where it is.
- ``Trainer(trace=DIR)`` alone (no launcher) merges every rank's file at the end of train().
- A traced FullyShardedDataParallel step (units, prefetches) shows its unit forwards, the
  backward, the all-gathers and reduce-scatters, all nested per track.
- The exit summary of ``tandem run`` (no trace) lists every rank's median step time and
  waiting, names rank 1 when it sleeps 50 ms more per step than rank 0, and names no one when
  both sleep alike.
- In one process: merging shifts times to start at 0 and keeps each rank's events; a span of
  the trace nests in its parent; a trace renders as a PNG.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem import _profile
from tandem.doctor import trace, trace_png
from tests.harness import run_ranks
from tests.launching import clean_env

TRAINER_JOB = """
import sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import tandem

torch.manual_seed(0)
x = torch.randn(128, 8)
y = (x.sum(1) > 0).long()
model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
trainer = tandem.Trainer(
    model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, y),
    loss_fn=F.cross_entropy, max_epochs=2, save_every=1, batch_size=16, run_dir=sys.argv[1],
    progress=False, ddp_kwargs={"bucket_cap_mb": 0.01},
)
trainer.train()
"""

DDP_JOB = """
import sys
import time
import torch
import torch.nn.functional as F
from torch import nn
import tandem

both, extra = float(sys.argv[1]), float(sys.argv[2])
rank = tandem.init().rank
torch.manual_seed(0)
model = tandem.DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 16), torch.randint(0, 2, (8,))
for _ in range(25):
    time.sleep(both + (extra if rank == 1 else 0.0))  # loading a batch
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
tandem.shutdown()
"""


def _tandem_run(tmp_path: Path, job: str, *args: str, trace_dir: Path | None = None):
    script = tmp_path / "job.py"
    script.write_text(job)
    traced = ["--trace", str(trace_dir)] if trace_dir is not None else []
    command = [sys.executable, "-m", "tandem.cli", "run", "--nproc-per-node", "2", *traced]
    done = subprocess.run(
        [*command, str(script), *args],
        capture_output=True,
        text=True,
        timeout=150,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done


def _check_chrome_trace(path: Path, ranks: set[int]) -> list[dict]:
    document = json.loads(path.read_text())
    events = document["traceEvents"]
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= e.keys(), e
        assert e["ph"] in ("X", "M", "i"), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
    assert {e["pid"] for e in events} == ranks
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in ranks}
    _check_nesting([e for e in events if e["ph"] == "X"])
    return events


def _check_nesting(complete: list[dict]) -> None:
    """On one track a complete event ends before the next begins, or contains it."""
    tracks: dict[tuple[int, int], list[dict]] = {}
    for e in complete:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for events in tracks.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ends: list[float] = []
        for e in events:
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + 1.0, (e, open_ends)  # 1 µs rounding
            open_ends.append(end)


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_tandem_run_trace_of_a_trainer_run(tmp_path):
    traces = tmp_path / "traces"
    done = _tandem_run(tmp_path, TRAINER_JOB, str(tmp_path / "run"), trace_dir=traces)
    assert f"the trace of every rank is {traces / 'trace.json'}" in done.stderr
    events = _check_chrome_trace(traces / "trace.json", {0, 1})
    for rank in (0, 1):
        names = {e["name"] for e in events if e["pid"] == rank and e["ph"] == "X"}
        for phase in (
            "tandem.ddp.forward",
            "tandem.ddp.backward",
            "tandem.ddp.bucket_reduce",
            "tandem.ddp.bucket_wait",
            "optimizer.step",
            "tandem.train.data",
            "tandem.train.checkpoint",
            "all_reduce",
        ):
            assert phase in names, (rank, phase, names)
        buckets = {
            e["args"]["detail"].split(",")[0]
            for e in events
            if e["pid"] == rank and e["name"] == "tandem.ddp.bucket_reduce"
        }
        assert len(buckets) >= 2, buckets  # every bucket's reduce, not just one
        contexts = [
            e["args"]["context"] for e in events if e["pid"] == rank and e["name"] == "all_reduce"
        ]
        assert any(c and c.startswith("DDP bucket 1, step") for c in contexts), contexts
    writes = {e["pid"] for e in events if e["name"] == "tandem.train.checkpoint_write"}
    assert writes == {0}  # rank 0 writes the (full) checkpoint file
    # The backward of a step holds its bucket reduces: phases in the order they ran.
    backward = next(e for e in events if e["name"] == "tandem.ddp.backward" and e["pid"] == 1)
    inside = [
        e["name"]
        for e in events
        if e["pid"] == 1 and e["tid"] == backward["tid"] and e is not backward
        and backward["ts"] <= e["ts"] <= backward["ts"] + backward["dur"]
    ]  # fmt: skip
    assert "tandem.ddp.bucket_reduce" in inside and "tandem.ddp.bucket_wait" in inside
    assert "steps per rank" in done.stderr  # the step summary comes with every run
    # With the bytes each group was handed per step (test_handed_bytes.py checks the numbers).
    assert "bytes handed to collectives per step, per group" in done.stderr, done.stderr
    assert re.search(r"^  world: [\d,]+ B", done.stderr, re.M), done.stderr
    # Each collective on its group's track, with the bytes it was handed.
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    reduces = [e for e in events if e["name"] == "all_reduce" and e["ph"] == "X"]
    on = {tracks[(e["pid"], e["tid"])] for e in reduces}
    assert on and all(t.startswith("collectives of world") for t in on), on  # its lanes: ", 2"
    assert all(e["args"]["group"] == "world" and e["args"]["bytes"] > 0 for e in reduces)


def _traced_trainer(directory: str) -> int:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    model = nn.Linear(4, 2)
    trainer = tandem.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TensorDataset(x, y),
        loss_fn=F.cross_entropy,
        max_epochs=1,
        save_every=1,
        batch_size=8,
        run_dir=Path(directory) / "run",
        progress=False,
        trace=directory,
    )
    return trainer.train().steps


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_trainer_with_trace_merges_every_rank(tmp_path):
    assert run_ranks(_traced_trainer, 2, args=(str(tmp_path),), timeout=100) == [4, 4]
    events = _check_chrome_trace(tmp_path / "trace.json", {0, 1})
    steps = [e for e in events if e["name"] == "optimizer.step"]
    assert sorted(e["pid"] for e in steps) == [0, 0, 0, 0, 1, 1, 1, 1]


def _traced_fsdp(directory: str) -> None:
    import torch.distributed as dist

    trace.start(directory)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    model = tandem.FullyShardedDataParallel(net, auto_wrap={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        F.mse_loss(model(torch.randn(4, 6)), torch.zeros(4, 2)).backward()
        opt.step()
        opt.zero_grad()
    trace.flush()
    dist.barrier()
    if dist.get_rank() == 0:
        trace.merge(directory)
    trace.stop()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_traced_fsdp_step_shows_its_units(tmp_path):
    run_ranks(_traced_fsdp, 2, args=(str(tmp_path),), timeout=100)
    events = _check_chrome_trace(tmp_path / "trace.json", {0, 1})
    for rank in (0, 1):
        names = {e["name"] for e in events if e["pid"] == rank and e["ph"] == "X"}
        for phase in (
            "tandem.fsdp.forward",
            "tandem.fsdp.backward",
            "tandem.fsdp.all_gather",
            "tandem.fsdp.reduce_scatter",
            "tandem.fsdp.finish_backward",
            "optimizer.step",
            "all_gather",
        ):
            assert phase in names, (rank, phase, names)


_SUMMARY = re.compile(r"rank (\d): 24 steps, ([\d.]+) ms; waiting ([\d.]+) ms")


@pytest.mark.launch
@pytest.mark.timeout(200)
@pytest.mark.parametrize("extra", [0.05, 0.0], ids=["rank 1 slower", "even"])
def test_the_exit_summary_names_a_slow_rank_and_only_then(tmp_path, extra):
    done = _tandem_run(tmp_path, DDP_JOB, "0.02", str(extra))
    found = {int(r): (float(step), float(wait)) for r, step, wait in _SUMMARY.findall(done.stderr)}
    assert set(found) == {0, 1}, done.stderr
    if extra:
        assert "rank 1 is the slowest" in done.stderr, done.stderr
        # Rank 0 spends rank 1's extra sleep waiting for it in the gradient all-reduce.
        assert found[0][1] > 35 > found[1][1], done.stderr
    else:
        assert "is the slowest" not in done.stderr, done.stderr


# -- in one process ----------------------------------------------------------------------------


def _rank_file(directory: Path, rank: int, offset_s: float) -> None:
    t0 = 1_700_000_000.0 + offset_s
    events = [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": rank, "tid": 0,
         "args": {"name": f"rank {rank}"}},
        trace._complete("tandem.ddp.forward", "forward", t0, t0 + 0.002, rank, 1),
        trace._complete("all_reduce", "collective", t0 + 0.003, t0 + 0.005, rank, 1000),
    ]  # fmt: skip
    document = {"traceEvents": events, "otherData": {"rank": rank, "run_id": "r1"}}
    (directory / f"trace-rank{rank}.json").write_text(json.dumps(document))


def test_merge_joins_the_ranks_and_starts_at_zero(tmp_path):
    _rank_file(tmp_path, 1, 0.5)
    _rank_file(tmp_path, 0, 0.0)
    path = trace.merge(tmp_path, run_id="r1")
    events = _check_chrome_trace(path, {0, 1})
    forward = {e["pid"]: e["ts"] for e in events if e["name"] == "tandem.ddp.forward"}
    assert forward == {0: 0.0, 1: 500_000.0}
    with pytest.raises(FileNotFoundError, match="of run other"):
        trace.merge(tmp_path, run_id="other")


def test_render_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    _rank_file(tmp_path, 0, 0.0)
    _rank_file(tmp_path, 1, 0.001)
    png = trace_png.render(trace.merge(tmp_path), tmp_path / "trace.png", end_ms=10)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_spans_nest_in_the_trace_and_cost_nothing_when_off(tmp_path, monkeypatch):
    assert _profile.span("tandem.test") is _profile.OFF  # neither trace nor profiler: no object
    monkeypatch.setenv("RANK", "0")
    trace.start(tmp_path)
    try:
        with _profile.span("tandem.test.outer", "o"):
            time.sleep(0.002)
            with _profile.span("tandem.test.inner"):
                time.sleep(0.001)
        path = trace.flush()
    finally:
        trace.stop()
    assert path == tmp_path / "trace-rank0.json"
    events = _check_chrome_trace(path, {0})
    outer, inner = sorted(
        (e for e in events if e["name"].startswith("tandem.test.")), key=lambda e: e["ts"]
    )
    assert outer["name"] == "tandem.test.outer" and outer["args"] == {"detail": "o"}
    assert outer["ts"] + 2000 <= inner["ts"] and inner["dur"] >= 1000
    assert inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert _profile.span("tandem.test") is _profile.OFF  # stopped
