"""Elastic re-form: a node of a ``--nnodes 1:2`` job dies; how long until the job runs again.

Both launchers run the same job on two "nodes" on loopback (two launchers on this machine, one
endpoint ``127.0.0.1:PORT``, c10d rendezvous, node 0 hosting the store), with their default
rendezvous settings (a 30 s last call, torch's keep-alives for torchrun, tandem's 1 s x 5 beats):

- ``tandem``: ``tandem run --nnodes 1:2 --max-restarts 1 --rdzv-backend c10d ...``
- ``torchrun``: ``python -m torch.distributed.run`` with the same flags.

Each worker joins with ``tandem.init()`` and runs a small all-reduce every 50 ms. Once both
nodes' workers have run for a moment, node 1 dies: its launcher and every worker under it get
SIGKILL at once (a machine switched off; torchrun's workers would otherwise outlive their
agent). Node 0 notices, re-forms alone at world size ``nproc`` and starts its workers again.
The workers write their own timestamps, so nothing depends on how a launcher relays output.
Per trial, from the kill:

- ``started``: the last of node 0's new workers started (the re-form is done);
- ``ready``: every one of them past ``tandem.init()`` (the job runs again).

``--idle``: the workers sleep instead, so no collective fails and only the launchers' own
liveness checks can tell that node 1 died.

Trials alternate, A B then B A, so drift in the machine's load hits both alike. Reported: the
median, min and max of each, and the ratio of the medians tandem/torchrun.

Run::

    python benchmarks/elastic_reform.py                 # 3 pairs (torchrun: ~50 s a trial)
    python benchmarks/elastic_reform.py --quick         # 1 pair
    python benchmarks/elastic_reform.py --ways tandem --idle --pairs 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WAYS = ("tandem", "torchrun")
LAUNCHER = {
    "tandem": [sys.executable, "-m", "tandem.cli", "run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
METRICS = ("started", "ready")


# -- the worker ------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """One rank: note when it started and when it joined, then all-reduce until the world
    shrinks (node 0's re-formed round ends at once) or the time limit."""
    started = time.time()
    import torch
    import torch.distributed as dist

    import tandem

    torch.set_num_threads(1)
    w = tandem.init()
    record = {"started": started, "ready": time.time(), "world": w.world_size, "rank": w.rank}
    name = f"rank{w.rank}-world{w.world_size}-{os.getpid()}.json"
    Path(args.out, name).write_text(json.dumps(record))
    if w.world_size < args.full_world:
        tandem.shutdown()  # the re-formed job: measured, done
        return
    t = torch.ones(16)
    until = time.monotonic() + args.timeout
    while time.monotonic() < until:
        if not args.idle:
            dist.all_reduce(t)  # fails at once when the other node's rank dies
        time.sleep(0.05)
    tandem.shutdown()


# -- the measurement -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and everything under it, found before any of them dies."""
    for p in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def records(out: Path) -> list[dict]:
    found = []
    for path in out.glob("rank*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except ValueError:  # being written
            continue
    return found


def trial(way: str, args: argparse.Namespace) -> dict[str, float] | None:
    """One job whose node 1 dies; seconds from the kill to each of METRICS, or None."""
    full = 2 * args.nproc
    with tempfile.TemporaryDirectory(prefix=f"tandem-reform-{way}-") as tmp:
        out = Path(tmp)
        port = free_port()
        job = f"reform{time.time_ns()}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
        nodes = []
        for node in (0, 1):
            conf = ",".join(c for c in (args.rdzv_conf, f"is_host={int(node == 0)}") if c)
            cmd = [*LAUNCHER[way], "--nnodes", "1:2", "--nproc-per-node", str(args.nproc),
                   "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"127.0.0.1:{port}", "--rdzv-id", job, "--rdzv-conf", conf,
                   __file__, "--worker", "--out", tmp, "--full-world", str(full),
                   "--timeout", str(args.timeout), *(["--idle"] if args.idle else [])]  # fmt: skip
            log = (out / f"node{node}.log").open("w")
            nodes.append(
                subprocess.Popen(
                    cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            log.close()
        try:
            deadline = time.monotonic() + args.timeout
            while sum(r["world"] == full for r in records(out)) < full:
                if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
                    raise RuntimeError("the two-node job never started")
                time.sleep(0.1)
            time.sleep(args.settle)
            killed = time.time()
            kill_tree(nodes[1].pid)
            code = nodes[0].wait(timeout=args.timeout)
            after = [r for r in records(out) if r["world"] < full and r["started"] > killed]
            if code != 0 or len(after) != args.nproc:
                raise RuntimeError(f"node 0 exited {code} with {len(after)} re-formed workers")
            return {m: max(r[m] for r in after) - killed for m in METRICS}
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            text = (out / "node0.log").read_text()[-3000:]
            print(f"{way}: trial failed ({error})\n{text}", file=sys.stderr)
            return None
        finally:
            for n in nodes:
                kill_tree(n.pid)
                n.wait()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 pair")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--nproc", type=int, default=1, help="workers per node")
    parser.add_argument(
        "--rdzv-conf", default="", help="extra --rdzv-conf for both (default: their defaults)"
    )
    parser.add_argument(
        "--idle",
        action="store_true",
        help="the workers do not communicate: only the launchers can tell that a node died",
    )
    parser.add_argument("--settle", type=float, default=2.0, help="s of running before the kill")
    parser.add_argument("--timeout", type=float, default=180.0, help="s per phase of a trial")
    parser.add_argument("--json", type=Path, default=RESULTS / "elastic_reform.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--full-world", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    if args.quick:
        args.pairs = 1

    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in args.ways}
    failed = dict.fromkeys(args.ways, 0)
    for pair in range(args.pairs):
        order = args.ways if pair % 2 == 0 else args.ways[::-1]
        for way in order:
            result = trial(way, args)
            if result is None:
                failed[way] += 1
            else:
                runs[way].append(result)
        print(f"pair {pair + 1}/{args.pairs}: " + ", ".join(
            f"{w} {runs[w][-1]['ready']:.1f} s" for w in args.ways if runs[w]))  # fmt: skip
    rows = {
        way: {
            "n": len(values),
            "failed": failed[way],
            **{f"{m}_median_s": statistics.median(v[m] for v in values) for m in METRICS},
            **{f"{m}_min_s": min(v[m] for v in values) for m in METRICS},
            **{f"{m}_max_s": max(v[m] for v in values) for m in METRICS},
            "runs_s": values,
        }
        for way, values in runs.items()
        if values
    }
    import torch

    meta = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nproc": args.nproc,
        "pairs": args.pairs,
        "rdzv_conf": args.rdzv_conf or "defaults",
        "workers": "idle" if args.idle else "all-reduce every 50 ms",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
    }
    result = {"meta": meta, "ways": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))

    print(
        f"\nnode 1 of a --nnodes 1:2 job SIGKILLed -> node 0 re-formed alone, {args.nproc} "
        f"worker(s) per node, rdzv-conf {meta['rdzv_conf']}, {args.pairs} pair(s), "
        f"{meta['cpus']} CPUs, torch {meta['torch']} (seconds from the kill: median [min, max])"
    )
    base = rows.get("torchrun", {}).get("ready_median_s")
    print("| launcher | n | new workers started | workers past init | ready / torchrun |")
    print("|---|---:|---:|---:|---:|")
    for way, row in rows.items():
        cells = [
            f"{row[f'{m}_median_s']:.1f} [{row[f'{m}_min_s']:.1f}, {row[f'{m}_max_s']:.1f}]"
            for m in METRICS
        ]
        ratio = f"{row['ready_median_s'] / base:.2f}" if base else "-"
        print(f"| {way} | {row['n']} | {cells[0]} | {cells[1]} | {ratio} |")
    print(f"JSON: {args.json}")
    return result


if __name__ == "__main__":
    main()
