"""``tandem lmdb convert`` and ``tandem lmdb info``: LMDB files from the command line.

The files themselves are :mod:`tandem.data.lmdb`'s; this module reads the command line.

Example::

    tandem lmdb convert --dataset mypkg.data:train_set --out /data/train.lmdb --map-size 8G
    tandem lmdb info /data/train.lmdb

``--dataset MODULE:NAME`` names a map-style data set, or a callable (a function, a class) that
returns one when called without arguments. The current directory is put first on ``sys.path``,
as ``python -m`` does (a console script's ``sys.path`` starts with its own bin directory).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from tandem.data.lmdb import FORMAT, LMDBDataset, convert_to_lmdb


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tandem lmdb convert`` and ``tandem lmdb info``; they run :func:`main`.

    Example::

        parser = argparse.ArgumentParser(prog="tandem")
        register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["lmdb", "convert", "--dataset", "mydata:train_set",
                                  "--out", "train.lmdb"])
        args.func(args)
    """
    parser = subparsers.add_parser(
        "lmdb",
        help="convert a data set into an LMDB file, or describe one",
        description="Convert a map-style data set into one LMDB file that tandem.data."
        "LMDBDataset reads from many processes at once, or describe such a file.",
    )
    verbs = parser.add_subparsers(dest="lmdb_command", required=True)
    convert = verbs.add_parser(
        "convert",
        help="write every sample of a data set into an LMDB file",
        epilog="example: tandem lmdb convert --dataset mypkg.data:train_set --out train.lmdb",
    )
    convert.add_argument(
        "--dataset",
        required=True,
        help="MODULE:NAME of a data set, or of a callable (function, class) returning one",
    )
    convert.add_argument("--out", required=True, type=Path, help="the LMDB file to write")
    convert.add_argument(
        "--map-size", "--map_size", type=_size, default=None, help="first map size: 1G, 512M..."
    )
    convert.add_argument("--commit-every", "--commit_every", type=int, default=1000)
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")
    info = verbs.add_parser("info", help="print the sample count and size of an LMDB file")
    info.add_argument("path", type=Path)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``tandem lmdb convert`` or ``tandem lmdb info``; return the exit status.

    A user's mistake (bad ``--dataset``, missing or foreign file) is printed as one line on
    stderr with status 2, not as a traceback.

    Example::

        main(argparse.Namespace(lmdb_command="info", path=Path("train.lmdb")))
    """
    try:
        if args.lmdb_command == "convert":
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            dataset = load_dataset(args.dataset)
            out = convert_to_lmdb(
                dataset,
                args.out,
                map_size=args.map_size,
                progress=not args.no_progress,
                commit_every=args.commit_every,
            )
            print(f"wrote {len(dataset)} samples to {out} ({out.stat().st_size} bytes)")
        else:
            ds = LMDBDataset(args.path)
            print(f"{ds.path}: {len(ds)} samples, {_file_bytes(ds.path)} bytes, {FORMAT.decode()}")
    except (ValueError, OSError, ImportError) as exc:
        print(f"tandem lmdb {args.lmdb_command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def load_dataset(spec: str) -> Any:
    """The data set named by ``MODULE:NAME`` (``NAME`` may be dotted); a callable that is not
    itself a data set is called with no arguments.

    Args:
        spec: e.g. ``"mypkg.data:train_set"`` or ``"mypkg.data:Builder.train"``.

    Raises:
        ValueError: ``spec`` has no colon, the module or name does not exist, or the result
            is not a map-style data set.

    Example::

        train = load_dataset("mypkg.data:train_set")  # mypkg/data.py: train_set = MyDataset()
    """
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"--dataset {spec!r} must be MODULE:NAME, e.g. mypkg.data:train_set")
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--dataset {spec!r}: cannot import {module_name!r}: {exc}") from exc
    for part in name.split("."):
        if not hasattr(value, part):
            raise ValueError(f"--dataset {spec!r}: {module_name} has no attribute {name!r}")
        value = getattr(value, part)
    if not _is_map_style(value) and callable(value):
        value = value()
    if not _is_map_style(value):
        raise ValueError(
            f"--dataset {spec!r} gave a {type(value).__qualname__}, not a map-style data set "
            "(__len__ and __getitem__)"
        )
    return value


def _is_map_style(value: Any) -> bool:
    return (
        not isinstance(value, type) and hasattr(value, "__len__") and hasattr(value, "__getitem__")
    )


def _size(text: str) -> int:
    """``"1G"``, ``"512M"``, ``"64K"`` or plain bytes, for ``--map-size``."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 1G, 512M or 4096") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be > 0")
    return size


def _file_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir())
