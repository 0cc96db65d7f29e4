"""What tests that start real launches share: a clean environment, the `tandem run` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The variables torchrun gives a worker (the harness sets them too).
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# A launcher's variables inherited from the shell running pytest (say, an srun allocation)
# would make a started job join that one instead of the one the test starts.
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_")


def python_path() -> str:
    """The PYTHONPATH of a process a test starts: this tree's ``src`` first, then its root (for
    the ``tests`` package). ``src`` comes first so that a test run from a second checkout (a git
    worktree) runs that checkout's tandem, not the one installed in editable mode from another."""
    return os.pathsep.join([str(ROOT / "src"), str(ROOT)])


def clean_env() -> dict[str, str]:
    """os.environ without any launcher's variables, on the CPU."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in TORCHRUN_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)
    }
    # CPU and Gloo everywhere: on a machine with one GPU, two ranks cannot have one each.
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def tandem_run_module(module: str, *args: str, nproc: int = 2) -> list[str]:
    """`tandem run --nproc-per-node N --no-prefix -m MODULE ARGS`, with this interpreter."""
    return [
        sys.executable,
        "-m",
        "tandem.cli",
        "run",
        "--nproc-per-node",
        str(nproc),
        "--no-prefix",
        "-m",
        module,
        *args,
    ]


def run_job(
    nproc: int,
    flags: list[str],
    module: str,
    *args: str,
    timeout: float = 240,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """`tandem run --nproc-per-node N FLAGS -m MODULE ARGS` from the repository's root, which
    must exit 0 when ``check`` (else its stderr's end fails the test)."""
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "run", "--nproc-per-node", str(nproc), *flags,
         "-m", module, *args],
        env={**clean_env(), "PYTHONPATH": python_path()},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip
    assert not check or result.returncode == 0, result.stderr[-4000:]
    return result


def final_checkpoint(run_dir: Path) -> dict[str, Any]:
    """The state of the newest checkpoint in ``run_dir`` (the dict under ``"state"``)."""
    from tandem.checkpoint.run_dir import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(run_dir)
    assert path is not None, f"no checkpoint in {run_dir}"
    return load_checkpoint(path)["state"]
