"""tandem.data.BijectiveSampler against torch's DistributedSampler: peak memory and first index.

torch's sampler builds ``randperm(n).tolist()`` at the start of every epoch; tandem's computes each
index from a keyed bijection. For each n and sampler, every measurement runs in a fresh Python
process, so that peak memory is that sampler's alone: after the imports the process resets its
peak-RSS mark (``/proc/self/clear_refs``), then constructs the sampler, calls ``set_epoch(0)`` and
times ``next(iter(sampler))``. Reported, as medians over the repetitions:

- peak RSS above the interpreter (with torch and numpy imported), over the first index and the
  iteration below: what the user's process pays;
- time to the first index (``next(iter(sampler))``; construction and ``set_epoch`` are in the JSON);
- iteration throughput over the next ``--iterate`` indices, for honesty: tandem's comes from numpy
  batches, torch's from a ready list.

Processes alternate, A B then B A, so drift in the machine's load hits both alike. n = 10^9 is
run for tandem alone (torch's list would take ~40 GB).

Run::

    python benchmarks/sampler.py                 # 10^6 x 7 pairs, 10^8 x 3 pairs, 10^9 x 3
    python benchmarks/sampler.py --pairs 3 --big-pairs 1
    python benchmarks/sampler.py --sizes 1000 --pairs 1 --iterate 10   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLERS = ("torch", "tandem")
MB = 2**20


class _Length:
    """A stand-in data set: the samplers only ask for its length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> tuple[int, str]:
    """This process's RSS now, in bytes, after resetting its peak mark where Linux allows.

    Without the reset the peak would still hold the imports' transient high, hiding anything
    smaller; getrusage's ru_maxrss is then the (conservative) fallback.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kb("VmRSS") * 1024, "VmHWM after clear_refs"
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"


def _peak(method: str) -> int:
    if method == "ru_maxrss":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return _status_kb("VmHWM") * 1024


def child(sampler: str, n: int, replicas: int, iterate: int) -> dict:
    """One measurement, in this (fresh) process."""
    import gc
    import itertools

    from torch.utils.data import DistributedSampler

    from tandem.data.bijective import BijectiveSampler

    gc.collect()
    baseline, method = _reset_peak()
    t0 = time.perf_counter()
    if sampler == "torch":
        s = DistributedSampler(_Length(n), num_replicas=replicas, rank=0, shuffle=True, seed=0)
    else:
        s = BijectiveSampler(n, num_replicas=replicas, rank=0, seed=0)
    t1 = time.perf_counter()
    s.set_epoch(0)
    t2 = time.perf_counter()
    it = iter(s)
    first = next(it)
    t3 = time.perf_counter()
    peak_first = _peak(method)
    count = sum(1 for _ in itertools.islice(it, iterate))
    t4 = time.perf_counter()
    peak = _peak(method)
    assert 0 <= first < n and count == min(iterate, len(s) - 1)
    return {
        "peak_rss_above_baseline_mb": (peak - baseline) / MB,
        "peak_rss_at_first_index_mb": (peak_first - baseline) / MB,
        "baseline_rss_mb": baseline / MB,
        "memory_method": method,
        "construct_s": t1 - t0,
        "set_epoch_s": t2 - t1,
        "first_index_s": t3 - t2,
        "iterate_indices_per_s": count / (t4 - t3),
    }


def _spawn(sampler: str, n: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", sampler, str(n)]
    cmd += ["--replicas", str(args.replicas), "--iterate", str(args.iterate)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _measure(n: int, samplers: tuple[str, ...], pairs: int, args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {s: [] for s in samplers}
    for rep in range(pairs):
        # A B, then B A: neither sampler always runs on the heels of the other
        for sampler in samplers if rep % 2 == 0 else samplers[::-1]:
            runs[sampler].append(_spawn(sampler, n, args))
    report = {}
    for sampler, rows in runs.items():
        keys = [k for k, v in rows[0].items() if isinstance(v, float)]
        report[sampler] = {k: statistics.median(r[k] for r in rows) for k in keys}
        report[sampler]["runs"] = rows
    if len(samplers) == 2:
        # per-pair ratios, then their median: the pairs share the machine's state of the moment
        t, b = runs["torch"], runs["tandem"]
        ratios = [x["first_index_s"] / y["first_index_s"] for x, y in zip(t, b, strict=True)]
        report["ratio_torch_over_tandem_first_index"] = statistics.median(ratios)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=7, help="repetitions at n = 10^6")
    parser.add_argument("--big-pairs", type=int, default=3, help="repetitions at 10^8 and 10^9")
    parser.add_argument("--replicas", type=int, default=1, help="num_replicas (rank 0 measured)")
    parser.add_argument("--iterate", type=int, default=100_000)
    parser.add_argument("--json", type=Path, default=RESULTS / "sampler.json")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        help="measure these n instead, both samplers, --pairs repetitions each (a smoke run)",
    )
    parser.add_argument("--child", nargs=2, metavar=("SAMPLER", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.replicas, args.iterate)))
        return {}

    if args.sizes:
        plan = [(n, SAMPLERS, args.pairs) for n in args.sizes]
    else:
        plan = [(10**6, SAMPLERS, args.pairs), (10**8, SAMPLERS, args.big_pairs)]
        plan.append((10**9, ("tandem",), args.big_pairs))
    results = {f"{n:.0e}": _measure(n, samplers, reps, args) for n, samplers, reps in plan}
    meta = {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": __import__("torch").__version__,
        "replicas": args.replicas,
        "repetitions": {f"{n:.0e}": reps for n, _, reps in plan},
        "iterate": args.iterate,
    }
    result = {"meta": meta, "n": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))

    print(
        f"Sampler cost, num_replicas={args.replicas}, {meta['cpus']} CPUs, torch {meta['torch']}"
        " (medians over fresh processes; memory is peak RSS above the interpreter)"
    )
    print("| n | sampler | peak memory | first index | iteration | first index torch/tandem |")
    print("|---|---|---:|---:|---:|---:|")
    for n, report in results.items():
        for sampler in SAMPLERS:
            if sampler not in report:
                continue
            r = report[sampler]
            ratio = ""
            if sampler == "tandem" and "torch" in report:
                ratio = f"{report['ratio_torch_over_tandem_first_index']:.0f}x"
            print(
                f"| {n} | {sampler} | {r['peak_rss_above_baseline_mb']:.1f} MB | "
                f"{_time(r['first_index_s'])} | {r['iterate_indices_per_s'] / 1e6:.2f} M/s | "
                f"{ratio} |"
            )
    print(f"JSON: {args.json}")
    return result


def _time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


if __name__ == "__main__":
    main()
