"""What a worker runs: `-m` finds modules as `python -m` does; `--no-python`, `--run-path`.

- `tandem run -m pkg.train` (and `-m pkg`, a package with `__main__`) finds a package in the
  current directory, from the `tandem` console script too, whose `sys.path` lacks it; the
  package's `__init__` is not run in the launcher. The module sees what `python -m` gives it.
- `--no-python` runs an executable (here a shell script) as each worker.
- `--run-path` runs a file with `runpy.run_path`: `__name__ == "__main__"` and `sys.argv` as
  torchrun's `run_script_path` sets them (compared with torchrun's own function).
- A module that does not exist (`-m nosuch`, `-m pkg.nosuch`) is a clear error within seconds
  naming it, exit status 2, and no process of the launch is left running; a module that is
  found but fails on import fails the run, also leaving nothing behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch

# The `tandem` console script's situation: the current directory is not on sys.path (as
# `python -m tandem.cli` would put it, hiding the bug).
TANDEM_SCRIPT = [
    sys.executable,
    "-c",
    "import sys; del sys.path[0]; from tandem.cli import main; sys.exit(main())",
]

TRAIN = """
import json, os, sys
print("RUN", json.dumps({"name": __name__, "argv": sys.argv[1:], "rank": os.environ.get("RANK"),
      "path0": sys.path[0]}), flush=True)
"""


def _run(cwd: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TANDEM_SCRIPT, "run", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _runs(stdout: str) -> list[dict]:
    return [json.loads(line.split("RUN ", 1)[1]) for line in stdout.splitlines() if "RUN " in line]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A package in the current directory whose import in the launcher would show."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os\nopen(os.environ.get('INIT_MARK', os.devnull), 'a').write('x')\n"
    )
    (pkg / "train.py").write_text(TRAIN)
    (pkg / "__main__.py").write_text(TRAIN)
    (pkg / "broken.py").write_text("import no_such_dependency_xyz\n")
    return tmp_path


def _no_process_mentions(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmdline:
                found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.mark.parametrize("module", ["pkg.train", "pkg"])
def test_module_in_the_current_directory(project, module, monkeypatch):
    mark = project / "init_mark"
    monkeypatch.setenv("INIT_MARK", str(mark))
    result = _run(project, "--nproc-per-node", "2", "-m", module, "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    runs = sorted(_runs(result.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in runs] == ["0", "1"]
    reference = subprocess.run(
        [sys.executable, "-m", module, "--lr", "0.1"], cwd=project, capture_output=True, text=True
    )
    (alone,) = _runs(reference.stdout)
    for r in runs:
        assert (r["name"], r["argv"], r["path0"]) == (alone["name"], alone["argv"], alone["path0"])
    # pkg/__init__ ran in the 2 workers and in `python -m` only, never in the launcher
    assert mark.read_text() == "xxx"


def test_no_python_runs_an_executable(tmp_path):
    script = tmp_path / "work.sh"
    script.write_text('#!/bin/sh\necho "SHELL rank $RANK of $WORLD_SIZE args $*"\n')
    script.chmod(0o755)
    result = _run(tmp_path, "--nproc-per-node", "2", "--no-python", str(script), "a", "b")
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "SHELL" in line)
    assert lines == [f"[rank {r}] SHELL rank {r} of 2 args a b" for r in (0, 1)]


def test_run_path_as_torchruns_run_script_path(project):
    script = project / "pkg" / "train.py"
    result = _run(project, "--nproc-per-node", "2", "--run-path", str(script), "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    runs = _runs(result.stdout)
    assert len(runs) == 2
    reference = subprocess.run(
        [sys.executable, "-c", "import sys; from torch.distributed.run import run_script_path; "
         "run_script_path(*sys.argv[1:])", str(script), "--lr", "0.1"],
        capture_output=True, text=True, check=True, cwd=project,
    )  # fmt: skip
    (alone,) = _runs(reference.stdout)
    for r in runs:
        assert (
            (r["name"], r["argv"]) == (alone["name"], alone["argv"]) == ("__main__", alone["argv"])
        )


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("nosuch_{mark}", "module 'nosuch_{mark}' not found"),
        ("pkg.nosuch_{mark}", "package 'pkg' ({cwd}) has no module 'nosuch_{mark}'"),
    ],
)
def test_a_missing_module_is_named_at_once_and_nothing_runs(project, module, message):
    mark = uuid.uuid4().hex[:8]
    module, message = module.format(mark=mark), message.format(mark=mark, cwd=project / "pkg")
    start = time.monotonic()
    result = _run(project, "--nproc-per-node", "2", "-m", module, timeout=20)
    assert time.monotonic() - start < 10
    assert result.returncode == 2
    assert message in result.stderr
    assert _no_process_mentions(mark) == []


def test_a_module_failing_on_import_fails_the_run_and_leaves_nothing(project):
    mark = uuid.uuid4().hex
    result = _run(project, "--nproc-per-node", "2", "-m", "pkg.broken", mark, timeout=30)
    assert result.returncode == 1
    assert "No module named 'no_such_dependency_xyz'" in result.stderr
    assert _no_process_mentions(mark) == []


def test_no_python_with_module_is_refused(tmp_path):
    result = _run(tmp_path, "--no-python", "-m", "pkg.train", timeout=20)
    assert result.returncode == 2
    assert "--no-python and -m cannot be combined" in result.stderr
