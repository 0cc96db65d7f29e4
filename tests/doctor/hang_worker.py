"""A job whose rank 1 never reaches the all-reduce: its collective times out on rank 0."""

import time

import torch
import torch.distributed as dist

import tandem


def read_forever() -> None:
    time.sleep(120)  # a read that never returns


def main() -> None:
    tandem.init(timeout=10, hang_report_after=2)
    if dist.get_rank() == 1:
        read_forever()
    dist.all_reduce(torch.ones(3))


if __name__ == "__main__":
    main()
