"""``python -m tests.torch_suite``: torch's own DDP tests with torch's DDP and with tandem.DDP.

Runs the selection (every test of torch's ``DistributedTest._DistTestBase`` that builds DDP,
see ``runner.select_tests``) on Gloo at world size 2, once per engine, prints one row per
test (torch's outcome, tandem's, and the first line of the error where one of them fails)
with a summary by category, and writes everything to ``--json``. About 2 minutes per engine
on 2 cores. See docs/torch-ddp-suite.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from tests.torch_suite import known
from tests.torch_suite.driver import ENGINES, TIMEOUT_S, Outcome, list_tests, run


def category(name: str, by_engine: dict[str, dict[str, Outcome]]) -> str:
    """Where a test stands: both pass, torch only (with known.py's group), ..."""
    status = {e: by_engine[e][name].status for e in by_engine}
    if len(status) < 2:
        return next(iter(status.values()))
    torch_s, tandem_s = status["torch"], status["tandem"]
    if torch_s == tandem_s:
        return {"pass": "both pass", "fail": "both fail"}.get(torch_s, f"both {torch_s}")
    if torch_s == "pass" and tandem_s == "fail":
        group = known.TANDEM_FAILS.get(name, ("NOT EXPLAINED in known.py",))[0]
        return f"torch only: {group}"
    return f"torch {torch_s}, tandem {tandem_s}"


def table(names: list[str], by_engine: dict[str, dict[str, Outcome]]) -> str:
    engines = list(by_engine)
    width = max(len(n) for n in names)
    head = f"{'test':<{width}}  moved  " + "  ".join(f"{e:<7}" for e in engines) + "  note"
    rows = [head, "-" * len(head)]
    for name in names:
        outcomes = [by_engine[e][name] for e in engines]
        moved = "yes" if any(o.moved for o in outcomes) else ""
        notes = [
            f"{e}: {o.message}"
            for e, o in zip(engines, outcomes, strict=True)
            if o.status != "pass"
        ]
        if len(engines) == 2 and outcomes[0].status == outcomes[1].status == "fail":
            notes = notes[1:]  # the same failure twice: tandem's is the one of interest
        cells = "  ".join(f"{o.status:<7}" for o in outcomes)
        rows.append(f"{name:<{width}}  {moved:<5}  {cells}  {'; '.join(notes)[:160]}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.torch_suite", description=__doc__)
    parser.add_argument("--engine", choices=(*ENGINES, "both"), default="both")
    parser.add_argument("--only", default="", help="comma-separated test names (default: all)")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds per test")
    parser.add_argument("--log-dir", type=Path, help="keep each engine's runner log here")
    args = parser.parse_args(argv)

    names = [n for n in args.only.split(",") if n] or list_tests()
    engines = list(ENGINES) if args.engine == "both" else [args.engine]
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    by_engine = run(engines, names, timeout_s=args.timeout, log_dir=args.log_dir)
    seconds = time.monotonic() - started

    print(table(names, by_engine))
    counts = Counter(category(n, by_engine) for n in names)
    print(f"\n{len(names)} tests, {seconds:.0f} s")
    for what, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{count:4d}  {what}")
    if args.json:
        report = {
            "torch": torch.__version__,
            "engines": engines,
            "seconds": round(seconds, 1),
            "tests": [
                {
                    "name": n,
                    "category": category(n, by_engine),
                    "why_tandem_fails": known.why_tandem_fails(n),
                    **{e: by_engine[e][n].__dict__ for e in engines},
                }
                for n in names
            ],
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
