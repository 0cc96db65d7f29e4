"""What tests that start real launches share: a clean environment, the `tandem run` command."""

from __future__ import annotations

import os
import sys

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
