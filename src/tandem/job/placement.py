"""Where this process sits in the job, read from the launcher's environment by a pure function.

torchrun, SLURM's srun and OpenMPI's mpirun each describe a process with their own variables.
:func:`placement_from_env` turns any of them into one :class:`Placement` and rejects bad values
here, with the variable's name and value, because past this point they would surface as a
rendezvous that hangs until its timeout. It reads a mapping rather than ``os.environ`` so tests
can pass dicts, and it imports no torch so the launcher can use it and still start fast.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tandem.job.hostlist import expand_hostlist

Source = Literal["torchrun", "slurm", "openmpi", "none"]

# The derived SLURM port lies in [15000, 25000): unprivileged, clear of torchrun's default 29500,
# and below Linux's ephemeral range (32768-60999), where the kernel picks the local ports of
# outgoing connections and so may be holding the one we want.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 10000

# Which variable holds the local rank under each launcher, for errors raised outside this file.
LOCAL_RANK_VARIABLE: dict[str, str] = {
    "torchrun": "LOCAL_RANK",
    "slurm": "SLURM_LOCALID",
    "openmpi": "OMPI_COMM_WORLD_LOCAL_RANK",
    "none": "local_rank",
}

_INTEGER = re.compile(r"-?[0-9]+")
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


@dataclass(frozen=True)
class Placement:
    """One process's place in the job, as its launcher described it.

    Attributes:
        rank: index of this process among all processes, from 0.
        local_rank: index among the processes on this node; picks the GPU.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, from 0.
        master_addr: host of rank 0's rendezvous, or None where the environment names none.
        master_port: port of that rendezvous, or None.
        source: which launcher's variables were read: "torchrun", "slurm", "openmpi" or "none".

    Example::

        >>> placement_from_env({"RANK": "1", "WORLD_SIZE": "2"}).rank
        1
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    source: Source


@dataclass(frozen=True)
class _Var:
    """An integer with the name the user knows it by, so an error can say ``RANK=4``."""

    name: str
    value: int

    def __str__(self) -> str:
        return f"{self.name}={self.value}"


def placement_from_env(environ: Mapping[str, str]) -> Placement:
    """Read this process's rank, world size and rendezvous address from ``environ``.

    The first launcher whose variables are present is used: torchrun (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK or NODE_RANK), then SLURM's srun (SLURM_STEP_ID and
    SLURM_PROCID,
    SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE),
    then OpenMPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE). torchrun comes first
    because a torchrun started inside a SLURM or MPI job is the one that knows its workers.
    With none of them, the process is alone: rank 0 of 1.

    MASTER_ADDR and MASTER_PORT are used when set. Otherwise SLURM's rank 0 is on the first host
    of SLURM_JOB_NODELIST (or SLURM_NODELIST) and its port is :func:`slurm_master_port` of
    SLURM_JOB_ID, the same on every task of the job.

    Args:
        environ: the environment, usually ``os.environ``.

    Raises:
        ValueError: a variable is missing, not an integer, negative or inconsistent with another
            (RANK >= WORLD_SIZE, LOCAL_RANK >= LOCAL_WORLD_SIZE, ...), a port is outside
            1..65535 or a hostlist is malformed; the message names the variables and values.

    Example::

        >>> p = placement_from_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0",
        ...     "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
        ...     "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"})
        >>> (p.rank, p.local_rank, p.node_rank, p.master_addr, p.master_port, p.source)
        (5, 1, 1, 'gpu07', 18456, 'slurm')
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    # Only a task srun started (a job step, SLURM_STEP_ID set) is one of SLURM_NTASKS: the
    # batch script itself carries SLURM_PROCID=0 and the job's SLURM_NTASKS too, and a plain
    # `python train.py` there is one process, not rank 0 of a job waiting for peers forever.
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and "SLURM_STEP_ID" in environ:
        return _from_slurm(environ)
    if "OMPI_COMM_WORLD_RANK" in environ:
        return _from_openmpi(environ)
    one, zero = _Var("world_size", 1), _Var("rank", 0)
    return _checked("none", zero, zero, one, one, zero, *_master(environ))


def override_placement(
    placement: Placement, *, rank: int | None = None, world_size: int | None = None
) -> Placement:
    """Replace the rank and/or world size, as ``tandem.init(rank=..., world_size=...)`` does.

    When the environment named no launcher, the processes are taken to share one node (how
    ``mp.spawn`` or a shell loop starts them), so the local rank is the rank; both values must
    then be given.

    Raises:
        ValueError: a value is not an integer, is out of range, or is missing with nothing in
            the environment to take it from.

    Example::

        >>> override_placement(placement_from_env({}), rank=1, world_size=2).local_rank
        1
    """
    if rank is None and world_size is None:
        return placement
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name}={value!r} is not an integer")
    if placement.source == "none":
        if rank is None or world_size is None:
            missing = "rank" if rank is None else "world_size"
            raise ValueError(
                f"{missing} was not given and no launcher variables say it: pass both rank= "
                "and world_size=, or start the processes with torchrun, srun or mpirun"
            )
        r, n = _Var("rank", rank), _Var("world_size", world_size)
        return _checked("none", r, r, n, n, _Var("node_rank", 0), *_master_of(placement))
    return _checked(
        placement.source,
        _Var("rank", placement.rank if rank is None else rank),
        _Var("local_rank", placement.local_rank),
        _Var("world_size", placement.world_size if world_size is None else world_size),
        _Var("local_world_size", placement.local_world_size),
        _Var("node_rank", placement.node_rank),
        *_master_of(placement),
    )


def slurm_master_port(job_id: int) -> int:
    """The rendezvous port of a SLURM job: ``15000 + job_id % 10000``.

    Every task of a job computes the same port without talking to the others, and jobs with
    nearby ids (the usual neighbours on a shared node) get different ports.

    Example::

        >>> slurm_master_port(123456)
        18456
    """
    if job_id < 0:
        raise ValueError(f"SLURM job id {job_id} is negative")
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def _from_torchrun(environ: Mapping[str, str]) -> Placement:
    hint = "torchrun sets RANK and WORLD_SIZE together"
    rank, world_size = _var(environ, "RANK", hint), _var(environ, "WORLD_SIZE", hint)
    # A hand-written launch may set only RANK and WORLD_SIZE: then all ranks share one node.
    local_rank = _var(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else rank
    local_world_size = (
        _var(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world_size
    )
    node_name = next((n for n in ("GROUP_RANK", "NODE_RANK") if n in environ), None)
    node_rank = _var(environ, node_name) if node_name else None
    return _checked(
        "torchrun", rank, local_rank, world_size, local_world_size, node_rank, *_master(environ)
    )


def _from_slurm(environ: Mapping[str, str]) -> Placement:
    hint = "srun sets it for every task"
    rank, world_size = _var(environ, "SLURM_PROCID", hint), _var(environ, "SLURM_NTASKS", hint)
    local_rank, node_rank = (
        _var(environ, "SLURM_LOCALID", hint),
        _var(environ, "SLURM_NODEID", hint),
    )
    addr, port = _master(environ)
    if addr is None:
        addr = slurm_first_host(environ)
    job_name = next((n for n in ("SLURM_JOB_ID", "SLURM_JOBID") if n in environ), None)
    if port is None and job_name is not None:
        port = slurm_master_port(_var(environ, job_name).value)
    local_world_size = _slurm_local_world_size(environ, node_rank)
    return _checked("slurm", rank, local_rank, world_size, local_world_size, node_rank, addr, port)


def _from_openmpi(environ: Mapping[str, str]) -> Placement:
    hint = "mpirun sets every OMPI_COMM_WORLD_* variable"
    rank, world_size, local_rank, local_world_size = (
        _var(environ, f"OMPI_COMM_WORLD_{suffix}", hint)
        for suffix in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")
    )
    # OpenMPI exports no node index; None derives it from mpirun's default by-slot mapping,
    # which fills each node with consecutive ranks.
    return _checked(
        "openmpi", rank, local_rank, world_size, local_world_size, None, *_master(environ)
    )


def _checked(
    source: Source,
    rank: _Var,
    local_rank: _Var,
    world_size: _Var,
    local_world_size: _Var,
    node_rank: _Var | None,
    master_addr: str | None,
    master_port: int | None,
) -> Placement:
    """The one place the rank arithmetic is checked; ``node_rank=None`` derives it."""
    for var in (rank, local_rank, node_rank):
        if var is not None and var.value < 0:
            raise ValueError(f"{var} is negative; ranks count from 0")
    for var in (world_size, local_world_size):
        if var.value < 1:
            raise ValueError(f"{var} is not a process count: it must be at least 1")
    if rank.value >= world_size.value:
        raise ValueError(
            f"{rank} is not < {world_size}; ranks run from 0 to {world_size.name}-1, so the "
            "launcher was given inconsistent process counts"
        )
    if local_world_size.value > world_size.value:
        raise ValueError(
            f"{local_world_size} exceeds {world_size}; a node cannot hold more processes than the "
            "whole job"
        )
    if local_rank.value >= local_world_size.value:
        raise ValueError(
            f"{local_rank} is not < {local_world_size}; local ranks run from 0 to "
            f"{local_world_size.name}-1, so the per-node process count is wrong"
        )
    if node_rank is None:
        # Launchers lay ranks out node by node, local_world_size consecutive ranks per node.
        node_rank = _Var("node_rank", rank.value // local_world_size.value)
    return Placement(
        rank=rank.value,
        local_rank=local_rank.value,
        world_size=world_size.value,
        local_world_size=local_world_size.value,
        node_rank=node_rank.value,
        master_addr=master_addr,
        master_port=master_port,
        source=source,
    )


def _var(environ: Mapping[str, str], name: str, hint: str = "") -> _Var:
    raw = environ.get(name)
    if raw is None:
        because = f" ({hint})" if hint else ""
        raise ValueError(f"{name} is not set{because}; set it, or unset the launcher's others")
    return _Var(name, _integer(name, raw))


def _integer(name: str, raw: str) -> int:
    if not _INTEGER.fullmatch(raw.strip()):
        raise ValueError(f"{_show(name, raw)} is not an integer; it must be a whole number")
    return int(raw)


def _show(name: str, raw: str) -> str:
    """``NAME=value``, quoting the value only where quotes are needed to see it."""
    return f"{name}={raw}" if raw and raw == raw.strip() else f"{name}={raw!r}"


def _master(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    """MASTER_ADDR and MASTER_PORT where set: they override whatever a launcher implies."""
    addr, raw_port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if addr is not None and not addr.strip():
        raise ValueError(f"{_show('MASTER_ADDR', addr)} is empty; name rank 0's host, or unset it")
    if raw_port is None:
        return addr, None
    port = _integer("MASTER_PORT", raw_port)
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT={raw_port} is outside 1..65535; choose a free TCP port")
    return addr, port


def _master_of(placement: Placement) -> tuple[str | None, int | None]:
    return placement.master_addr, placement.master_port


def slurm_first_host(
    environ: Mapping[str, str], names: tuple[str, ...] = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
) -> str | None:
    """The first host of the first of ``names`` that is set (a SLURM hostlist), or None.

    Example::

        >>> slurm_first_host({"SLURM_JOB_NODELIST": "gpu[07-08],cpu3"})
        'gpu07'
    """
    for name in names:
        if name in environ:
            raw = environ[name]
            try:
                hosts = expand_hostlist(raw)
            except ValueError as exc:
                raise ValueError(f"{_show(name, raw)} is not a valid hostlist: {exc}") from None
            if not hosts:
                raise ValueError(f"{_show(name, raw)} names no host")
            return hosts[0]
    return None


def _slurm_local_world_size(environ: Mapping[str, str], node_rank: _Var) -> _Var:
    """Tasks on this node: SLURM_NTASKS_PER_NODE, else this node's entry of SLURM_TASKS_PER_NODE."""
    if "SLURM_NTASKS_PER_NODE" in environ:
        return _var(environ, "SLURM_NTASKS_PER_NODE")
    raw = environ.get("SLURM_TASKS_PER_NODE")
    if raw is None:
        raise ValueError(
            "neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set, so the tasks per "
            "node are unknown; srun sets SLURM_TASKS_PER_NODE for every task"
        )
    # Walk the run-lengths rather than expanding them: "4(x100000)" is a valid value.
    first = 0
    for count, repeat in _tasks_per_node(raw):
        if first <= node_rank.value < first + repeat:
            return _Var(f"SLURM_TASKS_PER_NODE[{node_rank.value}]", count)
        first += repeat
    raise ValueError(
        f"{node_rank} is not a node of SLURM_TASKS_PER_NODE={raw}, which lists {first} node(s)"
    )


def _tasks_per_node(raw: str) -> list[tuple[int, int]]:
    """``2(x3),1`` -> ``[(2, 3), (1, 1)]``: SLURM's run-length form of a count per node."""
    runs = []
    for item in raw.split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None:
            raise ValueError(
                f"{_show('SLURM_TASKS_PER_NODE', raw)} is malformed at {item!r}; expected "
                "counts like 4 or 4(x2), separated by commas"
            )
        runs.append((int(match[1]), int(match[2] or 1)))
    return runs
