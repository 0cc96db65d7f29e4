"""Data for many ranks: samplers, exact evaluation, LMDB, local staging and broadcast loading.

Imported lazily (PEP 562), like the rest of tandem: ``import tandem.data`` costs nothing until a
name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "DistributedSampler": "tandem.data.sampler",
    "EvalSampler": "tandem.data.eval_sampler",
    "BijectiveSampler": "tandem.data.bijective",
    "LMDBDataset": "tandem.data.lmdb",
    "convert_to_lmdb": "tandem.data.lmdb",
    "stage_local": "tandem.data.staging",
    "BroadcastLoader": "tandem.data.broadcast",
    "StatefulLoader": "tandem.data.stateful_loader",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tandem.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
