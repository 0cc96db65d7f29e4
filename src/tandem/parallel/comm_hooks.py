"""Deprecated import path: communication hooks are :mod:`tandem.parallel.ddp.comm_hooks`.

``tandem.parallel.comm_hooks`` was documented before DDP's modules became one package
(:mod:`tandem.parallel.ddp`); it keeps working, with a :class:`DeprecationWarning`, until the
release after 0.1.

Example::

    from tandem.parallel.ddp.comm_hooks import allreduce_hook   # the path to use now
"""

from __future__ import annotations

import warnings

from tandem.parallel.ddp.comm_hooks import (
    CommHook,
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)

__all__ = [
    "CommHook",
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
]

warnings.warn(
    "tandem.parallel.comm_hooks moved to tandem.parallel.ddp.comm_hooks; the old path goes away "
    "in the release after 0.1",
    DeprecationWarning,
    stacklevel=2,
)
