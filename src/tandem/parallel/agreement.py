"""The end of a DDP backward: every rank learns whether any rank missed gradients.

A rank whose loss did not reach some parameter never gets their gradients. It still sends
zeros in their place, so that no rank waits for a collective this one would never issue; but
the mean is then wrong, and every rank must know. One small int32 all-reduce carries the count
of missed gradients (and, with find_unused_parameters, which parameters were used anywhere).
It is issued after every bucket's own collectives, so it is the same collective at the same
place on every rank; a non-zero count raises :class:`UnusedParametersError` on every rank,
naming each rank's parameters.

On a GPU, reading the count at once would make the CPU wait for the GPU every step: it is
copied to host memory in the background and read at the next forward, unless the used map is
needed now.

Example::

    agreement = Agreement(names, group, device, wait=reducer.wait)
    agreement.launch(missing=0, used=None)      # after the last bucket
    agreement.read(missing=[], want_used=False)  # at the end of backward
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tandem._dist import gather_objects, group_size
from tandem.doctor import records


class UnusedParametersError(RuntimeError):
    """Some rank finished backward without a gradient for some parameters."""


class Agreement:
    """The end-of-backward all-reduce of one DDP model (see the module docstring)."""

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

    @property
    def launched(self) -> bool:
        """The all-reduce of this backward has been issued (and not read yet)."""
        return self.work is not None

    def launch(self, missing: int, used: Sequence[bool] | None) -> None:
        """Issue the all-reduce: how many gradients this rank missed, and its used map."""
        values = [missing] + ([int(u) for u in used] if used is not None else [])
        self.counts = torch.tensor(values, dtype=torch.int32, device=self.device)
        if group_size(self.group) > 1:
            with records.tagged("DDP end-of-backward check"):
                self.work = dist.all_reduce(self.counts, group=self.group, async_op=True)

    def read(self, missing: list[int], want_used: bool) -> list[bool] | None:
        """Raise on every rank if any rank missed gradients; the agreed used map if wanted."""
        counts, work = self.counts, self.work
        self.work = None
        if work is not None:
            self.wait(work, "end-of-backward check")
        if counts.device.type == "cpu" or want_used:
            values = counts.tolist()
            if values[0] != 0:
                self._raise(missing)
            return [bool(u) for u in values[1:]] if want_used else None
        if self._host is None:
            self._host = torch.zeros(1, dtype=counts.dtype, pin_memory=True)
        self._host.copy_(counts[:1], non_blocking=True)
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
        if self._host is not None and self._host.item() != 0:
            self._raise(self._missing)

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
