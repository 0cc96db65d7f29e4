"""The arguments of :func:`tandem.init`, checked before anything starts; where its store is.

Each check names the bad value and says what to do instead. Split from :mod:`tandem.world` so
that ``init`` reads as what it does.
"""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta
from urllib.parse import urlsplit

from tandem.job.checkin import announce
from tandem.job.placement import Placement

BACKENDS = ("gloo", "nccl", "mpi")
INIT_SCHEMES = ("env", "tcp", "file")


def checked_backend(backend: str | None) -> str | None:
    import torch
    import torch.distributed as dist

    if backend is None:
        return None
    name = backend.lower() if isinstance(backend, str) else backend
    if name not in BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not one of {', '.join(BACKENDS)}; leave it out to get "
            "nccl where CUDA is available and gloo elsewhere"
        )
    if name == "mpi" and not dist.is_mpi_available():
        raise RuntimeError(
            "backend='mpi' was asked for, but this torch build has no MPI support "
            "(torch.distributed.is_mpi_available() is False); use 'gloo' or 'nccl', or a torch "
            "built from source against your MPI"
        )
    if name == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RuntimeError(
            "backend='nccl' needs CUDA and a torch built with NCCL, and this one has "
            f"cuda={torch.cuda.is_available()}, nccl={dist.is_nccl_available()}; use 'gloo'"
        )
    return name


def check_init_method(init_method: str | None) -> None:
    if init_method is None:
        return
    parts = urlsplit(init_method)
    if parts.scheme not in INIT_SCHEMES:
        raise ValueError(
            f"init_method={init_method!r} has the unknown scheme {parts.scheme!r}; use env://, "
            "tcp://HOST:PORT or file:///ABSOLUTE/PATH"
        )
    if parts.scheme == "tcp":
        try:
            port = parts.port  # raises for a non-number or a number past 65535
        except ValueError:
            port = None
        if not parts.hostname or port is None or not 1 <= port <= 65535:
            raise ValueError(
                f"init_method={init_method!r} is not tcp://HOST:PORT with PORT in 1..65535"
            )
    if parts.scheme == "file" and (parts.netloc or not parts.path):
        raise ValueError(
            f"init_method={init_method!r} is not file:///ABSOLUTE/PATH (three slashes, then a "
            "path every process can reach)"
        )


def checked_timeout(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"timeout={timeout!r} is neither seconds nor a timedelta")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"timeout={timeout!r} must be a positive, finite duration")
    return timedelta(seconds=seconds)


def export_master(placement: Placement) -> None:
    """Put the rendezvous address where torch's env:// reads it: in ``os.environ``.

    Under SLURM the address and port were derived, not set; exporting them also lets processes
    this one starts find the same rendezvous.
    """
    for name, value in (
        ("MASTER_ADDR", placement.master_addr),
        ("MASTER_PORT", placement.master_port),
    ):
        if value is None:
            raise ValueError(
                f"{name} is not set and the {placement.source} environment does not imply it; "
                "init_method='env://' needs MASTER_ADDR and MASTER_PORT (rank 0's host and a "
                "free port): export them, or pass init_method='tcp://HOST:PORT'"
            )
        os.environ.setdefault(name, str(value))


def store_address(init_method: str) -> tuple[str, int] | None:
    """Where rank 0's store listens for env:// and tcp:// (None for file://)."""
    if init_method.startswith("env://"):
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if init_method.startswith("tcp://"):
        parts = urlsplit(init_method)
        return parts.hostname or "", parts.port or 0
    return None


def announce_bad_environment(rank: int | None, world_size: int | None) -> None:
    """A process whose own RANK or WORLD_SIZE is invalid still tells the others (best effort),
    so that they name it instead of waiting for a rank that never comes."""
    env = os.environ
    try:
        entry = {
            "rank": int(rank if rank is not None else env["RANK"]),
            "world_size": int(world_size if world_size is not None else env["WORLD_SIZE"]),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return
    if entry["rank"] != 0:  # rank 0 would host the store; with a bad environment it must not
        announce(host, port, entry)
