"""Who am I: this process's place in the job, its process group and its device.

``init()`` turns the launcher's environment (read by :mod:`tandem.job.placement`) into the default
process group and a :class:`World` record; ``world()`` answers from that record everywhere else.
A job of one process needs no process group, so the same script runs on one process and on many.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from tandem.init_args import (
    announce_bad_environment,
    check_init_method,
    checked_backend,
    checked_timeout,
    export_master,
    store_address,
)
from tandem.job import checkin, join
from tandem.job.checkin import meet, rendezvous_timeout_s
from tandem.job.placement import (
    LOCAL_RANK_VARIABLE,
    Placement,
    override_placement,
    placement_from_env,
)

# torch is imported inside the functions that need it: `import tandem` stays fast, and the
# launcher (which imports this package) never pays for torch.
if TYPE_CHECKING:
    import torch


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
    rendezvous_timeout: float | None = None,
) -> World:
    """Join the job: create the default process group when there is more than one process.

    Rank, world size and rendezvous come from torchrun's, SLURM's or OpenMPI's environment
    (see :func:`tandem.job.placement.placement_from_env`); ``rank`` and ``world_size`` override
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
            A collective ``timeout`` shorter than twice that brings the report forward to half
            the timeout, so that the laggard is named before the timeout ends the job.
        rendezvous_timeout: seconds the processes wait for each other at the start (default
            60, or ``TANDEM_RENDEZVOUS_TIMEOUT``): a rank that never arrives, a RANK given
            twice, a WORLD_SIZE that differs or a busy port fails every rank by then
            (:mod:`tandem.job.checkin`).

    Returns:
        The :class:`World`, also returned by :func:`world` from now on.

    Raises:
        ValueError: a bad environment variable, backend, init_method, timeout or rank, named
            with its value.
        RuntimeError: the backend is not usable here (MPI missing from this torch build, NCCL
            without CUDA).
        RendezvousError: the processes could not meet (the message says why and who).

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
    backend = checked_backend(backend or os.environ.get("TANDEM_BACKEND") or None)
    check_init_method(init_method)
    delta = checked_timeout(timeout)
    meeting_s = rendezvous_timeout_s(rendezvous_timeout)
    try:
        placement = override_placement(
            placement_from_env(os.environ), rank=rank, world_size=world_size
        )
    except ValueError:
        announce_bad_environment(rank, world_size)
        raise
    device = _device(placement)
    me = join.joining()
    if me is not None:  # a replacement: the members admit it into the group they re-form
        _current = _join(me, placement, device, backend, delta, meeting_s)
        _owns_group = True
        records.clear()
        records.replacement_admitted(me)  # as the launcher names it (its launch rank)
        doctor.start()
        return _current
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
            export_master(placement)
        where = store_address(init_method)
        store = None
        if where is not None:  # every process checks in first (file:// is torch's own)
            store = _meet(
                *where,
                placement.rank,
                placement.world_size,
                timeout=meeting_s,
                agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                # The launcher's rendezvous round where it gives one: every node agrees on it.
                restart=int(
                    os.environ.get("TANDEM_RDZV_ROUND")
                    or os.environ.get("TORCHELASTIC_RESTART_COUNT")
                    or 0
                ),
                store_timeout=delta,
                numbered_by_hand=_numbered_by_hand(placement),
            )
        dist.init_process_group(
            backend,
            init_method=None if store is not None else init_method,
            store=store,
            rank=placement.rank,
            world_size=placement.world_size,
            timeout=delta,  # None: the backend's own default
        )
    _current, _owns_group = _from_group(placement), True
    # A new group numbers its collectives from 1 on every rank: the records start over with it.
    records.clear()
    doctor.start()
    return _current


def _join(
    me: int,
    placement: Placement,
    device: Any,
    backend: str | None,
    timeout: timedelta | None,
    wait_s: float,
) -> World:
    """A replacement worker (``tandem run --recover in-memory --max-restarts``): wait in the
    job's store until the members admit launch rank ``me`` at a step boundary, then form the
    group with them (:mod:`tandem.job.join`). ``wait_s``: how long to wait at most, at least
    ten minutes (the members admit it at their next step)."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=max(wait_s, 600.0)),
        use_libuv=True,
    )
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.constants import default_pg_timeout
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if device.type == "cuda":
        torch.cuda.set_device(device)

    def form(admission: dict[str, Any], seconds: float) -> bool:
        """The admitting generation's group, formed within ``seconds`` (as the members form
        theirs: a member lost meanwhile fails it, and a re-form follows); its collectives
        then wait ``timeout``."""
        try:
            dist.init_process_group(
                backend or ("nccl" if device.type == "cuda" else "gloo"),
                store=dist.PrefixStore(admission["prefix"], store),
                rank=admission["rank"],
                world_size=admission["world_size"],
                timeout=timedelta(seconds=seconds),
            )
        except dist.DistError:
            # Torch counted the group it failed to make, and a group's keys carry that count:
            # the members start theirs from 0 again (tandem.recovery takes their groups down so).
            c10d._world.group_count = 0
            return False
        _set_pg_timeout(timeout or default_pg_timeout)
        return True

    admitted = join.ask_to_join(store, me, timeout_s=max(wait_s, 600.0), form=form)
    # The world it joins may hold fewer processes than this node started (members of this node
    # lost): only the rank and the world size change, as for the members (:func:`reformed`).
    placement = dataclasses.replace(
        placement, rank=admitted["rank"], world_size=admitted["world_size"]
    )
    return _from_group(placement)


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

    Raises:
        RendezvousError: a process with a RANK of this job checked in after the job formed (a
            RANK given twice), on every rank (:func:`tandem.job.checkin.check_out`); the
            group is destroyed all the same.

    Example::

        tandem.init()
        try:
            train()
        finally:
            tandem.shutdown()
    """
    import torch.distributed as dist

    global _current, _owns_group
    try:
        if _owns_group and _group_exists():
            _meet_before_teardown(dist)
            try:
                # A RANK given twice fails every rank, however short the job (tandem.job.checkin).
                checkin.check_out(dist.get_rank(), dist.get_world_size())
            finally:
                dist.destroy_process_group()
    finally:
        _current, _owns_group = None, False
        checkin.joined = None  # its store goes with the group


def reformed(rank: int, world_size: int) -> World:
    """Record that the group was re-formed without some ranks: this process is now ``rank`` of
    ``world_size`` (:mod:`tandem.recovery` calls it after the survivors' new group exists).

    Example::

        reformed(1, 3)          # tandem.world().rank == 1, .world_size == 3 from here on
    """
    global _current
    current = world()
    _current = dataclasses.replace(current, rank=rank, world_size=world_size, is_main=rank == 0)
    return _current


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


def _numbered_by_hand(placement: Placement) -> bool:
    """Whether the processes got their RANK by hand, not from a launcher that numbers them once
    each (torchrun and ``tandem run`` set TORCHELASTIC_RUN_ID, ``tandem.spawn`` TANDEM_SPAWN;
    srun and mpirun number their tasks)."""
    if placement.source in ("slurm", "openmpi"):
        return False
    return not (os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("TANDEM_SPAWN"))


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


# The rendezvous of init(), a seam for tests that have no peers to meet.
_meet = meet
