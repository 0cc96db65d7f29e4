"""Capture and restore one process's random number generators, for exact resumption.

A resumed run draws the same dropout masks, augmentations and shuffles as the uninterrupted run
only if every generator it draws from continues where it stopped: Python's ``random``, NumPy's
global ``np.random`` and torch's CPU and CUDA default generators. The captured state holds only
tensors, ints, floats, strings and None, so it survives a checkpoint loaded with
``torch.load(..., weights_only=True)``.

Each rank has its own generator states; the Trainer captures them on every rank and saves the
list, and each rank restores its own entry. A rank that has no entry (a run resumed with more
processes than saved it) seeds its generators from :func:`derived_seed` with :func:`seed_rng`.
"""

from __future__ import annotations

import base64
import hashlib
import random
import warnings
from typing import Any

import numpy as np
import torch

_KEYS = ("python", "numpy", "torch")


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states, as plain data that ``weights_only`` loading accepts.

    CUDA generators are captured only when CUDA is already initialized in this process: asking
    for their state would otherwise initialize CUDA (a context on the GPU for a CPU-only run, and
    trouble for later forks), and a process that never initialized CUDA has drawn nothing from
    those generators, so there is nothing to resume.

    Returns:
        ``{"python": ..., "numpy": ..., "torch": uint8 tensor, "cuda": [uint8 tensor per
        device]}``; pass it to :func:`restore_rng_state`.

    Example::

        state = capture_rng_state()
        a = torch.rand(3)
        restore_rng_state(state)
        assert torch.equal(torch.rand(3), a)
    """
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=True)
    if not isinstance(np_state, tuple):
        # Only the legacy MT19937 generator has the tuple form; anything else was put there by
        # hand and we would not know how to restore it exactly.
        raise ValueError(f"np.random uses {np_state['bit_generator']}, expected MT19937")
    name, keys, pos, has_gauss, cached_gaussian = np_state
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return {
        # The words are 32-bit unsigned; int64 holds them exactly (int32 would not).
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "bit_generator": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state().clone(),
        "cuda": cuda,
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's generators to a state from :func:`capture_rng_state`.

    CUDA states are restored when CUDA is available (a state captured on a CPU-only process has
    none, and the CUDA generators are left alone). A different number of GPUs than at capture
    restores the devices both have and warns: the run continues, but not bit-for-bit.

    Args:
        state: the dict :func:`capture_rng_state` returned, possibly after a checkpoint round
            trip (tensors on any device).

    Raises:
        ValueError: ``state`` lacks one of ``"python"``, ``"numpy"``, ``"torch"``.

    Example::

        ckpt = load_checkpoint(run_dir)
        restore_rng_state(ckpt["state"]["rng"][rank])
    """
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise ValueError(f"RNG state lacks {missing}; it has {sorted(state)}")
    py = state["python"]
    internal = tuple(int(x) for x in py["internal"].tolist())
    random.setstate((py["version"], internal, py["gauss_next"]))
    npy = state["numpy"]
    keys = npy["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state(
        (npy["bit_generator"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    _restore_cuda(list(state.get("cuda") or []))


def compact_rng_state() -> dict[str, Any]:
    """This process's generator states as small JSON-ready data, fast enough for every step
    (recovery in memory publishes them at each commit): the 32-bit words packed as bytes,
    base64-encoded. :func:`expand_rng_state` turns it into :func:`capture_rng_state`'s form.

    Example::

        compact = compact_rng_state()
        a = torch.rand(3)
        restore_rng_state(expand_rng_state(json.loads(json.dumps(compact))))
        assert torch.equal(torch.rand(3), a)
    """
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return {
        "python": [version, _b64(np.asarray(internal, dtype=np.uint32).tobytes()), gauss_next],
        "numpy": [name, _b64(np.asarray(keys, dtype=np.uint32).tobytes()), int(pos), int(has_gauss),
                  float(cached_gaussian)],
        "torch": _b64(torch.get_rng_state().numpy().tobytes()),
        "cuda": cuda,
    }  # fmt: skip


def expand_rng_state(compact: dict[str, Any]) -> dict[str, Any]:
    """:func:`compact_rng_state`'s data in :func:`capture_rng_state`'s form (for
    :func:`restore_rng_state`, or a checkpoint)."""
    version, internal, gauss_next = compact["python"]
    name, keys, pos, has_gauss, cached_gaussian = compact["numpy"]
    return {
        "python": {
            "version": version,
            "internal": torch.from_numpy(_words(internal)),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "bit_generator": name,
            "keys": torch.from_numpy(_words(keys)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached_gaussian,
        },
        "torch": _bytes_tensor(compact["torch"]),
        "cuda": [_bytes_tensor(s) for s in compact["cuda"]],
    }


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _words(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.uint32).astype(np.int64)


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _restore_cuda(saved: list[torch.Tensor]) -> None:
    if not saved:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available != len(saved):
        warnings.warn(
            f"RNG state has {len(saved)} CUDA generator(s), this process sees {available}; "
            f"restoring the first {min(available, len(saved))}, so CUDA random draws will not "
            "repeat the original run exactly",
            stacklevel=3,
        )
    # set_rng_state_all queues the call when CUDA is not yet initialized, so this does not
    # initialize CUDA either.
    if available:
        torch.cuda.set_rng_state_all([s.cpu().to(torch.uint8) for s in saved[:available]])


def derived_seed(*parts: object) -> int:
    """A non-negative 63-bit seed from ``parts``, the same in every process and Python run.

    (Python's ``hash()`` of a string differs between processes; this does not.)

    Example::

        >>> derived_seed("tandem-rng", 0, 120, 3) == derived_seed("tandem-rng", 0, 120, 3)
        True
    """
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def states_digest(states: list[dict[str, Any]]) -> str:
    """A short hex digest of saved generator states (their torch CPU states, in order).

    A part for :func:`derived_seed` that differs from checkpoint to checkpoint, so that ranks
    added at a resume draw other numbers after each checkpoint, and the same after the same one.

    Example::

        seed = derived_seed("tandem.checkpoint.RNG", states_digest(saved), rank)
    """
    digest = hashlib.sha256()
    for state in states:
        digest.update(state["torch"].cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def seed_rng(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's CPU and CUDA generators.

    ``torch.manual_seed`` seeds the CUDA generators lazily: CUDA is not initialized here.

    Example::

        seed_rng(derived_seed("tandem-rng", seed, step, rank))
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seeds are 32-bit
    torch.manual_seed(seed)
