"""Run torch's DDP tests for an engine and read back every test's outcome.

``run_engine("tandem", names)`` starts ``python -m tests.torch_suite.runner`` (a fresh
interpreter: torch's suite configures itself from the environment and ``sys.argv`` when it is
imported) and returns ``{name: Outcome}``. Each test has torch's harness timeout
(``timeout_s``, 30 s by default): a hang fails that one test. Should the runner itself die
(a crash outside the ranks), the test it was in is failed with the tail of its log and a new
runner goes on with the rest; an overall deadline covers the runner too.

``python -m tests.torch_suite`` (``__main__.py``) runs the whole selection for both engines;
``test_torch_ddp_suite.py`` runs the tests that must pass under tandem.DDP.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINES = ("torch", "tandem")
TIMEOUT_S = 30


@dataclasses.dataclass
class Outcome:
    """One test under one engine: ``status`` is pass, fail, skip or "not run"."""

    name: str
    status: str
    message: str = ""
    seconds: float = 0.0
    constructed: int = 0  # times the engine's class was built, both ranks together
    moved: bool = False  # a GPU-only test moved to the CPU (cuda_to_cpu.py)

    @property
    def line(self) -> str:
        return f"{self.name}: {self.status}" + (f" ({self.message})" if self.message else "")


def _runner_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.torch_suite.runner", *args]


def list_tests() -> list[str]:
    """The selection (``runner.select_tests``): every test of torch's suite that builds DDP."""
    out = subprocess.run(
        _runner_cmd("--list"), cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_engine(
    engine: str,
    names: Iterable[str],
    *,
    timeout_s: int = TIMEOUT_S,
    budget_s: float | None = None,
    log: Path | None = None,
    hang: bool = False,
) -> dict[str, Outcome]:
    """Run ``names`` of torch's suite with ``engine`` ("torch" or "tandem"), in order.

    Each test is stopped by torch's harness after ``timeout_s``; ``budget_s`` bounds the whole
    call (the tests it leaves are "not run"). The ranks' output (torch's harness logs every
    rank's traceback) goes to ``log``, or to a temporary file quoted when the runner dies.
    ``hang`` makes every test body sleep instead (to check the timeout).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    names = list(names)
    results: dict[str, Outcome] = {}
    todo = list(names)
    deadline = time.monotonic() + (budget_s if budget_s is not None else 1e9)
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        log_path = log or Path(tmp, "runner.log")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("TANDEM_REPORT_DIR", tmp)  # tandem's hang reports: not into the checkout
        while todo:
            left = deadline - time.monotonic()
            done, running = _run_batch(
                engine, todo, timeout_s, left, Path(tmp), log_path, env, hang
            )
            results.update(done)
            todo = [n for n in todo if n not in done]
            if not todo:
                break
            if time.monotonic() >= deadline:
                for n in todo:
                    results[n] = Outcome(
                        n, "not run", f"out of time ({budget_s:.0f} s for the batch)"
                    )
                break
            tail = _tail(log_path)
            if running is not None:  # the runner died in this test: the rest in a new one
                results[running] = Outcome(running, "fail", f"the runner process died: {tail}")
                todo = [n for n in todo if n != running]
            elif not done:  # it died before its first test: it would again
                for n in todo:
                    results[n] = Outcome(n, "fail", f"the runner did not start: {tail}")
                break
    return {n: results[n] for n in names}


def _run_batch(
    engine: str,
    names: list[str],
    timeout_s: int,
    budget_s: float,
    tmp: Path,
    log_path: Path,
    env: dict[str, str],
    hang: bool,
) -> tuple[dict[str, Outcome], str | None]:
    """Outcomes of one runner process, and the test it was in if it stopped early."""
    out_path = tmp / "results.jsonl"
    out_path.unlink(missing_ok=True)
    cmd = _runner_cmd(
        "--engine", engine, "--names", ",".join(names), "--out", str(out_path),
        "--timeout", str(timeout_s),
        *(("--hang",) if hang else ()),
    )  # fmt: skip
    # Torch's harness stops a test at timeout_s (+5 s to fetch the stacks); this is the backstop.
    wait_s = min(budget_s, 30 + len(names) * (timeout_s + 15))
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait(timeout=max(wait_s, 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.write(f"\n[torch-suite] runner killed after {wait_s:.0f} s\n")
    done: dict[str, Outcome] = {}
    running = None
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "running" in row:
                running = row["running"]
            elif row:
                done[row["name"]] = Outcome(**row)
                running = None
    return done, running


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])


def run(
    engines: Iterable[str],
    names: list[str],
    *,
    timeout_s: int = TIMEOUT_S,
    log_dir: Path | None = None,
) -> dict[str, dict[str, Outcome]]:
    """``{engine: {name: Outcome}}``, one engine after the other."""
    results = {}
    for engine in engines:
        log = Path(log_dir, f"{engine}.log") if log_dir else None
        started = time.monotonic()
        results[engine] = run_engine(engine, names, timeout_s=timeout_s, log=log)
        print(
            f"[torch-suite] {engine}: {len(names)} tests in {time.monotonic() - started:.0f} s",
            file=sys.stderr,
        )
    return results
