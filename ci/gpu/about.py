"""What the GPU machine is: the card, the driver's CUDA, torch, NCCL; and what Gloo does with
CUDA tensors.

Printed at the top of ``ci/gpu/run``'s log (and written as JSON with ``--json``) so that every
GPU result names the machine it came from. The probe starts two processes on the first GPU,
joined by Gloo (NCCL refuses two ranks on one device), and tries each collective the engines
use on CUDA tensors: what Gloo refuses there is what the two-rank ``cuda`` tests cannot run
without NCCL. Without a GPU (``ci/gpu/run --dry``) it prints the versions and probes on the CPU.

Run::

    python ci/gpu/about.py --json gpu-results/about.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore", category=FutureWarning)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _try(name: str, fn, out: dict[str, str]) -> None:
    try:
        fn()
        out[name] = "ok"
    except Exception as exc:  # the probe reports, it does not judge
        out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def _probe(rank: int, port: int, device: str, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dev = torch.device(device)
    out: dict[str, str] = {}
    x = torch.arange(4.0, device=dev) + rank
    big = torch.zeros(8, device=dev)
    _try("all_reduce", lambda: dist.all_reduce(x.clone()), out)
    _try("broadcast", lambda: dist.broadcast(x.clone(), 0), out)
    _try("all_gather", lambda: dist.all_gather([x.clone(), x.clone()], x), out)
    _try("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(big, x), out)
    _try("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(x[:2].clone(), x), out)
    _try("reduce_scatter", lambda: dist.reduce_scatter(x[:2].clone(), [x[:2], x[2:]]), out)
    _try("all_reduce_async", lambda: dist.all_reduce(x.clone(), async_op=True).wait(), out)
    queue.put((rank, out))
    dist.destroy_process_group()


def gloo_on(device: str) -> dict[str, str]:
    """Each collective's outcome on two Gloo ranks with tensors on ``device`` (rank 0's view)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_probe, args=(r, port, device, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return results[0]


def about() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "nccl_available": dist.is_nccl_available(),
        "cpus": os.cpu_count(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["capability"] = f"{props.major}.{props.minor}"
    info["gloo_collectives"] = gloo_on("cuda:0" if cuda else "cpu")
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the answers here")
    args = parser.parse_args()
    info = about()
    for key, value in info.items():
        if key == "gloo_collectives":
            where = "CUDA" if info["cuda_available"] else "CPU"
            print(f"gloo on {where} tensors:")
            for op, outcome in value.items():
                print(f"  {op:24} {outcome}")
        else:
            print(f"{key:16} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)


if __name__ == "__main__":
    main()
