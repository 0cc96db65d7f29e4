"""Deprecated import path: the run directory's checkpoints are :mod:`tandem.checkpoint.run_dir`.

``tandem.train.checkpoint`` was documented before checkpointing became one package
(:mod:`tandem.checkpoint`); it keeps working, with a :class:`DeprecationWarning`, until the
release after 0.1.

Example::

    from tandem.checkpoint.run_dir import load_checkpoint   # the path to use now
"""

from __future__ import annotations

import warnings

from tandem.checkpoint.run_dir import (
    CHECKPOINTS_DIR,
    LATEST,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "LATEST",
    "CheckpointError",
    "checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

warnings.warn(
    "tandem.train.checkpoint moved to tandem.checkpoint.run_dir; the old path goes away in the "
    "release after 0.1",
    DeprecationWarning,
    stacklevel=2,
)
