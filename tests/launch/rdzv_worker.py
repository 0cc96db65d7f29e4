"""A process of a hand-made job (MASTER_ADDR/PORT, RANK, WORLD_SIZE set by the test): init,
one all-reduce, and a line saying how it ended. ``HOLD`` keeps a formed job training (one
all-reduce every 0.1 s) for that many seconds, for a duplicate that comes late; ``NO_SHUTDOWN``
leaves ``tandem.shutdown()`` out (its check-out comes at exit). ``GO=1``: say
"imported" once torch and tandem are imported, and start only on a line read from stdin (the
test then starts processes together however long their imports take)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import tandem

if os.environ.get("GO"):
    print("imported", flush=True)
    sys.stdin.readline()
started = time.monotonic()
try:
    tandem.init()
    print("formed", flush=True)
    hold = time.monotonic() + float(os.environ.get("HOLD", "0"))
    x = torch.ones(1)
    dist.all_reduce(x)
    while True:  # every rank stops after the same all-reduce: the one where one has held enough
        more = torch.tensor([float(time.monotonic() < hold)])
        dist.all_reduce(more, op=dist.ReduceOp.MIN)
        if not more.item():
            break
        time.sleep(0.1)
    if os.environ.get("NO_SHUTDOWN"):  # the check-out comes at exit (a non-zero status)
        print(f"ok {x.item()} (no shutdown)", flush=True)
        sys.exit(0)
    tandem.shutdown()  # where a duplicate that came late fails the job at the latest
    print(f"ok {x.item()}", flush=True)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc} [{time.monotonic() - started:.1f} s]", flush=True)
    sys.exit(3)
