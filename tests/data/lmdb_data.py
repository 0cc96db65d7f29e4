"""Data sets for the LMDB tests, importable as ``tandem lmdb convert --dataset MODULE:NAME``.

Every sample is rebuilt from its index alone, so any process (a DataLoader worker, a forked
reader) can compute the expected value and compare it with what it read.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

N_SAMPLES = 24


def make_sample(i: int) -> Any:
    """A sample holding every supported kind of value, varying with ``i``."""
    g = torch.Generator().manual_seed(i)
    floats = torch.randn(i % 3 + 1, 4, generator=g)
    floats[0, 0] = math.nan if i % 2 else math.inf  # bit-exact round trip, NaN included
    rng = np.random.default_rng(i)
    return {
        "image": torch.randint(0, 256, (3, 5, 5), dtype=torch.uint8, generator=g),
        "features": floats,
        "label": i % 10,
        "tensors": (
            torch.arange(i, dtype=torch.int64),
            torch.rand(2, 3, generator=g).to(torch.bfloat16),
            torch.rand(5, generator=g).half(),
            torch.rand(2, 2, dtype=torch.complex64, generator=g),
            torch.rand(3, generator=g) > 0.5,
            torch.tensor(float(i)),  # 0-d
            torch.empty(0, 3),  # no elements
            torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        ),
        "numpy": [
            rng.standard_normal((2, i % 4 + 1)),
            np.arange(12.0).reshape(3, 4)[:, ::2],  # not contiguous
            np.arange(i, dtype=np.int16),
            np.arange(3, dtype=">i4"),  # big-endian stays big-endian
            np.array(["ab", "çd", str(i)]),
            np.array([(i, 1.5)], dtype=[("id", "<i4"), ("w", "<f8")]),  # record dtype
            np.array([f"2024-01-0{i % 9 + 1}"], dtype="datetime64[D]"),
            np.float32(i / 3),
            np.int64(-i),
            np.bool_(i % 2),
        ],
        "meta": {
            "name": f"sample-ü-{i}",
            "raw": bytes([i, 0, 255]),
            "big": 2**70 + i,
            "ratio": -i / 7,
            "flag": bool(i % 2),
            "none": None,
            3: ("int key",),
            (1, "a"): [],
            "empty": ({}, (), [], ""),
        },
    }


class MixedDataset:
    """A map-style data set of :func:`make_sample` values."""

    def __init__(self, n: int = N_SAMPLES) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return make_sample(i)


def mixed_dataset() -> MixedDataset:
    """The callable form of ``--dataset``."""
    return MixedDataset()


SMALL = MixedDataset(5)  # the attribute form of ``--dataset``


def assert_same(a: Any, b: Any, where: str = "sample") -> None:
    """``a`` and ``b`` are the same value: same types, dtypes, shapes and bits (NaN == NaN)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{a.shape} != {b}"
        bits_a = a.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, b.contiguous().reshape(-1).view(torch.uint8)), where
    elif isinstance(a, (np.ndarray, np.generic)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{a.shape} != {b}"
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
