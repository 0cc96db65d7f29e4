"""StatefulLoader: a DataLoader whose state counts the samples it handed out, not those drawn.

torch's ``DataLoader`` with worker processes draws indices from its sampler ahead of the batches
it returns (``num_workers * prefetch_factor`` batches in flight), so a sampler's own state taken
mid-epoch counts samples never trained on: a resume from it skips them. torchdata's
``StatefulDataLoader`` answers this by remembering the sampler's state at the moment each
batch's indices were drawn and reporting the one that belongs to the last batch it yielded;
this loader does the same on top of torch's own ``DataLoader`` (nothing of its iterators is
copied or patched), for any sampler with ``state_dict()`` / ``load_state_dict()``.

How: the loader's batch sampler is ours. It draws each batch's indices from the sampler and
snapshots ``sampler.state_dict()`` after each one, queueing the snapshot after a batch's last
index with the batch's number. Batches come back in the order they were drawn (``in_order``),
so when the loader yields batch ``k`` the snapshot numbered ``k`` is the sampler's state after
exactly the batches handed out. (Snapshotting per index, not per batch, keeps the state of the
epoch's last batch from being the sampler's "exhausted" state, which the draw that finds the
end would leave.)

Example::

    sampler = tandem.data.DistributedSampler(dataset, seed=0)
    loader = tandem.data.StatefulLoader(dataset, batch_size=32, sampler=sampler, num_workers=4)
    if resuming:
        loader.load_state_dict(checkpoint["loader"])
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...
            checkpoint["loader"] = loader.state_dict()   # counts the batches trained on
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sized
from typing import Any, Generic, Protocol, TypeVar

from torch.utils.data import DataLoader, Dataset, Sampler

from tandem.data.lookahead import position_vouched

T_co = TypeVar("T_co", covariant=True)


class StatefulSampler(Protocol):
    """What the loader needs of a sampler: indices, and a state to save and load."""

    def __iter__(self) -> Iterator[int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


# DataLoader arguments this loader sets itself (it passes its own batch sampler).
_OWN = ("batch_sampler", "shuffle")


class StatefulLoader(Generic[T_co]):
    """A ``DataLoader`` whose ``state_dict()`` is the sampler's state after the batches it yielded.

    Use it where ``DataLoader(dataset, batch_size, sampler=sampler, ...)`` would be used; all of
    ``DataLoader``'s other arguments pass through (``num_workers``, ``prefetch_factor``,
    ``collate_fn``, ``pin_memory``, ``persistent_workers``, ``worker_init_fn``, ``generator``,
    ...). ``state_dict()`` holds ``"sampler"``, the sampler's ``state_dict()`` as it was right
    after the last yielded batch's indices were drawn, whatever the workers prefetched since, and
    ``"batches"``, how many batches the current iteration has yielded. After the epoch's last
    batch the state says the epoch is done (a tandem sampler's position is its length): loading
    it and iterating the same epoch yields nothing; ``set_epoch`` to the next one runs it whole.

    ``load_state_dict`` hands the sampler part to the sampler; the next iteration yields the
    rest of the saved epoch (with :class:`tandem.data.DistributedSampler` also at another world
    size). Worker processes start afresh: random transforms in them repeat after a resume only
    if they are seeded per sample.

    Args:
        dataset: the map-style data set.
        batch_size: samples per batch.
        sampler: where indices come from; it must have ``state_dict()`` and
            ``load_state_dict()`` (e.g. :class:`tandem.data.DistributedSampler`).
        drop_last: drop the last batch if it is smaller than ``batch_size``.
        **loader_kwargs: the other arguments of ``torch.utils.data.DataLoader``.

    Raises:
        ValueError: a sampler without ``state_dict``/``load_state_dict``, ``batch_size < 1``,
            ``batch_sampler`` or ``shuffle`` given (the sampler decides the order), or
            ``in_order=False`` (batches out of order would pair with the wrong snapshots).

    Example::

        loader = StatefulLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)
        for step, batch in enumerate(loader):
            train(batch)
            if step == 2:
                torch.save({"loader": loader.state_dict()}, "ckpt.pt")   # 3 batches' samples
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int = 1,
        *,
        sampler: StatefulSampler,
        drop_last: bool = False,
        **loader_kwargs: Any,
    ) -> None:
        for name in ("state_dict", "load_state_dict"):
            if not callable(getattr(sampler, name, None)):
                raise ValueError(
                    f"StatefulLoader needs a sampler with state_dict() and load_state_dict(); "
                    f"{type(sampler).__name__} has no {name}(). Use "
                    "tandem.data.DistributedSampler (one process too: num_replicas=1, rank=0)"
                )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        given = [name for name in _OWN if loader_kwargs.get(name) not in (None, False)]
        if given:
            raise ValueError(
                f"StatefulLoader sets {given} itself: the sampler decides the order and the "
                "loader batches it; pass sampler= and batch_size="
            )
        if loader_kwargs.get("in_order", True) is False:
            raise ValueError(
                "StatefulLoader needs in_order=True: it pairs each batch with the sampler state "
                "drawn for it, in the order the batches were drawn"
            )
        for name in _OWN:
            loader_kwargs.pop(name, None)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self._batches = _SnapshotBatches(sampler, batch_size, drop_last)
        #: The torch DataLoader doing the loading (its batch sampler takes the snapshots).
        self.loader: DataLoader[T_co] = DataLoader(
            dataset, batch_sampler=self._batches, **loader_kwargs
        )
        self._yielded = 0  # batches the current iteration has yielded
        self._state: dict[str, Any] | None = None  # the sampler's state after those batches

    def __len__(self) -> int:
        """Batches in a whole epoch (``len(sampler) / batch_size``, rounded as ``drop_last``)."""
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        # The sampler's iterator is made here, before the DataLoader's (whose workers start
        # drawing at once), so that the state before the first batch is this iteration's start.
        self._state = self._batches.start()
        self._yielded = 0
        return self._yield(iter(self.loader), self._batches.iteration)

    def _yield(self, batches: Iterator[Any], iteration: int) -> Iterator[Any]:
        for batch in batches:
            if iteration == self._batches.iteration:  # an abandoned iteration moves nothing
                self._yielded += 1
                self._state = self._batches.state_after(self._yielded)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``{"sampler": the sampler's state after the batches yielded, "batches": their count}``.

        Before any iteration it is the sampler's own state (a loaded resume point included).

        Example::

            torch.save({"model": model.state_dict(), "loader": loader.state_dict()}, path)
        """
        sampler = self._state if self._state is not None else self.sampler.state_dict()
        return {"sampler": sampler, "batches": self._yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields the rest of the saved epoch.

        Args:
            state: a :meth:`state_dict` (its ``"sampler"`` goes to the sampler, which checks it).

        Raises:
            ValueError: ``state`` has no ``"sampler"``; whatever the sampler raises.

        Example::

            loader.load_state_dict(torch.load(path)["loader"])
        """
        if "sampler" not in state:
            raise ValueError(f"loader state lacks 'sampler'; it has {sorted(state)}")
        self.sampler.load_state_dict(state["sampler"])
        self._state, self._yielded = None, 0


class _SnapshotBatches(Sampler[list[int]]):
    """The loader's batch sampler: batches of the sampler's indices, each with its snapshot."""

    def __init__(self, sampler: StatefulSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.iteration = 0  # which StatefulLoader iteration is live
        self._source: Iterator[int] | None = None
        self._pending: deque[tuple[int, dict[str, Any]]] = deque()

    def start(self) -> dict[str, Any]:
        """Begin an iteration: the sampler's iterator, and its state before any batch."""
        self.iteration += 1
        self._source = iter(self.sampler)
        self._pending.clear()
        return self._snapshot()

    def state_after(self, k: int) -> dict[str, Any]:
        """The snapshot taken when batch ``k`` (from 1) of the live iteration was drawn."""
        while self._pending[0][0] < k:  # batches before k are behind us for good
            self._pending.popleft()
        number, state = self._pending[0]
        assert number == k, f"batch {k} yielded, but the next snapshot is batch {number}'s"
        return state

    def _snapshot(self) -> dict[str, Any]:
        # The caller vouches for this position: it is taken right after the draw it belongs to.
        with position_vouched():
            return self.sampler.state_dict()

    def __len__(self) -> int:
        n = len(self.sampler) if isinstance(self.sampler, Sized) else 0
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: a DataLoader iterator calls iter() on its batch sampler twice as it is
        # made (in __init__ and _reset) and advances only the second, so nothing here may run
        # before the first next().
        source, self._source = self._source, None
        if source is None:  # iterated without StatefulLoader.__iter__ (the bare .loader)
            self.start()
            source, self._source = self._source, None
        assert source is not None
        for k in itertools.count(1):
            batch: list[int] = []
            state = None
            with position_vouched():
                for index in itertools.islice(source, self.batch_size):
                    batch.append(index)
                    state = self.sampler.state_dict()
            if not batch or (self.drop_last and len(batch) < self.batch_size):
                return
            assert state is not None  # set with the batch's last index
            self._pending.append((k, state))
            yield batch
