"""Collectives that differ across ranks: the error every rank raises instead of a hang or abort.

Ranks that issue different collectives at the same number in a group (another op, shape or
dtype) make Gloo hang (another op) or abort the process (another size), and NCCL hang or
return garbage. Two checks turn that into :class:`CollectiveMismatchError` on every rank,
naming each rank's side and line:

- the default one (``tandem.doctor.hang``): a collective blocked for a few seconds is compared
  across ranks through the rendezvous store; on a mismatch every rank's doctor calls
  :func:`fail`, and the waits of this process, which on Gloo block in slices
  (:func:`wait_in_slices`), raise the error in the waiting thread;
- strict mode (``TANDEM_DEBUG=collectives``): :func:`check_everywhere` compares every collective
  before it is issued, at the cost of a store round trip each.

Example of the message::

    CollectiveMismatchError: collective #2 of world differs across ranks: rank 0: all_reduce of
    float32 (3,) at train.py:10 in main; rank 1: all_reduce of float32 (5,) at train.py:10 in
    main. Every rank must issue the same collectives, ...
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Collectives that every rank calls with the same shapes and dtypes (gather and scatter pass a
# list on one rank only; all_to_all's splits may differ): for the others only the op is compared.
_SAME_SHAPES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
)  # fmt: skip
# How long a wait on Gloo blocks in C++ before it looks for an error found meanwhile.
_SLICE = timedelta(seconds=0.5)

#: The message of the mismatch found while this process waits (:func:`fail`), or None. Once
#: set, the process group is unusable: every wait in slices and every later collective raises.
failed: str | None = None
#: The error :func:`raise_if_failed` raises with :data:`failed` (a late duplicate rank found by
#: the rendezvous stops the job with ``RendezvousError`` the same way).
error: type[RuntimeError] = RuntimeError
#: Called once before the error is first raised here: the doctor waits (a few seconds at most)
#: until every rank has taken it. A rank that raised may exit, and its peers' collectives then
#: fail with the backend's own words ("Connection reset by peer") instead of this error.
before_raise: Callable[[], None] | None = None
_told = False


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives at the same number in a group."""


def fail(
    message: str, kind: type[RuntimeError] | None = None, wait_for_others: bool = True
) -> None:
    """From now on every collective of this process raises ``kind`` (default
    :class:`CollectiveMismatchError`) with ``message`` (the first one stays): the ones waited
    for now, on Gloo within half a second, and the next ones at their entry.

    ``wait_for_others=False`` raises at once, without :data:`before_raise`'s wait for the other
    ranks to take the error (:mod:`tandem.recovery`: a member is gone, and the survivors leave
    the step to re-form without it).

    Example::

        mismatch.fail(mismatch.message("world", 2, sides))   # the doctor, on every rank
    """
    global failed, error, _told
    if failed is None:
        failed, error = message, kind or CollectiveMismatchError
        if not wait_for_others:
            _told = True


def reset() -> None:
    """Forget the failure (a new process group starts over)."""
    global failed, _told
    failed, _told = None, False


def raise_if_failed() -> None:
    """Raise :func:`fail`'s error if it was called (a cheap check)."""
    global _told
    if failed is None:
        return
    if not _told and before_raise is not None:
        _told = True
        before_raise()
    raise error(failed)


def wait_in_slices(work: Any) -> None:
    """``work.wait()`` on Gloo, in slices, raising :func:`fail`'s error between them.

    A slice that times out leaves the work running (``Work::wait`` in torch's c10d throws "timed
    out" and cancels nothing); a work that completed with an error (a peer gone, the
    collective's own timeout) raises it as the plain wait does.
    """
    while True:
        try:
            work.wait(_SLICE)  # positional: a keyword costs pybind a fifth of a microsecond
            return
        except RuntimeError:
            raise_if_failed()  # a peer that raised it may have left: this is why the work failed
            # Gloo's own timeout says "timed out" too: only completion tells the two apart. A
            # work that completed after the slice ran out but before this look may have
            # succeeded: waiting on it again returns, or raises its own error.
            if work.is_completed():
                work.wait()
                return
        raise_if_failed()


def message(group: str, seq: int, sides: dict[int, dict[str, Any]]) -> str:
    """The error's text: every rank's side (``sides``: rank -> its ``op``, ``shapes``,
    ``dtypes`` and ``site``, as in a record's ``as_dict()``)."""
    told = "; ".join(f"rank {r}: {side(d)}" for r, d in sorted(sides.items()))
    return (
        f"collective #{seq} of {group} differs across ranks: {told}. Every rank must issue the "
        "same collectives, in the same order, with the same shapes and dtypes (look for a "
        "collective under `if rank == ...`, or data-dependent shapes)"
    )


def side(d: dict[str, Any]) -> str:
    """``all_reduce of float32 (3,) at train.py:10 in main``: one rank's side of a mismatch."""
    pairs = zip(d["shapes"], d["dtypes"], strict=True)
    tensors = ", ".join(f"{t} {tuple(s)}" for s, t in pairs) or "no tensors"
    return f"{d['op']} of {tensors} at {d['site']}"


def fingerprint(d: dict[str, Any]) -> tuple[str, ...]:
    """What every rank's collective of the same group and number must share: the op, and the
    shapes and dtypes where every rank passes the same."""
    compared = ("op", "shapes", "dtypes") if d["op"] in _SAME_SHAPES else ("op",)
    return tuple(json.dumps(d[k]) for k in compared)


_group_ranks: dict[Any, list[int]] = {}


def check_everywhere(record: Any, group: Any) -> None:
    """Strict mode: every rank of ``group`` publishes ``record`` (a ``records.Record``) before
    issuing it and compares all of them; :class:`CollectiveMismatchError` if they differ."""
    key = id(group) if group is not None else None
    ranks = _group_ranks.get(key)
    if ranks is None:
        ranks = _group_ranks[key] = (
            list(range(dist.get_world_size())) if group is None
            else dist.get_process_group_ranks(group)
        )  # fmt: skip
    store = dist.PrefixStore("tandem/strict/", c10d._get_default_store())
    mine = {"op": record.op, "shapes": record.shapes, "dtypes": record.dtypes, "site": record.site}
    prefix = f"{record.group}/{record.seq}/"
    store.set(prefix + str(dist.get_rank()), json.dumps(mine))
    keys = [prefix + str(r) for r in ranks]
    store.wait(keys)  # a rank that never comes is a hang: the hang report names it
    everyone = {r: json.loads(v) for r, v in zip(ranks, store.multi_get(keys), strict=True)}
    if len({fingerprint(d) for d in everyone.values()}) > 1:
        raise CollectiveMismatchError(message(record.group, record.seq, everyone))
