"""A timeline of every rank, as one Chrome trace (ui.perfetto.dev, chrome://tracing).

While tracing is on (``tandem run --trace DIR``, ``Trainer(trace=DIR)``, or :func:`start`),
each rank keeps, in memory and bounded to the newest :data:`CAPACITY` of each:

- the phases the engines mark with :func:`tandem._profile.span`: ``tandem.ddp.forward``, the
  backward (``tandem.ddp.backward``, from its first gradient to the end of the gradient sync),
  each bucket's ``tandem.ddp.bucket_reduce`` (filled and issued) and ``bucket_wait``, FSDP's
  all-gathers and reduce-scatters, ZeRO's step, every ``optimizer.step``, the Trainer's data
  loading (``tandem.train.data``) and checkpoints (``tandem.train.checkpoint``, and
  ``tandem.train.checkpoint_write`` for the file itself);
- every collective of :mod:`tandem.doctor.records` (op, group, shapes, bytes handed, what the
  engine was doing, the user's line), from its issue to its end. An asynchronous collective's
  end is when a later span of this process finds its work done: close enough, with spans every
  bucket.

At exit, or on :func:`flush`, a rank writes ``DIR/trace-rank<R>.json``, a Chrome trace whose
process is the rank (``pid`` = rank, named ``rank R``), with a track per thread and the
collectives on tracks of their own, one per process group (``collectives of world``,
``collectives of ranks 0,1``; overlapping asynchronous ones of a group take a second lane,
``collectives of world, 2``). :func:`merge` joins the ranks' files into ``DIR/trace.json``,
times counted from the first event; ``tandem run --trace DIR`` does so when the job ends.
:func:`tandem.doctor.trace_png.render` draws a trace as a PNG.

Cost: off, a flag check per span; on, a few microseconds per span and nothing per collective
(the records are converted when the file is written).

Example::

    from tandem.doctor import trace

    trace.start("traces")             # or run the job with `tandem run --trace traces`
    train()
    trace.flush()                     # traces/trace-rank<R>.json (again at exit)
    if rank == 0:                     # once every rank has flushed
        print(trace.merge("traces"))  # traces/trace.json
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from tandem.files import write_atomic

#: The environment variable that switches tracing on, naming the directory (``tandem run``
#: sets it for its workers).
ENV = "TANDEM_TRACE_DIR"
#: Spans and collectives kept per rank (the newest; each of the two kinds).
CAPACITY = 200_000

#: Whether this process traces: the one flag :func:`tandem._profile.span` reads.
on = False
#: ``(name, detail, start, end, thread ident)`` per span, times from ``time.time()``.
spans: deque[tuple[str, str | None, float, float, int]] = deque(maxlen=CAPACITY)

_dir: Path | None = None
_pid: int | None = None  # the process that started tracing (a forked child writes nothing)
_records: Any = None  # tandem.doctor.records, imported when tracing starts (it imports torch)
_collectives: deque[Any] = deque(maxlen=CAPACITY)
_open: list[Any] = []  # asynchronous collectives not known to have ended
_seen: Any = None  # the newest record already taken
_lock = threading.Lock()
_hooked = False

# (category, substrings of a span's name): the first match wins; collectives are "collective".
CATEGORIES = (
    ("backward", ("backward",)),
    ("forward", ("forward",)),
    ("wait", ("_wait",)),
    ("reduce", ("bucket_reduce", "reduce_scatter")),
    ("all_gather", ("all_gather",)),
    ("optimizer", ("optimizer", "tandem.zero.")),
    ("data", ("tandem.train.data",)),
    ("checkpoint", ("checkpoint",)),
)
#: The track of a rank's first lane of collectives; lane k is ``COLLECTIVE_TID + k`` (the lanes
#: of every group, numbered in the order they first appear).
COLLECTIVE_TID = 1000


def start(directory: str | Path) -> Path:
    """Trace this process from now on, writing into ``directory`` (created); idempotent.

    Example::

        trace.start("traces")
    """
    global on, _dir, _pid, _records
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _dir = path
    if on and _pid == os.getpid():
        return path
    from tandem.doctor import records

    if _pid is None:
        atexit.register(_at_exit)
    _records, _pid = records, os.getpid()
    _hook_optimizers()
    on = True
    return path


def start_from_env() -> None:
    """:func:`start` in ``$TANDEM_TRACE_DIR`` if it is set (``tandem run --trace`` sets it)."""
    where = os.environ.get(ENV)
    if where and not (on and _pid == os.getpid()):
        start(where)


def stop() -> None:
    """Stop tracing and forget what was kept (nothing is written)."""
    global on, _seen
    on = False
    with _lock:
        spans.clear()
        _collectives.clear()
        _open.clear()
        _seen = None


def add(name: str, start: float, end: float, detail: str | None = None) -> None:
    """Keep a span that ran from ``start`` to ``end`` (``time.time()``) on this thread."""
    spans.append((name, detail, start, end, threading.get_ident()))
    collect()


def collect() -> None:
    """Take the collectives issued since the last look, and end the asynchronous ones done.

    Called at every span's end, so that an asynchronous collective's end is seen soon after
    it happens; the ring of records holds only the newest few thousand.
    """
    global _seen
    records = _records
    if records is None:
        return
    with _lock:
        new = []
        with records._lock:
            ring = records._ring
            if ring and ring[-1] is not _seen:
                for record in reversed(ring):
                    if record is _seen:
                        break
                    new.append(record)
                _seen = ring[-1]
        for record in reversed(new):
            _collectives.append(record)
            if record.end is None:
                _open.append(record)
        if _open:
            _open[:] = [r for r in _open if not r.poll()]


def flush() -> Path | None:
    """Write this rank's trace now (it is written at exit too); its path, None when off.

    Example::

        trace.flush()    # traces/trace-rank0.json
    """
    if _dir is None or _pid != os.getpid():
        return None
    collect()
    rank = _rank()
    document = {
        "traceEvents": events(rank),
        "displayTimeUnit": "ms",
        "otherData": {"rank": rank, "run_id": os.environ.get("TORCHELASTIC_RUN_ID")},
    }
    path = _dir / f"trace-rank{rank}.json"
    write_atomic(path, json.dumps(document).encode())
    return path


def category(name: str) -> str:
    """The category a span is drawn in (``forward``, ``reduce``, ``wait``, ...; see above).

    Example::

        >>> category("tandem.ddp.bucket_wait"), category("tandem.fsdp.finish_backward")
        ('wait', 'backward')
    """
    for found, parts in CATEGORIES:
        if any(p in name for p in parts):
            return found
    return "other"


def events(rank: int) -> list[dict[str, Any]]:
    """This process's spans and collectives as Chrome trace events of process ``rank``."""
    with _lock:
        kept = list(spans)
        collectives = list(_collectives)
    names = {t.ident: t.name for t in threading.enumerate()}
    tids: dict[int, int] = {threading.main_thread().ident or 0: 1}
    out: list[dict[str, Any]] = []
    for name, detail, begin, end, ident in kept:
        tid = tids.setdefault(ident, len(tids) + 1)
        event = _complete(name, category(name), begin, end, rank, tid)
        if detail is not None:
            event["args"] = {"detail": detail}
        out.append(event)
    # Per group, the end of the last collective on each of its lanes, and the lanes' tracks.
    lanes: dict[str, list[float]] = {}
    tracks: dict[tuple[str, int], int] = {}
    for r in collectives:
        ends = lanes.setdefault(r.group, [])
        lane = next((k for k, free in enumerate(ends) if free <= r.start), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ended = r.end if r.end is not None else r.start
        ends[lane] = ended
        track = tracks.setdefault((r.group, lane), COLLECTIVE_TID + len(tracks))
        event = _complete(r.op, "collective", r.start, ended, rank, track)
        event["args"] = {
            "seq": r.seq, "group": r.group, "bytes": r.nbytes, "context": r.context,
            "site": r.site, "thread": r.thread, "shapes": [list(s) for s in r.shapes],
            "dtypes": list(r.dtypes),
        }  # fmt: skip
        if r.end is None:  # never seen to end: an instant, not a duration
            event.update(ph="i", s="t")
            del event["dur"]
        out.append(event)
    meta = [_meta("process_name", rank, 0, name=f"rank {rank}")]
    meta.append(_meta("process_sort_index", rank, 0, sort_index=rank))
    for ident, tid in tids.items():
        meta.append(_meta("thread_name", rank, tid, name=names.get(ident, f"thread {ident}")))
        meta.append(_meta("thread_sort_index", rank, tid, sort_index=tid))
    for (group, lane), track in tracks.items():
        label = f"collectives of {group}" + ("" if lane == 0 else f", {lane + 1}")
        meta.append(_meta("thread_name", rank, track, name=label))
        meta.append(_meta("thread_sort_index", rank, track, sort_index=track))
    return meta + out


def merge(directory: str | Path, run_id: str | None = None, name: str = "trace.json") -> Path:
    """Join the ranks' ``trace-rank<R>.json`` in ``directory`` into one trace; its path.

    Times are shifted to start at 0 (the shift, in µs since the epoch, is kept as
    ``otherData.origin_unix_us``). With ``run_id``, only that run's files are taken
    (``TORCHELASTIC_RUN_ID`` of the workers).

    Raises:
        FileNotFoundError: no rank's trace file is there.

    Example::

        path = trace.merge("traces")   # traces/trace.json: open it in ui.perfetto.dev
    """
    where = Path(directory)
    found = []
    for path in where.glob("trace-rank*.json"):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a rank killed while writing leaves no file (atomic), but be safe
        other = document.get("otherData", {})
        if run_id is None or other.get("run_id") == run_id:
            found.append((other.get("rank", 0), document["traceEvents"]))
    if not found:
        which = f" of run {run_id}" if run_id is not None else ""
        raise FileNotFoundError(f"no trace-rank*.json{which} in {where}")
    found.sort(key=lambda pair: pair[0])
    merged = [e for _, rank_events in found for e in rank_events]
    timed = [e["ts"] for e in merged if e["ph"] != "M"]
    origin = min(timed) if timed else 0.0
    for e in merged:
        if e["ph"] != "M":
            e["ts"] = round(e["ts"] - origin, 3)
    document = {
        "traceEvents": merged,
        "displayTimeUnit": "ms",
        "otherData": {"ranks": [r for r, _ in found], "origin_unix_us": origin, "run_id": run_id},
    }
    out = where / name
    write_atomic(out, json.dumps(document).encode())
    return out


def _complete(name: str, cat: str, begin: float, end: float, pid: int, tid: int) -> dict:
    return {
        "name": name, "cat": cat, "ph": "X", "ts": round(begin * 1e6, 3),
        "dur": round(max(end - begin, 0.0) * 1e6, 3), "pid": pid, "tid": tid,
    }  # fmt: skip


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict:
    return {"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _rank() -> int:
    if os.environ.get("RANK"):
        return int(os.environ["RANK"])
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _hook_optimizers() -> None:
    """Every ``optimizer.step`` a span (torch's global optimizer hooks, set while tracing)."""
    global _hooked
    if _hooked:
        return
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    began: dict[int, float] = {}

    def before(optimizer: Any, args: Any, kwargs: Any) -> None:
        if on:
            began[id(optimizer)] = time.time()

    def after(optimizer: Any, args: Any, kwargs: Any) -> None:
        t0 = began.pop(id(optimizer), None)
        if t0 is not None and on:
            add("optimizer.step", t0, time.time(), type(optimizer).__name__)

    register_optimizer_step_pre_hook(before)
    register_optimizer_step_post_hook(after)
    _hooked = True


def _at_exit() -> None:
    if not on or _pid != os.getpid():
        return
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        return  # a DataLoader worker of a traced rank: the rank writes its own file
    flush()
