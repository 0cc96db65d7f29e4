"""The step clock: how long each training step took on this rank, and how much of it waited.

Always on, and cheap: an engine ticks its :class:`Clock` once per step (a few hundred
nanoseconds), and the time a thread spends blocked in a collective is added to one running
sum, by :mod:`tandem.doctor.records` for a blocking call and by ``with steps.waiting:`` around
an engine's wait on an asynchronous one (nested waits count once). A step's waiting is what that
sum grew by between its two ticks.

Likewise the bytes handed to collectives: :mod:`tandem.doctor.records` adds each collective's
(its :attr:`~tandem.doctor.records.Record.nbytes`) to a running sum per group with
:func:`handed`, and a step's bytes per group are what those sums grew by between its two ticks
(a step starts at its tick: DDP's buffer broadcast and the backward's all-reduces fall in the
step of their forward).

What a step is: for tandem.DDP a forward in grad mode, for FullyShardedDataParallel a forward
of the root in grad mode, for the Trainer an optimizer step. The Trainer's clock wins over the
engine's (with gradient accumulation one optimizer step is several forwards); among engines the
first one built counts (a second model's forwards fall inside the first one's steps).

At exit a rank writes ``tandem-steps-<run id>-rank<R>.json`` into ``TANDEM_REPORT_DIR``
(``tandem run`` sets it for its workers; nothing is written without it): the newest
:data:`KEEP` steps as ``[seconds, seconds waited]``, the same steps' bytes handed to collectives
as ``{group: bytes}`` (``handed``; a group handed nothing in a step is left out), and the
seconds waited in all. The launcher's exit summary (:mod:`tandem.doctor.stragglers`) reads them.

Example::

    clock = steps.clock("tandem.DDP forwards", priority=1)   # once, when the engine is built
    clock.tick()                                              # once per step
    step_clock.handed("world", 4096)                          # records does this per collective
    with steps.waiting:                                       # around a wait on async work
        work.wait()
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import threading
import time
from collections import deque
from pathlib import Path

from tandem.files import write_atomic

#: Steps kept per clock (the newest); a median over them is what the summary reports.
KEEP = 10_000

_clocks: list[Clock] = []
_waited = 0.0  # seconds any thread of this process spent blocked in collectives
_handed: dict[str, int] = {}  # bytes handed to collectives so far, per group name
_pid: int | None = None  # the process that made the clocks: a forked child writes nothing


class _Waiting:
    """``with steps.waiting:`` the calling thread is blocked in a collective (see module doc)."""

    __slots__ = ()

    def __enter__(self) -> None:
        mine = _thread
        depth = getattr(mine, "depth", 0)
        if depth == 0:
            mine.since = time.perf_counter()
        mine.depth = depth + 1

    def __exit__(self, *exc: object) -> None:
        global _waited
        mine = _thread
        mine.depth -= 1
        if mine.depth == 0:
            _waited += time.perf_counter() - mine.since


_thread = threading.local()  # per thread: how deep in `waiting`, and since when
waiting = _Waiting()


def blocked(seconds: float) -> None:
    """A blocking collective took ``seconds`` (counted unless inside ``with waiting:``)."""
    global _waited
    if getattr(_thread, "depth", 0) == 0:
        _waited += seconds


def handed(group: str, nbytes: int) -> None:
    """A collective of ``group`` (its records name) was handed ``nbytes`` by this rank.

    Not thread-safe on its own: :mod:`tandem.doctor.records` calls it under its lock.

    Example::

        step_clock.handed("ranks 0,1", flat.nbytes)
    """
    _handed[group] = _handed.get(group, 0) + nbytes


def handed_so_far() -> dict[str, int]:
    """Bytes handed to collectives by this process so far, per group (a copy).

    Example::

        before = step_clock.handed_so_far()
        dist.all_reduce(torch.ones(4))       # 16 more bytes under "world"
    """
    return _handed.copy()


def waited() -> float:
    """Seconds this process has spent blocked in collectives so far."""
    return _waited


class Clock:
    """One engine's (or the Trainer's) steps: :meth:`tick` once per step.

    ``priority``: the clock the summary reports is the lowest-numbered one that ticked
    (the Trainer's is 0, an engine's 1).
    """

    __slots__ = ("handed", "handed_then", "last", "name", "priority", "steps", "waited_then")

    def __init__(self, name: str, priority: int) -> None:
        self.name = name
        self.priority = priority
        self.last: float | None = None
        self.waited_then = 0.0
        self.handed_then: dict[str, int] = {}
        self.steps: deque[tuple[float, float]] = deque(maxlen=KEEP)
        #: Per step of ``steps`` (the same index): bytes handed to collectives per group.
        self.handed: deque[dict[str, int]] = deque(maxlen=KEEP)

    def tick(self) -> None:
        """A step starts (and the previous one, if any, ends)."""
        # The copy is atomic under the GIL: a collective on another thread lands in one step.
        now, so_far, sums = time.perf_counter(), _waited, _handed.copy()
        if self.last is not None:
            self.steps.append((now - self.last, so_far - self.waited_then))
            then = self.handed_then
            self.handed.append(
                {g: n - then.get(g, 0) for g, n in sums.items() if n != then.get(g, 0)}
            )
        self.last, self.waited_then, self.handed_then = now, so_far, sums


def clock(name: str, priority: int) -> Clock:
    """A new clock, reported at exit if it is the one that counts (see the module doc)."""
    global _pid
    if _pid != os.getpid():
        _pid = os.getpid()
        _clocks.clear()  # a forked child starts its own
        atexit.register(_at_exit)
    made = Clock(name, priority)
    _clocks.append(made)
    return made


def counting() -> Clock | None:
    """The clock whose steps are reported: lowest priority first, then the first made."""
    ticked = [c for c in _clocks if c.steps]
    return min(ticked, key=lambda c: c.priority) if ticked else None


def write(directory: str | Path) -> Path | None:
    """Write this rank's steps into ``directory`` now; the file (None: no step yet).

    Example::

        steps.write("logs")       # logs/tandem-steps-<run id>-rank0.json
    """
    chosen = counting()
    if chosen is None:
        return None
    rank = int(os.environ.get("RANK", "0") or 0)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    record = {
        "rank": rank,
        "run_id": run_id,
        "attempt": int(os.environ.get("TANDEM_RESTART_COUNT", "0") or 0),
        "clock": chosen.name,
        "steps": [[round(s, 7), round(w, 7)] for s, w in chosen.steps],
        "handed": list(chosen.handed),
        "waited_s": _waited,
    }
    path = Path(directory) / file_name(run_id, rank)
    write_atomic(path, json.dumps(record).encode())
    return path


def file_name(run_id: str | None, rank: int | str) -> str:
    """The step file of ``rank`` in run ``run_id`` (None: a glob pattern of every run's).

    >>> file_name("3f2a9c01be77", 1), file_name(None, "*")
    ('tandem-steps-3f2a9c01be77-rank1.json', 'tandem-steps-*-rank*.json')
    """
    # The launcher's run id is a hex token; anything else is made safe for a file name.
    run = "*" if run_id is None else re.sub(r"[^\w.-]", "_", run_id)
    return f"tandem-steps-{run}-rank{rank}.json"


def _at_exit() -> None:
    where = os.environ.get("TANDEM_REPORT_DIR")
    if not where or _pid != os.getpid():
        return
    # A rank that cannot write is left out of the summary; the run's own result stands.
    with contextlib.suppress(OSError):
        write(where)
