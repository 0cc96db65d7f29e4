"""No module of tandem imports itself back, the layers import one way, and no caller outside
``tandem.parallel`` asks which engine it holds.

Proves, on the module graph of ``src/tandem`` read with :mod:`ast` (``import a.b``, ``from a
import b``, relative imports, imports inside functions and under ``if TYPE_CHECKING:``):

- there is no cycle (each is named as ``a -> b -> a``);
- the layers import one way (:data:`LAYERS`): ``checkpoint`` never imports ``train``,
  ``doctor`` never imports ``launch``, ``job`` imports none of the packages that use it, ...;
- the launcher's modules (``launch``, ``job``, ``cli``) import no torch, and every module
  imports on its own in a fresh interpreter (in any order, since each starts clean);
- outside ``tandem.parallel`` no ``isinstance`` names an engine or wrapper class and no code
  reaches into an engine's wrapper (``.fsdp``): callers use :class:`tandem.parallel.engine.Engine`
  and the adapters of :mod:`tandem.parallel.adapters`.

Each checker is shown to find what it looks for in a synthetic case, so a green run means
something. Imports inside functions and under ``TYPE_CHECKING`` count: they hide a cycle from
Python at import time, not from the reader, and the two modules still cannot be understood (or
moved) one without the other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
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


def _imports(node: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth (``TYPE_CHECKING`` blocks too)."""
    for child in ast.iter_child_nodes(node):
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
        "pkg.a": {"pkg.c", "pkg.sub.b"},  # the TYPE_CHECKING import of c counts
        "pkg.c": {"pkg.sub.b"},  # inside a function, relative
        "pkg.sub": {"pkg.c"},
        "pkg.sub.b": {"pkg.a", "pkg.sub.d"},
        "pkg.sub.d": set(),
    }
    assert [format_cycle(c) for c in find_cycles(graph)] == [
        "pkg.a -> pkg.c -> pkg.sub.b -> pkg.a",
        "pkg.a -> pkg.sub.b -> pkg.a",
    ]


# tandem itself.


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(map(format_cycle, cycles))


#: (importer, imported, why): no module under the first package may import one under the second.
LAYERS = [
    ("checkpoint", "train", "checkpoints know nothing of the Trainer (the Trainer uses them)"),
    ("doctor", "launch", "the doctor runs in the workers; the launcher reads its files"),
    ("doctor", "parallel", "the engines report to the doctor, not the other way round"),
    ("parallel", "train", "engines know nothing of the Trainer"),
    ("parallel", "checkpoint", "the checkpoint package drives the engines' adapters"),
    ("parallel", "launch", "engines run in the workers"),
    ("launch", "data", "the launcher imports tandem.launch before any worker starts"),
    ("launch", "parallel", "the launcher starts workers; it trains nothing"),
    ("launch", "train", "the launcher starts workers; it trains nothing"),
    *[
        ("job", above, "what a process knows of its job sits below everything that uses it")
        for above in ("launch", "doctor", "data", "parallel", "train", "checkpoint", "world")
    ],
    *[
        (below, "cli", "the command line sits on top")
        for below in ("launch", "job", "doctor", "parallel", "train", "checkpoint", "data")
    ],
]


def _under(module: str, package: str) -> bool:
    full = f"{PACKAGE}.{package}"
    return module == full or module.startswith(f"{full}.")


def layering_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """``"a imports b: why"`` for every edge that goes against :data:`LAYERS`."""
    return sorted(
        f"{_short(module)} imports {_short(target)}: {why}"
        for low, high, why in LAYERS
        for module, targets in graph.items()
        if _under(module, low)
        for target in targets
        if _under(target, high)
    )


def test_layering_checker_finds_a_wrong_way_import():
    graph = {"tandem.checkpoint.entries": {"tandem.train.trainer", "tandem.parallel.engine"}}
    assert layering_violations(graph) == [
        "checkpoint.entries imports train.trainer: checkpoints know nothing of the Trainer "
        "(the Trainer uses them)"
    ]


def test_layers_import_one_way():
    wrong = layering_violations(import_graph())
    assert not wrong, "\n".join(wrong)


#: Classes whose name a caller outside tandem.parallel must not test for: the engines, the
#: wrappers and the adapters (ask the Engine or the adapter instead).
ENGINE_CLASSES = {
    "DDP",
    "DataParallel",
    "DistributedDataParallel",
    "FSDP",
    "FullyShardedDataParallel",
    "PlainModel",
    "PlainOptimizer",
    "ReplicatedEngine",
    "ShardOptimizer",
    "ShardedEngine",
    "ShardedModel",
    "ShardedOptimizer",
    "ZeroOptimizer",
}


def engine_lookups(source: str, filename: str = "<source>") -> list[str]:
    """``"line N: ..."`` for each ``isinstance``/``issubclass`` naming an engine class, and each
    ``.fsdp`` attribute read, in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"isinstance", "issubclass"}
            and len(node.args) == 2
        ):
            names = {
                n.id if isinstance(n, ast.Name) else n.attr
                for n in ast.walk(node.args[1])
                if isinstance(n, ast.Name | ast.Attribute)
            }
            for name in sorted(names & ENGINE_CLASSES):
                found.append(f"line {node.lineno}: {node.func.id}(..., {name})")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "fsdp"
            and not ast.unparse(node).startswith(f"{PACKAGE}.")  # a module path, not a field
        ):
            found.append(f"line {node.lineno}: .fsdp")
    return found


def test_engine_lookup_checker_finds_class_tests():
    source = (
        "if isinstance(model, (nn.Linear, tandem.parallel.fsdp.FullyShardedDataParallel)):\n"
        "    x = engine.fsdp\n"
        "ok = isinstance(engine, Engine)\n"
    )
    assert engine_lookups(source) == [
        "line 1: isinstance(..., FullyShardedDataParallel)",
        "line 2: .fsdp",
    ]


def test_nothing_outside_parallel_asks_which_engine_it_holds():
    wrong = [
        f"{path.relative_to(SRC)} {lookup}"
        for name, path in module_files().items()
        if not _under(name, "parallel")
        for lookup in engine_lookups(path.read_text(), str(path))
    ]
    assert not wrong, "ask the Engine or its adapters instead:\n" + "\n".join(wrong)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_the_launchers_modules_import_no_torch():
    # tandem run imports these before any worker starts: torch would cost seconds per launch.
    launcher = sorted(
        name
        for name in module_files()
        if any(_under(name, p) for p in ("launch", "job", "cli")) and not name.endswith("__main__")
    )
    result = _run(
        "import importlib, sys\n"
        f"for name in {launcher!r}:\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, name + ' imports torch'\n"
    )
    assert result.returncode == 0, result.stderr


def test_every_module_imports_first_in_a_fresh_interpreter():
    # Each module is imported with no tandem module loaded before it (torch stays loaded, to
    # keep this to one process): an import order that only works after another module ran
    # fails here.
    modules = sorted(name for name in module_files() if not name.endswith("__main__"))
    result = _run(
        "import importlib, sys, torch\n"
        f"for name in {modules!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'tandem' or m.startswith('tandem.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        raise SystemExit(f'{name}: {type(e).__name__}: {e}')\n"
    )
    assert result.returncode == 0, result.stderr


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
