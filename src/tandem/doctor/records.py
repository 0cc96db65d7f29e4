"""A record of every collective this process issues, always on: what the doctor reads.

After ``tandem.init()`` every ``torch.distributed`` collective goes through :func:`_recorded`,
whoever calls it (tandem's engines, torch's helpers, the user's own ``dist.all_reduce``), and
leaves a :class:`Record` in a bounded ring (the newest :data:`CAPACITY`): its sequence number in
its group, the op, the group, the shapes and dtypes it sends, what the engine was doing (``DDP
bucket 3, step 12``, set with :func:`tagged`), the line of user code it came from, and when it
started and ended. A blocking call ends when it returns; an asynchronous one is marked ended the
first time a later look (the next collective of its group, or a report) finds its work done.

The cost is a few microseconds of Python per collective (``benchmarks/ddp_throughput.py``
measures it against recording switched off).

Example::

    tandem.init()
    dist.all_reduce(torch.ones(3))
    last = records.recent(1)[0]
    print(last.op, last.seq, last.site)      # all_reduce 1 train.py:12 in main
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

#: Records kept per process (the oldest are dropped first).
CAPACITY = 2048

# The collectives recorded; the point-to-point ones count per group like the others.
OPS = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
    "scatter", "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
    "gather_object", "scatter_object_list", "send", "recv", "isend", "irecv",
)  # fmt: skip

_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
# Collectives that every rank calls with the same shapes and dtypes (gather and scatter pass a
# list on one rank only; all_to_all's splits may differ): strict mode compares those too.
_SAME_SHAPES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor",
)  # fmt: skip

#: ``TANDEM_DEBUG=collectives``: before every collective, the ranks of its group compare what
#: they are about to issue (op, shapes, dtypes) through the store, and all raise
#: :class:`CollectiveMismatchError` if they differ, instead of a Gloo abort, a wrong result or
#: a hang. A round trip to the store per collective: for debugging. Read by :func:`install`.
strict = False


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to issue different collectives at the same number in a group."""


@dataclass(slots=True)
class Record:
    """One collective, as this rank issued it."""

    seq: int  # its number among this group's collectives on this rank, from 1
    op: str
    group: str  # "world", or "ranks 0,2" for a subgroup
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    context: str | None  # what the engine was doing ("DDP bucket 3, step 12")
    site: str  # the user's line that led to it ("train.py:44 in step")
    thread: str
    start: float  # time.time()
    end: float | None = None  # None: not known to have ended yet
    work: Any = field(default=None, repr=False, compare=False)  # an async op's, until done

    def describe(self) -> str:
        """``all_reduce #57 (DDP bucket 0, step 12) of world``, for messages."""
        where = f" ({self.context})" if self.context else ""
        return f"{self.op} #{self.seq}{where} of {self.group}"

    def fingerprint(self) -> tuple:
        """What every rank's collective of the same group and number must share."""
        return (self.group, self.seq, self.op, self.shapes, self.dtypes)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready), for reports."""
        self.poll()
        return {
            "seq": self.seq,
            "op": self.op,
            "group": self.group,
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "context": self.context,
            "site": self.site,
            "thread": self.thread,
            "start": self.start,
            "end": self.end,
        }

    def poll(self) -> bool:
        """True once ended (an async op's work is asked, and let go of when done)."""
        if self.end is None and self.work is not None and self.work.is_completed():
            self.end, self.work = time.time(), None
        return self.end is not None


class _State(threading.local):
    context: str | None = None


_ring: collections.deque[Record] = collections.deque(maxlen=CAPACITY)
_seq: dict[Any, int] = {}
_group_names: dict[Any, str] = {}
_dtype_names: dict[torch.dtype, str] = {}
_internal_code: dict[Any, bool] = {}  # code object -> in torch or tandem (asked once per code)
_lock = threading.Lock()
_local = _State()
_originals: dict[str, Callable[..., Any]] = {}
# Thread ident -> the record of the collective it is blocked in (a blocking call, or a wait on
# an asynchronous one that an engine announced with `waiting`).
blocked: dict[int, Record] = {}
enabled = True  # switched off only to measure what recording costs


class tagged:
    """Collectives issued in the block carry ``context`` (this thread's, innermost wins).

    A class rather than a generator: it is entered once per bucket and unit, every step.

    Example::

        with records.tagged(f"DDP bucket {k}, step {step}"):
            dist.all_reduce(flat, async_op=True)
    """

    __slots__ = ("context", "outer")

    def __init__(self, context: str) -> None:
        self.context = context

    def __enter__(self) -> None:
        self.outer, _local.context = _local.context, self.context

    def __exit__(self, *exc: object) -> None:
        _local.context = self.outer


class waiting:
    """The calling thread waits for ``record``'s collective in the block (for hang reports).

    Example::

        with records.waiting(records.of(work)):
            work.wait()
    """

    __slots__ = ("me", "record")

    def __init__(self, record: Record | None) -> None:
        self.record = record

    def __enter__(self) -> None:
        self.me = threading.get_ident()
        if self.record is not None:
            blocked[self.me] = self.record

    def __exit__(self, *exc: object) -> None:
        if self.record is not None:
            blocked.pop(self.me, None)


def of(work: Any) -> Record | None:
    """The newest record whose asynchronous work is ``work`` (None if not recorded)."""
    with _lock:
        for record in reversed(_ring):
            if record.work is work:
                return record
    return None


def recent(n: int | None = None) -> list[Record]:
    """The newest ``n`` records (all kept, by default), oldest first."""
    with _lock:
        items = list(_ring)
    return items if n is None else items[-n:]


def open_records() -> list[Record]:
    """The records not known to have ended, oldest first."""
    return [r for r in recent() if not r.poll()]


def clear() -> None:
    """Forget every record and restart the numbering (a new process group starts over)."""
    with _lock:
        _ring.clear()
        _seq.clear()
        _group_names.clear()


def install() -> None:
    """Record every collective from now on (``tandem.init()`` calls this; idempotent)."""
    global strict
    strict = "collectives" in os.environ.get("TANDEM_DEBUG", "").split(",")
    for name in OPS:
        original = getattr(c10d, name, None)
        if original is None or name in _originals:
            continue
        _originals[name] = original
        wrapper = _recorded(name, original)
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)


def uninstall() -> None:
    """Put torch's functions back."""
    for name, original in _originals.items():
        if getattr(dist, name, None) is not None:
            setattr(dist, name, original)
        setattr(c10d, name, original)
    _originals.clear()


def _recorded(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    params = list(inspect.signature(original).parameters)
    group_at = params.index("group") if "group" in params else None
    async_at = params.index("async_op") if "async_op" in params else None

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not enabled:
            return original(*args, **kwargs)
        group = kwargs.get("group")
        if group is None and group_at is not None and len(args) > group_at:
            group = args[group_at]
        record = _start(name, group, args, kwargs)
        is_async = kwargs.get("async_op") or (async_at is not None and len(args) > async_at
                                               and args[async_at])  # fmt: skip
        me = threading.get_ident()
        if not is_async:
            blocked[me] = record  # inside until it returns: what a hang report looks at
        try:
            if strict and name not in _POINT_TO_POINT:
                _check_everywhere(record, group)
            result = original(*args, **kwargs)
        finally:
            if not is_async:
                blocked.pop(me, None)
        if name in ("isend", "irecv") or (is_async and result is not None):
            record.work = result
        else:
            record.end = time.time()
        return result

    return call


def _start(op: str, group: Any, args: tuple, kwargs: dict) -> Record:
    tensors = [t for t in _tensors(args) if isinstance(t, torch.Tensor)]
    tensors += [t for t in _tensors(tuple(kwargs.values())) if isinstance(t, torch.Tensor)]
    key = id(group) if group is not None else None
    with _lock:
        seq = _seq[key] = _seq.get(key, 0) + 1
        name = _group_names.get(key)
    if name is None:
        name = _group_names[key] = _group_name(group)
    record = Record(
        seq=seq,
        op=op,
        group=name,
        shapes=tuple(tuple(t.shape) for t in tensors),
        dtypes=tuple(_dtype_name(t.dtype) for t in tensors),
        context=_local.context,
        site=_user_site(),
        thread=threading.current_thread().name,
        start=time.time(),
    )
    with _lock:
        _ring.append(record)
    return record


def _dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:  # str(dtype) costs microseconds: once per dtype
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def _tensors(values: tuple) -> Iterator[Any]:
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from v
        else:
            yield v


def _group_name(group: Any) -> str:
    if group is None or group is c10d.GroupMember.WORLD:
        return "world"
    try:
        return "ranks " + ",".join(str(r) for r in dist.get_process_group_ranks(group))
    except Exception:  # a group this rank is not in, or one already destroyed
        return f"group {id(group):x}"


def _user_site() -> str:
    """The innermost frame outside torch and tandem: the user's line that led here."""
    return user_line(sys._getframe(3))


def user_line(frame: Any) -> str:
    """``train.py:44 in step``: the innermost frame from ``frame`` out that is the user's
    (outside torch and tandem); ``"?"`` if there is none."""
    while frame is not None:
        code = frame.f_code
        internal = _internal_code.get(code)
        if internal is None:
            internal = _internal_code[code] = code.co_filename.startswith(_INTERNAL)
        if not internal:
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return "?"


_group_ranks: dict[Any, list[int]] = {}


def _check_everywhere(record: Record, group: Any) -> None:
    """Strict mode: every rank of ``group`` publishes ``record`` and compares all of them."""
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
    compared = ("op", "shapes", "dtypes") if record.op in _SAME_SHAPES else ("op",)

    def what(d: dict) -> tuple:
        return tuple(json.dumps(d[k]) for k in compared)

    if len({what(d) for d in everyone.values()}) == 1:
        return
    sides = "; ".join(f"rank {r}: {_side(d)}" for r, d in everyone.items())
    raise CollectiveMismatchError(
        f"collective #{record.seq} of {record.group} differs across ranks: {sides}. Every rank "
        "must issue the same collectives, in the same order, with the same shapes and dtypes "
        "(look for a collective under `if rank == ...`, or data-dependent shapes)"
    )


def _side(d: dict) -> str:
    """``all_reduce of float32 (3,) at train.py:10 in main``: one rank's side of a mismatch."""
    pairs = zip(d["shapes"], d["dtypes"], strict=True)
    tensors = ", ".join(f"{t} {tuple(s)}" for s, t in pairs) or "no tensors"
    return f"{d['op']} of {tensors} at {d['site']}"
