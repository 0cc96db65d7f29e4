"""Where a `tandem run` started by srun stands: node count, node rank, rendezvous host and port.

Under ``srun --ntasks-per-node=1 tandem run ...`` (the script ``tandem slurm`` prints) every
node's launcher reads SLURM's variables instead of --nnodes/--node-rank/--master-addr. Nothing
here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from tandem.job.placement import slurm_first_host, slurm_master_port

_DIGITS = re.compile(r"[0-9]+")


def node_placement_from_slurm(environ: Mapping[str, str]) -> tuple[int, int, str, int] | None:
    """``(nnodes, node_rank, master_addr, master_port)`` of a ``tandem run`` started by srun.

    Under ``srun --ntasks-per-node=1 tandem run ...`` each node's task reads where it stands from
    SLURM's variables: the node count from SLURM_STEP_NUM_NODES, SLURM_NNODES or
    SLURM_JOB_NUM_NODES, its rank from SLURM_NODEID, the rendezvous host as the first of
    SLURM_STEP_NODELIST, SLURM_NODELIST or SLURM_JOB_NODELIST (the step's own variables first:
    a step may run on part of the job's nodes) and the port as :func:`slurm_master_port` of
    SLURM_JOB_ID. MASTER_ADDR and MASTER_PORT override the derived host and port, as they do
    in :func:`tandem.job.placement.placement_from_env`.

    The batch script itself (no SLURM_STEP_ID) of a one-node job also gets its placement, so
    ``tandem run`` may run there without srun.

    Args:
        environ: the environment, usually ``os.environ``.

    Returns:
        The placement, or None outside a SLURM job (no SLURM_JOB_ID, SLURM_NODEID, or node
        count; salloc's shell, for one, has no SLURM_NODEID).

    Raises:
        ValueError: a variable is not a valid count, rank, hostlist or port; the batch script of
            a job of several nodes (without srun the other nodes never start); or a step with
            more tasks than nodes (several ``tandem run`` per node, each starting every
            worker). The message names the variables and their values.

    Example::

        >>> node_placement_from_slurm({"SLURM_JOB_ID": "123456", "SLURM_NODEID": "1",
        ...     "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
        ...     "SLURM_JOB_NODELIST": "gpu[07-08]"})
        (2, 1, 'gpu07', 18456)
    """
    job_name = _first_set(environ, ("SLURM_JOB_ID", "SLURM_JOBID"))
    nodes_name = _first_set(
        environ, ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    )
    if job_name is None or nodes_name is None or "SLURM_NODEID" not in environ:
        return None
    job_id = _count(environ, job_name, minimum=0)
    nnodes = _count(environ, nodes_name, minimum=1)
    node_rank = _count(environ, "SLURM_NODEID", minimum=0)
    if node_rank >= nnodes:
        raise ValueError(
            f"SLURM_NODEID={node_rank} is not < {nodes_name}={nnodes}: node ranks run from 0 "
            f"to {nnodes - 1}"
        )
    in_step = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    if not in_step and nnodes > 1:
        raise ValueError(
            f"this is the batch script of job {job_id} ({nodes_name}={nnodes}, no SLURM_STEP_ID): "
            "tandem run started here runs on the first node only, and the job would wait for "
            "the others until its timeout; start it with `srun --ntasks-per-node=1 tandem run ...`"
        )
    tasks_name = _first_set(environ, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
    if tasks_name is not None and in_step:
        tasks = _count(environ, tasks_name, minimum=1)
        if tasks > nnodes:
            raise ValueError(
                f"{tasks_name}={tasks} tasks on {nodes_name}={nnodes} node(s): tandem run wants "
                "one task per node (srun --ntasks-per-node=1), and starts the workers itself; "
                "with one task per GPU, run the script without tandem run (tandem.init() reads "
                "srun's ranks)"
            )

    master_addr = environ.get("MASTER_ADDR")
    if master_addr is not None and not master_addr.strip():
        raise ValueError(f"MASTER_ADDR={master_addr!r} is empty; name rank 0's host, or unset it")
    if master_addr is None:
        master_addr = _first_host(environ)
    if "MASTER_PORT" in environ:
        master_port = _count(environ, "MASTER_PORT", minimum=1)
        if master_port > 65535:
            raise ValueError(f"MASTER_PORT={master_port} is outside 1..65535")
    else:
        master_port = slurm_master_port(job_id)
    return nnodes, node_rank, master_addr, master_port


def _first_set(environ: Mapping[str, str], names: Sequence[str]) -> str | None:
    return next((name for name in names if name in environ), None)


def _count(environ: Mapping[str, str], name: str, *, minimum: int) -> int:
    raw = environ[name]
    if not _DIGITS.fullmatch(raw.strip()) or int(raw) < minimum:
        raise ValueError(f"{name}={raw!r} is not an integer >= {minimum}")
    return int(raw)


def _first_host(environ: Mapping[str, str]) -> str:
    # The step's own list first: `srun -N2 -w ...` inside a larger job starts on its nodes.
    names = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    host = slurm_first_host(environ, names)
    if host is None:
        raise ValueError(
            f"none of {', '.join(names)} is set, so the rendezvous host is unknown; srun sets "
            "them, or export MASTER_ADDR"
        )
    return host
