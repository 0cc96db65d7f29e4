"""What each worker runs: a script, a module (as ``python -m``), an executable, or ``run_path``.

Checked in the launcher, before any worker starts, so a typo is one clear line within a
fraction of a second rather than N identical tracebacks. A module is looked up the way
``python -m`` will find it in the worker: the current directory first, then ``sys.path``; and
without importing anything (finding ``pkg.train`` by ``importlib.util.find_spec`` would execute
``pkg/__init__.py`` in the launcher, and raise ModuleNotFoundError when ``pkg`` is only in the
current directory, which the ``tandem`` console script does not have on its path).

Example::

    worker_command("train.py", ["--lr", "0.1"])        # [python, "-u", "train.py", "--lr", "0.1"]
    worker_command("pkg.train", [], module=True)        # [python, "-u", "-m", "pkg.train"]
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from importlib.machinery import PathFinder
from pathlib import Path

from tandem.launch.rendezvous import LaunchError

# torchrun's --run-path calls runpy.run_path in its worker; ours is a fresh interpreter running
# the same call, with sys.argv as the script sees it under torchrun.
RUN_PATH = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def worker_command(
    script: str,
    script_args: list[str],
    *,
    module: bool = False,
    no_python: bool = False,
    run_path: bool = False,
) -> list[str]:
    """The worker's command line, as torchrun builds it (``PYTHON_EXEC`` chooses the python).

    Raises:
        LaunchError: the script, module or executable does not exist; --no-python with -m.

    Example::

        worker_command("train.py", [], run_path=True)   # [python, "-u", "-c", RUN_PATH, ...]
    """
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if run_path:  # torchrun: "takes precedence over --no-python" (and over -m)
        _check_script(script, "--run-path")
        return [python, "-u", "-c", RUN_PATH, script, *script_args]
    if no_python:
        if module:
            raise LaunchError("--no-python and -m cannot be combined (as in torchrun)")
        if shutil.which(script) is None:
            raise LaunchError(f"executable {script!r} not found (with --no-python)")
        return [script, *script_args]
    if module:
        find_module(script)
        return [python, "-u", "-m", script, *script_args]
    _check_script(script, "")
    return [python, "-u", script, *script_args]


def _check_script(script: str, how: str) -> None:
    if not Path(script).is_file():
        with_how = f" (with {how})" if how else ""
        raise LaunchError(f"script {script!r} not found{with_how} (cwd: {os.getcwd()})")


def find_module(name: str, cwd: str | None = None) -> str:
    """Where ``python -m NAME`` started in ``cwd`` finds the module; LaunchError if nowhere.

    Packages are searched through their ``__path__`` locations without being imported.

    Example::

        >>> find_module("json.tool").endswith("tool.py")
        True
    """
    cwd = cwd or os.getcwd()
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        raise LaunchError(f"module {name!r} is not a dotted module name (-m takes pkg.mod)")
    # python -m puts the current directory first on sys.path; the launcher may not have it.
    spec = PathFinder.find_spec(parts[0], [cwd]) or importlib.util.find_spec(parts[0])
    if spec is None:
        raise LaunchError(
            f"module {name!r} not found by {sys.executable}: {parts[0]!r} is neither in the "
            f"current directory ({cwd}) nor on sys.path"
        )
    for i, part in enumerate(parts[1:], start=1):
        package = ".".join(parts[:i])
        locations = list(spec.submodule_search_locations or [])
        if not locations:
            raise LaunchError(f"module {name!r} not found: {package!r} is not a package")
        found = PathFinder.find_spec(f"{package}.{part}", locations)
        if found is None:
            raise LaunchError(
                f"module {name!r} not found: package {package!r} ({', '.join(locations)}) "
                f"has no module {part!r}"
            )
        spec = found
    if spec.submodule_search_locations is not None:
        # python -m runs a package's __main__; without one it fails in every worker.
        main = PathFinder.find_spec(f"{name}.__main__", list(spec.submodule_search_locations))
        if main is None:
            raise LaunchError(f"module {name!r} is a package without a __main__ module")
        spec = main
    return str(spec.origin)
