"""DistributedSampler: torch's indices, rank by rank, plus a state that resumes mid-epoch.

The indices are those of ``torch.utils.data.distributed.DistributedSampler`` for every argument
and epoch (the unit tests compare them), so switching a script to tandem changes no batch. What
torch lacks is ``state_dict``/``load_state_dict``: a job restarted mid-epoch continues with the
samples it had not yet seen instead of replaying the epoch from its start.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from tandem.data.ranks import replicas_and_rank

# The fields a state must share with the sampler it is loaded into: with any of them different,
# the saved position points into another sequence of indices.
_FIXED_FIELDS = ("dataset_len", "num_replicas", "seed", "shuffle", "drop_last")


class DistributedSampler(Sampler[int]):
    """Each rank's share of a data set: the same indices as torch's sampler, and resumable.

    Every epoch orders the data set (a permutation drawn from a generator seeded with
    ``seed + epoch`` when ``shuffle``, else ``0..n-1``), makes that order a multiple of
    ``num_replicas`` long, and deals it out like cards: rank ``r`` takes positions
    ``r, r + num_replicas, r + 2 * num_replicas, ...``. So every rank runs the same number of
    steps, ``len(sampler)``, and all ranks together see every sample of an epoch.

    Making the order a multiple of ``num_replicas`` long:

    - ``drop_last=False`` (default) pads it by repeating indices from its start, as many times
      over as needed (3 samples on 8 ranks: ``0 1 2 0 1 2 0 1``). Those samples are seen twice
      in the epoch. In training that is harmless; in **evaluation it biases the metric** towards
      the repeated samples. Evaluate with :class:`tandem.data.EvalSampler`, which gives every
      sample exactly once.
    - ``drop_last=True`` cuts the tail instead, so up to ``num_replicas - 1`` samples are skipped
      this epoch (different ones each epoch when shuffling). With fewer samples than ranks every
      rank would get none: a ValueError.

    Resuming: ``state_dict()`` records the epoch and ``position``, the number of indices this
    rank's current iterator has yielded. After ``load_state_dict(state)`` the next ``iter()``
    yields exactly the rest of that epoch; once that iterator is exhausted the position is 0
    again and later epochs run whole, after ``set_epoch`` as usual. ``set_epoch`` with the saved
    epoch keeps the pending resume (the usual loop calls it before iterating); any other epoch
    drops it. Breaking off an iterator and calling ``iter()`` again starts the epoch afresh, as in
    torch. Positions advance in lock step across ranks, so the main rank's state can be loaded on
    every rank. A DataLoader draws indices ahead of the step it hands out (prefetch), so a
    position saved mid-epoch runs ahead of the steps taken by up to what the loader had in
    flight.

    Args:
        dataset: the data set; only its ``len`` is used, and it must not change.
        num_replicas: number of ranks sharing the data. Default: ``tandem.world().world_size``.
        rank: this rank, in ``[0, num_replicas)``. Default: ``tandem.world().rank``.
        shuffle: draw a new permutation every epoch; otherwise ``0..n-1`` in order.
        seed: base seed of the permutation, ``>= 0``; it must be the same on every rank.
        drop_last: cut the tail instead of padding (see above).

    Raises:
        ValueError: ``num_replicas < 1``, ``rank`` outside ``[0, num_replicas)``, a negative
            ``seed``, an empty data set, or ``drop_last`` with fewer samples than ranks.

    Example::

        sampler = tandem.data.DistributedSampler(dataset, seed=42)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        if resuming:
            sampler.load_state_dict(checkpoint["sampler"])
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
            for batch in loader:
                ...
                checkpoint["sampler"] = sampler.state_dict()
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        num_replicas, rank = replicas_and_rank(num_replicas, rank)
        n = len(dataset)
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if n == 0:
            raise ValueError("the data set is empty (len 0): there is nothing to sample")
        if drop_last and n < num_replicas:
            raise ValueError(
                f"drop_last=True with {n} samples and {num_replicas} replicas gives every rank "
                f"0 samples; use at least {num_replicas} samples or drop_last=False"
            )
        self.dataset = dataset
        self.dataset_len = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        # Cutting the tail keeps floor(n / R) per rank, padding makes it ceil(n / R): torch's
        # counts, written without its ceil of a negative fraction.
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)
        self.total_size = self.num_samples * num_replicas
        # _resume: where the next iter() starts (set by load_state_dict, used once).
        # _position: indices of this epoch the live iterator has yielded, counted from the
        # epoch's start (equal to _resume while a resume is pending).
        # _live: which iterator is live; an abandoned one must not move the position.
        self._resume = 0
        self._position = 0
        self._live = 0

    def __iter__(self) -> Iterator[int]:
        if len(self.dataset) != self.dataset_len:
            raise ValueError(
                f"the data set's length changed from {self.dataset_len} to "
                f"{len(self.dataset)} after the sampler was built"
            )
        # The bookkeeping happens here, not in the generator, so that it takes effect at iter()
        # even if the first next() comes later.
        start, self._resume = self._resume, 0
        self._position = start
        self._live += 1
        return self._yield(self._indices(start), self._live)

    def _indices(self, start: int) -> list[int]:
        """This rank's indices of the current epoch from its ``start``-th on."""
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        # The one rule: rank r's j-th sample sits at position r + j * R of the epoch's order made
        # total_size long. Padding repeats the order from its start, so position p holds
        # order[p % n]; with drop_last, total_size <= n and the modulo never wraps.
        # (Clamped: a rank resuming at the epoch's end starts past total_size, which arange
        # refuses rather than answering empty.)
        first = min(self.rank + start * self.num_replicas, self.total_size)
        positions = torch.arange(first, self.total_size, self.num_replicas)
        return order[positions % n].tolist()

    def _yield(self, indices: list[int], live: int) -> Iterator[int]:
        for index in indices:
            # Counted before the yield: once the caller holds the index it has been handed out.
            if live == self._live:
                self._position += 1
            yield index
        if live == self._live:
            self._position = 0

    def __len__(self) -> int:
        """Indices per rank in a whole epoch, the same on every rank (also when resuming)."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose permutation the next ``iter()`` draws.

        Call it before each epoch, with the same value on every rank; otherwise every epoch
        repeats the same order. A resume pending from ``load_state_dict`` survives a call with
        its own epoch and is dropped by any other.

        Args:
            epoch: the epoch number; it is added to ``seed``.

        Example::

            for epoch in range(epochs):
                sampler.set_epoch(epoch)
                for batch in loader:
                    ...
        """
        if epoch != self.epoch:
            self._resume = 0
            self._position = 0
            self._live += 1  # an iterator of the old epoch no longer moves the position
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands: epoch, position in it, and the arguments that fix the order.

        ``position`` counts the indices the current iterator has yielded (the pending resume
        point before ``iter()`` after ``load_state_dict``); it is 0 once an epoch is exhausted.

        Example::

            torch.save({"model": model.state_dict(), "sampler": sampler.state_dict()}, path)
        """
        return {
            "epoch": self.epoch,
            "position": self._position,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next ``iter()`` yields the rest of its epoch.

        Args:
            state: a ``state_dict()`` of a sampler over a data set of the same length with the
                same ``num_replicas``, ``seed``, ``shuffle`` and ``drop_last`` (the rank may
                differ: positions advance in lock step).

        Raises:
            ValueError: a field missing, one of those fields different (naming both values), or
                a position outside ``[0, len(self)]``.

        Example::

            sampler.load_state_dict(torch.load(path)["sampler"])
        """
        missing = sorted({"epoch", "position", *_FIXED_FIELDS} - set(state))
        if missing:
            raise ValueError(f"sampler state lacks {missing}; it has {sorted(state)}")
        mine = self.state_dict()
        for field in _FIXED_FIELDS:
            if state[field] != mine[field]:
                raise ValueError(
                    f"sampler state has {field}={state[field]!r} but this sampler has "
                    f"{field}={mine[field]!r}: its position means other indices here"
                )
        position = state["position"]
        if not 0 <= position <= self.num_samples:
            raise ValueError(
                f"sampler state has position {position}, outside [0, {self.num_samples}] "
                "(indices per rank per epoch)"
            )
        self.epoch = state["epoch"]
        self._resume = position
        self._position = position
        self._live += 1  # an iterator from before the load no longer moves the position
