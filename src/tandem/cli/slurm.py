"""``tandem slurm``: the command line of :func:`tandem.launch.slurm.build_sbatch_script`.

Example::

    tandem slurm --nodes 2 --gpus-per-node 4 --time 01:00:00 --partition gpu -- train.py > job.sh
"""

from __future__ import annotations

import argparse
import re
import sys

from tandem.launch.slurm import DEFAULT_SIGNAL, build_sbatch_script, parse_time
from tandem.launch.slurm_options import check_mem, parse_signal


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``slurm`` subcommand to ``tandem``'s subparsers; it runs :func:`main`.

    Every option takes dashes or underscores (``--gpus-per-node``, ``--gpus_per_node``), like
    torchrun's. The script and its arguments follow ``--`` (or the first word that is not an
    option of ``tandem slurm``).

    Example::

        parser = argparse.ArgumentParser(prog="tandem")
        register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["slurm", "--nodes", "2", "--gpus-per-node", "4",
                                  "--time", "01:00:00", "--", "train.py"])
        args.func(args)  # prints the script
    """
    parser = subparsers.add_parser(
        "slurm",
        help="print an sbatch script that runs a training script on SLURM nodes",
        description=(
            "Print an sbatch script: one `tandem run` per node through srun, one worker per "
            "GPU, requeued shortly before the time limit. Save it and submit it with sbatch."
        ),
        epilog="example: tandem slurm --nodes 2 --gpus-per-node 4 --time 01:00:00 -- train.py",
    )

    def option(name: str, **kwargs) -> None:
        flags = [f"--{name}"]
        if "-" in name:
            flags.append(f"--{name.replace('-', '_')}")
        parser.add_argument(*flags, **kwargs)

    option("nodes", type=_positive, required=True, help="number of nodes")
    option(
        "gpus-per-node",
        type=_non_negative,
        required=True,
        help="GPUs per node, one worker each; 0 for a CPU job (then give --nproc-per-node)",
    )
    option("time", type=_time, required=True, help="time limit: minutes or [D-]HH:MM:SS")
    option("partition", help="partition to submit to (default: the cluster's default)")
    option("cpus-per-task", type=_positive, help="CPUs per node, shared by its workers")
    option("job-name", default="tandem", help="job name (default: %(default)s)")
    option("output", default="%x-%j.out", help="log file (default: %(default)s)")
    option("nproc-per-node", type=_positive, help="workers per node (default: --gpus-per-node)")
    option("account", help="account to charge (default: your default account)")
    option("qos", help="quality of service (default: the association's)")
    option("mem", type=_mem, help="memory per node: 64G, 16000M, 0 for all (default: Slurm's)")
    option("constraint", help="node features required, e.g. 'a100&ib' (default: none)")
    option("exclusive", action="store_true", help="whole nodes, shared with no other job")
    option(
        "requeue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="requeue after --signal, and on preemption or node failure; the training script "
        "must resume from its latest checkpoint (default: %(default)s)",
    )
    option(
        "signal",
        type=_signal,
        default=DEFAULT_SIGNAL,
        help="SIG@SECONDS: Slurm signals the batch shell SECONDS before the time limit and the "
        "script passes it to every worker (USR1: the Trainer checkpoints); 'none' for no "
        "signal (default: %(default)s)",
    )
    option(
        "sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="another #SBATCH option, e.g. --sbatch mail-type=END (the leading -- may be "
        "left out); repeat for more",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="run the script as a module (python -m)"
    )
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="-- then the script and its arguments"
    )
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Print the batch script that ``args`` (from :func:`register`'s parser) describe.

    Returns:
        0, or 2 after printing the error when the arguments do not make a valid job.
    """
    script_args = list(args.script_args)
    # argparse keeps the "--" that ends tandem's own options in the remainder.
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    try:
        script = build_sbatch_script(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            time=args.time,
            partition=args.partition,
            cpus_per_task=args.cpus_per_task,
            job_name=args.job_name,
            nproc_per_node=args.nproc_per_node,
            script_args=script_args,
            module=args.module,
            output=args.output,
            account=args.account,
            qos=args.qos,
            mem=args.mem,
            constraint=args.constraint,
            exclusive=args.exclusive,
            requeue=args.requeue,
            signal=args.signal,
            sbatch=args.sbatch,
        )
    except ValueError as exc:
        print(f"tandem slurm: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(script)
    return 0


def _argument(check):
    """An argparse ``type`` from a check that raises ValueError, keeping its message."""

    def parse(text: str):
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _integer_at_least(minimum: int):
    def check(text: str) -> int:
        if not re.fullmatch(r"-?[0-9]+", text.strip()) or int(text) < minimum:
            raise ValueError(f"{text!r} is not an integer >= {minimum}")
        return int(text)

    return _argument(check)


def _check_time(text: str) -> str:
    parse_time(text)
    return text


def _check_signal(text: str) -> str | None:
    if text.strip().lower() == "none":
        return None
    parse_signal(text)
    return text


_positive = _integer_at_least(1)
_non_negative = _integer_at_least(0)
_time = _argument(_check_time)
_mem = _argument(check_mem)
_signal = _argument(_check_signal)
