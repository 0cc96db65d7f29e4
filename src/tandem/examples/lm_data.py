"""The example LM's corpus: the docstrings of standard library modules, as character ids.

Generated offline and deterministically: the docstrings of a fixed list of Python standard
library modules, read from their source files with :mod:`ast` (nothing imported or
downloaded), in a fixed order, the same text on every rank; cut into sequences of
``block + 1`` characters (:class:`CharChunks`), the last tenth held out.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

# Pure-Python modules present from Python 3.10 to 3.13 whose docstrings are prose, in the order
# the corpus takes them. Platform-specific modules (os, posixpath) are left out: the text must
# not depend on the machine.
MODULES = (
    "argparse", "collections", "contextlib", "dataclasses", "fractions", "functools", "heapq",
    "json", "pathlib", "string", "textwrap", "random", "statistics", "shutil", "tempfile",
    "typing", "logging", "calendar", "difflib", "enum", "fnmatch", "glob", "gzip", "ipaddress",
    "pprint", "queue", "sched", "shlex", "threading", "timeit", "uuid", "zipfile", "bisect",
    "copy", "csv", "configparser", "optparse", "gettext", "inspect", "pydoc", "doctest",
    "unittest", "email", "http", "urllib", "decimal", "datetime", "subprocess", "tarfile",
    "smtplib", "ftplib", "imaplib", "turtle", "tokenize", "pickle", "abc", "numbers",
    "operator", "codecs", "hashlib", "hmac", "secrets", "base64", "struct", "weakref",
    "types", "traceback", "warnings", "mailbox", "wave", "colorsys", "graphlib", "ast", "dis",
    "selectors", "socket", "ssl", "trace", "profile", "pstats", "code", "codeop", "cmd",
    "plistlib", "quopri", "rlcompleter", "symtable", "tabnanny", "webbrowser", "zipapp",
)  # fmt: skip

# Newline and printable ASCII: a fixed vocabulary, so the model's shape never depends on the text.
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
_INDEX = {c: i for i, c in enumerate(VOCAB)}


def module_docstrings(name: str) -> list[str]:
    """The docstrings of module ``name``'s source file, in source order ([] without a source).

    Read with :mod:`ast`: the module is not imported, so nothing of it runs.

    Example::

        >>> module_docstrings("textwrap")[0].splitlines()[0]
        'Text wrapping and filling.'
    """
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return []  # frozen, built in, or shipped without its source
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    # ast.walk is breadth-first; sorting by line gives the order a reader meets them in.
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = [n for n in ast.walk(tree) if isinstance(n, nodes)]
    found.sort(key=lambda n: getattr(n, "lineno", 0))
    docs = (ast.get_docstring(n) for n in found)
    return [d for d in docs if d]


def load_corpus(chars: int | None = None) -> str:
    """The corpus: :data:`MODULES`' docstrings, one blank line apart, cut to ``chars``.

    Characters outside :data:`VOCAB` (tabs, non-ASCII letters) become spaces and ``?``.

    Example::

        >>> len(load_corpus(1000))
        1000
    """
    parts: list[str] = []
    total = 0
    for name in MODULES:
        for doc in module_docstrings(name):
            parts.append(doc)
            total += len(doc) + 2
        if chars is not None and total >= chars:
            break  # reading stops early for a small corpus: the test's run starts faster
    text = "\n\n".join(parts)
    text = text.encode("ascii", "replace").decode("ascii")
    text = "".join(c if c in _INDEX else " " for c in text)
    return text if chars is None else text[:chars]


def encode(text: str) -> torch.Tensor:
    """Character ids of ``text`` (int64), every character in :data:`VOCAB`.

    Example::

        >>> decode(encode("Hi!\\n"))
        'Hi!\\n'
    """
    return torch.tensor([_INDEX[c] for c in text], dtype=torch.long)


def decode(ids: torch.Tensor | Sequence[int]) -> str:
    """The text of character ids."""
    return "".join(VOCAB[int(i)] for i in ids)


class CharChunks(Dataset):
    """Consecutive sequences of ``block + 1`` characters: ``{"ids": LongTensor[block + 1]}``.

    Sequence ``i`` starts at ``i * block``, so the last character of one is the first of the
    next: every character of the text is predicted once (the first is only context).

    Example::

        >>> chunks = CharChunks(encode("abcdefghij"), block=4)
        >>> len(chunks), decode(chunks[1]["ids"])
        (2, 'efghi')
    """

    def __init__(self, ids: torch.Tensor, block: int) -> None:
        if block < 1 or len(ids) < block + 1:
            raise ValueError(f"{len(ids)} characters make no sequence of block {block} + 1")
        self.ids = ids
        self.block = block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = i * self.block
        return {"ids": self.ids[start : start + self.block + 1]}


def load_data(
    chars: int | None, block: int, eval_fraction: float = 0.1
) -> tuple[CharChunks, CharChunks]:
    """Training and evaluation sequences: the corpus's first part and its last ``eval_fraction``.

    A contiguous tail rather than random sequences: held-out text that no training sequence
    overlaps.

    Example::

        train_set, eval_set = load_data(chars=20_000, block=32)
    """
    ids = encode(load_corpus(chars))
    if len(ids) < 1000:
        raise ValueError(
            f"the corpus has {len(ids)} characters: the standard library's .py sources, which it "
            "is read from, are missing from this Python installation"
        )
    cut = int(len(ids) * (1 - eval_fraction))
    return CharChunks(ids[:cut], block), CharChunks(ids[cut:], block)
