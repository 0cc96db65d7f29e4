"""A shuffling sampler for huge data sets: a keyed bijection on [0, n), never a stored permutation.

torch's ``DistributedSampler`` materializes ``randperm(n)`` every epoch, on every rank: 800 MB of
int64 at n = 10^8 (and several GB once ``.tolist()`` boxes it), seconds before the first index.
:class:`BijectiveSampler` instead computes the permutation's j-th element on demand, so its memory
does not depend on n and any index is available in O(1):

1. **Domain.** Pad [0, n) to [0, 4^h), the smallest power of four >= n, so a value splits into two
   h-bit halves (a *balanced* Feistel network, the well-studied case).
2. **Feistel network.** ``ROUNDS`` rounds of ``(L, R) -> (R, L xor F_k(R))`` with
   ``F_k(R) = splitmix64(R xor k)``: a permutation of [0, 4^h) whatever F is, and with a
   well-mixing F and 8 rounds its outputs pass statistical tests for a random permutation.
3. **Cycle walking.** A value that lands in [n, 4^h) is encrypted again until it lands in [0, n).
   This restricts the permutation of the domain to one of [0, n) (the walk stays on the cycle that
   started in [0, n), so it ends); since 4^h <= 4n the expected walk, 4^h / n, is at most 4.
4. **Keys.** Round keys are a splitmix64 stream seeded from (seed, epoch): same pair, same
   permutation, on every rank and every run.

Sharding is torch's, so the two samplers are drop-in for each other: rank r takes global positions
r, r+R, r+2R, ... of a list padded by wrapping (position j >= n holds the element of position
j - n, as torch repeats the permutation's head) or cut to a multiple of R with ``drop_last``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from tandem.data.ranks import replicas_and_rank

ROUNDS = 8
MAX_N = 2**63  # indices must fit torch's int64; positions (< n + R) then fit uint64 arithmetic

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB

# __iter__ yields its first indices one by one from the scalar path (microseconds each, where a
# fresh process's first numpy calls take milliseconds), then computes numpy batches that grow so
# that per-batch overhead vanishes.
_SCALAR_HEAD = 64
_MAX_BATCH = 8192


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit ints in which every input bit flips about
    half the output bits."""
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def round_keys(seed: int, epoch: int, rounds: int = ROUNDS) -> tuple[int, ...]:
    """The Feistel round keys of (seed, epoch): ``rounds`` 64-bit ints from a splitmix64 stream.

    Args:
        seed: a non-negative int of any size (all its bits count).
        epoch: any int; negative epochs are taken modulo 2^64.
        rounds: how many keys.

    Example::

        round_keys(0, 0) != round_keys(0, 1)  # True
    """
    state = _mix64(0x5EED ^ seed.bit_length())
    while True:  # fold every 64-bit limb of the seed, so seeds past 2^64 stay distinct
        state = _mix64(state ^ (seed & _M64))
        seed >>= 64
        if not seed:
            break
    # Mixing before combining keeps (seed, epoch) and (seed + 1, epoch - 1) unrelated.
    state = _mix64(state ^ _mix64((epoch + _GOLDEN) & _M64))
    return tuple(_mix64((state + (r + 1) * _GOLDEN) & _M64) for r in range(rounds))


def _half_bits(n: int) -> int:
    """h such that 4^h is the smallest power of four >= n (h >= 1, so the halves are never
    empty)."""
    return max(1, ((n - 1).bit_length() + 1) // 2)


def _permute(x: int, n: int, keys: tuple[int, ...], h: int) -> int:
    """The keyed permutation of [0, n) at x: Feistel rounds, cycle-walked into [0, n)."""
    mask = (1 << h) - 1
    while True:
        left, right = x >> h, x & mask
        for k in keys:  # _mix64 inlined: this loop is the scalar path's whole cost
            z = right ^ k
            z = ((z ^ (z >> 30)) * _C1) & _M64
            z = ((z ^ (z >> 27)) * _C2) & _M64
            left, right = right, left ^ ((z ^ (z >> 31)) & mask)
        x = (left << h) | right
        if x < n:
            return x


def _feistel_np(x: np.ndarray, keys: tuple[int, ...], h: int) -> np.ndarray:
    """One Feistel encryption of every element of a uint64 array (uint64 products wrap mod 2^64,
    which is the arithmetic splitmix64 wants)."""
    mask = np.uint64((1 << h) - 1)
    left, right = x >> np.uint64(h), x & mask
    for k in keys:
        z = right ^ np.uint64(k)
        z ^= z >> np.uint64(30)
        z *= np.uint64(_C1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_C2)
        z ^= z >> np.uint64(31)
        z &= mask
        z ^= left
        left, right = right, z
    return (left << np.uint64(h)) | right


def _permute_np(x: np.ndarray, n: int, keys: tuple[int, ...], h: int) -> np.ndarray:
    """:func:`_permute` of every element of a uint64 array: walk only the elements still out of
    range, so each pass costs in proportion to what is left (about a quarter or less each time)."""
    y = _feistel_np(x, keys, h)
    out = np.flatnonzero(y >= np.uint64(n))
    while out.size:
        y[out] = _feistel_np(y[out], keys, h)
        out = out[y[out] >= np.uint64(n)]
    return y


class BijectiveSampler(Sampler[int]):
    """Shuffles [0, n) with a keyed bijection: memory flat in n, first index in microseconds.

    Every epoch is a full permutation of [0, n), fixed by (seed, epoch) and the same on every
    rank; ranks take disjoint strided shards of it, padded or dropped exactly as torch's
    ``DistributedSampler`` does, so all ranks have the same length. Any index is random access
    (``sampler[i]``, :meth:`permute`), which makes resuming mid-epoch O(1). Works for any
    ``n <= 2**63``; the permutation differs from torch's (this is not ``randperm``).

    Args:
        n_or_dataset: the number of samples, or a dataset whose ``len()`` it is.
        num_replicas: number of ranks sharing the data; default ``tandem.world().world_size``.
        rank: this rank, in [0, num_replicas); default ``tandem.world().rank``.
        seed: non-negative int; with the epoch it fixes the permutation, so it must be the same
            on every rank.
        drop_last: cut the tail so that every rank gets ``n // num_replicas`` samples, instead of
            padding every rank up to ``ceil(n / num_replicas)`` with samples from the head.

    Raises:
        ValueError: n < 1 or n > 2**63, num_replicas < 1, rank outside [0, num_replicas), or a
            negative seed.

    Example::

        sampler = tandem.data.BijectiveSampler(10**11, seed=1234)
        loader = DataLoader(dataset, batch_size=256, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)  # a new permutation each epoch
            for batch in loader:
                ...
        sampler[5]  # this rank's 6th index of the epoch, without iterating
    """

    def __init__(
        self,
        n_or_dataset: int | Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        n = _length(n_or_dataset)
        num_replicas, rank = replicas_and_rank(num_replicas, rank)
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.n = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.drop_last = drop_last
        # torch's arithmetic, so that len() and the shards match DistributedSampler's
        if drop_last:
            self.num_samples = n // num_replicas
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self._h = _half_bits(n)
        self._position = 0  # indices the current iteration has handed out (state_dict's)
        self._resume_at = 0  # where the next __iter__ starts: set by load_state_dict, used once
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's permutation; call it before each epoch, as with torch's sampler.

        A pending resume point (from :meth:`load_state_dict`) survives setting the same epoch
        again, as a training loop does right after loading, and is dropped for any other epoch.

        Args:
            epoch: the epoch number; the same on every rank.

        Example::

            sampler.set_epoch(3)
        """
        if epoch != getattr(self, "epoch", None):
            self._resume_at = 0
        self.epoch = epoch
        self._keys = round_keys(self.seed, epoch)

    def permute(self, j: int) -> int:
        """The element at global position j of this epoch's permutation of [0, n).

        Args:
            j: a position in [0, n).

        Example::

            sorted(s.permute(j) for j in range(s.n)) == list(range(s.n))  # True
        """
        if not 0 <= j < self.n:
            raise IndexError(f"position {j} not in [0, {self.n})")
        return _permute(j, self.n, self._keys, self._h)

    def index(self, i: int) -> int:
        """This rank's i-th index of the epoch, in O(1): what the i-th step of ``iter`` yields.

        Args:
            i: in [0, len(self)); negative i counts from the end, like a list.

        Example::

            assert sampler.index(0) == next(iter(sampler))
        """
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} not in [0, {self.num_samples}) on rank {self.rank}")
        # The one place that maps a rank's step to a global position: strided, then wrapped.
        j = (self.rank + i * self.num_replicas) % self.n
        return _permute(j, self.n, self._keys, self._h)

    __getitem__ = index

    def indices(self, start: int, stop: int) -> np.ndarray:
        """This rank's indices ``start .. stop-1`` of the epoch as an int64 array, vectorized.

        Args:
            start, stop: a range within [0, len(self)].

        Example::

            batch = sampler.indices(0, 256)  # equals [sampler[i] for i in range(256)]
        """
        if not 0 <= start <= stop <= self.num_samples:
            raise IndexError(f"range [{start}, {stop}) not within [0, {self.num_samples}]")
        steps = np.arange(start, stop, dtype=np.uint64)
        j = np.uint64(self.rank) + steps * np.uint64(self.num_replicas)
        j %= np.uint64(self.n)
        return _permute_np(j, self.n, self._keys, self._h).astype(np.int64)

    def __iter__(self) -> Iterator[int]:
        start, self._resume_at = self._resume_at, 0
        return self._generate(start)

    def _generate(self, start: int) -> Iterator[int]:
        self._position = start
        while self._position < min(start + _SCALAR_HEAD, self.num_samples):
            index = self.index(self._position)
            self._position += 1
            yield index
        batch = _SCALAR_HEAD
        while self._position < self.num_samples:
            stop = min(self._position + batch, self.num_samples)
            for index in self.indices(self._position, stop).tolist():
                self._position += 1
                yield index
            batch = min(2 * batch, _MAX_BATCH)

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and how many indices the current iteration handed out.

        A ``DataLoader`` draws indices ahead of the batches it has returned (prefetching), so
        for an exact resume store the count of samples actually consumed as ``position``.

        Example::

            state = sampler.state_dict()  # {"epoch": 3, "position": 1024, ...}
            state["position"] = batches_done * batch_size  # with a prefetching DataLoader
        """
        return {
            "epoch": self.epoch,
            "position": self._position,
            "seed": self.seed,
            "n": self.n,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``iter`` continues the stored epoch at the stored position, in O(1).

        Args:
            state: from :meth:`state_dict`; its seed, n and num_replicas must match this
                sampler's, since a position means nothing in another permutation or shard.

        Raises:
            ValueError: a mismatch, or a position outside [0, len(self)].

        Example::

            sampler.load_state_dict(checkpoint["sampler"])
            sampler.set_epoch(checkpoint["sampler"]["epoch"])  # keeps the resume point
        """
        for key in ("seed", "n", "num_replicas"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"state has {key}={state[key]} but this sampler has {getattr(self, key)}"
                )
        position = state["position"]
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"position {position} not in [0, {self.num_samples}]")
        self.set_epoch(state["epoch"])
        self._resume_at = self._position = position


def _length(n_or_dataset: int | Sized) -> int:
    if isinstance(n_or_dataset, bool):
        raise TypeError(f"n_or_dataset must be an int or a sized dataset, got {n_or_dataset!r}")
    n = n_or_dataset if isinstance(n_or_dataset, int) else len(n_or_dataset)
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n must be in [1, 2**63], got {n}")
    return n
