"""tandem: data-parallel training for PyTorch, engines written in Python on torch.distributed."""

from tandem.parallel.comm_hooks import GradBucket
from tandem.parallel.ddp import DistributedDataParallel, drop_zero_grads
from tandem.world import World, init, shutdown, world

DDP = DistributedDataParallel

__all__ = [
    "DDP",
    "DistributedDataParallel",
    "GradBucket",
    "World",
    "drop_zero_grads",
    "init",
    "shutdown",
    "world",
]

__version__ = "0.1.0"
