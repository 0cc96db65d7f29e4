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
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from tandem.doctor import trace
from tandem.launch.rendezvous import (
    Coordinator,
    LaunchError,
    LocalCoordinator,
    StoreCoordinator,
)
from tandem.launch.supervisor import LaunchSpec, Supervisor

DEFAULT_MULTINODE_PORT = 29500


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs: object) -> None:
    """Add ``--some-flag`` with its torchrun spelling ``--some_flag`` as an alias."""
    names = [f"--{name}"]
    if "-" in name:
        names.append(f"--{name.replace('-', '_')}")
    parser.add_argument(*names, **kwargs)  # type: ignore[arg-type]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``run`` subcommand to ``tandem``'s subparsers; it runs :func:`run_command`."""
    p = subparsers.add_parser(
        "run",
        help="start one worker per device (torchrun's flags)",
        description="Start NPROC_PER_NODE workers of a script or module with torchrun's "
        "environment, supervise them, and stop them all at the first failure.",
    )
    _flag(
        p, "nproc-per-node", default="1", help="a number, or auto (one per GPU, else 1), gpu, cpu"
    )
    _flag(p, "nnodes", default=None, help="number of nodes (default 1, or SLURM's)")
    _flag(p, "node-rank", default=None, help="this node's rank (default 0, or SLURM's)")
    _flag(p, "master-addr", default=None, help="node 0's address (default 127.0.0.1 for one node)")
    _flag(p, "master-port", default=None, type=int, help="default: a free port on one node")
    _flag(p, "max-restarts", default=0, type=int, help="restart all workers up to K times")
    _flag(p, "log-dir", default=None, type=Path, help="also write each rank's output here")
    _flag(p, "backend", default=None, choices=["gloo", "nccl", "mpi"], help="for tandem.init()")
    _flag(
        p,
        "hang-report-after",
        default=None,
        type=float,
        help="seconds a collective may block before a hang report (default 60)",
    )
    _flag(
        p,
        "trace",
        default=None,
        type=Path,
        help="write every rank's timeline here, merged into DIR/trace.json (Chrome trace: "
        "ui.perfetto.dev, chrome://tracing)",
    )
    _flag(p, "ranks", default=None, help="show only these global ranks' output, e.g. 0 or 0,3")
    _flag(p, "local-ranks-filter", default=None, help="torchrun's: show only these local ranks")
    _flag(p, "no-prefix", action="store_true", help="do not prefix lines with [rank N]")
    _flag(p, "rdzv-timeout", default=300.0, type=float, help="seconds to wait for all nodes")
    _flag(
        p,
        "grace-period",
        default=3.0,
        type=float,
        help="after a worker failed: seconds the others get between SIGTERM and SIGKILL",
    )
    _flag(
        p,
        "term-timeout",
        default=30.0,
        type=float,
        help="after SIGTERM/SIGINT to tandem run: seconds the workers get to finish (a "
        "Trainer saves a checkpoint) before SIGKILL",
    )
    _flag(p, "standalone", action="store_true", help="accepted for torchrun compatibility")
    _flag(p, "no-python", action="store_true", help="run the script as an executable")
    p.add_argument("-m", "--module", action="store_true", help="run a module, as python -m")
    p.add_argument("script", help="the training script (or module, with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(func=run_command)


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


def _command(args: argparse.Namespace) -> list[str]:
    if args.no_python:
        if args.module:
            raise LaunchError("--no-python and -m cannot be combined")
        if shutil.which(args.script) is None:
            raise LaunchError(f"executable {args.script!r} not found (with --no-python)")
        return [args.script, *args.script_args]
    if args.module:
        if importlib.util.find_spec(args.script) is None:
            raise LaunchError(f"module {args.script!r} not found by {sys.executable}")
        return [sys.executable, "-u", "-m", args.script, *args.script_args]
    if not Path(args.script).is_file():
        raise LaunchError(f"script {args.script!r} not found (cwd: {os.getcwd()})")
    return [sys.executable, "-u", args.script, *args.script_args]


def _ranks(text: str | None, name: str) -> set[int] | None:
    if text is None:
        return None
    try:
        return {int(r) for r in text.replace(" ", "").split(",") if r}
    except ValueError:
        raise LaunchError(f"--{name} {text!r} is not a comma-separated list of ranks") from None


def build_spec(args: argparse.Namespace) -> tuple[LaunchSpec, str, int | None]:
    """Validate the arguments; return the spec and the rendezvous address and port."""
    nproc = _nproc(str(args.nproc_per_node))
    nnodes, node_rank, addr, port = args.nnodes, args.node_rank, args.master_addr, args.master_port
    if nnodes is None and node_rank is None and "SLURM_JOB_ID" in os.environ:
        from tandem.launch.slurm_node import node_placement_from_slurm

        # Under srun with one task per node, SLURM says which node this is and where node 0 is.
        slurm = node_placement_from_slurm(os.environ)
        if slurm is not None:
            nnodes, node_rank, slurm_addr, slurm_port = slurm
            addr = addr or (slurm_addr if nnodes > 1 else None)
            port = port or (slurm_port if nnodes > 1 else None)
    nnodes = _positive_int("nnodes", nnodes if nnodes is not None else 1)
    node_rank = _positive_int("node-rank", node_rank if node_rank is not None else 0, minimum=0)
    if node_rank >= nnodes:
        raise LaunchError(f"--node-rank {node_rank} must be < --nnodes {nnodes}")
    if port is not None and not 1 <= port <= 65535:
        raise LaunchError(f"--master-port {port} is outside 1..65535")
    if nnodes > 1 and addr is None:
        raise LaunchError(f"--nnodes {nnodes} needs --master-addr: node 0's address")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts} must be >= 0")
    show = _ranks(args.ranks, "ranks")
    local = _ranks(args.local_ranks_filter, "local-ranks-filter")
    if local is not None:
        local_shown = {node_rank * nproc + r for r in local}
        show = local_shown if show is None else show & local_shown
    spec = LaunchSpec(
        command=_command(args),
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        show_ranks=frozenset(show) if show is not None else None,
        prefix=not args.no_prefix,
        backend=args.backend,
        grace_s=args.grace_period,
        term_timeout_s=args.term_timeout,
    )
    # One node: rendezvous on loopback, where no other host can reach or disturb it.
    return spec, addr or "127.0.0.1", port


def run_command(args: argparse.Namespace) -> int:
    """``tandem run``: returns the exit status (0, or the first failure's)."""
    if args.term_timeout < 0:
        raise ValueError(f"--term-timeout must be >= 0 seconds, got {args.term_timeout}")
    after = args.hang_report_after
    if after is not None:
        if not after > 0:
            raise ValueError(f"--hang-report-after must be > 0 seconds, got {after}")
        os.environ["TANDEM_HANG_REPORT_AFTER"] = str(after)  # the workers inherit it
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
        os.environ[trace.ENV] = str(args.trace.resolve())  # the workers inherit it
    spec, addr, port = build_spec(args)
    coordinator: Coordinator
    if spec.nnodes == 1:
        coordinator = LocalCoordinator(addr, port)
    else:
        port = port or DEFAULT_MULTINODE_PORT
        coordinator = StoreCoordinator(spec.nnodes, spec.node_rank, addr, port, args.rdzv_timeout)
    code = Supervisor(spec, coordinator).run()
    if args.trace is not None:
        _merge_trace(args.trace, spec)
    return code


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
