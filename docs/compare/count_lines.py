"""Count the lines of user code in the comparison scripts: not blank, not comment, not docstring.

A line counts when a token other than a comment starts on it or runs across it (each line of a
multi-line call counts, as a reader reads it). Docstrings (module, class, function) do not
count; neither do lines holding only comments. Imports are counted, and also shown apart.

Run::

    python docs/compare/count_lines.py                 # the lm_*.py scripts beside this file
    python docs/compare/count_lines.py a.py b.py

Example::

    >>> code_lines("'Doc.'\\n\\nimport os  # why\\n# note\\nx = (1,\\n     2)\\n")
    (3, 1)
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(source: str) -> tuple[int, int]:
    """``(lines of code, of which import lines)`` in ``source``."""
    tree = ast.parse(source)
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    lines -= _docstring_lines(tree)
    imports: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return len(lines), len(lines & imports)


def main(argv: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """Print a table of the files' counts; return them by file name."""
    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        paths = sorted(Path(__file__).resolve().parent.glob("lm_*.py"))
    counts = {p.name: code_lines(p.read_text()) for p in paths}
    print("| script | lines of code | of which imports | without imports |")
    print("|---|---:|---:|---:|")
    for name, (total, imports) in counts.items():
        print(f"| {name} | {total} | {imports} | {total - imports} |")
    return counts


if __name__ == "__main__":
    main()
