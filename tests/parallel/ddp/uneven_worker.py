"""A training script whose rank 1 runs out of data early (see test_ddp_uneven.py).

Run as ``python -m tests.parallel.ddp.uneven_worker MODE`` in each rank's environment:

- ``barrier``: rank 1 trains 2 steps, the others 5; then every rank calls ``dist.barrier()``;
- ``exit``: the same, then the script simply ends (the process exits);
- ``slow``: every rank trains 5 steps, rank 1 sleeping 6 s in its third (busy, not out of step).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tandem
from tests import models


def main(mode: str) -> None:
    torch.set_num_threads(1)
    tandem.init()
    rank = dist.get_rank()
    model = tandem.DDP(models.conv_bn(seed=rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = 2 if rank == 1 and mode != "slow" else 5
    for step in range(steps):
        if mode == "slow" and rank == 1 and step == 2:
            time.sleep(6)
        x, y = models.batch(step, rank, 4, (1, 6, 6))
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    print(f"rank {rank} done training at {time.time():.3f}", flush=True)
    if mode == "barrier":
        dist.barrier()
    if mode == "slow":
        total = sum(p.double().sum() for p in model.parameters()).item()
        print(f"rank {rank} checksum {total!r}", flush=True)
        tandem.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
