"""The ``tandem`` command: ``tandem run`` (a torchrun-compatible launcher) and ``tandem slurm``.

(And ``tandem lmdb``, which converts and describes LMDB files.) Each verb is one module here
that adds its parser and runs it; the work itself lives in :mod:`tandem.launch` and
:mod:`tandem.data`. Start-up is fast because nothing here imports torch: a one-node
``tandem run`` is the supervisor and its workers, nothing else. (Many nodes meet through
torch's TCPStore, and only that path imports torch.)

Example::

    tandem run --nproc-per-node 2 train.py --lr 0.1
    tandem run --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 train.py
    tandem run --nproc-per-node auto -m tandem.examples.wine
"""

from __future__ import annotations

import argparse
import sys

from tandem import __version__
from tandem.cli import export, lmdb, run, slurm
from tandem.launch.rendezvous import LaunchError
from tandem.launch.torchrun_flags import DefaultsHelpFormatter


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every ``--help`` says each option's default, nested verbs (``tandem lmdb convert``) too."""
    if parser.formatter_class is argparse.HelpFormatter:
        parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)


def build_parser() -> argparse.ArgumentParser:
    """The ``tandem`` command's parser, every verb registered.

    Example::

        args = build_parser().parse_args(["run", "--nproc_per_node=2", "train.py"])
    """
    parser = argparse.ArgumentParser(
        prog="tandem",
        description=(__doc__ or "").split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    run.register(subparsers)
    slurm.register(subparsers)
    lmdb.register(subparsers)
    export.register(subparsers)
    for verb in subparsers.choices.values():
        _show_defaults(verb)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tandem`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (LaunchError, ValueError) as exc:
        # A user's mistake is one line and status 2, as argparse reports its own.
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2
