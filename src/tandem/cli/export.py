"""``tandem export``: a checkpoint's plain model weights as one safetensors file.

The work is :func:`tandem.checkpoint.export.export_file`'s; this module reads the command line. It
imports torch only when the verb runs, so the other verbs start as fast as before.

Example::

    tandem export runs/lm lm.safetensors                     # the run's latest checkpoint
    tandem export runs/lm/checkpoints/ckpt-e0003-s00001200.pt lm.safetensors
    tandem export ckpt/last.pt gen.safetensors --key generator   # a tandem.checkpoint file
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``export`` subcommand to ``tandem``'s subparsers; it runs :func:`main`.

    Example::

        parser = argparse.ArgumentParser(prog="tandem")
        register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["export", "runs/lm", "lm.safetensors"])
        args.func(args)
    """
    parser = subparsers.add_parser(
        "export",
        help="write a checkpoint's model weights as a safetensors file",
        description=(
            "Write the plain model's weights of a checkpoint as one safetensors file, keys "
            "without wrapper prefixes: it loads with safetensors.torch.load_file into the "
            "unwrapped model with load_state_dict(strict=True). Reads Trainer checkpoints "
            "(tandem.DDP, ShardedOptimizer, FSDP; full or sharded) and tandem.checkpoint.save "
            "files. Needs safetensors: pip install 'tandem[export]'."
        ),
        epilog="example: tandem export runs/lm lm.safetensors",
    )
    parser.add_argument(
        "source",
        help="a run directory (its latest checkpoint), a Trainer checkpoint file, a file "
        "written by tandem.checkpoint.save, or a torch distributed checkpoint (DCP) directory",
    )
    parser.add_argument("out", help="the .safetensors file to write (replaced atomically)")
    parser.add_argument(
        "--key", help="the model's key in a tandem.checkpoint.save file that holds several"
    )
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Export, print one line saying what was written; 0, or 2 after printing the error."""
    from tandem.checkpoint.export import export_file
    from tandem.checkpoint.run_dir import CheckpointError

    try:
        report = export_file(args.source, args.out, key=args.key)
    except (CheckpointError, ValueError, ImportError, OSError) as exc:
        print(f"tandem export: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"tandem export: wrote {report.out} ({report.tensors} tensors, {report.numel:,} values, "
        f"{_size(report.nbytes)}) from {report.source}"
    )
    return 0


def _size(nbytes: int) -> str:
    """``nbytes`` for a person: ``'812 B'``, ``'3.4 kB'``, ``'1.2 GB'``."""
    size, unit = float(nbytes), "B"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            break
        size /= 1000
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
