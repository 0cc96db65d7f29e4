"""A job with a short collective timeout (``TIMEOUT_S``, 8 s) and the default report threshold
(60 s): rank 1 sleeps before the all-reduce that rank 0 waits in, until the timeout ends it."""

import os
import time

import torch
import torch.distributed as dist

import tandem

TIMEOUT_S = float(os.environ.get("TIMEOUT_S", "8"))


def read_forever() -> None:
    time.sleep(120)  # a read that never returns


def main() -> None:
    tandem.init(timeout=TIMEOUT_S)  # hang_report_after: the default (60 s)
    print(f"READY rank {dist.get_rank()} {time.time()}", flush=True)
    if dist.get_rank() == 1:
        read_forever()
    dist.all_reduce(torch.ones(3))


if __name__ == "__main__":
    main()
