"""A record of every collective this process issues, always on: what the doctor reads.

After ``tandem.init()`` every ``torch.distributed`` collective goes through :func:`_recorded`,
whoever calls it (tandem's engines, torch's helpers, the user's own ``dist.all_reduce``), and
leaves a :class:`Record` in a bounded ring (the newest :data:`CAPACITY`): its sequence number in
its group, the op, the group (named by :func:`group_name`), the shapes and dtypes it sends, the
bytes this rank handed to it (:data:`HANDED`), what the engine was doing (``DDP bucket 3, step
12``, set with :func:`tagged`), the line of user code it came from, and when it started and
ended. A blocking call ends when it returns; an asynchronous one is marked ended the
first time a later look (the next collective this process issues, or a report) finds its work
done, and its work is let go of then: a finished collective's Work holds its tensors, and a
record must not keep a bucket or an all-gathered buffer alive (on a GPU that is device memory).

On Gloo a blocking collective is issued asynchronously and waited for in slices (:func:`wait`),
so that an error the doctor finds while it waits (``mismatch.fail``: the ranks' collectives
differ) is raised in the waiting thread within a second, instead of after the collective's
timeout: a thread blocked in C++ cannot be interrupted otherwise. NCCL's waits stay plain.

The bytes handed are also added up per group for the step clock
(``tandem.doctor.step_clock.handed``), which turns them into bytes per step per group for
``tandem run``'s exit summary. They are the sizes of the tensors this rank gives the collective
(``Tensor.nbytes``: metadata, no device sync), not what crosses the wire: a ring all-reduce of
``B`` bytes over ``n`` ranks sends ``2 (n - 1) / n * B`` from each rank, an all-gather of a
``B``-byte shard ``(n - 1) * B``; the backend's choice, which the count leaves out.

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

from tandem.doctor import mismatch, step_clock

# Re-exported: the error and the calls that set and check it are part of the records' API.
from tandem.doctor.mismatch import CollectiveMismatchError, fail, raise_if_failed  # noqa: F401
from tandem.doctor.sites import user_line

#: Records kept per process (the oldest are dropped first).
CAPACITY = 2048

# The collectives recorded; the point-to-point ones count per group like the others.
OPS = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "gather",
    "scatter", "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
    "gather_object", "scatter_object_list", "send", "recv", "isend", "irecv",
)  # fmt: skip

_POINT_TO_POINT = ("send", "recv", "isend", "irecv")

#: The bytes a rank hands to a collective (:attr:`Record.nbytes`): the ``nbytes`` of the tensors
#: in the argument named here, summed over a list. So: ``all_reduce`` and ``reduce`` the tensor;
#: ``all_gather``, ``all_gather_into_tensor`` and ``gather`` this rank's input (its shard, not
#: the gathered output); ``reduce_scatter(_tensor)`` the whole input (every rank's part);
#: ``all_to_all(_single)`` the whole input (its own part included); ``send``/``isend`` the
#: tensor. ``broadcast`` and ``scatter`` count on their source rank only (the tensor, the
#: scatter list); a receiving rank, ``recv``/``irecv``, ``barrier`` and every ``*_object``
#: collective count 0 (the object collectives issue tensor collectives of their own, which
#: count themselves). A rank outside the group hands nothing.
HANDED = {
    "all_reduce": "tensor", "reduce": "tensor", "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor", "all_gather_single": "input_tensor",
    "gather": "tensor", "reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input", "all_to_all": "input_tensor_list",
    "all_to_all_single": "input", "send": "tensor", "isend": "tensor",
    "broadcast": "tensor", "scatter": "scatter_list",
}  # fmt: skip
_FROM_SOURCE = ("broadcast", "scatter")
# Deprecated names that call the newer function (looked up in c10d at call time): recording
# both would count each collective twice.
_FORWARDS = {
    "all_gather_into_tensor": "all_gather_single",
    "reduce_scatter_tensor": "reduce_scatter_single",
}

#: ``TANDEM_DEBUG=collectives``: before every collective, the ranks of its group compare what
#: they are about to issue (op, shapes, dtypes) through the store, and all raise
#: :class:`CollectiveMismatchError` if they differ, instead of a Gloo abort, a wrong result or
#: a hang (``tandem.doctor.mismatch``). A round trip to the store per collective: for debugging.
#: Read by :func:`install`.
strict = False


@dataclass(slots=True)
class Record:
    """One collective, as this rank issued it."""

    seq: int  # its number among this group's collectives on this rank, from 1
    op: str
    group: str  # "world", or "ranks 0,2" for a subgroup (see `group_name`)
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    context: str | None  # what the engine was doing ("DDP bucket 3, step 12")
    site: str  # the user's line that led to it ("train.py:44 in step")
    thread: str
    start: float  # time.time()
    end: float | None = None  # None: not known to have ended yet
    nbytes: int = 0  # the bytes this rank handed to the collective (see HANDED)
    work: Any = field(default=None, repr=False, compare=False)  # an async op's, until done
    gloo: bool = field(default=False, repr=False)  # its group's backend: waited for in slices
    failed: bool = field(default=False, repr=False)  # a wait for it raised (a timeout, say)

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
            "nbytes": self.nbytes,
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
# Group key -> (its name, whether it is Gloo's, whether this rank is in it).
_groups: dict[Any, tuple[str, bool, bool]] = {}
_dtype_names: dict[torch.dtype, str] = {}
_lock = threading.Lock()
# Records whose asynchronous work was not yet seen done, oldest first (polled by `_start`).
_open: collections.deque[Record] = collections.deque()
_local = _State()
_originals: dict[str, Callable[..., Any]] = {}
# Thread ident -> the record of the collective it is blocked in (a blocking call, or a wait on
# an asynchronous one: `wait`, or one that an engine announced with `waiting`).
blocked: dict[int, Record] = {}
enabled = True  # switched off only to measure what recording costs

# A replacement admitted into a running job (``tandem run --recover in-memory``), from its
# admission until its training starts (:func:`replacement_admitted`, :func:`training_started`):
# its rank, else None. The members are past the part of the script before training, so a
# collective the user's own code makes there would be met by none of theirs, or by another one.
_replacement: int | None = None


class ReplacementCollectiveError(RuntimeError):
    """A replacement worker's script made a collective of its own before its training started
    (see :func:`replacement_admitted`)."""


def replacement_admitted(rank: int) -> None:
    """This process is a replacement, launch rank ``rank`` (as ``tandem run`` names it),
    admitted into a running job: until
    :func:`training_started`, a collective made outside the constructors whose collectives
    the members make too (:func:`members_sequence`: the Trainer's, ``tandem.recovery.Run``'s)
    raises :class:`ReplacementCollectiveError` naming the user's line that led to it (its own
    ``dist.barrier()``, or a ``trainer.evaluate()`` before ``train()``), instead of waiting for
    members that are past it.

    Example::

        replacement_admitted(3)
        dist.barrier()   # ReplacementCollectiveError: ... train.py:12 in main ...
    """
    global _replacement
    _replacement = rank


_members_sequence = 0  # how deep in a constructor whose collectives the members make too


def members_sequence(init: Callable[..., None]) -> Callable[..., None]:
    """Decorates a constructor whose collectives, on a replacement, are those the members make
    when they admit it (the Trainer's, ``tandem.recovery.Run``'s): allowed before training,
    where every other one raises (:func:`replacement_admitted`)."""

    @functools.wraps(init)
    def wrapped(*args: Any, **kwargs: Any) -> None:
        global _members_sequence
        _members_sequence += 1
        try:
            init(*args, **kwargs)
        finally:
            _members_sequence -= 1

    return wrapped


def training_started() -> None:
    """The replacement's training started (a Trainer's ``train()``, ``tandem.recovery.Run``'s
    first step): from here it makes the members' collectives, its own code's included."""
    global _replacement
    _replacement = None


def _refuse_on_a_replacement(name: str) -> None:
    if _members_sequence:
        return
    site = user_line(sys._getframe(2))
    raise ReplacementCollectiveError(
        f"rank {_replacement} is a replacement that joined the running job (tandem run "
        f"--recover in-memory), and {site} leads to torch.distributed.{name} before its "
        "training started: the other ranks are past that part of the script, so none would "
        "meet this "
        "collective (the job would hang, or mix it up with theirs). Skip it on a replacement: "
        "`if not tandem.recovery.replacing(): ...` (an evaluation before train(), a barrier "
        "after a download), or make it part of training (a Trainer callback, Run's step)"
    )


# torch's "inside a coalescing manager" state: a blocking call there issues nothing, so it is
# left as it is (its asynchronous form would return a Work that must not be waited for).
_coalescing: dict[Any, Any] = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", {})


def wait(work: Any, record: Record | None = None) -> None:
    """``work.wait()``, but on Gloo an error the doctor finds meanwhile is raised here.

    On Gloo it blocks in slices of half a second and looks for :func:`fail`'s error between
    them (``mismatch.wait_in_slices``); NCCL's is a plain wait. The collective's own error, its
    timeout included, is raised as by the plain wait. ``record``: the collective's record
    (looked up from ``work`` when None), which hang reports see the thread blocked in.

    Example::

        work = dist.all_reduce(flat, async_op=True)
        ...                          # overlap
        records.wait(work)           # instead of work.wait()
    """
    mismatch.raise_if_failed()
    if record is None:
        record = of(work)
    try:
        if record is None or not record.gloo:
            work.wait()
            return
        with waiting(record):
            mismatch.wait_in_slices(work)
    except BaseException:
        if record is not None:
            record.failed = True
        raise


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

    def __exit__(self, kind: object, *exc: object) -> None:
        if self.record is not None:
            blocked.pop(self.me, None)
            if kind is not None:  # the wait raised: the collective never completed here
                self.record.failed = True


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
        _open.clear()
        _seq.clear()
        _groups.clear()
    mismatch.reset()


def install() -> None:
    """Record every collective from now on (``tandem.init()`` calls this; idempotent)."""
    global strict
    strict = "collectives" in os.environ.get("TANDEM_DEBUG", "").split(",")
    for name in OPS:
        original = getattr(c10d, name, None)
        if original is None or name in _originals:
            continue
        if name in _FORWARDS and hasattr(c10d, _FORWARDS[name]):
            continue  # torch >= 2.13: it calls the newer name, which is recorded
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
    measure = _measurer(name, params)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _replacement is not None:
            _refuse_on_a_replacement(name)
        if not enabled:
            return original(*args, **kwargs)
        if mismatch.failed is not None:  # the group is broken: nothing more is issued on it
            mismatch.raise_if_failed()
        group = kwargs.get("group")
        if group is None and group_at is not None and len(args) > group_at:
            group = args[group_at]
        handed = measure(args, kwargs, group) if measure is not None else 0
        record = _start(name, group, args, kwargs, handed)
        if async_at is not None and len(args) > async_at:
            is_async = args[async_at]
            # Blocking on Gloo: issued asynchronously and waited for in slices (see `wait`).
            sliced = record.gloo and not is_async and not _coalescing
            if sliced:
                args = (*args[:async_at], True, *args[async_at + 1 :])
        else:
            is_async = kwargs.get("async_op")
            sliced = async_at is not None and record.gloo and not is_async and not _coalescing
            if sliced:
                kwargs["async_op"] = True
        me = threading.get_ident()
        if not is_async:
            blocked[me] = record  # inside until it returns: what a hang report looks at
        try:
            if strict and name not in _POINT_TO_POINT:
                mismatch.check_everywhere(record, group)
            result = original(*args, **kwargs)
            if sliced and result is not None:  # None: this rank is not in the group
                record.work = result  # until it is done, should the wait raise
                mismatch.wait_in_slices(result)
                record.work = result = None
        except BaseException:
            record.failed = True  # never completed here (hang reports tell it at exit)
            raise
        finally:
            if not is_async:
                blocked.pop(me, None)
        if name in ("isend", "irecv") or (is_async and result is not None):
            record.work = result
            with _lock:
                _open.append(record)
        else:
            record.end = time.time()
            if not is_async:  # the time this thread waited, for tandem run's exit summary
                step_clock.blocked(record.end - record.start)
        return result

    return call


def _measurer(op: str, params: list[str]) -> Callable[[tuple, dict, Any], int] | None:
    """What counts the bytes ``op`` is handed (:data:`HANDED`); None if it is handed none."""
    handed = HANDED.get(op)
    if handed is None or handed not in params:
        return None
    at = params.index(handed)
    # Where a broadcast's or scatter's source is named: (parameter, position), if it has one.
    sources = [(name, params.index(name)) for name in ("src", "group_src") if name in params]

    def measure(args: tuple, kwargs: dict, group: Any) -> int:
        value = args[at] if len(args) > at else kwargs.get(handed)
        if value is None:
            return 0
        if op in _FROM_SOURCE:
            named = {n: args[i] if len(args) > i else kwargs.get(n) for n, i in sources}
            if not _is_source(named.get("src"), named.get("group_src"), group):
                return 0
        if isinstance(value, torch.Tensor):
            return value.nbytes
        return sum(t.nbytes for t in value if isinstance(t, torch.Tensor))

    return measure


def _is_source(src: int | None, group_src: int | None, group: Any) -> bool:
    """Whether this rank is a broadcast's or scatter's source (``src`` is a global rank)."""
    try:
        if group_src is not None:
            return dist.get_rank(group) == group_src
        return src is not None and dist.get_rank() == src
    except Exception:  # not initialized: torch's own call raises its error next
        return False


def _start(op: str, group: Any, args: tuple, kwargs: dict, nbytes: int = 0) -> Record:
    tensors = [t for t in _tensors(args) if isinstance(t, torch.Tensor)]
    tensors += [t for t in _tensors(tuple(kwargs.values())) if isinstance(t, torch.Tensor)]
    key = id(group) if group is not None else None
    with _lock:
        # Let go of the works found done since the last collective (their tensors with them).
        for _ in range(len(_open)):
            done = _open.popleft()
            if not done.poll():
                _open.append(done)
        seq = _seq[key] = _seq.get(key, 0) + 1
        known = _groups.get(key)
    if known is None:
        name = group_name(group) or f"group {id(group):x}"
        known = _groups[key] = (name, _is_gloo(group), _is_member(group))
    if not known[2]:
        nbytes = 0  # not in the group: torch issues nothing
    record = Record(
        seq=seq,
        op=op,
        group=known[0],
        shapes=tuple(tuple(t.shape) for t in tensors),
        dtypes=tuple(_dtype_name(t.dtype) for t in tensors),
        context=_local.context,
        site=_user_site(),
        thread=threading.current_thread().name,
        start=time.time(),
        nbytes=nbytes,
        gloo=known[1],
    )
    with _lock:
        _ring.append(record)
        if nbytes:  # under the lock: threads of one process add to the same sums
            step_clock.handed(record.group, nbytes)
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


def _is_gloo(group: Any) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # a group this rank is not in, or one already destroyed
        return False


def group_name(group: Any) -> str | None:
    """The name records give ``group``, the same on each of its ranks; None if torch cannot
    tell its ranks here (a group already destroyed, say). A rank outside the group (where a
    collective on it issues nothing and counts no bytes) names it as well as torch lets it.

    ``"world"`` for the default group; else ``"ranks "`` and its global ranks in group order,
    then in brackets the description given to ``dist.new_group(group_desc=...)``, if any, and
    ``2nd``, ``3rd``, ... for the second, third live group of the same ranks (in the order torch
    made them, the same on every rank: ``new_group`` is collective), so that two groups never
    share a name.

    Example::

        dist.new_group([0, 1])                          # "ranks 0,1"
        dist.new_group([0, 1], group_desc="shard")      # "ranks 0,1 (shard, 2nd)"
        dist.new_group([2, 0])                          # "ranks 2,0"
    """
    if group is None or group is c10d.GroupMember.WORLD:
        return "world"
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # a group this rank is not in, or one already destroyed
        return None
    notes = []
    described = getattr(group, "group_desc", None)
    if described and described not in ("undefined", "default_pg"):
        notes.append(described)
    # Earlier live groups of the same ranks (torch's registry keeps the order they were made).
    made = getattr(getattr(c10d, "_world", None), "pg_group_ranks", {})
    world = c10d.GroupMember.WORLD
    same = [g for g, m in made.items() if g is not world and sorted(m, key=m.get) == ranks]
    if group in same and same.index(group) > 0:
        notes.append(_ordinal(same.index(group) + 1))
    name = "ranks " + ",".join(str(r) for r in ranks)
    return f"{name} ({', '.join(notes)})" if notes else name


def _is_member(group: Any) -> bool:
    """Whether this rank is in ``group`` (a collective on a group it is not in issues nothing)."""
    try:
        return group is None or dist.get_rank(group) >= 0
    except Exception:  # destroyed, or a sentinel torch gives for a group this rank is not in
        return False


def _ordinal(n: int) -> str:
    """``2nd`` for 2.

    >>> [_ordinal(n) for n in (2, 3, 4, 11, 21, 22)]
    ['2nd', '3rd', '4th', '11th', '21st', '22nd']
    """
    tens = n % 100 in (11, 12, 13)
    return f"{n}{'th' if tens else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _user_site() -> str:
    """The innermost frame outside torch, tandem and Python: the user's line that led here."""
    return user_line(sys._getframe(3))
