"""`tandem run` against `torchrun`: time to every rank past init, and wall time of a trivial job.

Each launcher starts ``--nproc-per-node N`` copies of ``benchmarks/launch_probe.py``, which
initialises a Gloo process group, passes one barrier and exits. ``t0`` is ``time.time()`` taken
just before the launcher's process is started; the probe writes its own timestamps, so that
nothing depends on how a launcher forwards or prefixes the workers' output. Per run:

- ``to_start``: last worker's first line - t0 (launcher start-up, plus the worker interpreter's);
- ``to_import``: last rank past ``import torch.distributed`` - t0;
- ``to_init``: last rank past ``init_process_group`` - t0 (the issue's first metric);
- ``wall``: launch command start to its exit (the issue's second metric).

Runs alternate, A B then B A, so that drift in the machine's load hits both launchers alike,
after one unmeasured run of each (file caches warm). Reported: medians per launcher and the
median of the per-pair ratios tandem/torchrun. Target of the issue: ratio <= 0.5.

A third column, on by default, starts the probes straight from this script with torchrun's
variables and no launcher at all, interleaved with the other two: the floor that no launcher can
beat. Both launchers pay the workers' own ``import torch`` (about a second), so the floor says how
much of the 0.5 target is in the launcher's hands on this machine.

torchrun runs with its default static rendezvous and ``--master-port`` set to a port free just
before the run (its default 29500 may be taken, or linger in TIME_WAIT from the previous run);
``--torchrun-rdzv standalone`` measures ``--standalone`` (c10d rendezvous) instead. Both launchers
get ``OMP_NUM_THREADS=1`` in their environment, which torchrun would otherwise set itself with a
warning; tandem picks its own port.

Run::

    python benchmarks/launch.py                 # 7 pairs, 2 workers
    python benchmarks/launch.py --quick         # 3 pairs, smoke run
    python benchmarks/launch.py --nproc 2 4 --no-floor   # without the no-launcher runs
    python benchmarks/launch.py --tandem-cmd "python -m torch.distributed.run"   # stub
    python benchmarks/launch.py --elastic 1 --json benchmarks/results/launch_elastic.json
                                                # both: --nnodes 1:2 c10d, a 1 s last call
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PROBE = HERE / "launch_probe.py"
LAUNCHERS = ("tandem", "torchrun")
METRICS = ("to_start", "to_import", "to_init", "wall")
TANDEM_CMD = [sys.executable, "-m", "tandem.cli", "run"]
TORCHRUN_CMD = [sys.executable, "-m", "torch.distributed.run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _elastic_flags(last_call: float) -> list[str]:
    """A one-node elastic job: ``--nnodes 1:2`` on the c10d rendezvous, for both launchers.

    With one node of up to two, each waits the last call for the second: both get the same
    ``last_call_timeout`` (torch's default is 30 s).
    """
    return [
        "--nnodes", "1:2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", f"bench{time.time_ns()}",
        "--rdzv-conf", f"last_call_timeout={last_call:g}",
    ]  # fmt: skip


def _command(launcher: str, nproc: int, args: argparse.Namespace) -> list[str]:
    if args.elastic is not None:
        launch = args.tandem_cmd if launcher == "tandem" else TORCHRUN_CMD
        return [*launch, "--nproc-per-node", str(nproc), *_elastic_flags(args.elastic), str(PROBE)]
    if launcher == "tandem":
        return [*args.tandem_cmd, "--nproc-per-node", str(nproc), str(PROBE)]
    if args.torchrun_rdzv == "standalone":
        rdzv = ["--standalone"]
    else:
        rdzv = ["--master-port", str(_free_port())]
    return [*TORCHRUN_CMD, "--nproc-per-node", str(nproc), *rdzv, str(PROBE)]


def _bare(nproc: int, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """The floor: N interpreters started straight from here with torchrun's variables, no
    launcher in between. What no launcher can beat; it shows how much of each launcher's time
    is its own."""
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROBE)],
            env={
                **env,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(nproc)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(
        "bare", code, "".join(o for o, _ in outs), "".join(e for _, e in outs)
    )


def _run(launcher: str, nproc: int, args: argparse.Namespace) -> dict[str, float]:
    """One launch of the probe; seconds for each of METRICS."""
    cmd = _command(launcher, nproc, args) if launcher != "bare" else ["bare"]
    with tempfile.TemporaryDirectory(prefix="tandem-launch-") as out:
        env = {
            **os.environ,
            "TANDEM_BENCH_OUT": out,
            "OMP_NUM_THREADS": "1",
            "TANDEM_PROBE_INIT": args.init,
        }
        t0 = time.time()
        start = time.perf_counter()
        if launcher == "bare":
            proc = _bare(nproc, env, args.timeout)
        else:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False
            )
        wall = time.perf_counter() - start
        records = [json.loads(p.read_text()) for p in Path(out).glob("rank*.json")]
    if proc.returncode != 0 or len(records) != nproc:
        raise RuntimeError(
            f"{launcher} exited {proc.returncode} with {len(records)} of {nproc} probe records: "
            f"{shlex.join(cmd)}\n--- stdout\n{proc.stdout[-3000:]}\n"
            f"--- stderr\n{proc.stderr[-3000:]}"
        )
    return {
        "to_start": max(r["started"] for r in records) - t0,
        "to_import": max(r["imported"] for r in records) - t0,
        "to_init": max(r["init"] for r in records) - t0,
        "wall": wall,
    }


def _measure(nproc: int, args: argparse.Namespace) -> dict:
    launchers = (*LAUNCHERS, "bare") if args.floor else LAUNCHERS
    for launcher in launchers:
        _run(launcher, nproc, args)  # warm-up: imports from a cold page cache are not the launcher
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in launchers}
    for pair in range(args.pairs):
        order = launchers if pair % 2 == 0 else launchers[::-1]
        for launcher in order:
            runs[launcher].append(_run(launcher, nproc, args))
    median = {e: {m: statistics.median(r[m] for r in runs[e]) for m in METRICS} for e in launchers}
    ratios = {
        m: [a[m] / b[m] for a, b in zip(runs["tandem"], runs["torchrun"], strict=True)]
        for m in METRICS
    }
    return {
        "median_s": median,
        "ratio_tandem_over_torchrun": {m: statistics.median(ratios[m]) for m in METRICS},
        "ratios": ratios,
        "runs_s": runs,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 pairs, for a smoke run")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2])
    parser.add_argument("--torchrun-rdzv", choices=["static", "standalone"], default="static")
    parser.add_argument(
        "--elastic",
        type=float,
        default=None,
        metavar="LAST_CALL_S",
        help="both launchers run a one-node --nnodes 1:2 c10d job with this last_call_timeout",
    )
    parser.add_argument(
        "--tandem-cmd",
        type=shlex.split,
        default=TANDEM_CMD,
        help="command that --nproc-per-node N and the script follow (default: %(default)s)",
    )
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the probes started directly, no launcher: the floor for both",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per launch")
    parser.add_argument(
        "--init",
        choices=["tandem", "torch"],
        default="tandem",
        help="the probe joins with tandem.init() or plain init_process_group (same for both)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "launch.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs = 3

    load_before = os.getloadavg()[0]
    report = {str(n): _measure(n, args) for n in args.nproc}
    meta = {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "probe_init": args.init,
        "pairs": args.pairs,
        "tandem_cmd": shlex.join(args.tandem_cmd),
        "torchrun_rdzv": (
            f"both: --nnodes 1:2 c10d, last_call_timeout={args.elastic:g}"
            if args.elastic is not None
            else "--standalone"
            if args.torchrun_rdzv == "standalone"
            else "static, --master-port free"
        ),
        "backend": "gloo",
        # a shared machine: what else ran during the measurement
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
    }
    result = {"meta": meta, "nproc": report}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))

    print(
        f"Launch time, probe script, gloo, {meta['cpus']} CPUs, python {meta['python']}, "
        f"torch {meta['torch']}, {args.pairs} pairs (median seconds; target tandem/torchrun <= 0.5)"
    )
    floor = "| no launcher " if args.floor else ""
    print(f"| workers | metric | tandem run | torchrun {floor}| tandem/torchrun |")
    print("|---:|---|---:|---:|" + ("---:|" if args.floor else "") + "---:|")
    labels = {
        "to_start": "to last worker started",
        "to_import": "to all ranks past import torch",
        "to_init": "to all ranks past init",
        "wall": "wall time",
    }
    for n, r in report.items():
        for m in METRICS:
            s = r["median_s"]
            bare = f"{s['bare'][m]:.3f} | " if args.floor else ""
            print(
                f"| {n} | {labels[m]} | {s['tandem'][m]:.3f} | {s['torchrun'][m]:.3f} | {bare}"
                f"{r['ratio_tandem_over_torchrun'][m]:.3f} |"
            )
    print(f"JSON: {args.json}")
    return result


if __name__ == "__main__":
    main()
