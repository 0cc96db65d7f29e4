"""Hang reports: a rank stuck in a collective asks every rank where it is, and names the laggard.

Each process runs one reporter thread (started with the records, see ``records.install``).
Every half second it:

1. answers the questions other ranks put in the rendezvous store (so it works across nodes,
   under ``tandem run``, torchrun or a hand-made environment): its newest collectives, the one
   its main thread is blocked in and since when, and the Python stacks of all its threads;
2. checks its own main thread: blocked in a collective for longer than ``report_after`` seconds
   (``tandem.init(hang_report_after=...)``, ``tandem run --hang-report-after``, or the
   ``TANDEM_HANG_REPORT_AFTER`` environment variable; default 60), it asks every rank, builds one
   report that names the laggards first, prints it (the lowest rank that waits prints, once per
   hang) and writes it as JSON (``TANDEM_REPORT_DIR``, default the working directory).

The report does not stop the job: the collective's timeout still does. Example of what it says::

    tandem: rank 0 has waited 61 s in all_reduce #57 (DDP bucket 0, step 12) of world
      rank 1 never entered all_reduce #57: its newest is all_reduce #56 (DDP bucket 0,
             step 11); it is at train.py:44 in load_batch
      rank 2 waits in all_reduce #57 too
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch.distributed as dist

from tandem.doctor import records

log = logging.getLogger(__name__)

DEFAULT_AFTER_S = 60.0
# A collective blocked this long is compared across ranks (op, shapes, dtypes): cheap, and a
# mismatch is reported without waiting for the hang threshold.
DESYNC_CHECK_S = 5.0
_POLL_S = 0.5
_ANSWER_WITHIN_S = 5.0


def report_after() -> float:
    """Seconds a collective may block before a report (``TANDEM_HANG_REPORT_AFTER``)."""
    value = os.environ.get("TANDEM_HANG_REPORT_AFTER")
    try:
        return float(value) if value else DEFAULT_AFTER_S
    except ValueError:
        return DEFAULT_AFTER_S


class Reporter:
    """The one reporter thread of this process (see the module doc)."""

    _thread: threading.Thread | None = None
    _store: Any = None
    _stop = threading.Event()
    # The reports this process built, newest last (for an exit summary, and tests).
    reports: ClassVar[list[dict[str, Any]]] = []

    @classmethod
    def start(cls) -> None:
        """Start (or follow a new process group with) the reporter; no-op without a group."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        base = dist.distributed_c10d._get_default_store()
        if cls._thread is not None and cls._thread.is_alive() and cls._base is base:
            return
        if cls._thread is None:
            atexit.register(cls._exiting)
        cls._base = base
        cls._store = dist.PrefixStore("tandem/doctor/", base)
        cls._rank, cls._world = dist.get_rank(), dist.get_world_size()
        cls._main = threading.main_thread().ident
        cls._thread = threading.Thread(
            target=cls._run, args=(cls._store,), name="tandem-doctor", daemon=True
        )
        cls._thread.start()

    _base: Any = None
    _rank = 0
    _world = 1
    _main: int | None = None

    _answered = 0

    @classmethod
    def _exiting(cls) -> None:
        # Never inside a store call while the interpreter tears down: a C++ thread dropping
        # Python objects then aborts the process.
        cls._stop.set()
        if cls._thread is not None:
            cls._thread.join(timeout=2 * _POLL_S)

    @classmethod
    def _run(cls, store: Any) -> None:
        cls._answered = 0
        checked: records.Record | None = None  # compared across ranks (the cheap check)
        reported: records.Record | None = None
        try:
            while not cls._stop.wait(_POLL_S) and store is cls._store and dist.is_initialized():
                cls._answer(store)
                stuck = records.blocked.get(cls._main) if cls._main is not None else None
                if stuck is None or stuck is reported:
                    continue
                waited, after = time.time() - stuck.start, report_after()
                full = waited >= after
                if not full and (stuck is checked or waited < min(DESYNC_CHECK_S, after)):
                    continue
                # A few seconds in: do the ranks' collectives even match? Reported at once if
                # not (a mismatched op hangs Gloo); the full report waits for the threshold.
                checked = stuck
                try:
                    if cls._survey(store, stuck, only_if_mismatched=not full):
                        reported = stuck
                except (ValueError, TypeError, KeyError) as e:  # a bug of ours: say so
                    reported = stuck
                    log.warning("tandem: the hang report failed: %r", e)
        except Exception:  # the store went away with the job: nothing left to report
            return

    @classmethod
    def _answer(cls, store: Any) -> None:
        """Answer every question asked since the last answer (its own included: harmless)."""
        cls._answered = answer_queries(store, cls._answered, cls._rank, cls.state)

    @classmethod
    def state(cls) -> dict[str, Any]:
        """Where this process stands: newest collectives, what it is blocked in, its stacks."""
        stuck = records.blocked.get(cls._main) if cls._main is not None else None
        newest: dict[str, dict[str, Any]] = {}
        for record in records.recent(64):
            newest[record.group] = record.as_dict()
        frames = sys._current_frames()
        main = frames.get(cls._main) if cls._main is not None else None
        return {
            "rank": cls._rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "blocked": stuck.as_dict() if stuck is not None else None,
            "newest": newest,  # per group: its newest record
            "where": records.user_line(main),
            "stacks": {
                thread.name: "".join(traceback.format_stack(frames[thread.ident]))
                for thread in threading.enumerate()
                if thread.ident in frames and not thread.name.startswith("tandem-")
            },
        }

    @classmethod
    def _survey(cls, store: Any, stuck: records.Record, only_if_mismatched: bool) -> bool:
        """Ask every rank, build the report; print and write it (True) unless only a mismatch
        was to be reported and there is none (False)."""
        query = int(store.add("queries", 1))
        deadline = time.monotonic() + _ANSWER_WITHIN_S
        answers: dict[int, dict[str, Any]] = {cls._rank: cls.state()}
        while time.monotonic() < deadline and len(answers) < cls._world:
            cls._answer(store)  # another rank may be asking at the same time
            for r in range(cls._world):
                key = f"answer/{query}/{r}"
                if r not in answers and store.check([key]):
                    answers[r] = json.loads(store.get(key))
            time.sleep(0.05)
        report = build_report(cls._rank, stuck, answers, cls._world)
        if only_if_mismatched and not report["mismatched"]:
            return False
        cls.reports.append(report)
        # One rank prints: the first to claim this hang (every waiting rank builds the same).
        claim = store.compare_set(f"printed/{stuck.group}/{stuck.seq}", "", str(cls._rank))
        if claim.decode() == str(cls._rank):
            print(report["text"], file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            where = Path(os.environ.get("TANDEM_REPORT_DIR") or ".")
            where.mkdir(parents=True, exist_ok=True)
            name = f"tandem-hang-rank{cls._rank}-{stuck.op}-{stuck.seq}.json"
            path = where / name
            path.write_text(json.dumps(report, indent=2))
        return True


def answer_queries(store: Any, answered: int, rank: int, state: Callable[[], dict]) -> int:
    """Answer the questions put in ``store`` since question ``answered``; the last one answered.

    The protocol both this reporter and tandem.DDP's lockstep survey use: an asker increments
    ``queries`` and reads ``answer/<query>/<rank>`` from every rank.
    """
    asked = int(store.add("queries", 0))
    if asked > answered:
        text = json.dumps(state())
        for query in range(answered + 1, asked + 1):
            store.set(f"answer/{query}/{rank}", text)
    return max(asked, answered)


def build_report(
    rank: int, stuck: records.Record, answers: dict[int, dict[str, Any]], world: int
) -> dict[str, Any]:
    """The report of ``rank``, blocked in ``stuck``, from every rank's answer (laggards first)."""
    waited = time.time() - stuck.start
    lines = [f"tandem: rank {rank} has waited {waited:.0f} s in {stuck.describe()}"]
    laggards, waiting, silent, mismatched = [], [], [], []
    for r in range(world):
        answer = answers.get(r)
        if r == rank:
            continue
        if answer is None:
            silent.append(r)
            continue
        newest = answer["newest"].get(stuck.group)
        seq = newest["seq"] if newest is not None else 0
        if seq < stuck.seq:
            had = f"{_describe(newest)}" if newest is not None else "none in this group"
            laggards.append(
                f"  rank {r} never entered {stuck.op} #{stuck.seq}: its newest is {had}; "
                f"it is at {answer['where']}"
            )
        elif seq == stuck.seq and _fingerprint(newest) != _fingerprint(stuck.as_dict()):
            mismatched.append(
                f"  rank {r} issued {_side(newest)} where rank {rank} issued "
                f"{_side(stuck.as_dict())}: the ranks' collectives differ "
                "(TANDEM_DEBUG=collectives checks every one before it is issued)"
            )
        elif answer["blocked"] is not None:
            waiting.append(f"  rank {r} waits in {_describe(answer['blocked'])} too")
        else:
            waiting.append(f"  rank {r} has passed it; it is at {answer['where']}")
    lines += mismatched
    lines += laggards
    lines += [f"  rank {r} did not answer within {_ANSWER_WITHIN_S:.0f} s" for r in silent]
    lines += waiting
    if laggards:
        lines.append(
            "The laggards' stacks follow; the job goes on until the collective's timeout stops it."
        )
    for r in range(world):
        answer = answers.get(r)
        if answer is not None and any(f"rank {r} never" in line for line in laggards):
            for name, stack in answer["stacks"].items():
                lines.append(f"--- rank {r} thread {name}:\n{stack.rstrip()}")
    return {
        "rank": rank,
        "waited_s": waited,
        "collective": stuck.as_dict(),
        "laggards": [line.strip() for line in laggards],
        "mismatched": [line.strip() for line in mismatched],
        "silent": silent,
        "ranks": answers,
        "text": "\n".join(lines),
    }


def _describe(record: dict[str, Any]) -> str:
    where = f" ({record['context']})" if record.get("context") else ""
    return f"{record['op']} #{record['seq']}{where}"


def _fingerprint(record: dict[str, Any]) -> tuple:
    return (record["op"], json.dumps(record["shapes"]), json.dumps(record["dtypes"]))


def _side(record: dict[str, Any]) -> str:
    pairs = zip(record["shapes"], record["dtypes"], strict=True)
    tensors = ", ".join(f"{t} {tuple(s)}" for s, t in pairs) or "no tensors"
    return f"{record['op']} #{record['seq']} of {tensors} at {record['site']}"
