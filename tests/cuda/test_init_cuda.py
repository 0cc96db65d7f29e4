"""tandem.init on GPUs picks NCCL and the local rank's GPU; the doctor records NCCL's collectives
and names a hung peer when the tensors are on the GPU.

Proves:

- ``tandem.init()`` with no backend, in real processes that create the group themselves: the
  backend is NCCL, the World's device is ``cuda:LOCAL_RANK`` and the current CUDA device is set
  to it, an all-reduce of a tensor there sums the ranks, and ``shutdown()`` destroys the group
  (one rank on one GPU, with ``init_method="env://"`` since a lone process without one makes no
  group, and that lone World is already on ``cuda:0`` with no backend; two ranks where there
  are two GPUs). A local rank past the visible GPUs is refused, naming ``LOCAL_RANK`` and the
  count;
- on NCCL every collective leaves a record, as tests/doctor/test_records.py proves on Gloo:
  the user's own ``dist.all_reduce`` with this file's line, its shapes and dtypes; per group
  numbered from 1 without gaps, a subgroup on its own; every record ended once the GPU has
  finished (an asynchronous one once its work is done); none waited for in slices (that is
  Gloo's). With two GPUs also tandem.DDP's bucket all-reduces, its end-of-backward check as a
  collective of its own (int32, the GPU path of ``tandem.parallel.ddp.end_of_backward``), and every
  rank's sequence the same;
- a collective that ends a second after it was issued (the GPU kept busy by
  ``torch.cuda._sleep`` before it) is waited for whole, and gives its sum, by ``records.wait``
  and by the wait tandem.DDP's reducer uses for its buckets (``lockstep.wait``, which waits in
  slices to survey the ranks): a slice that runs out must not end the collective;
- a hang report with CUDA tensors, as tests/doctor/test_hang_report.py proves on the CPU:
  rank 1 sleeps in a function of this file while rank 0 waits (in the user's all-reduce, in
  tandem.DDP's bucket rebuild at the next forward, or in its bucket all-reduces during
  backward); within seconds rank 0's report says "rank 1 never entered <op> #<n>", names the
  function and shows rank 1's stack, is written as JSON, and the job still finishes once rank 1
  wakes. NCCL refuses two ranks on one GPU, so there both ranks share ``cuda:0`` over Gloo
  (which takes CUDA tensors); with two GPUs the same runs over NCCL too.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.doctor import hang, records
from tandem.parallel.ddp import out_of_step as lockstep
from tandem.world import World
from tests.cuda import gpu
from tests.harness import run_ranks

pytestmark = pytest.mark.cuda

SLEEP_S = 6.0
REPORT_AFTER_S = 2.0


def _nccl_worlds():
    return [
        pytest.param(1, marks=gpu.needs_real_gpu("NCCL"), id="1rank"),
        pytest.param(2, marks=gpu.needs_real_gpu("NCCL with a GPU per rank", 2), id="2ranks"),
    ]


# tandem.init on NCCL.


def _init_body() -> dict:
    lone = None
    if int(os.environ["WORLD_SIZE"]) == 1:
        w = tandem.init()  # a lone process: no group, but its GPU
        lone = (w.backend, w.device, dist.is_initialized())
        tandem.shutdown()
        w = tandem.init(init_method="env://", timeout=60)
    else:
        w = tandem.init(timeout=60)
    t = torch.full((1,), float(w.rank + 1), device=w.device)
    dist.all_reduce(t)
    out = {
        "world": w,
        "sum": t.item(),
        "backend": dist.get_backend(),
        "current": torch.cuda.current_device(),
        "lone": lone,
    }
    tandem.shutdown()
    out["left"] = dist.is_initialized()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", _nccl_worlds())
def test_init_picks_nccl_and_the_local_ranks_gpu(world):
    results = run_ranks(_init_body, world, init=None, env=gpu.env(), timeout=120)
    for rank, r in enumerate(results):
        cuda = torch.device("cuda", rank)
        assert r["world"] == World(rank, rank, world, world, 0, "nccl", cuda, rank == 0), r
        assert r["backend"] == "nccl" and r["current"] == rank, r
        assert r["sum"] == world * (world + 1) / 2, r
        assert r["left"] is False, r
    if world == 1:
        assert results[0]["lone"] == (None, torch.device("cuda", 0), False), results[0]


@gpu.needs_real_gpu("a local rank past the visible GPUs")
def test_a_local_rank_past_the_visible_gpus_is_refused(monkeypatch):
    n = gpu.gpus()
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_")):
            monkeypatch.delenv(name)
    placement = {"RANK": n, "WORLD_SIZE": n + 1, "LOCAL_RANK": n, "LOCAL_WORLD_SIZE": n + 1}
    for name, value in placement.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match=rf"LOCAL_RANK={n} but this process sees only {n} CUDA"):
        tandem.init()  # refused before any rendezvous: nothing to wait for


# The doctor's records on NCCL.


def _recorded_on_nccl() -> dict:
    gpu.deterministic()
    w = tandem.init(init_method="env://", timeout=60)
    dev, world = w.device, w.world_size
    if world > 1:
        torch.manual_seed(0)
        model = tandem.DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(dev))
        x = torch.randn(6, 4).to(dev)
        y = torch.randint(0, 2, (6,)).to(dev)
        for _ in range(2):
            F.cross_entropy(model(x), y).backward()
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    dist.all_reduce(torch.ones(3, dtype=torch.float64, device=dev))
    work = dist.all_reduce(torch.ones(2, device=dev), async_op=True)
    work.wait()
    everyone = dist.new_group(list(range(world)))
    dist.all_reduce(torch.ones(1, device=dev), group=everyone)
    dist.barrier()
    torch.cuda.synchronize()  # every collective done on the GPU
    recent = records.recent()
    result = {
        "records": [r.as_dict() for r in recent],
        "sliced": [r.gloo for r in recent],
        "line": line,
        "open": len(records.open_records()),
        "backend": dist.get_backend(),
    }
    tandem.shutdown()
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("world", _nccl_worlds())
def test_every_collective_is_recorded_on_nccl(world):
    results = run_ranks(_recorded_on_nccl, world, init=None, env=gpu.env(), timeout=120)
    for result in results:
        assert result["backend"] == "nccl", result["backend"]
        recs = result["records"]
        contexts = [r["context"] for r in recs]
        if world > 1:
            assert "DDP bucket 0, step 1" in contexts and "DDP bucket 0, step 2" in contexts
            checks = [r for r in recs if r["context"] == "DDP end-of-backward check"]
            assert len(checks) == 2 and all(r["dtypes"] == ["int32"] for r in checks), contexts
        user = [r for r in recs if r["context"] is None and r["op"] == "all_reduce"]
        assert user[0]["site"] == f"test_init_cuda.py:{result['line']} in _recorded_on_nccl"
        assert user[0]["shapes"] == [[3]] and user[0]["dtypes"] == ["float64"], user[0]
        assert recs[-1]["op"] == "barrier", recs[-1]
        for group in {r["group"] for r in recs}:
            seqs = [r["seq"] for r in recs if r["group"] == group]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (group, seqs)
        everyone = "ranks " + ",".join(str(r) for r in range(world))
        assert [r["seq"] for r in recs if r["group"] == everyone] == [1], recs
        assert all(r["end"] is not None and r["end"] >= r["start"] for r in recs), recs
        assert result["open"] == 0
        assert not any(result["sliced"]), "NCCL's waits are plain, not Gloo's slices"
    keys = ("group", "seq", "op", "shapes", "dtypes", "context")
    for other in results[1:]:
        assert [[r[k] for k in keys] for r in other["records"]] == [
            [r[k] for k in keys] for r in results[0]["records"]
        ]


# Waits on NCCL collectives that end late.

SLOW_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second of GPU clock cycles


def _slow_collectives() -> dict:
    w = tandem.init(init_method="env://", timeout=60)
    dev = w.device
    waits = {
        "records.wait": records.wait,
        "tandem.DDP's wait": lambda work: lockstep.wait(
            work, lockstep.track(None), "gradient all-reduce, bucket 0"
        ),
    }
    out: dict[str, tuple] = {}
    for name, wait in waits.items():
        t = torch.full((4,), 3.0, device=dev)
        torch.cuda.synchronize()
        start = time.monotonic()
        torch.cuda._sleep(SLOW_CYCLES)  # the GPU is busy for about a second, so the
        work = dist.all_reduce(t, async_op=True)  # all-reduce ends that long after its issue
        try:
            wait(work)
            out[name] = (t.tolist(), time.monotonic() - start)
        except RuntimeError as e:  # the communicator may be gone: nothing more to try
            out[name] = (f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", None)
            return out
    tandem.shutdown()
    return out


@pytest.mark.distributed
@gpu.needs_real_gpu("NCCL")
def test_waits_on_an_nccl_collective_that_ends_late_return_its_sum():
    (result,) = run_ranks(_slow_collectives, 1, init=None, env=gpu.env(), timeout=120)
    for name in ("records.wait", "tandem.DDP's wait"):
        values, elapsed = result.get(name, ("not reached", None))
        assert values == [3.0] * 4, (name, result)
        assert elapsed >= 0.5, (name, result)  # the collective did end late


# A hung peer, named, with the tensors on the GPU.


def load_batch() -> None:
    time.sleep(SLEEP_S)  # the hang: a slow disk, a stuck data loader


def compute_metrics() -> None:
    time.sleep(SLEEP_S)  # the hang between forward and backward: a slow metric


def _watch_blocked(seen: set, stop: threading.Event) -> None:
    """What this process's threads are blocked in, sampled (for the failure message)."""
    main = threading.main_thread().ident
    while not stop.wait(0.25):
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, record in list(records.blocked.items()):
            who = "main thread" if ident == main else names.get(ident, f"thread {ident}")
            seen.add(f"{who}: {record.describe()}")


def _hung_peer(kind: str) -> dict:
    gpu.deterministic()
    dev = gpu.device()
    # Both ranks start CUDA (its context, cuBLAS, autograd's device thread) and meet before the
    # doctor starts: a rank still starting would be a late peer too.
    w = torch.ones(2, 2, device=dev, requires_grad=True)
    (w @ w).sum().backward()
    dist.barrier()
    tandem.init()  # adopts the harness's group and starts the doctor
    rank = dist.get_rank()
    seen: set[str] = set()
    stop = threading.Event()
    watcher = threading.Thread(
        target=_watch_blocked, args=(seen, stop), name="tandem-test-watch", daemon=True
    )
    watcher.start()
    if kind == "user":
        if rank == 1:
            load_batch()
        t = torch.ones(2, device=dev)
        dist.all_reduce(t)
        assert t.tolist() == [2.0, 2.0]  # on NCCL, where the CPU waits for it
    else:
        torch.manual_seed(0)
        model = tandem.DDP(nn.Linear(4, 2).to(dev))
        x, y = torch.randn(3, 4).to(dev), torch.randint(0, 2, (3,)).to(dev)
        for step in range(3):
            if kind == "forward" and rank == 1 and step == 1:
                load_batch()
            loss = F.cross_entropy(model(x), y)
            if kind == "backward" and rank == 1 and step == 2:
                compute_metrics()
            loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    stop.set()
    watcher.join()
    threads = [t.name for t in threading.enumerate()]
    return {
        "reports": list(hang.Reporter.reports),
        "threads": threads,
        "device": str(dev),
        "blocked": sorted(seen),
    }


# What rank 0 waits in when rank 1 is late: (op, context) of the collective.
_STUCK = {
    "user": ("all_reduce", None),
    "forward": ("broadcast", "DDP bucket rebuild, step 2"),
    "backward": ("all_reduce", "DDP bucket"),  # a bucket of step 3, in backward
}
_LATE_IN = {"user": "load_batch", "forward": "load_batch", "backward": "compute_metrics"}


def _backends():
    return [
        pytest.param("gloo", id="gloo"),
        pytest.param("nccl", marks=gpu.needs_real_gpu("NCCL with a GPU per rank", 2), id="nccl"),
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind", list(_STUCK))
def test_hung_peer_with_cuda_tensors_is_named(tmp_path, capfd, kind, backend):
    env = {
        **gpu.env(2),
        "TANDEM_HANG_REPORT_AFTER": str(REPORT_AFTER_S),
        "TANDEM_REPORT_DIR": str(tmp_path),
    }
    start = time.monotonic()
    first, second = run_ranks(_hung_peer, 2, args=(kind,), init=backend, env=env, timeout=90)
    assert time.monotonic() - start < 60  # the job went on and finished once rank 1 woke
    assert [first["device"], second["device"]] == [gpu.expected_device(r, 2) for r in range(2)]
    assert second["reports"] == []  # rank 1 never waited long in a collective
    for result in (first, second):
        doctors = [n for n in result["threads"] if n in ("tandem-doctor", "tandem-lockstep")]
        assert doctors == ["tandem-doctor"], result["threads"]
    assert len(first["reports"]) == 1, (
        f"rank 0 made {len(first['reports'])} reports; what its threads were seen blocked in "
        f"(records.blocked): {first['blocked']}"
    )
    (report,) = first["reports"]
    stuck = report["collective"]
    op, context = _STUCK[kind]
    assert stuck["op"] == op, report["text"]
    assert (stuck["context"] or "").startswith(context or ""), report["text"]
    if kind == "backward":
        assert stuck["context"].endswith("step 3"), report["text"]
    laggards = report["laggards"]
    assert len(laggards) == 1, report["text"]
    assert laggards[0].startswith(f"rank 1 never entered {op} #{stuck['seq']}"), laggards
    assert "test_init_cuda.py" in laggards[0] and f"in {_LATE_IN[kind]}" in laggards[0], laggards
    assert "time.sleep(SLEEP_S)" in report["text"]  # rank 1's stack
    assert "rank 0 never" not in report["text"]
    files = list(Path(tmp_path).glob("tandem-hang-rank0-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["laggards"] == laggards
    printed = capfd.readouterr().err
    assert printed.count("tandem: rank 0 has waited") <= 1
