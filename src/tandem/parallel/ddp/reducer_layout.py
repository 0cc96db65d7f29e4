"""The bucket layout of tandem.DDP's reducer: how gradients are grouped, and when regrouped.

Buckets follow torch's rules so that both engines sum the same numbers in the same groups: the
first backward runs with one bucket per dtype and device (the ready order is unknown), then the
buckets are rebuilt once in the order the gradients really became ready (rank 0's order,
broadcast). With find_unused_parameters the graph may change every step: the buckets are cut
from the start and never rebuilt. The learnt layout is part of the reducer's state, so that a
resumed run reduces in the same buckets as the uninterrupted one.

:class:`ReducerLayout` is the part of :class:`tandem.parallel.ddp.reducer.Reducer` that owns the
buckets and their buffers: cut, rebuilt, saved, the means given to ``.grad`` (large ones as
views of a buffer, which comes back to its bucket once nobody holds it); the reducer adds the
per-iteration hooks, launches and the end of backward.

Example::

    bucket_caps(None, None)          # torch's defaults: [1 MiB, 25 MiB] in bytes
    reducer.state_dict()             # {"rebuilt": True, "layout": [[5, 4], [3, 2, 1, 0]], ...}
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from tandem._dist import global_rank
from tandem.doctor import records
from tandem.parallel.ddp import out_of_step
from tandem.parallel.ddp.buckets import MIB, Bucket, assign_buckets, build_buckets

DEFAULT_BUCKET_MB = 25.0
# With the default cap the first rebuilt bucket is small, so that the first all-reduce starts
# early in backward; an explicit bucket_cap_mb applies to every bucket (torch's rule).
DEFAULT_FIRST_BUCKET_MB = 1.0


log = logging.getLogger("tandem.parallel.ddp.reducer")


# Whether a buffer's storage is still shared by a tensor other than the bucket's own (torch's
# count of the tensors that share a storage; without it, buffers are never handed over).
CAN_HAND_OVER = hasattr(torch._C, "_storage_Use_Count")


def _unreferenced(flat: torch.Tensor, views: list[torch.Tensor]) -> bool:
    # The storage is shared by flat, by each of its views, and by the storage object this
    # query makes: any more is somebody else's tensor (a gradient handed over, or one made
    # from it).
    return torch._C._storage_Use_Count(flat.untyped_storage()._cdata) == len(views) + 2


def bucket_caps(
    bucket_cap_mb: float | None,
    first_bucket_cap_mb: float | None,
    bucket_cap_mb_list: Sequence[float] | None = None,
) -> list[int]:
    """The caps in bytes of each dtype's first, second, ... bucket, the last one repeated.

    torch's rule: ``[1 MiB, 25 MiB]`` by default, ``[cap, cap]`` for an explicit
    ``bucket_cap_mb``, or ``bucket_cap_mb_list`` as given (``bucket_cap_mb`` is then ignored,
    as in torch). ValueError for a cap that is not positive.
    """
    if bucket_cap_mb_list:
        if first_bucket_cap_mb is not None:
            raise ValueError(
                f"bucket_cap_mb_list={list(bucket_cap_mb_list)} and first_bucket_cap_mb="
                f"{first_bucket_cap_mb} both set the first bucket's cap: pass one of them"
            )
        named = [(f"bucket_cap_mb_list[{k}]", mb) for k, mb in enumerate(bucket_cap_mb_list)]
    else:
        cap_mb = DEFAULT_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb
        if first_bucket_cap_mb is None:
            first_bucket_cap_mb = DEFAULT_FIRST_BUCKET_MB if bucket_cap_mb is None else cap_mb
        named = [("first_bucket_cap_mb", first_bucket_cap_mb), ("bucket_cap_mb", cap_mb)]
    for name, mb in named:
        if not mb > 0:
            raise ValueError(f"{name}={mb} must be a positive number of MiB")
    # At least one byte: a tiny cap means one parameter per bucket, not an invalid cap.
    return [max(1, int(mb * MIB)) for _, mb in named]


class ReducerLayout:
    """The reducer's buckets: cut, installed, rebuilt once, saved and loaded (module doc)."""

    # Set by the Reducer's constructor.
    params: list[torch.Tensor]
    group: dist.ProcessGroup | None
    world_size: int
    caps: list[int]  # bytes: each dtype's first, second, ... bucket (see bucket_caps)
    as_view: bool
    static_graph: bool
    eager: list[bool]  # copied in as soon as ready (see reducer.LARGE_GRADIENT)
    hook: Any  # the communication hook, None for the default mean
    replaced: list[torch.Tensor]  # gradients a bucket's view replaced, freed at the next forward
    rebuilt: bool
    ready_order: list[int]
    backwards: int
    progress: out_of_step.ModelSteps
    wait: Callable[[dist.Work, str], None]

    def _layout(
        self, order: list[int], reverse: bool = False, one_bucket: bool = False
    ) -> list[list[int]]:
        # Cut in registration order and reversed (initially): gradients arrive roughly in
        # reverse, and the small first-cut bucket then holds the first layers, whose gradients
        # come last, so the all-reduce left after backward is a short one.
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        if one_bucket:
            return list(reversed(assign_buckets(sizes, keys, order, sys.maxsize, sys.maxsize)))
        layout = assign_buckets(sizes, keys, order, self.caps[-1], self.caps[0], caps=self.caps)
        return list(reversed(layout)) if reverse else layout

    def _install(self, layout: list[list[int]]) -> None:
        self.buckets: list[Bucket] = build_buckets(layout, self.params)
        self.has_eager = [any(self.eager[i] for i in b.params) for b in self.buckets]
        self.bucket_of = [self.buckets[0]] * len(self.params) if self.buckets else []
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.params):
                self.bucket_of[i] = bucket
                self.views[i] = bucket.views[slot]
        if self.as_view:
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self.views[i].copy_(p.grad)
                    p.grad = self.views[i]

    def _reclaim(self, bucket: Bucket) -> None:
        """Before a backward, for a bucket whose buffer the parameters took as their gradients:
        keep it if no gradient of it is held any more (``zero_grad`` set them to None), else
        take the bucket's spare buffer if that one is free, else a new one; the buffer still
        held becomes the spare. A gradient a user keeps is never written into."""
        bucket.handed_over = False
        if _unreferenced(bucket.flat, bucket.views):
            return
        spare = bucket.spare
        bucket.spare = (bucket.flat, bucket.views)
        if spare is not None and _unreferenced(*spare):
            bucket.flat, bucket.views = spare
        else:
            bucket.flat = torch.empty_like(bucket.flat)  # every slot is written before the sum
            params = [self.params[i] for i in bucket.params]
            bucket.views = list(_unflatten_dense_tensors(bucket.flat, params))  # one C++ call
        for i, view in zip(bucket.params, bucket.views, strict=True):
            self.views[i] = view

    def _write_back_bucket(self, bucket: Bucket) -> None:
        """``_write_back`` of one bucket's parameters, without a used map."""
        if not self.as_view and not self.has_eager[bucket.index]:
            # The common case for small gradients: one call, no loop over the parameters here.
            maybe = [self.params[i].grad for i in bucket.params]
            grads = [g for g in maybe if g is not None]
            if len(grads) == len(maybe):
                torch._foreach_copy_(grads, bucket.views)
                return
        self._write_back(bucket.params, None)

    def _write_back(self, indices: Sequence[int], used: list[bool] | None) -> None:
        """Give parameters ``indices`` their mean gradient (``used``: which were used on some
        rank; the others keep their ``.grad`` as it is, as under torch's DDP).

        A large gradient takes its slot of the bucket as it is (see the module doc); small ones
        are copied, in one call.
        """
        grads, means = [], []
        hand_over = CAN_HAND_OVER and self.hook is None and not self.as_view
        for i in indices:
            p, view = self.params[i], self.views[i]
            if used is not None:
                if not used[i]:
                    continue  # used on no rank: .grad left as it is (None stays None)
            elif p.grad is None:
                continue
            if p.grad is view:
                continue  # gradient_as_bucket_view: already there
            if self.as_view:
                p.grad = view
            elif hand_over and self.eager[i]:
                if p.grad is not None:
                    self.replaced.append(p.grad)  # freed at the next forward (see start_step)
                p.grad = view.view_as(view)  # a tensor of its own: see _reclaim
                self.bucket_of[i].handed_over = True
            elif p.grad is None:  # unused here but used on another rank: step with the mean
                p.grad = view.clone()
            else:
                grads.append(p.grad)
                means.append(view)
        if grads:
            torch._foreach_copy_(grads, means)  # one call, not one per parameter

    @property
    def layout(self) -> list[list[int]]:
        """Parameter indices per bucket, in launch order."""
        return [list(b.params) for b in self.buckets]

    def state_dict(self) -> dict[str, Any]:
        """The bucket order learnt so far: a resumed run then builds the same buckets.

        Example::

            state = ddp.reducer.state_dict()     # saved in a checkpoint
            fresh.reducer.load_state_dict(state)
        """
        return {"rebuilt": self.rebuilt, "layout": self.layout, "ready_order": self.ready_order}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the buckets of a saved run (see ``state_dict``)."""
        layout = [list(b) for b in state["layout"]]
        if sorted(i for b in layout for i in b) != list(range(len(self.params))):
            raise ValueError(
                f"the saved bucket layout covers {sum(len(b) for b in layout)} parameters, this "
                f"model has {len(self.params)}: load the state of the same model"
            )
        self.rebuilt = bool(state["rebuilt"])
        self.ready_order = list(state["ready_order"])
        if layout != self.layout:
            self._install(layout)

    def rebuild(self) -> bool:
        """Once, before a forward: re-bucket in the order gradients became ready.

        Rank 0's observed order is broadcast, because every rank must build identical buckets
        and hook timing can differ between ranks.
        """
        if self.rebuilt or len(self.ready_order) == 0:
            return False
        self.rebuilt = True
        seen = set(self.ready_order)
        # Parameters that got no gradient (static_graph's unused) go last in index order, where
        # torch appends them: the same buckets, so the same sums in Gloo's ring, bit for bit.
        order = self.ready_order + [i for i in range(len(self.params)) if i not in seen]
        if self.world_size > 1:
            t = torch.tensor(order, dtype=torch.int64, device=self.params[0].device)
            with records.tagged(f"DDP bucket rebuild, step {self.progress.step}"):
                work = dist.broadcast(
                    t, src=global_rank(self.group, 0), group=self.group, async_op=True
                )
            self.wait(work, "bucket rebuild broadcast")
            order = t.tolist()
        layout = self._layout(order)
        if layout == self.layout:
            log.debug("bucket rebuild: the learnt order gives the same %d bucket(s)", len(layout))
            return False
        self._install(layout)
        log.debug(
            "buckets rebuilt in the order gradients became ready: %d bucket(s) of %s parameters",
            len(layout), [len(b) for b in layout],
        )  # fmt: skip
        return True

    def _recording(self) -> bool:
        # torch learns the order from the first backward that reduces bucket by bucket: the
        # first one, or with static_graph the second (the first reduces everything at its end).
        if self.rebuilt:
            return False
        return not self.static_graph or self.backwards == 1
