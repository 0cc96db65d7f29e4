"""Where the ``cuda`` tests put their ranks, and the switches that make CUDA runs repeatable.

Every test under ``tests/cuda/`` is marked ``cuda`` and runs where a CUDA device is visible
(``ci/gpu/run`` on the GPU machine); elsewhere it is skipped, saying why. Setting
``TANDEM_CUDA_ON_CPU=1`` rehearses them on the CPU instead: the same bodies, the same oracles,
with :func:`device` answering ``cpu``, so a test's logic is checked here before the GPU's few
minutes are spent on it (what needs a GPU by nature, NCCL or peak CUDA memory, still skips).

Placement (one GPU is the common case of the GPU machine):

- world size 1 uses NCCL on ``cuda:0``;
- more ranks than GPUs (two ranks on the one GPU): Gloo with CUDA tensors, every rank on
  ``cuda:0``. NCCL refuses two ranks on one device; Gloo still runs every CUDA stream path of
  the engines (their buckets, events and copies stay on the GPU);
- as many GPUs as ranks: NCCL, rank ``r`` on ``cuda:r``.

Example::

    def _body():
        dev = gpu.device()                   # cuda:0 (or cuda:rank with enough GPUs)
        t = torch.ones(1, device=dev)
        dist.all_reduce(t)
        return t.item()

    run_ranks(_body, 2, init=gpu.backend(2), env=gpu.env())
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CPU = os.environ.get("TANDEM_CUDA_ON_CPU") == "1"


def have_cuda() -> bool:
    """A CUDA device is visible to this process (asks the driver; creates no context)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def gpus() -> int:
    """How many CUDA devices the tests may use (0 when rehearsing on the CPU)."""
    return torch.cuda.device_count() if have_cuda() and not ON_CPU else 0


def backend(world_size: int) -> str:
    """NCCL where every rank has its own GPU, else Gloo (which takes CUDA tensors too)."""
    return "nccl" if gpus() >= world_size else "gloo"


def device(rank: int | None = None) -> torch.device:
    """The device of ``rank`` (default: this process's ``RANK``): ``cuda:rank`` when each rank
    has a GPU, ``cuda:0`` when the ranks share one, ``cpu`` when rehearsing on the CPU."""
    if ON_CPU or not have_cuda():
        return torch.device("cpu")
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    index = rank if torch.cuda.device_count() >= world else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def env(world_size: int | None = None) -> dict[str, str]:
    """Environment for the ranks: deterministic cuBLAS (bitwise oracles need it); with
    ``world_size`` ranks that outnumber the GPUs, each rank alone on a node of its own (so
    ``tandem.init``, which puts a rank on ``cuda:LOCAL_RANK``, places every rank on ``cuda:0``,
    where :func:`device` puts it too)."""
    out = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    if ON_CPU:
        out["TANDEM_CUDA_ON_CPU"] = "1"
    if world_size is not None and gpus() < world_size:
        out.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="{rank}")
    return out


def expected_device(rank: int, world_size: int) -> str:
    """Where :func:`device` (and ``tandem.init``, given :func:`env`) puts ``rank``."""
    if gpus() == 0:
        return "cpu"
    return f"cuda:{rank if gpus() >= world_size else 0}"


def deterministic() -> None:
    """Deterministic kernels in this process: the same inputs give the same bits, run to run.

    Call it first in a rank's body (after :func:`env`'s variables are set by the harness).
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # TF32 would make torch's and tandem's matmuls equal still, but a float32 one-process oracle
    # within 1e-6 would not hold: keep full float32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def needs_real_gpu(what: str, count: int = 1):
    """Skip (saying why) unless ``count`` real GPUs are visible: NCCL, CUDA memory statistics."""
    return pytest.mark.skipif(
        gpus() < count,
        reason=f"{what} needs {count} real CUDA device(s); this process sees "
        f"{gpus()}" + (" (rehearsing on the CPU)" if ON_CPU else ""),
    )
