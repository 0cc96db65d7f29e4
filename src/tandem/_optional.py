"""Optional dependencies: imported when a feature is used, named with the extra that installs them.

``import tandem`` needs torch and numpy only. LMDB files, progress bars, plots and the
TensorBoard logger need packages that ``pip install "tandem[lmdb]"``, ``"tandem[progress]"``,
``"tandem[plots]"`` and ``"tandem[tensorboard]"`` (or ``"tandem[all]"``) install; the code
that uses one calls :func:`require` at the point of use, so a missing package is an error that
says what to install, raised where the feature is used.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, *, extra: str) -> ModuleType:
    """Import ``module``, or raise ImportError naming the extra of tandem that installs it.

    Args:
        module: the module to import, e.g. ``"lmdb"`` or ``"matplotlib.figure"``.
        extra: the extra of tandem whose installation brings it, e.g. ``"lmdb"``.

    Raises:
        ImportError: ``module`` cannot be imported; the message names the distribution
            and ``pip install "tandem[EXTRA]"``, and the original error is its cause.

    Example::

        >>> require("json", extra="none").dumps([1])
        '[1]'
        >>> require("tandem_no_such_module", extra="plots")
        Traceback (most recent call last):
        ...
        ImportError: tandem_no_such_module is not installed: pip install "tandem[plots]"
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.partition(".")[0]
        missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").partition(".")[0] == top
        # Installed but broken (a missing shared library, say): say so, with the reason.
        problem = "is not installed" if missing else f"cannot be imported ({exc})"
        raise ImportError(f'{top} {problem}: pip install "tandem[{extra}]"', name=top) from exc
