"""``python -m tests.torch_suite.runner``: runs PyTorch's own DDP tests, for one engine.

Not a test module: ``driver.py`` starts it in a fresh interpreter (the torch test suite reads
its configuration from the environment when it is imported, parses ``sys.argv`` and sets
global state, none of which belongs in a pytest process), and reads back one JSON line per
test from ``--out``.

What it does:

- sets the environment torch's ``test/distributed/test_distributed_spawn.py`` expects
  (``BACKEND=gloo``, ``WORLD_SIZE=2``; ``TEMP_DIR`` and ``INIT_METHOD`` are made per test by
  torch's own ``TestDistBackend.setUp``), then imports
  ``torch.testing._internal.distributed.distributed_test``;
- builds the test class as ``test_distributed_spawn.py`` does (``TestDistBackend`` +
  ``DistributedTest._DistTestBase``), except that the two ranks are *forked* from this
  process, which has imported torch, the suite and tandem once, instead of spawned (each
  spawned rank re-imports torch: seconds per rank on 2 cores);
- in each rank, before the test body runs, the engine is chosen: ``torch`` leaves everything
  alone; ``tandem`` binds ``tandem.DDP`` to the two names through which the suite reaches DDP,
  ``distributed_test.DistributedDataParallel`` (its ``from torch.nn.parallel import
  DistributedDataParallel``) and ``torch.nn.parallel.DistributedDataParallel`` (its
  ``nn.parallel.DistributedDataParallel(...)`` and ``torch.nn.parallel.DistributedDataParallel``
  calls). ``torch.nn.parallel.distributed.DistributedDataParallel`` stays torch's class, so
  torch's own internals (dynamo's DDP optimizer, ...) are untouched;
- each rank counts how many times the engine's class was constructed, so a test that passes
  without ever building the engine is visible (``constructed`` in the result);
- every test has torch's harness timeout, set here to ``--timeout`` seconds, 30 by default
  (45 s for the torch.compile test; torch's own default is 300 s): a hang fails that test,
  with every rank's stack in the log, and the run goes on with the next.

``--list`` prints the selection (see ``select_tests``) as JSON instead of running anything.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import inspect
import json
import multiprocessing
import os
import re
import sys
import tempfile
import textwrap
import time
import traceback
import unittest
from pathlib import Path
from typing import Any

import torch

from tests.torch_suite.cuda_to_cpu import (
    cpu_for_cuda,
    drop_device_ids,
    has_gpu_skip,
    strip_gpu_skips,
)

ENGINES = ("torch", "tandem")
WORLD_SIZE = 2

# Tests that reach DDP although neither their body nor a helper they call names it; none today.
EXTRA_TESTS: tuple[str, ...] = ()

# Selected, but not run: what each would need is out of reach of a CPU machine.
NOT_RUN = {
    "test_ddp_uneven_inputs": (
        "GPU-sized: a 3-layer conv net on a 1000x1000 image, 24 cases; on 2 CPU cores one "
        "case takes minutes, and the whole test did not finish in 400 s under torch's DDP"
    ),
}

# torch.compile with a cold cache: 13 s alone on 2 cores, so 30 s could fire under load.
SLOW_TESTS_TIMEOUT_S = {"test_ddp_compile_static_graph": 45}


def _configure_environment(tmp: str) -> None:
    """What torch's suite reads at import; must run before ``torch.testing._internal``."""
    os.environ["BACKEND"] = "gloo"
    os.environ["WORLD_SIZE"] = str(WORLD_SIZE)
    # As test_distributed_spawn.py requires; torch's TestDistBackend.setUp then makes a fresh
    # one (barrier/, test_dir/, init_dir/) for every test and sets INIT_METHOD to a file in it.
    os.makedirs(os.path.join(tmp, "barrier"), exist_ok=True)
    os.environ["TEMP_DIR"] = tmp


def _suite_module() -> Any:
    from torch.testing._internal.distributed import distributed_test

    return distributed_test


def select_tests() -> list[str]:
    """The DDP tests of ``DistributedTest._DistTestBase``.

    A test is selected when its code uses DDP: its body, or a ``self._helper`` it calls
    (followed transitively through the class's methods), refers to ``DistributedDataParallel``
    (a name or an attribute, in the code: decorators and strings, such as the skip message
    "The gloo backend does not support DistributedDataParallel", do not count). That is every
    test in which swapping the engine can change anything: the tests named after DDP
    (``ddp`` / ``DistributedDataParallel`` in the name) less ``test_dump_DDP_relevant_env_vars``
    (prints environment variables, builds no DDP), plus the tests that build DDP without
    saying so in their name (``test_accumulate_gradients_no_sync``,
    ``test_skip_all_reduce_unused_parameters``, the post-local-SGD tests, ...).
    """
    base = _suite_module().DistributedTest._DistTestBase
    uses_ddp: dict[str, bool] = {}
    calls: dict[str, set[str]] = {}
    for name, value in vars(base).items():
        if not callable(value):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(value))))
        except (OSError, TypeError, SyntaxError):
            continue
        func = tree.body[0]
        if not isinstance(func, ast.FunctionDef):
            continue
        nodes = [n for stmt in func.body for n in ast.walk(stmt)]
        uses_ddp[name] = any(
            (isinstance(n, ast.Name) and n.id == "DistributedDataParallel")
            or (isinstance(n, ast.Attribute) and n.attr == "DistributedDataParallel")
            for n in nodes
        )
        calls[name] = {
            n.attr
            for n in nodes
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
        }

    def reaches(name: str) -> bool:
        seen, todo = {name}, [name]
        while todo:
            current = todo.pop()
            if uses_ddp.get(current):
                return True
            for callee in calls.get(current, set()) & uses_ddp.keys():
                if callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
        return False

    tests = [n for n in dir(base) if n.startswith("test") and callable(getattr(base, n))]
    return sorted(n for n in tests if reaches(n) or n in EXTRA_TESTS)


def _count_constructions(cls: type, marks: Path, moved: bool) -> None:
    """Append a byte to ``marks`` each time ``cls`` is constructed (in this rank only); in a
    test moved to the CPU, construct it without ``device_ids`` / ``output_device``."""
    original = drop_device_ids(cls.__init__) if moved else cls.__init__

    @functools.wraps(original)
    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        with open(marks, "a") as f:
            f.write("x")
        original(self, *args, **kwargs)

    cls.__init__ = counting_init  # type: ignore[misc]


def _choose_engine(engine: str, marks: Path, moved: bool) -> None:
    """In a rank, before the test body: make the suite's DDP the engine's."""
    import torch.nn.parallel

    if engine == "torch":
        _count_constructions(torch.nn.parallel.DistributedDataParallel, marks, moved)
        return
    import tandem

    suite = _suite_module()
    suite.DistributedDataParallel = tandem.DDP
    torch.nn.parallel.DistributedDataParallel = tandem.DDP  # type: ignore[misc]
    _count_constructions(tandem.DDP, marks, moved)


def build_case(engine: str, marks_dir: Path, hang: bool = False) -> type[unittest.TestCase]:
    """The runnable test class of torch's suite for ``engine`` ("torch" or "tandem").

    ``hang``: every rank's test body sleeps for an hour instead (to check the timeout).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    suite = _suite_module()
    fork = multiprocessing.get_context("fork")

    class TorchDDPSuite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):  # type: ignore[name-defined,misc]
        def setUp(self) -> None:
            super().setUp()
            # test_distributed_spawn.py calls self._spawn_processes() here: same ranks, forked.
            self._start_processes(fork.Process)

        def tearDown(self) -> None:
            super().tearDown()
            # MultiProcessTestCase.setUp makes the init file with delete=False.
            Path(self.file_name).unlink(missing_ok=True)

        @classmethod
        def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
            # Two ranks on two cores: one intra-op thread each, or they fight over the cores.
            torch.set_num_threads(1)
            if hang:
                setattr(cls, test_name, lambda self: time.sleep(3600))
            moved = has_gpu_skip(getattr(cls, test_name))
            _choose_engine(engine, marks_dir / test_name, moved)
            if not moved:
                super()._run(rank, test_name, file_name, pipe, **kwargs)
                return
            setattr(cls, test_name, strip_gpu_skips(getattr(cls, test_name)))
            with cpu_for_cuda(rank):
                super()._run(rank, test_name, file_name, pipe, **kwargs)

    TorchDDPSuite.__name__ = TorchDDPSuite.__qualname__ = f"TorchDDPSuite_{engine}"
    return TorchDDPSuite


def _set_timeout(seconds: int) -> None:
    """torch's harness timeout for every test (its own overrides of 400 and 500 s go)."""
    from torch.testing._internal import common_distributed

    common_distributed.TIMEOUT_DEFAULT = seconds
    common_distributed.TIMEOUT_OVERRIDE.clear()
    common_distributed.TIMEOUT_OVERRIDE.update(
        {name: max(seconds, s) for name, s in SLOW_TESTS_TIMEOUT_S.items()}
    )


def first_error_line(text: str) -> str:
    """The exception line of the last traceback in ``text`` (torch's rank reports hold them),
    prefixed with the rank that raised it; else the first non-empty line of ``text``."""
    rank = re.search(r"Process (\d+) exited with error code", text)
    prefix = f"rank {rank.group(1)}: " if rank else ""
    if rank:  # the first reporting rank's traceback only
        nxt = re.search(r"\nProcess \d+ exited with error code", text[rank.end() :])
        text = text[: rank.end() + nxt.start()] if nxt else text
    if "Traceback (most recent call last):" in text:
        tail = text.rsplit("Traceback (most recent call last):", 1)[1]
        for line in tail.splitlines():
            if line.strip() and not line.startswith(" "):
                return prefix + line.strip()
    for line in text.splitlines():
        if line.strip():
            return prefix + line.strip()
    return prefix + "(no message)"


class _Collector(unittest.TestResult):
    """Writes one JSON line per finished test to ``out`` (flushed, so a killed run keeps them)."""

    def __init__(self, out: Any, marks_dir: Path) -> None:
        super().__init__()
        self._out = out
        self._marks_dir = marks_dir
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._started = time.monotonic()
        self._out.write(json.dumps({"running": test._testMethodName}) + "\n")
        self._out.flush()
        print(f"[torch-suite] {test._testMethodName} ...", file=sys.stderr, flush=True)

    def _record(self, test: unittest.TestCase, status: str, message: str = "") -> None:
        name = test._testMethodName
        marks = self._marks_dir / name
        constructed = len(marks.read_text()) if marks.exists() else 0
        row = {
            "name": name,
            "status": status,
            "message": message,
            "seconds": round(time.monotonic() - self._started, 2),
            "constructed": constructed,
            "moved": has_gpu_skip(getattr(type(test), name)),
        }
        self._out.write(json.dumps(row) + "\n")
        self._out.flush()
        print(f"[torch-suite] {name} {status} {message}", file=sys.stderr, flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._record(test, "fail", first_error_line("".join(traceback.format_exception(*err))))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        if isinstance(test, unittest.TestCase):
            self._record(test, "fail", first_error_line("".join(traceback.format_exception(*err))))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._record(test, "skip", reason.splitlines()[0] if reason else "")

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._record(test, "pass", "expected failure (torch's own mark)")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._record(test, "fail", "unexpected success of a test torch marks expectedFailure")


def run_tests(engine: str, names: list[str], out: Any, timeout_s: int, hang: bool = False) -> None:
    """Run ``names`` of torch's suite under ``engine``, one JSON line per test to ``out``
    (``{"running": name}`` when a test starts, then its outcome)."""
    _set_timeout(timeout_s)
    with tempfile.TemporaryDirectory(prefix="torch-suite-marks-") as marks:
        case = build_case(engine, Path(marks), hang)
        to_run = []
        for name in names:
            row = {"name": name, "status": "fail", "message": "no such test in torch's suite"}
            if hasattr(case, name) and name in NOT_RUN:
                moved = has_gpu_skip(getattr(case, name))
                row = {"name": name, "status": "not run", "message": NOT_RUN[name], "moved": moved}
            elif hasattr(case, name):
                to_run.append(name)
                continue
            out.write(json.dumps(row) + "\n")
        suite = unittest.TestSuite(case(name) for name in to_run)
        suite.run(_Collector(out, Path(marks)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.torch_suite.runner")
    parser.add_argument("--engine", choices=ENGINES, default="tandem")
    parser.add_argument("--names", default="", help="comma-separated test names")
    parser.add_argument("--out", help="JSON-lines result file (default: stdout)")
    parser.add_argument("--timeout", type=int, default=30, help="seconds per test")
    parser.add_argument("--list", action="store_true", help="print the selection as JSON")
    parser.add_argument("--hang", action="store_true", help="the tests hang (checks the timeout)")
    args = parser.parse_args(argv)
    # torch's common_utils parses sys.argv when it is imported: leave it nothing of ours.
    sys.argv = sys.argv[:1]
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        _configure_environment(tmp)
        if args.list:
            print(json.dumps(select_tests()))
            return 0
        if args.engine == "tandem":
            import tandem  # noqa: F401  (imported once here, before the ranks are forked)
        torch.set_num_threads(1)
        names = [n for n in args.names.split(",") if n] or select_tests()
        with open(args.out, "a") if args.out else contextlib.nullcontext(sys.stdout) as out:
            run_tests(args.engine, names, out, args.timeout, args.hang)
    return 0


if __name__ == "__main__":
    sys.exit(main())
