"""``tandem run``: torchrun's flags in, a :class:`~tandem.launch.supervisor.Supervisor` out.

This module reads and checks the command line; starting, watching and stopping the workers is
:mod:`tandem.launch.supervisor`'s, the rendezvous :mod:`tandem.launch.rendezvous`'s.

Example::

    tandem run --nproc-per-node 2 train.py --lr 0.1
    tandem run --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 train.py
    tandem run --nproc-per-node auto -m tandem.examples.wine
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from tandem.doctor import trace
from tandem.launch.command import worker_command
from tandem.launch.hostfile import read_hostfile
from tandem.launch.in_memory import MODES, InMemoryCoordinator, check_one_node
from tandem.launch.logfiles import LogPlan, parse_filters
from tandem.launch.membership import (
    ElasticCoordinator,
    ElasticInMemoryCoordinator,
    ElasticSettings,
    JobEnded,
)
from tandem.launch.rendezvous import (
    Coordinator,
    LaunchError,
    LocalCoordinator,
    StoreCoordinator,
)
from tandem.launch.supervisor import LaunchSpec, Supervisor
from tandem.launch.torchrun_flags import (
    C10D_DEFAULT_PORT,
    RDZV_BACKENDS,
    DefaultsHelpFormatter,
    add_torchrun_flags,
    flag,
    parse_endpoint,
    parse_nnodes,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
)

DEFAULT_MULTINODE_PORT = 29500


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``run`` subcommand to ``tandem``'s subparsers; it runs :func:`run_command`."""
    p = subparsers.add_parser(
        "run",
        help="start one worker per device (torchrun's flags)",
        description="Start NPROC_PER_NODE workers of a script or module with torchrun's "
        "environment, supervise them, and stop them all at the first failure (with --recover "
        "in-memory, the others go on). Every torchrun flag is accepted (dashes or underscores; "
        "PET_<NAME> variables as defaults).",
        formatter_class=DefaultsHelpFormatter,
    )
    add_torchrun_flags(p)
    own = p.add_argument_group("tandem's own", "what torchrun does not have")
    flag(
        own,
        "--backend",
        default=None,
        choices=["gloo", "nccl", "mpi"],
        help="for tandem.init() (default: nccl with GPUs, else gloo)",
    )
    flag(
        own,
        "--hang-report-after",
        default=None,
        type=float,
        help="seconds a collective may block before a hang report (default: 60, or half the "
        "collective timeout if shorter); the JSON goes to the --log-dir run directory, else the "
        "working directory",
    )
    flag(
        own,
        "--trace",
        default=None,
        type=Path,
        help="write every rank's timeline here, merged into DIR/trace.json (Chrome trace: "
        "ui.perfetto.dev, chrome://tracing)",
    )
    flag(own, "--ranks", default=None, help="show only these global ranks' output, e.g. 0 or 0,3")
    flag(own, "--no-prefix", switch=True, help="do not prefix lines with [rank N]")
    flag(
        own,
        "--rdzv-timeout",
        default=300.0,
        type=float,
        help="static rendezvous: seconds to wait for all nodes (--rdzv-conf join_timeout= "
        "overrides; c10d waits join_timeout, torchrun's 600)",
    )
    flag(
        own,
        "--grace-period",
        default=3.0,
        type=float,
        help="after a worker failed: seconds the others get between SIGTERM and SIGKILL",
    )
    flag(
        own,
        "--term-timeout",
        default=30.0,
        type=float,
        help="after SIGTERM/SIGINT to tandem run: seconds the workers get to finish (a "
        "Trainer saves a checkpoint) before SIGKILL",
    )
    flag(
        own,
        "--recover",
        default=MODES[0],
        choices=list(MODES),
        help="what a failed worker (non-zero exit, or a signal) costs. restart: every worker is "
        "stopped (and restarted from the last checkpoint, up to --max-restarts). in-memory: "
        "one node, a fixed --nnodes N (static: --master-addr, --master-port, --node-rank), or "
        "--nnodes MIN:MAX with --rdzv-backend c10d --rdzv-endpoint HOST:PORT (HOST is node "
        "0); the launcher (node 0's) hosts the job's store, each launcher announces its lost "
        "ranks there and the others go on without them (a script using tandem's in-memory "
        "recovery re-forms and redoes the step; a side of a partition without a majority "
        "stops); a node's launcher succeeds if one of its workers runs to completion. With "
        "MIN:MAX a node arriving while the job runs (one that was down, started again) joins "
        "it at a step boundary if fewer than MAX nodes run (else it waits), without spending "
        "--max-restarts; fewer than MIN nodes left stops every worker and, with a restart "
        "left, restarts them from the last checkpoint once MIN nodes are there again (waiting "
        "up to join_timeout; else the job ends), and a fall-back restarts every node still "
        "there, at that size (waiting likewise below MIN). A lost worker is "
        "replaced while --max-restarts allows (by "
        "its own node's launcher, counted per node as torchrun counts restarts; the others "
        "admit the replacement at their next step); a loss the others cannot go on from in "
        "memory (a sharded Trainer, a script without tandem's recovery) falls back to restart, "
        "up to --max-restarts (with many nodes: every node's workers restart together) "
        "(default: restart; see docs/guides/recovery.md)",
    )
    flag(
        own,
        "--heartbeat-timeout",
        default=10.0,
        type=float,
        help="with --recover in-memory: seconds a worker may be silent (hung, stopped, cut off) "
        "before the others count it as lost and go on without it",
    )
    flag(
        own,
        "--hostfile",
        default=None,
        type=Path,
        help="start one tandem run per host of this file (`hostname slots=N` lines) over ssh "
        "(TANDEM_SSH: the ssh command; see docs/guides/multi-node.md)",
    )
    p.add_argument("script", help="the training script (or module, with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(func=run_command, run_actions=p._actions)  # --hostfile passes them on


def _positive_int(name: str, value: str | int, minimum: int = 1) -> int:
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(f"--{name} {value!r} is not an integer") from None
    if number < minimum:
        raise LaunchError(f"--{name} {number} must be >= {minimum}")
    return number


def gpu_count() -> int:
    """GPUs this process may use, without importing torch (CUDA_VISIBLE_DEVICES, /proc)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def _nproc(value: str) -> int:
    if value == "auto":
        return max(gpu_count(), 1)
    if value == "gpu":
        if gpu_count() == 0:
            raise LaunchError("--nproc-per-node gpu, but no GPU is visible; use a number or cpu")
        return gpu_count()
    if value == "cpu":
        return os.cpu_count() or 1
    return _positive_int("nproc-per-node", value)


def _ranks(text: str | None, name: str) -> set[int] | None:
    if not text:  # torchrun's default is "": no filter
        return None
    try:
        return {int(r) for r in text.replace(" ", "").split(",") if r}
    except ValueError:
        raise LaunchError(f"--{name} {text!r} is not a comma-separated list of ranks") from None


@dataclass(frozen=True)
class Meeting:
    """Where this node's launcher meets the others: the rendezvous part of the command line."""

    backend: str  # "local" (one node), "static" or "c10d"
    addr: str
    port: int | None
    node_rank: int | None  # None: c10d numbers the nodes anew in every round
    timeout: float
    is_host: bool | None = None
    elastic: ElasticSettings | None = None  # c10d: node counts MIN:MAX, rounds per attempt


def _placement(args: argparse.Namespace) -> tuple[int, Meeting]:
    """The node count and the meeting, from torchrun's rendezvous flags (or SLURM's)."""
    backend = args.rdzv_backend
    if backend not in RDZV_BACKENDS:
        raise LaunchError(
            f"--rdzv-backend {backend!r} is not supported: tandem run has static (the default: "
            "--node-rank, --master-addr, --master-port) and c10d (--rdzv-endpoint HOST:PORT); "
            "etcd and etcd-v2 need torchrun"
        )
    conf = parse_rdzv_conf(args.rdzv_conf)
    timeout = _seconds(conf.get("join_timeout", args.rdzv_timeout), "join_timeout")
    is_host = _flag_value(conf["is_host"]) if "is_host" in conf else None
    node_rank, addr, port = args.node_rank, args.master_addr, args.master_port
    most = None
    if args.nnodes is not None:
        nnodes, most = parse_nnodes(args.nnodes)
        # In-memory refuses a static MIN:MAX (build_spec): no warning before the error.
        static = backend != "c10d" or args.standalone
        if most > nnodes and static and args.recover != "in-memory":
            _say(
                f"--nnodes {args.nnodes}: the job starts with {nnodes} node(s), the first to "
                "arrive; elastic membership (up to MAX) needs --rdzv-backend c10d "
                "--rdzv-endpoint HOST:PORT"
            )
    elif node_rank is None and "SLURM_JOB_ID" in os.environ:
        from tandem.launch.slurm_node import node_placement_from_slurm

        # Under srun with one task per node, SLURM says which node this is and where node 0 is.
        nnodes = 1
        slurm = node_placement_from_slurm(os.environ)
        if slurm is not None:
            nnodes, node_rank, slurm_addr, slurm_port = slurm
            addr = addr or (slurm_addr if nnodes > 1 else None)
            port = port or (slurm_port if nnodes > 1 else None)
    else:
        nnodes = 1
    if args.standalone:
        if nnodes > 1:
            raise LaunchError(f"--standalone is one node, but --nnodes is {args.nnodes}")
        backend = "static"  # torchrun: --rdzv-* "auto-assigned and explicit values ignored"
    if node_rank is not None and node_rank < 0:
        raise LaunchError(f"--node-rank {node_rank} must be >= 0")
    if node_rank is not None and node_rank >= nnodes:
        raise LaunchError(f"--node-rank {node_rank} must be < --nnodes {nnodes}")
    if port is not None and not 1 <= port <= 65535:
        raise LaunchError(f"--master-port {port} is outside 1..65535")
    if backend == "c10d" and most is not None and most > 1:
        if not args.rdzv_endpoint:
            raise LaunchError(
                f"--rdzv-backend c10d with --nnodes {args.nnodes} needs --rdzv-endpoint"
            )
        host, c10d_port = parse_endpoint(args.rdzv_endpoint, C10D_DEFAULT_PORT)
        elastic = _elastic(conf, nnodes, most, is_host)
        meeting = Meeting("c10d", host, c10d_port, None, elastic.join_timeout, is_host, elastic)
        return nnodes, meeting
    if nnodes == 1:
        # One node: rendezvous on loopback, where no other host can reach or disturb it.
        local_port = port if backend == "static" else None
        return 1, Meeting("local", addr or "127.0.0.1", local_port, 0, timeout)
    if args.rdzv_endpoint:  # torchrun's static rendezvous takes the endpoint as node 0's
        addr, port = parse_endpoint(args.rdzv_endpoint, port or DEFAULT_MULTINODE_PORT)
    if addr is None:
        raise LaunchError(f"--nnodes {nnodes} needs --master-addr: node 0's address")
    return nnodes, Meeting("static", addr, port or DEFAULT_MULTINODE_PORT, node_rank or 0, timeout)


def _elastic(conf: dict[str, str], least: int, most: int, is_host: bool | None) -> ElasticSettings:
    """The c10d rendezvous' settings: ``--nnodes MIN:MAX`` and torch's ``--rdzv-conf`` keys."""
    attempts = conf.get("keep_alive_max_attempt", "5")
    if not attempts.isdigit() or int(attempts) < 1:
        raise LaunchError(
            f"--rdzv-conf keep_alive_max_attempt={attempts!r} must be a whole number >= 1"
        )
    return ElasticSettings(
        least,
        most,
        join_timeout=_seconds(conf.get("join_timeout", 600), "join_timeout"),
        last_call=_seconds(conf.get("last_call_timeout", 30), "last_call_timeout"),
        keep_alive_interval=_seconds(conf.get("keep_alive_interval", 1), "keep_alive_interval"),
        keep_alive_max_attempt=int(attempts),
        is_host=is_host,
    )


def _seconds(value: object, name: str) -> float:
    try:
        seconds = float(str(value))
    except ValueError:
        raise LaunchError(f"--rdzv-conf {name}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise LaunchError(f"--rdzv-conf {name}={value!r} must be > 0 seconds")
    return seconds


def _flag_value(text: str) -> bool:
    if text.lower() in ("1", "true", "t", "yes", "y"):
        return True
    if text.lower() in ("0", "false", "f", "no", "n"):
        return False
    raise LaunchError(f"--rdzv-conf is_host={text!r} is not a boolean (1 or 0)")


def build_spec(args: argparse.Namespace) -> tuple[LaunchSpec, Meeting]:
    """Validate the arguments; return the spec and where the nodes meet.

    Example::

        spec, meeting = build_spec(parser.parse_args(["run", "--nproc-per-node", "2", "t.py"]))
    """
    nproc = _nproc(str(args.nproc_per_node))
    nnodes, meeting = _placement(args)
    if args.recover == "in-memory":
        most = parse_nnodes(args.nnodes)[1] if args.nnodes is not None else nnodes
        # One node, --nnodes N with the static rendezvous (node 0 hosts the store), or the
        # c10d rendezvous (N or MIN:MAX: the endpoint's host hosts it); a static MIN:MAX is
        # refused (its node count could not change).
        supported = meeting.backend == "c10d" or most == nnodes
        check_one_node(f"--nnodes {args.nnodes or nnodes}", supported)
        if not args.heartbeat_timeout > 0:
            raise LaunchError(f"--heartbeat-timeout {args.heartbeat_timeout:g} must be > 0")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts} must be >= 0")
    if args.numa_binding:
        _say("warning: --numa-binding is accepted but not applied by tandem run")
    if args.logs_specs is not None:
        _say(f"warning: --logs-specs {args.logs_specs!r} is ignored: tandem's own log layout")
    command = worker_command(
        args.script,
        args.script_args,
        module=args.module,
        no_python=args.no_python,
        run_path=args.run_path,
    )
    run_id = args.rdzv_id if args.rdzv_id != "none" else uuid.uuid4().hex[:12]
    show = _ranks(args.ranks, "ranks")
    local = _ranks(args.local_ranks_filter, "local-ranks-filter")
    logs = LogPlan(
        Path(args.log_dir) if args.log_dir else None,
        run_id,
        parse_std(args.redirects, nproc, "redirects"),
        parse_std(args.tee, nproc, "tee"),
        {
            "stdout": parse_filters(args.duplicate_stdout_filters),
            "stderr": parse_filters(args.duplicate_stderr_filters),
        },
    )
    if logs.run_dir is not None:
        _say(f"each worker's output goes to {logs.run_dir}/attempt_<n>/<local rank>/")
    spec = LaunchSpec(
        command=command,
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=meeting.node_rank or 0,  # c10d by arrival: replaced once it is known
        max_restarts=args.max_restarts,
        log_dir=logs.run_dir,
        show_ranks=frozenset(show) if show is not None else None,
        prefix=not args.no_prefix,
        backend=args.backend,
        grace_s=args.grace_period,
        term_timeout_s=(
            args.term_timeout if args.shutdown_timeout is None else args.shutdown_timeout
        ),
        run_id=run_id,
        logs=logs,
        role=args.role,
        virtual_local_rank=args.virtual_local_rank,
        signals=_signals(args.signals_to_handle),
        local_ranks=frozenset(local) if local is not None else None,
        recover=args.recover,
    )
    return spec, meeting


def _signals(text: str) -> tuple[int, ...]:
    # SIGUSR1 always: it asks the workers to checkpoint now (tandem's Trainer).
    names = (*parse_signals(text), "SIGUSR1")
    return tuple(dict.fromkeys(int(getattr(signal, n)) for n in names))


def run_command(args: argparse.Namespace) -> int:
    """``tandem run``: returns the exit status (0, or the first failure's)."""
    if args.hostfile is not None:  # one `tandem run` per host, over ssh
        from tandem.launch.ssh_launcher import run_hostfile

        if args.recover == "in-memory":  # each host's launcher would refuse: say it once
            hosts = len(read_hostfile(Path(args.hostfile)))
            check_one_node(f"--hostfile of {hosts} hosts", hosts == 1)

        return run_hostfile(args, args.run_actions)
    term = args.term_timeout if args.shutdown_timeout is None else args.shutdown_timeout
    if term < 0:
        raise ValueError(f"--term-timeout must be >= 0 seconds, got {term}")
    after = args.hang_report_after
    if after is not None:
        if not after > 0:
            raise ValueError(f"--hang-report-after must be > 0 seconds, got {after}")
        os.environ["TANDEM_HANG_REPORT_AFTER"] = str(after)  # the workers inherit it
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
        os.environ[trace.ENV] = str(args.trace.resolve())  # the workers inherit it
    spec, meeting = build_spec(args)
    # As torch's launcher does: in its own environment, which the workers inherit.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = args.signals_to_handle
    coordinator: Coordinator
    if meeting.backend == "local" and spec.recover == "in-memory":
        # It hosts the store; the workers learn the heartbeat timeout from it.
        coordinator = InMemoryCoordinator(meeting.addr, meeting.port, args.heartbeat_timeout)
    elif spec.recover == "in-memory" and meeting.elastic is not None:
        # c10d, N or MIN:MAX: the endpoint's host is node 0 and hosts the store; a node that
        # arrives while the job runs joins it in memory.
        grows = ElasticInMemoryCoordinator(
            meeting.elastic,
            meeting.addr,
            meeting.port or C10D_DEFAULT_PORT,
            args.heartbeat_timeout,
            spec.nproc_per_node,
            spec.max_restarts,
        )
        spec = dataclasses.replace(spec, node_rank=0 if grows.serving else 1)
        coordinator = grows
    elif spec.recover == "in-memory":  # many nodes, static: node 0 hosts the store
        assert meeting.node_rank is not None
        coordinator = InMemoryCoordinator(
            meeting.addr,
            meeting.port or DEFAULT_MULTINODE_PORT,
            args.heartbeat_timeout,
            nnodes=spec.nnodes,
            node_rank=meeting.node_rank,
            join_timeout=meeting.timeout,
        )
    elif meeting.backend == "local":
        coordinator = LocalCoordinator(meeting.addr, meeting.port)
    elif meeting.elastic is not None:
        elastic = ElasticCoordinator(
            meeting.elastic,
            meeting.addr,
            meeting.port or C10D_DEFAULT_PORT,
            job=args.rdzv_id,  # as given: the same on every node (run_id may be random)
        )
        # Each round numbers the nodes anew, but the store's host is always node 0: the one
        # whose console shows rank 0.
        spec = dataclasses.replace(spec, node_rank=0 if elastic.serving else 1)
        coordinator = elastic
    else:
        assert meeting.node_rank is not None  # static: given, or 0
        coordinator = StoreCoordinator(
            spec.nnodes,
            meeting.node_rank,
            meeting.addr,
            meeting.port or DEFAULT_MULTINODE_PORT,
            meeting.timeout,
        )
    try:
        code = Supervisor(spec, coordinator).run()
    except JobEnded as ended:  # a node that waited to join a job that then finished
        _say(str(ended))
        return 0
    if args.trace is not None:
        _merge_trace(args.trace, spec)
    return code


def _say(message: str) -> None:
    print(f"tandem run: {message}", file=sys.stderr, flush=True)


def _merge_trace(directory: Path, spec: LaunchSpec) -> None:
    """One trace of this node's ranks (of this run) in ``directory``, and where it is."""
    name = "trace.json" if spec.nnodes == 1 else f"trace-node{spec.node_rank}.json"
    try:
        path = trace.merge(directory, run_id=spec.run_id, name=name)
    except FileNotFoundError:
        print(f"tandem run: no rank wrote a trace into {directory}", file=sys.stderr)
        return
    print(
        f"tandem run: the trace of every rank is {path} (open it in ui.perfetto.dev or "
        "chrome://tracing)",
        file=sys.stderr,
    )
