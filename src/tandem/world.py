"""Who am I: this process's place in the job, its process group and its device.

``init()`` turns the launcher's environment (read by :mod:`tandem.launch.env`) into the default
process group and a :class:`World` record; ``world()`` answers from that record everywhere else.
A job of one process needs no process group, so the same script runs on one process and on many.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from tandem.launch.env import (
    LOCAL_RANK_VARIABLE,
    Placement,
    override_placement,
    placement_from_env,
)

# torch is imported inside the functions that need it: `import tandem` stays fast, and the
# launcher (which imports this package) never pays for torch.
if TYPE_CHECKING:
    import torch

BACKENDS = ("gloo", "nccl", "mpi")
INIT_SCHEMES = ("env", "tcp", "file")


@dataclass(frozen=True)
class World:
    """This process's place in the job, fixed from ``init()`` to ``shutdown()``.

    Attributes:
        rank: index of this process among all processes, from 0.
        local_rank: index among the processes on this node.
        world_size: number of processes.
        local_world_size: number of processes on this node.
        node_rank: index of this node.
        backend: the process group's backend ("gloo", "nccl", "mpi"), None with no group.
        device: ``cuda:local_rank`` where CUDA is available, else ``cpu``.
        is_main: ``rank == 0``: the process that logs, prints and writes checkpoints.

    Example::

        w = tandem.world()
        model.to(w.device)
        if w.is_main:
            print(f"training on {w.world_size} processes")
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    backend: str | None
    device: torch.device
    is_main: bool

    def __post_init__(self) -> None:
        if self.is_main != (self.rank == 0):
            raise ValueError(f"is_main={self.is_main} contradicts rank={self.rank}")


# What init() built, and whether tandem created the group (and so is the one to destroy it).
_current: World | None = None
_owns_group = False


def init(
    backend: str | None = None,
    init_method: str | None = None,
    *,
    timeout: float | timedelta | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    hang_report_after: float | None = None,
) -> World:
    """Join the job: create the default process group when there is more than one process.

    Rank, world size and rendezvous come from torchrun's, SLURM's or OpenMPI's environment
    (see :func:`tandem.launch.env.placement_from_env`); ``rank`` and ``world_size`` override
    them. A lone process with no ``init_method`` creates no group. A default group that
    already exists is adopted, and left for its creator to destroy. A second call returns the
    current world.

    Args:
        backend: "gloo", "nccl" or "mpi"; by default NCCL where CUDA is available, else Gloo.
        init_method: "env://" (the default: MASTER_ADDR and MASTER_PORT), "tcp://HOST:PORT" or
            "file:///PATH" (a file on storage that every process sees).
        timeout: how long collectives and the rendezvous wait, in seconds or as a timedelta;
            torch's default when None.
        rank: this process's rank, where the environment does not say it.
        world_size: the number of processes, where the environment does not say it.
        hang_report_after: seconds a collective may block before every rank is asked where it
            is and a report names the ranks that never arrived (``tandem.doctor.hang``);
            default 60, or ``TANDEM_HANG_REPORT_AFTER`` (``tandem run --hang-report-after``).

    Returns:
        The :class:`World`, also returned by :func:`world` from now on.

    Raises:
        ValueError: a bad environment variable, backend, init_method, timeout or rank, named
            with its value.
        RuntimeError: the backend is not usable here (MPI missing from this torch build, NCCL
            without CUDA).

    Example::

        import tandem

        w = tandem.init()  # torchrun, srun, mpirun or plain `python train.py`
        model = tandem.DDP(model.to(w.device))
        ...
        tandem.shutdown()
    """
    import torch
    import torch.distributed as dist

    from tandem import doctor
    from tandem.doctor import records

    global _current, _owns_group
    if hang_report_after is not None:
        if not hang_report_after > 0:
            raise ValueError(f"hang_report_after must be > 0 seconds, got {hang_report_after!r}")
        os.environ["TANDEM_HANG_REPORT_AFTER"] = str(float(hang_report_after))
    if _owns_group and _group_exists() and _current is not None:
        return _current
    if _group_exists():
        # The user made the group (mp.spawn, their own init_process_group): use it, keep off it.
        _current, _owns_group = _from_group(placement_from_env(os.environ)), False
        doctor.start()  # from here on every collective is recorded, and hangs reported
        return _current

    # `tandem run --backend` hands its choice down through the environment.
    backend = _checked_backend(backend or os.environ.get("TANDEM_BACKEND") or None)
    _check_init_method(init_method)
    delta = _checked_timeout(timeout)
    placement = override_placement(placement_from_env(os.environ), rank=rank, world_size=world_size)
    device = _device(placement)
    if placement.world_size == 1 and init_method is None and backend != "mpi":
        _current = _record(placement, None, device)
        return _current

    if device.type == "cuda":
        # NCCL binds a communicator to the current device when it is created: without this every
        # rank of a node would start on cuda:0.
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "mpi":
        # The MPI runtime numbers and connects the processes itself: no rendezvous to pass.
        dist.init_process_group("mpi", timeout=delta)
    else:
        init_method = init_method or "env://"
        if init_method.startswith("env://"):
            _export_master(placement)
        if placement.rank != 0:
            _wait_for_rank0(init_method, delta)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=placement.rank,
            world_size=placement.world_size,
            timeout=delta,  # None: the backend's own default
        )
    _current, _owns_group = _from_group(placement), True
    # A new group numbers its collectives from 1 on every rank: the records start over with it.
    records.clear()
    doctor.start()
    return _current


def world() -> World:
    """This process's :class:`World`.

    After ``init()`` it is the record init returned. Before, a lone process gets its one-process
    world (so library code can ask without caring whether init ran), while a process of a
    larger job raises: its rank means nothing until the group exists.

    Raises:
        RuntimeError: the environment describes several processes and ``init()`` has not run.

    Example::

        if tandem.world().is_main:
            torch.save(model.state_dict(), "model.pt")
    """
    global _current, _owns_group
    if _current is not None and (_current.backend is None or _group_exists()):
        return _current
    # Whatever group the record described was destroyed behind our back: forget it.
    _current, _owns_group = None, False
    placement = placement_from_env(os.environ)
    if _group_exists():
        return _from_group(placement)
    if placement.world_size > 1:
        raise RuntimeError(
            f"tandem.world() was called before tandem.init(), and the {placement.source} "
            f"environment says this is rank {placement.rank} of {placement.world_size}; "
            "call tandem.init() first, once, at the start of the script"
        )
    return _record(placement, None, _device(placement))


def shutdown() -> None:
    """Destroy the process group if ``init()`` created it; forget the current world.

    Safe to call twice and with no group; a group the user created is left alone.

    Example::

        tandem.init()
        try:
            train()
        finally:
            tandem.shutdown()
    """
    import torch.distributed as dist

    global _current, _owns_group
    if _owns_group and _group_exists():
        _meet_before_teardown(dist)
        dist.destroy_process_group()
    _current, _owns_group = None, False


def _meet_before_teardown(dist: Any) -> None:
    """Wait for every rank before the group is destroyed (Gloo only).

    A Gloo rank that destroys its group and exits while a peer's last collective is still in
    flight can abort ("terminate called without an active exception"). A monitored barrier,
    bounded in time, lets every rank finish first; if a peer is gone it fails, and teardown
    goes on anyway.
    """
    if dist.get_backend() != "gloo" or dist.get_world_size() == 1:
        return
    with contextlib.suppress(RuntimeError):
        dist.monitored_barrier(timeout=timedelta(seconds=60))


def _group_exists() -> bool:
    from tandem._dist import initialized

    return initialized()


def _from_group(placement: Placement) -> World:
    """The World of the existing default group, local fields from the environment."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    if (rank, size) != (placement.rank, placement.world_size):
        placement = override_placement(placement, rank=rank, world_size=size)
    return _record(placement, str(dist.get_backend()), _device(placement))


def _record(placement: Placement, backend: str | None, device: torch.device) -> World:
    return World(
        rank=placement.rank,
        local_rank=placement.local_rank,
        world_size=placement.world_size,
        local_world_size=placement.local_world_size,
        node_rank=placement.node_rank,
        backend=backend,
        device=device,
        is_main=placement.rank == 0,
    )


def _device(placement: Placement) -> torch.device:
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if placement.local_rank >= count:
        name = LOCAL_RANK_VARIABLE[placement.source]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ValueError(
            f"{name}={placement.local_rank} but this process sees only {count} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={visible}); start at most {count} processes per node"
        )
    return torch.device("cuda", placement.local_rank)


def _checked_backend(backend: str | None) -> str | None:
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


def _check_init_method(init_method: str | None) -> None:
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


def _checked_timeout(timeout: float | timedelta | None) -> timedelta | None:
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


def _export_master(placement: Placement) -> None:
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


def _wait_for_rank0(init_method: str, timeout: timedelta | None) -> None:
    """Return once rank 0's store accepts connections (or at the deadline, and let torch fail).

    torch's store client backs off for most of a second after a refused connection; ranks that
    finish importing torch before rank 0 listens would all pay it. Polling every 10 ms instead
    gets every rank past init as soon as rank 0 is.
    """
    import socket
    import time

    if init_method.startswith("env://"):
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return  # the launcher's store, listening since before this process started
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    elif init_method.startswith("tcp://"):
        parts = urlsplit(init_method)
        host, port = parts.hostname or "", parts.port or 0
    else:
        return
    deadline = time.monotonic() + (timeout.total_seconds() if timeout else 1800.0)
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except socket.gaierror:
            return  # an unknown host: torch's own error says it best
        except OSError:
            time.sleep(0.01)
