"""The end of a DDP backward: every rank learns whether any rank missed gradients.

A rank whose loss did not reach some parameter never gets their gradients. It still sends
zeros in their place, so that no rank waits for a collective this one would never issue; but
the mean is then wrong, and every rank must know. A non-zero count of missed gradients raises
:class:`UnusedParametersError` on every rank, naming each rank's parameters. How the count
travels depends on the device:

- On the CPU (Gloo) a collective of its own costs more than the check is worth (about 0.7 ms
  of CPU per step in thread hand-offs, measured on a 2-core machine). The check rides in the
  last bucket instead (:meth:`EndOfBackward.mark`): a rank with something to say puts NaN in that
  bucket's first element before its all-reduce, and since NaN plus anything is NaN, every rank
  reads NaN there after the sum. Only then do the ranks sum their counts, in a collective of
  its own, and sum that first element again from each rank's own value (:meth:`settle`): the
  same sum, bit for bit, so a step that carried a request is the step it would have been. A
  NaN gradient there comes out of the same two collectives unchanged.
- On a GPU, reading that element would make the CPU wait for the GPU every step: one small
  int32 all-reduce, issued after every bucket's own collectives, carries the count (and, with
  find_unused_parameters, which parameters were used anywhere); it is copied to host memory in
  the background and read at the next forward, unless the used map is needed now. The used map
  (find_unused_parameters, static_graph's first step) takes this collective on the CPU too.

A :class:`Rider` may add a few counts of its own, so that they cost no collective of their own:
the Trainer's stop and checkpoint requests ride here every step. The rider's values are taken
at launch (or at the mark) and their sums delivered once read (on a GPU, at the next forward).
A :class:`Vote` (recovery in memory's commit, :mod:`tandem.recovery`) rides beside it: the
reducer also tells it when a backward that reduces starts, when the backward's last collective is
about to be issued, and when every collective of the backward has completed on this rank.

Example::

    end_of_backward = EndOfBackward(names, group, device, wait=reducer.wait)
    end_of_backward.launch(missing=0, used=None)      # after the last bucket
    end_of_backward.read(missing=[], want_used=False)  # at the end of backward

    end_of_backward.mark(last.flat, missing=0)         # on the CPU: before the last bucket's sum
    end_of_backward.settle(last.flat, missing=[])      # and once it is done
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from tandem._dist import gather_objects, group_size
from tandem.doctor import records


class Rider(Protocol):
    """Counts that travel with the end-of-backward check (same number on every rank)."""

    def values(self) -> list[int]:
        """This rank's counts, taken now (called at launch, on every rank)."""
        ...

    def deliver(self, sums: list[int]) -> None:
        """The counts summed over ranks (called once the all-reduce is read)."""
        ...


class Vote(Rider, Protocol):
    """A commit vote that rides in a DDP backward (:mod:`tandem.recovery`): its counts travel as
    a :class:`Rider`'s, and the reducer calls it around the backward's collectives."""

    def starting(self) -> None:
        """The backward that will reduce the buckets started (its first gradient is ready):
        the vote may start its own work then, off the backward's path."""
        ...

    def entering(self) -> None:
        """Right before the backward's last gradient bucket is reduced: once that bucket's
        collective completes anywhere, every rank has been here."""
        ...

    def passed(self) -> None:
        """Every collective of the backward completed on this rank (a Gloo group, whose waits
        block the host: on NCCL the host does not know, and this is not called)."""
        ...


class UnusedParametersError(RuntimeError):
    """Some rank finished backward without a gradient for some parameters."""


class EndOfBackward:
    """The end-of-backward check of one DDP model (see the module docstring)."""

    def __init__(
        self,
        names: Sequence[str],
        group: dist.ProcessGroup | None,
        device: torch.device,
        wait: Callable[[dist.Work, str], None],
    ) -> None:
        self.names = list(names)
        self.group = group
        self.device = device
        self.wait = wait
        self.work: dist.Work | None = None
        self.counts = torch.zeros(1, dtype=torch.int32)
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._missing: list[int] = []
        self.rider: Rider | None = None
        self.vote: Vote | None = None  # rides after the rider
        # How many of the launched counts are the rider's and the vote's (the last ones).
        self._riding = 0
        self._voting = 0
        # mark() to settle(): this rank's counts, and its own first element before the mark.
        self._marked_values: list[int] = []
        self._own_first: torch.Tensor | None = None

    @property
    def launched(self) -> bool:
        """The all-reduce of this backward has been issued (and not read yet)."""
        return self.work is not None

    def launch(self, missing: int, used: Sequence[bool] | None) -> None:
        """Issue the all-reduce: how many gradients this rank missed, and its used map."""
        values = [missing] + ([int(u) for u in used] if used is not None else [])
        values += self._rider_values()
        host = torch.tensor(values, dtype=torch.int32)
        if group_size(self.group) == 1:
            # Nothing to agree with: the counts stay on the host and are read at once.
            self.counts = host
            return
        if self.device.type == "cuda":
            # From pageable memory the copy would make the CPU wait for the whole backward.
            host = host.pin_memory()
        self.counts = host.to(self.device, non_blocking=True)
        with records.tagged("DDP end-of-backward check"):
            self.work = dist.all_reduce(self.counts, group=self.group, async_op=True)

    def mark(self, flat: torch.Tensor, missing: int) -> None:
        """Before the last bucket's all-reduce (CPU): take this rank's counts, and mark ``flat``
        with NaN if any is non-zero (see the module doc). ``flat`` must not be empty."""
        self._marked_values = [missing, *self._rider_values()]
        self._own_first = flat[:1].clone()
        if any(self._marked_values):
            flat[0] = float("nan")

    def settle(self, flat: torch.Tensor, missing: list[int]) -> None:
        """After the marked bucket's all-reduce: if some rank marked it (or a gradient there was
        NaN), sum the counts, raise on every rank if any rank missed gradients, and sum the
        first element again from every rank's own value."""
        own, values, riding = self._own_first, self._marked_values, self._riding
        self._own_first = None
        assert own is not None, "settle() without mark()"
        if not bool(flat[:1].isnan()):
            if riding:
                self._deliver([0] * riding)  # no rank has a request (its mark would show)
            return
        counts = torch.tensor(values, dtype=torch.int32, device=flat.device)
        with records.tagged("DDP end-of-backward check"):
            work = dist.all_reduce(counts, group=self.group, async_op=True)
        self.wait(work, "end-of-backward check")
        sums = counts.tolist()
        if riding:
            self._deliver(sums[-riding:])
        if sums[0] != 0:
            self._raise(missing)
        # The same number of elements as the bucket: the backend splits and orders the sum
        # alike, so the first element gets the bits the unmarked sum would have given it.
        again = torch.zeros_like(flat)
        again[:1] = own
        with records.tagged("DDP end-of-backward check, first element again"):
            work = dist.all_reduce(again, group=self.group, async_op=True)
        self.wait(work, "end-of-backward check")
        flat[:1] = again[:1]

    def read(self, missing: list[int], want_used: bool) -> list[bool] | None:
        """Raise on every rank if any rank missed gradients; the agreed used map if wanted."""
        counts, work = self.counts, self.work
        self.work = None
        if work is not None:
            self.wait(work, "end-of-backward check")
        riding = self._riding
        if counts.device.type == "cpu" or want_used:
            values = counts.tolist()
            if riding:
                self._deliver(values[-riding:])
                values = values[:-riding]
            if values[0] != 0:
                self._raise(missing)
            return [bool(u) for u in values[1:]] if want_used else None
        # Only the missing count, and the rider's, come back (the used map is not wanted).
        wanted = torch.cat([counts[:1], counts[len(counts) - riding :]]) if riding else counts[:1]
        if self._host is None or self._host.numel() != wanted.numel():
            self._host = torch.zeros(wanted.numel(), dtype=counts.dtype, pin_memory=True)
        self._host.copy_(wanted, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        self._missing = missing
        return None

    def check_previous_step(self) -> None:
        """Raise the error deferred from the previous backward (GPU only)."""
        if self._event is None:
            return
        self._event.synchronize()
        self._event = None
        assert self._host is not None
        values = self._host.tolist()
        if len(values) > 1:
            self._deliver(values[1:])
        if values[0] != 0:
            self._raise(self._missing)

    def _rider_values(self) -> list[int]:
        # Taken once per backward, on every rank; their sums are delivered after the read.
        extra = self.rider.values() if self.rider is not None else []
        votes = self.vote.values() if self.vote is not None else []
        self._voting = len(votes)
        self._riding = len(extra) + len(votes)
        return extra + votes

    def _deliver(self, sums: list[int]) -> None:
        split = len(sums) - self._voting
        if self.rider is not None:
            self.rider.deliver(sums[:split])
        if self.vote is not None and self._voting:
            self.vote.deliver(sums[split:])

    def _raise(self, missing: list[int]) -> None:
        per_rank = gather_objects([self.names[i] for i in missing], self.group)
        lines = [f"rank {r}: {', '.join(n)}" for r, n in enumerate(per_rank) if n]
        raise UnusedParametersError(
            "tandem.DDP: these parameters received no gradient in this backward, so their "
            "gradients could not be averaged:\n  " + "\n  ".join(lines) + "\n"
            "If some parameters are legitimately unused in some steps, pass "
            "find_unused_parameters=True to tandem.DDP; otherwise make sure the loss depends "
            "on every parameter (e.g. every output of forward is used in the loss)."
        )
