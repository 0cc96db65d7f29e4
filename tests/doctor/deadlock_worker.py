"""A job whose ranks all wait outside torch.distributed, forever (see test_deadlock_report.py).

After one all-reduce, rank 0 waits on an event only rank 1 would set, and rank 1 sleeps: no
collective is in flight, so no collective timeout will ever end the job.
"""

import os
import threading
import time

import torch
import torch.distributed as dist

import tandem


def wait_for_data(ready: threading.Event) -> None:
    ready.wait()  # set by nobody: a deadlock in the user's own code


def main() -> None:
    tandem.init(hang_report_after=2)
    dist.all_reduce(torch.ones(2))
    print(f"READY rank {dist.get_rank()} pid {os.getpid()}", flush=True)
    if dist.get_rank() == 0:
        wait_for_data(threading.Event())
    else:
        time.sleep(3600)


if __name__ == "__main__":
    main()
