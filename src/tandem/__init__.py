"""tandem: data-parallel training for PyTorch, engines written in Python on torch.distributed.

The engines are imported on first use (PEP 562), so that ``import tandem`` and the ``tandem``
command line start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tandem.world import World, init, shutdown, world

if TYPE_CHECKING:
    from tandem.launch.spawn import spawn
    from tandem.parallel.ddp.comm_hooks import GradBucket
    from tandem.parallel.ddp.join import join
    from tandem.parallel.ddp.wrapper import DistributedDataParallel, drop_zero_grads
    from tandem.parallel.dp.wrapper import DataParallel
    from tandem.parallel.fsdp.wrapper import FullyShardedDataParallel, MixedPrecisionPolicy
    from tandem.parallel.zero import ShardedOptimizer
    from tandem.train.trainer import Trainer

    DDP = DistributedDataParallel

_LAZY = {
    "DDP": ("tandem.parallel.ddp.wrapper", "DistributedDataParallel"),
    "DataParallel": ("tandem.parallel.dp.wrapper", "DataParallel"),
    "DistributedDataParallel": ("tandem.parallel.ddp.wrapper", "DistributedDataParallel"),
    "FullyShardedDataParallel": ("tandem.parallel.fsdp.wrapper", "FullyShardedDataParallel"),
    "GradBucket": ("tandem.parallel.ddp.comm_hooks", "GradBucket"),
    "MixedPrecisionPolicy": ("tandem.parallel.fsdp.wrapper", "MixedPrecisionPolicy"),
    "ShardedOptimizer": ("tandem.parallel.zero", "ShardedOptimizer"),
    "Trainer": ("tandem.train.trainer", "Trainer"),
    "drop_zero_grads": ("tandem.parallel.ddp.wrapper", "drop_zero_grads"),
    "join": ("tandem.parallel.ddp.join", "join"),
    "spawn": ("tandem.launch.spawn", "spawn"),
}

__all__ = [
    "DDP",
    "DataParallel",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "GradBucket",
    "MixedPrecisionPolicy",
    "ShardedOptimizer",
    "Trainer",
    "World",
    "checkpoint",
    "data",
    "drop_zero_grads",
    "groups",
    "init",
    "join",
    "metrics",
    "shutdown",
    "spawn",
    "world",
]

__version__ = "0.1.0"


# Submodules reachable as attributes after a bare `import tandem` (tandem.groups.partition(...)).
_SUBMODULES = ("checkpoint", "data", "groups", "metrics")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"tandem.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
