"""Read once per group, share over the network: :class:`BroadcastLoader`.

On many nodes the storage is often what limits training: every rank reading its batches makes
as many reads as there are ranks. A BroadcastLoader lets one rank per group (the *leader*) touch
the storage and send the batches to the others.

The protocol, per batch, in both modes:

1. the leader takes the next batch from its loader and flattens it: its tensors, and a small
   header (the batch's structure with each tensor replaced by a slot, the tensors' shapes,
   dtypes and byte offsets, the non-tensor leaves as they are);
2. it encodes one message, a byte tensor on ``device``: the tensors' bytes, then the pickled
   header. A header is a batch, the end of the epoch or the leader's error, so the members stop
   when the leader's loader ends and raise when it raises, instead of waiting for a batch that
   will never come;
3. the message travels as two transfers: its sizes (so that a receiver allocates it, and batches
   may vary in shape), then the message itself: two round trips per batch, whatever its number
   of tensors and dtypes (a header sent with ``broadcast_object_list`` would add a third);
4. every rank, the leader included, yields the batch rebuilt from views into the message.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from tandem._dist import initialized
from tandem.data.batch_codec import (
    Header,
    decode,
    encode,
    error_header,
    flatten,
    unpack,
)

MODES = ("broadcast", "scatter")

Mode = Literal["broadcast", "scatter"]


class LoaderError(RuntimeError):
    """The leader's loader raised: raised on every member, with the leader's traceback."""


class _InvalidSource(ValueError):
    """``loader_or_factory`` cannot be used: a ValueError on every member."""


class BroadcastLoader:
    """A data loader of which only one rank per group reads; the others receive over the network.

    ``mode="broadcast"``: the leader iterates ``loader_or_factory`` and broadcasts each batch to
    the group. Every member of the group yields, batch for batch, exactly what the leader's loader
    yields: the group shares one stream of data. Give the leader the group's shard of the data
    set (for instance a ``DistributedSampler`` with ``num_replicas`` = the number of groups and
    ``rank`` = the group's index); each member then receives the batches it would have read
    itself from that shard, and the storage serves ``group size`` times fewer reads. This is for
    groups whose members need the same input: a group that splits one model, or that evaluates
    the same batch differently.

    ``mode="scatter"``: the leader reads one batch per member per step, each from that member's
    own loader, and sends each member its own batch. Every member yields exactly the batches its
    own loader yields, as if it had read them itself; reads do not fall, but only the leader
    touches the storage. A member whose loader ends early ends its epoch early (as it would have
    reading directly). Batches travel point to point (``send``/``recv``), not with ``scatter``
    (which needs equal shapes) nor a broadcast per member (which would send every batch to every
    member): each batch crosses the network once, to the rank that uses it.

    In both modes: tensors inside tuples, lists, dicts and named tuples are sent as tensors and
    arrive contiguous on ``device``; any other value (strings, ids, numbers, other objects) is
    pickled. ``len()`` is the length of this member's loader on the leader, sent once at
    construction. The constructor, every ``iter()`` and every batch are collective over the
    group: all members must construct the loader and consume the same number of batches (the
    same loop). An error of the leader's loader is raised on every member as
    :class:`LoaderError`. Without a process group (one process) it is a plain loader.

    Args:
        loader_or_factory: what the leader reads. In broadcast mode an iterable of batches (a
            ``torch.utils.data.DataLoader``) or a callable without arguments returning one. In
            scatter mode a sequence of iterables, one per member in group-rank order, or a
            callable ``factory(global_rank)`` returning that rank's iterable. Only the leader
            calls or iterates it; the other members may pass ``None``.
        group: the process group that shares a leader (created with ``dist.new_group`` on every
            rank); ``None`` for all ranks.
        leader: the global rank that reads; the group's rank 0 by default.
        mode: ``"broadcast"`` or ``"scatter"``.
        device: where received batches are put (and sent from): by default ``cuda:LOCAL_RANK``
            with NCCL, else ``cpu``.

    Example::

        # 4 ranks, groups [0, 1] and [2, 3]: ranks 0 and 2 read their group's half of the data
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        index = dist.get_rank() // 2
        sampler = DistributedSampler(dataset, num_replicas=2, rank=index)
        loader = BroadcastLoader(
            lambda: DataLoader(dataset, batch_size=32, sampler=sampler), group=groups[index]
        )
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for inputs, targets in loader:
                ...
    """

    def __init__(
        self,
        loader_or_factory: Iterable | Callable[..., Iterable] | Sequence[Iterable] | None,
        *,
        group: dist.ProcessGroup | None = None,
        leader: int | None = None,
        mode: Mode = "broadcast",
        device: torch.device | str | None = None,
    ) -> None:
        self.mode = mode
        self.group = group
        self.ranks, self.rank = _members(group)
        self.leader = self.ranks[0] if leader is None else leader
        self.device = torch.device(device) if device is not None else _default_device(group)
        self._loaders: dict[int, Iterable] = {}  # the leader's: member's global rank -> loader
        # Agree first, check second: once every member holds the same arguments, a wrong one
        # raises on all of them.
        self._check_same_arguments()
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; expected one of {MODES}")
        if self.leader not in self.ranks:
            raise ValueError(f"leader={self.leader} is not in the group's ranks {self.ranks}")
        self._length = self._open(loader_or_factory)

    @property
    def reads(self) -> bool:
        """Whether this rank is the leader, the one that reads from storage."""
        return self.rank == self.leader

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"the loader on rank {self.leader} has no len()")
        return self._length

    def __iter__(self) -> Iterator[Any]:
        return self._read() if self.reads else self._receive_all()

    def set_epoch(self, epoch: int) -> None:
        """Forward ``set_epoch`` to the leader's loaders (or their samplers) that have one.

        Example::

            loader.set_epoch(epoch)   # on every rank; only the leader's samplers need it
        """
        for loader in self._loaders.values():
            target = loader if hasattr(loader, "set_epoch") else getattr(loader, "sampler", None)
            set_epoch = getattr(target, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)

    # --- construction -----------------------------------------------------------------------

    def _check_same_arguments(self) -> None:
        """Raise on every member unless all of them name the same mode and leader.

        A rank that disagrees would wait for a different sender: a hang, not an error. A tensor
        all-gather (not an object one) so that it works on NCCL without a current device.
        """
        if len(self.ranks) == 1:
            return
        code = MODES.index(self.mode) if self.mode in MODES else -1
        mine = torch.tensor([code, self.leader], device=self.device)
        everyone = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(everyone, mine, group=self.group)
        seen = [(MODES[c] if c >= 0 else "?", lead) for c, lead in (t.tolist() for t in everyone)]
        if any(s != seen[0] for s in seen):
            described = ", ".join(
                f"rank {r}: mode={m!r} leader={lead}"
                for r, (m, lead) in zip(self.ranks, seen, strict=True)
            )
            raise ValueError(f"BroadcastLoader: the group's ranks disagree: {described}")

    def _open(self, loader_or_factory: Any) -> int | None:
        """The leader builds its loaders and sends their lengths; returns this member's length.

        Building may fail (a factory raising, a wrong number of loaders): the failure is sent
        instead of the lengths, so that every member raises it.
        """
        header, cause = None, None
        if self.reads:
            try:
                self._loaders = self._build(loader_or_factory)
                lengths = tuple(_length(loader) for loader in self._loaders.values())
                header = Header("ready", lengths=lengths)
            except _InvalidSource as exc:
                header = Header("invalid", error=f"BroadcastLoader on rank {self.leader}: {exc}")
            except Exception as exc:
                header, cause = error_header(exc, self.leader, "building the loader"), exc
            self._send(header, encode(header, [], self.device), to=None)
        else:
            header, _ = self._receive(from_group=True)
        if header.kind == "invalid":
            raise ValueError(header.error)
        if header.kind == "error":
            raise LoaderError(header.error) from cause
        mine = 0 if self.mode == "broadcast" else self.ranks.index(self.rank)
        return header.lengths[mine]

    def _build(self, source: Any) -> dict[int, Iterable]:
        """The leader's loaders by the global rank they read for; _InvalidSource if misused."""
        if self.mode == "broadcast":
            loaders = {self.leader: source() if _is_factory(source) else source}
        elif _is_factory(source):
            loaders = {r: source(r) for r in self.ranks}
        elif isinstance(source, Sequence) and len(source) == len(self.ranks):
            loaders = dict(zip(self.ranks, source, strict=True))
        else:
            got = f"{len(source)} loaders" if isinstance(source, Sequence) else repr(source)
            raise _InvalidSource(
                f"scatter mode needs a factory(rank) or one loader per member of the group "
                f"{self.ranks}; got {got}"
            )
        for rank, loader in loaders.items():
            if not hasattr(loader, "__iter__"):
                raise _InvalidSource(f"the loader for rank {rank} is not iterable: {loader!r}")
        return loaders

    # --- the leader's side ------------------------------------------------------------------

    def _read(self) -> Iterator[Any]:
        """Each step: read every member's next batch, deliver it, yield this rank's own."""
        streams = {member: _batches(loader) for member, loader in self._loaders.items()}
        step = 0
        while streams:
            own = []  # this rank's batch of the step, if its loader has not ended
            for member, batches in list(streams.items()):
                header, message, cause = self._next(batches, member, step)
                self._deliver(header, message, member)
                if header.kind == "error":
                    # The failing member was told by the delivery above; the others still
                    # reading expect a message next, and get the error instead of a hang.
                    for other in streams:
                        if other != member:
                            self._deliver(header, message, other)
                    raise LoaderError(header.error) from cause
                if header.kind == "end":
                    del streams[member]
                elif member == self.rank:
                    own.append(unpack(header, message))
            yield from own
            step += 1

    def _next(
        self, batches: Iterator[Any], member: int, step: int
    ) -> tuple[Header, torch.Tensor, Exception | None]:
        """The member's next batch encoded, or the end, or the error that reading or encoding
        it raised (with the exception itself, which stays on the leader: it may not pickle)."""
        try:
            header, tensors = flatten(next(batches))
            return header, encode(header, tensors, self.device), None
        except StopIteration:
            header, cause = Header("end"), None
        except Exception as exc:
            where = f"reading batch {step} of the epoch" + (
                f" for rank {member}" if self.mode == "scatter" else ""
            )
            header, cause = error_header(exc, self.leader, where), exc
        return header, encode(header, [], self.device), cause

    def _deliver(self, header: Header, message: torch.Tensor, member: int) -> None:
        # Broadcast mode: the batch is the whole group's. Scatter mode: it is one member's, and
        # goes to that member alone (the leader keeps its own).
        if self.mode == "broadcast":
            self._send(header, message, to=None)
        elif member != self.leader:
            self._send(header, message, to=member)

    # --- the members' side ------------------------------------------------------------------

    def _receive_all(self) -> Iterator[Any]:
        while True:
            header, message = self._receive(from_group=self.mode == "broadcast")
            if header.kind == "error":
                raise LoaderError(header.error)
            if header.kind == "end":
                return
            yield unpack(header, message)

    # --- transport: the only place that communicates ----------------------------------------

    def _send(self, header: Header, message: torch.Tensor, to: int | None) -> None:
        """The leader sends a message to one member (``to``, a global rank) or the whole group
        (``to=None``): its sizes first, so that the receivers can allocate it."""
        if len(self.ranks) == 1:
            return
        sizes = torch.tensor([message.numel(), header.nbytes], device=self.device)
        if to is None:
            dist.broadcast(sizes, src=self.leader, group=self.group)
            dist.broadcast(message, src=self.leader, group=self.group)
        else:
            dist.send(sizes, dst=to, group=self.group)
            dist.send(message, dst=to, group=self.group)

    def _receive(self, from_group: bool) -> tuple[Header, torch.Tensor]:
        """A member's side of ``_send``: the header and the message, from a broadcast to the
        group (``from_group``) or from a send to this member alone."""
        sizes = torch.empty(2, dtype=torch.int64, device=self.device)
        if from_group:
            dist.broadcast(sizes, src=self.leader, group=self.group)
        else:
            dist.recv(sizes, src=self.leader, group=self.group)
        total, data = sizes.tolist()
        message = torch.empty(total, dtype=torch.uint8, device=self.device)
        if from_group:
            dist.broadcast(message, src=self.leader, group=self.group)
        else:
            dist.recv(message, src=self.leader, group=self.group)
        return decode(message, data), message


# --- small helpers ---------------------------------------------------------------------------


def _is_factory(source: Any) -> bool:
    # A DataLoader is not callable; a callable that is also iterable is taken as the loader.
    return callable(source) and not hasattr(source, "__iter__")


def _batches(loader: Iterable) -> Iterator[Any]:
    # A generator, so that iter(loader) (which may raise: a DataLoader starting its workers)
    # runs inside the first next(), where reading errors are caught and sent.
    yield from loader


def _length(loader: Iterable) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _members(group: dist.ProcessGroup | None) -> tuple[list[int], int]:
    """The group's global ranks and this rank; ``([0], 0)`` without a process group."""
    if not initialized():
        if group is not None:
            raise ValueError("a group was given but no process group is initialized")
        return [0], 0
    # Not tandem._dist.global_ranks: a rank outside the group must still see who is in it.
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    rank = dist.get_rank()
    if rank not in ranks:
        raise ValueError(
            f"rank {rank} is not a member of the group {ranks}: only members construct its "
            "BroadcastLoader"
        )
    return ranks, rank


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    if initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")
