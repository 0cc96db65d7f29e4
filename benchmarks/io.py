"""BroadcastLoader against every rank reading: storage reads and wall time per epoch.

A data set whose reads are slow: each ``__getitem__`` sleeps ``--read-ms`` (2 ms) and counts
itself in a counter that all ranks share. WORLD ranks (4), Gloo, one thread each, are split into
groups of ``g`` consecutive ranks (g = 2 and 4). In both arms every rank consumes the same
batches, its group's shard of the data set (a DistributedSampler over the groups), shuffled anew
each epoch:

- *every rank reads*: each rank reads its group's shard itself, from storage;
- *BroadcastLoader*: the group's leader reads the shard and broadcasts each batch to the group.

Two storages: ``serial`` serves one read at a time to all ranks (a lock around the sleep: a
network file system whose throughput is the limit), ``parallel`` serves every rank at once (the
reads of different ranks overlap: only latency counts).

Expected: reads per epoch fall by the group size (g x samples -> samples), whatever the storage.
Wall time falls by about the group size too on the serial storage, where time is reads; on the
parallel storage it stays about the same (the leader reads as many samples as each rank did;
the broadcast adds a little).

Measurements alternate, A B then B A, every configuration in every pair, so that drift in the
machine's load hits both arms alike. Reported: median reads and seconds per epoch of each arm
over the pairs, and the medians of the per-pair ratios every-rank / BroadcastLoader.

Run::

    python benchmarks/io.py --pairs 7
    python benchmarks/io.py --storage serial --group-sizes 2 4 --read-ms 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tandem.data import BroadcastLoader

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("every rank reads", "BroadcastLoader")
STORAGES = ("serial", "parallel")


class SlowDataset(Dataset):
    """Sample i: ``floats`` float32 values and its id; every read sleeps and is counted.

    ``counter`` is shared by all ranks (a multiprocessing Value), so it counts the storage's
    reads, whoever makes them. ``lock``, when given, is shared too: the storage then serves one
    read at a time.
    """

    def __init__(self, size: int, floats: int, read_s: float, counter: Any, lock: Any) -> None:
        self.size, self.floats, self.read_s = size, floats, read_s
        self.counter, self.lock = counter, lock

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.lock is not None:
            with self.lock:
                time.sleep(self.read_s)
        else:
            time.sleep(self.read_s)
        with self.counter.get_lock():
            self.counter.value += 1
        return torch.full((self.floats,), float(i)), i


def _epoch(loader: Any, epoch: int, counter: Any) -> tuple[float, int, int]:
    """(seconds of the slowest rank, storage reads, checksum of the ids this rank consumed)."""
    sampler = loader if isinstance(loader, BroadcastLoader) else loader.sampler
    sampler.set_epoch(epoch)
    if dist.get_rank() == 0:
        counter.value = 0
    dist.barrier()  # the reset is seen before anyone reads
    start = time.perf_counter()
    checksum = 0
    for values, ids in loader:
        checksum += int(ids.sum()) + int(values[:, 0].sum())
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    # The epoch is as slow as its slowest rank; after this every rank's reads are counted.
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), counter.value, checksum


def _worker(
    rank: int, world: int, port: int, args: argparse.Namespace, counter: Any, lock: Any, out: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # Every rank creates every group, in the same order: new_group is collective over the world.
    partitions = {
        g: [dist.new_group(list(range(s, s + g))) for s in range(0, world, g)]
        for g in args.group_sizes
    }
    loaders: dict[tuple[str, int, str], Any] = {}
    for storage in args.storage:
        dataset = SlowDataset(
            args.samples,
            args.floats,
            args.read_ms / 1000,
            counter,
            lock if storage == "serial" else None,
        )
        for g in args.group_sizes:
            index = rank // g

            def group_shard(g: int = g, index: int = index, dataset: Dataset = dataset):
                sampler = DistributedSampler(dataset, num_replicas=world // g, rank=index, seed=0)
                return DataLoader(dataset, batch_size=args.batch, sampler=sampler)

            loaders[storage, g, ARMS[0]] = group_shard()
            loaders[storage, g, ARMS[1]] = BroadcastLoader(group_shard, group=partitions[g][index])

    configs = [(s, g) for s in args.storage for g in args.group_sizes]
    rounds: dict[tuple[str, int, str], list[tuple[float, int, int]]] = {k: [] for k in loaders}
    for pair in range(args.pairs):
        for storage, g in configs:
            # A B, then B A: neither arm always runs right after the other
            for arm in ARMS if pair % 2 == 0 else ARMS[::-1]:
                key = (storage, g, arm)
                rounds[key].append(_epoch(loaders[key], pair, counter))

    # Both arms must have delivered the same data to this rank, epoch by epoch.
    for storage, g in configs:
        direct, shared = (rounds[storage, g, arm] for arm in ARMS)
        if [c for *_, c in direct] != [c for *_, c in shared]:
            raise AssertionError(f"rank {rank}, {storage}, g={g}: the arms' data differ")
    if rank == 0:
        Path(out).write_text(json.dumps(_report(rounds, configs)))
    dist.barrier()  # Gloo may abort a rank whose peer tears down mid-operation
    dist.destroy_process_group()


def _report(rounds: dict, configs: list[tuple[str, int]]) -> list[dict]:
    report = []
    for storage, g in configs:
        direct, shared = (rounds[storage, g, arm] for arm in ARMS)
        report.append(
            {
                "storage": storage,
                "group_size": g,
                "reads_per_epoch": {
                    ARMS[0]: statistics.median(r for _, r, _ in direct),
                    ARMS[1]: statistics.median(r for _, r, _ in shared),
                },
                "seconds_per_epoch": {
                    ARMS[0]: statistics.median(t for t, _, _ in direct),
                    ARMS[1]: statistics.median(t for t, _, _ in shared),
                },
                "reads_ratio": statistics.median(
                    a[1] / b[1] for a, b in zip(direct, shared, strict=True)
                ),
                "time_ratio": statistics.median(
                    a[0] / b[0] for a, b in zip(direct, shared, strict=True)
                ),
                "rounds": {ARMS[0]: direct, ARMS[1]: shared},
            }
        )
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--storage", nargs="+", choices=STORAGES, default=list(STORAGES))
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--floats", type=int, default=4096, help="float32 values per sample")
    parser.add_argument("--read-ms", type=float, default=2.0)
    parser.add_argument("--json", type=Path, default=RESULTS / "io.json")
    args = parser.parse_args(argv)
    for g in args.group_sizes:
        if args.world % g:
            raise ValueError(f"group size {g} does not divide the world of {args.world} ranks")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    counter, lock = ctx.Value("q", 0), ctx.Lock()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(args.json) + ".part"
    mp.spawn(
        _worker, args=(args.world, port, args, counter, lock, tmp), nprocs=args.world, join=True
    )
    report = json.loads(Path(tmp).read_text())
    os.remove(tmp)
    meta = {
        "world": args.world,
        "backend": "gloo",
        "device": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads_per_rank": 1,
        "pairs": args.pairs,
        "samples": args.samples,
        "batch": args.batch,
        "sample_bytes": 4 * args.floats,
        "read_ms": args.read_ms,
        "torch": torch.__version__,
        "expected": "reads per epoch fall by the group size; on the serial storage wall time "
        "falls by about the group size too, on the parallel one it stays about the same",
    }
    result = {"meta": meta, "results": report}
    args.json.write_text(json.dumps(result, indent=2))

    print(
        f"IO per epoch, {meta['world']} ranks, gloo, {meta['cpus']} CPUs, {args.samples} samples "
        f"of {meta['sample_bytes'] // 1024} KiB read in {args.read_ms:g} ms each, batch "
        f"{args.batch}, {args.pairs} pairs (medians; ratios = every rank reads / BroadcastLoader)"
    )
    print(
        "| storage | group size | reads: every rank | reads: BroadcastLoader | reads ratio "
        "| s: every rank | s: BroadcastLoader | time ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in report:
        reads, secs = r["reads_per_epoch"], r["seconds_per_epoch"]
        print(
            f"| {r['storage']} | {r['group_size']} | {reads[ARMS[0]]:.0f} | {reads[ARMS[1]]:.0f} "
            f"| {r['reads_ratio']:.2f} | {secs[ARMS[0]]:.3f} | {secs[ARMS[1]]:.3f} "
            f"| {r['time_ratio']:.2f} |"
        )
    print(f"Expected: {meta['expected']}.")
    print(f"JSON: {args.json}")
    return result


if __name__ == "__main__":
    main()
