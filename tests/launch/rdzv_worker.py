"""A process of a hand-made job (MASTER_ADDR/PORT, RANK, WORLD_SIZE set by the test): init,
one all-reduce, and a line saying how it ended. ``HOLD`` keeps a formed job training (one
all-reduce every 0.1 s) for that many seconds, for a duplicate that comes late."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import tandem

started = time.monotonic()
try:
    tandem.init()
    print("formed", flush=True)
    hold = time.monotonic() + float(os.environ.get("HOLD", "0"))
    x = torch.ones(1)
    dist.all_reduce(x)
    while time.monotonic() < hold:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)
    print(f"ok {x.item()}", flush=True)
    tandem.shutdown()
except Exception as exc:
    print(f"{type(exc).__name__}: {exc} [{time.monotonic() - started:.1f} s]", flush=True)
    sys.exit(3)
