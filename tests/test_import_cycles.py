"""No module of tandem imports itself back, and the layers import in one direction only.

Proves: the module graph of ``src/tandem`` read with :mod:`ast` (``import a.b``, ``from a import
b``, relative imports, imports inside functions; ``if TYPE_CHECKING:`` blocks left out, as they
never run) has no cycle, every cycle is named as ``a -> b -> a``, and ``tandem.launch`` (which
the launcher imports before any worker starts) imports nothing from ``tandem.data``. The checker
itself is shown to find the cycles of a synthetic graph, so a green run means something.

An import inside a function is counted: it hides a cycle from Python at import time, not from
the reader, and the two modules still cannot be understood (or moved) one without the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "tandem"


def module_files(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``src``: dotted name -> file (a package: its __init__)."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            # The body never runs; an `else:` branch does.
            for statement in child.orelse:
                if isinstance(statement, ast.Import | ast.ImportFrom):
                    yield statement
                yield from _imports(statement)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _imports(child)


def imported_modules(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The modules among ``known`` that module ``name`` (at ``path``) imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for statement in _imports(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(statement, ast.Import):
            targets = [alias.name for alias in statement.names]
        else:
            base = statement.module or ""
            if statement.level:
                # `from . import x` in a package's __init__ is relative to the package itself.
                anchor = name.split(".")
                drop = statement.level - 1 if is_package else statement.level
                anchor = anchor[: len(anchor) - drop] if drop else anchor
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule; `from mod import name` the module.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in statement.names
            ]
        for target in targets:
            # `import tandem.data.lmdb` runs tandem.data.lmdb; a missing leaf is a name in its
            # parent (the longest known prefix).
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != name:
                found.add(".".join(parts))
    return found


def import_graph(src: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    known = module_files(src, package)
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def find_cycles(graph: Mapping[str, Iterable[str]], limit: int = 1000) -> list[list[str]]:
    """Every elementary cycle of ``graph``, each as ``[a, b, ..., a]`` starting at its least node.

    For each start node in sorted order, a depth-first search finds the paths back to it through
    nodes greater than it only, so every cycle is found once, from its least node.
    """
    edges = {node: sorted(set(targets)) for node, targets in graph.items()}
    cycles: list[list[str]] = []
    for start in sorted(edges):
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack and len(cycles) < limit:
            node, path = stack.pop()
            for nxt in reversed(edges.get(node, [])):
                if nxt == start:
                    cycles.append([*path, start])
                elif nxt > start and nxt not in path:
                    stack.append((nxt, [*path, nxt]))
    return sorted(cycles)


def _short(module: str) -> str:
    return module.removeprefix(f"{PACKAGE}.")


def format_cycle(cycle: list[str]) -> str:
    return " -> ".join(_short(m) for m in cycle)


# The checker, on graphs whose answers are known.


def test_finds_every_cycle_of_a_synthetic_graph():
    graph = {
        "a": {"b"},
        "b": {"a", "c"},
        "c": {"d"},
        "d": {"b"},
        "e": {"e", "a"},
        "f": {"a"},
    }
    assert find_cycles(graph) == [["a", "b", "a"], ["b", "c", "d", "b"], ["e", "e"]]
    assert format_cycle(["tandem.x", "tandem.y", "tandem.x"]) == "x -> y -> x"


def test_acyclic_graph_has_no_cycles():
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import pkg.sub.b\n"
        "if TYPE_CHECKING:\n"
        "    from pkg import c\n"
        "else:\n"
        "    import os\n"
    )
    (pkg / "c.py").write_text("def f():\n    from .sub.b import thing\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import c\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom pkg.sub import d\n")
    (pkg / "sub" / "d.py").write_text("")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub.b"},  # the TYPE_CHECKING import of c is not counted
        "pkg.c": {"pkg.sub.b"},  # inside a function, relative
        "pkg.sub": {"pkg.c"},
        "pkg.sub.b": {"pkg.a", "pkg.sub.d"},
        "pkg.sub.d": set(),
    }
    assert [format_cycle(c) for c in find_cycles(graph)] == ["pkg.a -> pkg.sub.b -> pkg.a"]


# tandem itself.


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(map(format_cycle, cycles))


def test_launch_imports_nothing_from_data():
    # The launcher imports tandem.launch before any worker starts; data belongs to the workers.
    graph = import_graph()
    wrong = sorted(
        f"{_short(module)} imports {_short(target)}"
        for module, targets in graph.items()
        if module.startswith(f"{PACKAGE}.launch")
        for target in targets
        if target == f"{PACKAGE}.data" or target.startswith(f"{PACKAGE}.data.")
    )
    assert not wrong, "\n".join(wrong)
