"""DistributedSampler: torch's indices, rank by rank, plus a state that resumes mid-epoch.

The indices are those of ``torch.utils.data.distributed.DistributedSampler`` for every argument
and epoch (the unit tests compare them), so switching a script to tandem changes no batch. What
torch lacks is ``state_dict``/``load_state_dict``: a job restarted mid-epoch continues with the
samples it had not yet seen instead of replaying the epoch from its start, at the same world
size or at another one.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from tandem.data.lookahead import drawn_by_worker_loader, is_vouched
from tandem.data.ranks import replicas_and_rank

# The fields a state must share with the sampler it is loaded into: with any of them different,
# the saved position points into another sequence of indices. (num_replicas may differ: the
# rest of the epoch is then dealt anew, see load_state_dict.)
_FIXED_FIELDS = ("dataset_len", "seed", "shuffle", "drop_last")


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
    every rank.

    Resuming at another world size: the ranks together had trained on the first
    ``position * num_replicas`` places of the epoch's order (dealing like cards makes that a
    prefix). A state saved with another ``num_replicas`` skips that prefix and deals the rest
    of the order to this world, padded (by repeating the rest from its start) or cut to a
    multiple of ``num_replicas`` as above: every sample not yet trained on comes once, none
    trained on comes again, apart from that padding. The state then records the prefix as
    ``offset``; the epoch after runs whole.

    A DataLoader with worker processes draws indices ahead of the batch it hands out, so the
    position of an iterator it draws from counts samples not yet trained on. ``state_dict()``
    warns in that case; checkpoint :class:`tandem.data.StatefulLoader`'s ``state_dict()``
    instead, which counts the batches it yielded.

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
        self.num_samples = _share(n, num_replicas, drop_last)
        self.total_size = self.num_samples * num_replicas
        # _resume: (offset, position) where the next iter() starts (set by load_state_dict,
        # used once). _offset: places of the epoch's order that the live iterator skips (trained
        # on at another world size); _position: indices the live iterator has yielded, counted
        # from its dealing's start (equal to the resume point while a resume is pending).
        # _live: which iterator is live; an abandoned one must not move the position.
        # _ahead: the live iterator is drawn by a DataLoader with workers (its count runs ahead).
        self._resume = (0, 0)
        self._offset = 0
        self._position = 0
        self._live = 0
        self._ahead = False

    def __iter__(self) -> Iterator[int]:
        if len(self.dataset) != self.dataset_len:
            raise ValueError(
                f"the data set's length changed from {self.dataset_len} to "
                f"{len(self.dataset)} after the sampler was built"
            )
        # The bookkeeping happens here, not in the generator, so that it takes effect at iter()
        # even if the first next() comes later.
        (self._offset, start), self._resume = self._resume, (0, 0)
        self._position = start
        self._live += 1
        self._ahead = False
        return self._yield(self._indices(self._offset, start), self._live)

    def _indices(self, offset: int, start: int) -> list[int]:
        """This rank's indices of the current epoch after ``offset`` places, from its
        ``start``-th on."""
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        # The one rule: rank r's j-th sample sits at position r + j * R of the dealt order made
        # R * share long. Padding repeats the dealt order from its start, so position p holds
        # rest[p % len(rest)]; with drop_last the length is <= len(rest) and the modulo never
        # wraps. The dealt order is the epoch's order, or after a resume at another world size
        # what that order has left after the offset places trained on before.
        rest = order[offset:]
        total = _share(n - offset, self.num_replicas, self.drop_last) * self.num_replicas
        # (Clamped: a rank resuming at the epoch's end starts past total, which arange refuses
        # rather than answering empty.)
        first = min(self.rank + start * self.num_replicas, total)
        positions = torch.arange(first, total, self.num_replicas)
        return rest[positions % max(len(rest), 1)].tolist()

    def _yield(self, indices: list[int], live: int) -> Iterator[int]:
        first = True
        for index in indices:
            if live == self._live:
                if first:
                    # Once per iterator: whoever draws the first index is the one iterating.
                    self._ahead, first = drawn_by_worker_loader(), False
                # Counted before the yield: once the caller holds the index it has been handed
                # out.
                self._position += 1
            yield index
        if live == self._live:
            self._offset = self._position = 0

    def __len__(self) -> int:
        """Indices per rank in a whole epoch, the same on every rank (also when resuming)."""
        return self.num_samples

    def current_len(self) -> int:
        """Indices per rank of the epoch in progress (or about to start after a load).

        ``len(self)``, except in an epoch resumed at another world size: then this rank's share
        of what that epoch had left, the same on every rank.

        Example::

            sampler.load_state_dict(state_from_another_world_size)
            steps_left = math.ceil(sampler.current_len() / batch_size)
        """
        return _share(self.dataset_len - self._offset, self.num_replicas, self.drop_last)

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
            self._resume = (0, 0)
            self._offset = self._position = 0
            self._live += 1  # an iterator of the old epoch no longer moves the position
            self._ahead = False
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands: epoch, position in it, and the arguments that fix the order.

        ``position`` counts the indices the current iterator has yielded (the pending resume
        point before ``iter()`` after ``load_state_dict``); it is 0 once an epoch is exhausted.
        ``offset`` is the number of places of the epoch's order trained on at another world size
        before this iterator's dealing began (0 unless resumed so).

        Warns (UserWarning) when a DataLoader with worker processes has drawn from this epoch's
        iterator (until the next ``set_epoch`` to another epoch, ``iter()`` or load): the
        position then counts indices drawn ahead of the batches trained on, and the sampler
        cannot tell how far the loader got. Checkpoint
        :class:`tandem.data.StatefulLoader`'s ``state_dict()`` instead.

        Example::

            torch.save({"model": model.state_dict(), "sampler": sampler.state_dict()}, path)
        """
        if self._ahead and not is_vouched():
            # The sampler cannot tell how far the loader got: with the whole share drawn (and
            # the position back at 0) batches may still be in flight, so it warns in any case.
            warnings.warn(
                f"DistributedSampler.state_dict(): a DataLoader with worker processes draws "
                f"this epoch's indices ahead of the batches it hands out, so position "
                f"{self._position} (epoch {self.epoch}) counts indices drawn, not trained on; "
                "resuming from it would skip samples (or replay them, once all were drawn). "
                "Checkpoint a tandem.data.StatefulLoader's state_dict() instead (it counts the "
                "batches yielded), or set position to batches_trained * batch_size yourself",
                stacklevel=2,
            )
        return {
            "epoch": self.epoch,
            "position": self._position,
            "offset": self._offset,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": self.dataset_len,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next ``iter()`` yields the rest of its epoch.

        With the same ``num_replicas`` the rest is exactly what the saving rank had left. With
        another ``num_replicas`` the places of the epoch's order all ranks had trained on
        (``offset + position * num_replicas`` of the state) are skipped and the rest is dealt
        to this world (see the class doc); the loaded state's ``position`` is then 0.

        Args:
            state: a ``state_dict()`` of a sampler over a data set of the same length with the
                same ``seed``, ``shuffle`` and ``drop_last`` (the rank and ``num_replicas`` may
                differ: positions advance in lock step). A state without ``offset`` (an older
                tandem's) has offset 0.

        Raises:
            ValueError: a field missing, one of those fields different (naming both values), or
                a position or offset outside what the state's epoch holds.

        Example::

            sampler.load_state_dict(torch.load(path)["sampler"])
        """
        missing = sorted({"epoch", "position", "num_replicas", *_FIXED_FIELDS} - set(state))
        if missing:
            raise ValueError(f"sampler state lacks {missing}; it has {sorted(state)}")
        for field in _FIXED_FIELDS:
            if state[field] != getattr(self, field):
                raise ValueError(
                    f"sampler state has {field}={state[field]!r} but this sampler has "
                    f"{field}={getattr(self, field)!r}: its position means other indices here"
                )
        offset, position = state.get("offset", 0), state["position"]
        replicas = state["num_replicas"]
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"sampler state has num_replicas={replicas!r}, expected an int >= 1")
        if not 0 <= offset <= self.dataset_len:
            raise ValueError(
                f"sampler state has offset {offset}, outside [0, {self.dataset_len}] (samples)"
            )
        dealt = _share(self.dataset_len - offset, replicas, self.drop_last)
        if not 0 <= position <= dealt:
            raise ValueError(
                f"sampler state has position {position}, outside [0, {dealt}] "
                "(indices per rank per epoch)"
            )
        if replicas != self.num_replicas:
            # What every rank of the saving world had trained on is a prefix of the dealt
            # order (ranks take places r, r + R, ...): skip it, padding included.
            offset, position = min(offset + position * replicas, self.dataset_len), 0
        self.epoch = state["epoch"]
        self._resume = (offset, position)
        self._offset, self._position = offset, position
        self._live += 1  # an iterator from before the load no longer moves the position
        self._ahead = False


def _share(n: int, num_replicas: int, drop_last: bool) -> int:
    """Indices per rank when ``n`` places are dealt to ``num_replicas`` ranks.

    Cutting the tail keeps floor(n / R) per rank, padding makes it ceil(n / R): torch's counts,
    written without its ceil of a negative fraction. Nothing to deal deals nothing.

    Example::

        >>> _share(10, 4, drop_last=False), _share(10, 4, drop_last=True), _share(0, 4, False)
        (3, 2, 0)
    """
    return n // num_replicas if drop_last else -(-n // num_replicas)
