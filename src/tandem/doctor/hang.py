"""The doctor's thread: answers other ranks, and names a stuck, out-of-step or deadlocked rank.

Each process runs one reporter thread (started with the records, see ``tandem.doctor.start``);
it is also the thread that answers for tandem.DDP's lockstep check (``parallel.lockstep`` adds
its part to the answers and its step to the polls). Every half second it:

1. answers the questions other ranks put in the rendezvous store (so it works across nodes,
   under ``tandem run``, torchrun or a hand-made environment): its newest and open collectives,
   the one its main thread is blocked in and since when, and the Python stacks of its threads;
2. takes a mismatch another rank found (the store's ``fatal`` key): from then on this process's
   collectives raise ``CollectiveMismatchError`` (``tandem.doctor.mismatch``);
3. checks its own main thread. Blocked in a collective for ``DESYNC_CHECK_S`` (5 s), it compares
   that collective across ranks: if the ranks' differ (op, shapes, dtypes), every rank raises
   the error naming both sides, within a second (Gloo's waits are sliced for this, see
   ``records.wait``; a size mismatch that makes Gloo abort is held for this check, see
   ``tandem.doctor.aborts``). Blocked for longer than ``report_after`` seconds
   (``tandem.init(hang_report_after=...)``, ``tandem run --hang-report-after``, or the
   ``TANDEM_HANG_REPORT_AFTER`` environment variable; default 60), or for half the collective's
   timeout if that is sooner (:func:`report_after`: a short timeout would otherwise end the job
   before anyone is named), it asks every rank and builds one report that names the laggards
   first, prints it (the lowest rank that waits prints, once per hang) and writes it as JSON
   (:func:`report_dir`: ``TANDEM_HANG_REPORT_DIR``, else ``TANDEM_REPORT_DIR``, else the working
   directory). At exit, a report whose collective never completed is marked so
   (``"unfinished_at_exit"``): ``tandem run``'s exit summary then blames the laggards, not the
   rank whose collective timed out;
4. on the lowest rank: when no rank is in a collective and none has started or finished one for
   ``report_after`` seconds (after at least one), every rank waits on something else: one report
   gives each rank's line and stacks, once per quiet period.

A hang report does not stop the job: the collective's timeout still does. Example::

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
import math
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch.distributed as dist

from tandem.doctor import aborts, mismatch, records, reports
from tandem.job import checkin

log = logging.getLogger(__name__)

DEFAULT_AFTER_S = 60.0
#: Of the collective's timeout, the share a collective may wait before it is reported: the rest
#: leaves time to ask every rank (at most a quarter of the timeout, see :func:`answer_within_s`)
#: and write the report before the timeout ends the job.
TIMEOUT_SHARE = 0.5
# A collective blocked this long is compared across ranks (op, shapes, dtypes): cheap, and a
# mismatch raises on every rank without waiting for the hang threshold.
DESYNC_CHECK_S = 5.0
_POLL_S = 0.5
# How long a rank that raises a mismatch waits for every rank to have taken it.
_TAKEN_WITHIN_S = 3.0
# At exit without tandem.shutdown(): how long a rank waits for rank 0's check-out verdict (rank
# 0 may still be working; past this, what the rank knows itself stands).
_CHECK_OUT_AT_EXIT_S = 5.0


def configured_after() -> float:
    """The report threshold asked for: ``TANDEM_HANG_REPORT_AFTER`` (``tandem.init``'s
    ``hang_report_after``, ``tandem run --hang-report-after``), default 60 s."""
    value = os.environ.get("TANDEM_HANG_REPORT_AFTER")
    try:
        return float(value) if value else DEFAULT_AFTER_S
    except ValueError:
        return DEFAULT_AFTER_S


def report_after(timeout_s: float | None = None) -> float:
    """Seconds a collective may block before a report: the configured threshold, or
    ``TIMEOUT_SHARE`` (half) of the collective timeout ``timeout_s`` (the default group's when
    None) if that is sooner, so that the report is out before the timeout ends the job.

    Example (``hang_report_after`` left at 60 s)::

        report_after(20.0)      # 10.0: tandem.init(timeout=20) is reported after 10 s
        report_after(1800.0)    # 60.0: torch's 30-minute default leaves the threshold as is
    """
    if timeout_s is None:
        timeout_s = Reporter.timeout_s
    after = configured_after()
    return after if timeout_s is None else min(after, TIMEOUT_SHARE * timeout_s)


def answer_within_s(timeout_s: float | None = None) -> float:
    """How long a report waits for the ranks' answers: 5 s, or a quarter of a shorter collective
    timeout (a report at half the timeout is then complete by three quarters of it).

    Example::

        answer_within_s(8.0)      # 2.0
        answer_within_s(1800.0)   # 5.0
    """
    if timeout_s is None:
        timeout_s = Reporter.timeout_s
    within = reports.ANSWER_WITHIN_S
    return within if timeout_s is None else min(within, timeout_s / 4)


def report_dir() -> Path:
    """Where hang reports are written: ``TANDEM_HANG_REPORT_DIR`` (``tandem run`` without
    ``--log-dir`` sets it to its working directory), else ``TANDEM_REPORT_DIR``, else the
    working directory."""
    env = os.environ
    return Path(env.get("TANDEM_HANG_REPORT_DIR") or env.get("TANDEM_REPORT_DIR") or ".")


def collective_timeout_s() -> float | None:
    """The default process group's collective timeout in seconds (None if it cannot be read:
    torch keeps it in its backend's options)."""
    try:
        import torch

        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return float(group._get_backend(device).options._timeout.total_seconds())
    except Exception:  # another torch, another backend: no cap, the configured threshold holds
        return None


class Reporter:
    """The one doctor thread of this process (see the module doc)."""

    _thread: threading.Thread | None = None
    _store: Any = None
    _base: Any = None
    _rank = 0
    _world = 1
    _main: int | None = None
    _stop = threading.Event()
    _wake = threading.Event()
    _answering = threading.Lock()
    _answered = 0
    # The reports this process built, newest last (for an exit summary, and tests).
    reports: ClassVar[list[dict[str, Any]]] = []
    #: More to tell the peers: name -> a function whose result joins every answer.
    sections: ClassVar[dict[str, Callable[[], Any]]] = {}
    #: Called on every poll with the doctor's store (lockstep takes its verdicts there).
    hooks: ClassVar[dict[str, Callable[[Any], None]]] = {}
    #: Whether the answers show a mismatch that another check names better (lockstep: the
    #: ranks ran different numbers of DDP steps); it is then left to that check for a while.
    deferrals: ClassVar[dict[str, Callable[[dict[int, dict[str, Any]]], bool]]] = {}
    #: A collective of this process can never complete: the exit is made immediate (the
    #: backend would wait for that collective while the interpreter tears down).
    stuck = False
    #: The default group's collective timeout (seconds; None: unknown), read at start.
    timeout_s: float | None = None
    # The hang reports this process wrote: (file, report, the record it waits in), for exit.
    _written: ClassVar[list[tuple[Path, dict[str, Any], Any]]] = []

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
        cls.timeout_s = collective_timeout_s()
        aborts.install(cls._wake.set)
        mismatch.before_raise = _until_everyone_took_it
        cls._thread = threading.Thread(
            target=cls._run, args=(cls._store,), name="tandem-doctor", daemon=True
        )
        cls._thread.start()

    @classmethod
    def _exiting(cls) -> None:
        cls._mark_unfinished()
        if cls.stuck or (mismatch.failed is not None and records.open_records()):
            # The error has been printed; tearing the process group down would hang on the
            # collective that never completes.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        try:  # a script that never called tandem.shutdown(): its check-out, here
            checkin.check_out(cls._rank, cls._world, checkin.SETTLE_S + _CHECK_OUT_AT_EXIT_S)
        except checkin.RendezvousError as e:
            print(f"tandem: RendezvousError: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        aborts.uninstall()
        # Peers that ask from now on read this instead (tandem.DDP names a rank that left).
        with contextlib.suppress(Exception):
            cls._store.set(f"exit/{cls._rank}", json.dumps(cls.state(exited=True)))
        # Never inside a store call while the interpreter tears down: a C++ thread dropping
        # Python objects then aborts the process.
        cls._stop.set()
        cls._wake.set()
        if cls._thread is not None:
            cls._thread.join(timeout=2 * _POLL_S)

    @classmethod
    def _mark_unfinished(cls) -> None:
        """At exit: the reports whose collective never completed say so in their JSON (the
        collective's timeout, or an error, ended this process while it waited)."""
        for path, report, record in cls._written:
            if record is None or report.get("unfinished_at_exit"):
                continue
            if record.end is not None or (not record.failed and record.poll()):
                continue
            report["unfinished_at_exit"] = True
            with contextlib.suppress(OSError):
                path.write_text(json.dumps(report, indent=2))

    @classmethod
    def _run(cls, store: Any) -> None:
        cls._answered = 0
        watch = _Watch()
        try:
            while store is cls._store and dist.is_initialized():
                cls._wake.wait(_POLL_S)
                cls._wake.clear()
                if cls._stop.is_set() or store is not cls._store:
                    return
                cls._poll(store)
                for hook in list(cls.hooks.values()):
                    hook(store)
                try:
                    if aborts.aborting.is_set():
                        watch.abort(cls, store)
                    watch.main_thread(cls, store)
                    if cls._rank == 0:
                        watch.quiet(cls)
                except (ValueError, TypeError, KeyError) as e:  # a bug of ours: say so
                    log.warning("tandem: the doctor's check failed: %r", e)
        except Exception:  # the store went away with the job: nothing left to report
            return

    @classmethod
    def _poll(cls, store: Any) -> None:
        """Answer every question asked since the last answer (its own included: harmless), and
        take a mismatch another rank found."""
        with cls._answering:
            cls._answered = answer_queries(store, cls._answered, cls._rank, cls.state)
        if mismatch.failed is None and store.check(["fatal"]):
            _take(store, store.get("fatal").decode())
        if mismatch.failed is None and (note := checkin.fatal_note()) is not None:
            _take(store, note, checkin.RendezvousError)  # a late duplicate RANK: stop the job

    @classmethod
    def blocked_in(cls) -> records.Record | None:
        """The collective the main thread waits in: its own, or, while it has none, the oldest
        that a thread started outside Python waits in. On a GPU autograd runs the backward's
        hooks (DDP's bucket waits among them) in a device thread of its own, while the main
        thread sits in ``backward()``: that thread's wait is the main thread's. Threads that
        Python started (a loader's prefetch, say) wait on their own account and are left out:
        their collectives are not the main thread's to compare across ranks."""
        mine = records.blocked.get(cls._main) if cls._main is not None else None
        if mine is not None:
            return mine
        foreign = {t.ident for t in threading.enumerate() if isinstance(t, threading._DummyThread)}
        waits = [r for ident, r in list(records.blocked.items()) if ident in foreign]
        return min(waits, key=lambda r: r.start, default=None)

    @classmethod
    def state(cls, exited: bool = False) -> dict[str, Any]:
        """Where this process stands: its collectives, what it is blocked in, its stacks."""
        stuck = cls.blocked_in()
        newest: dict[str, dict[str, Any]] = {}
        recent = records.recent(64)
        for record in recent:
            newest[record.group] = record.as_dict()
        frames = sys._current_frames()
        main = frames.get(cls._main) if cls._main is not None else None
        quiet = _quiet_s(recent[-16:])
        state = {
            "rank": cls._rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "exited": exited,
            "blocked": stuck.as_dict() if stuck is not None else None,
            "newest": newest,  # per group: its newest record
            "open": [r.as_dict() for r in recent if not r.poll()][:16],
            "last": recent[-1].as_dict() if recent else None,
            "quiet_s": quiet,
            "where": records.user_line(main),
            "stacks": {
                thread.name: "".join(traceback.format_stack(frames[thread.ident]))
                for thread in threading.enumerate()
                if thread.ident in frames and not thread.name.startswith("tandem-")
            },
        }
        for name, section in list(cls.sections.items()):
            state[name] = section()
        return state

    @classmethod
    def publish(
        cls,
        report: dict[str, Any],
        name: str,
        claim: str | None = None,
        show: bool = True,
        record: records.Record | None = None,
    ) -> None:
        """Keep ``report``, print it (``show``, unless another rank won the store key ``claim``:
        one rank prints what every rank found) and write it as JSON
        ``tandem-hang-rank<r>-<name>.json`` in :func:`report_dir` (where ``tandem run`` looks
        for its exit summary). ``record``: the collective it is about, checked at exit."""
        cls.reports.append(report)
        me = str(cls._rank)
        if show and (claim is None or cls._store.compare_set(claim, "", me).decode() == me):
            print(report["text"], file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            where = report_dir()
            where.mkdir(parents=True, exist_ok=True)
            path = where / f"tandem-hang-rank{cls._rank}-{name}.json"
            path.write_text(json.dumps(report, indent=2))
            cls._written.append((path.resolve(), report, record))


class _Watch:
    """What the doctor thread has checked already (one per thread run)."""

    def __init__(self) -> None:
        self.checked: records.Record | None = None  # the main thread's collective, compared
        self.check_at = 0.0  # ... when it has waited this long (inf: compared)
        self.reported: records.Record | None = None
        self.quiet_survey = 0.0  # time.monotonic() of the next deadlock survey
        self.quiet_reported: Any = None

    def main_thread(self, reporter: type[Reporter], store: Any) -> None:
        """The main thread blocked in a collective: compare it, or report the hang."""
        stuck = reporter.blocked_in()
        if stuck is None or stuck is self.reported:
            return
        waited, after = time.time() - stuck.start, report_after()
        if stuck is not self.checked:
            self.checked, self.check_at = stuck, min(DESYNC_CHECK_S, after)
        if waited < min(self.check_at, after):
            return
        self.check_at = math.inf
        within = answer_within_s()
        answers = ask(range(reporter._world), within)
        sides = reports.mismatched(stuck.as_dict(), answers)
        deferred = any(defer(answers) for defer in list(Reporter.deferrals.values()))
        if sides is not None and deferred and waited < 2 * DESYNC_CHECK_S:
            self.check_at = waited + DESYNC_CHECK_S  # once, for the check that names it better
            return
        if sides is not None:
            _fail_everywhere(store, stuck, sides)
        if sides is not None or waited >= after:
            self.reported = stuck
            report = reports.hang_report(
                reporter._rank, stuck.as_dict(), answers, reporter._world, within
            )
            report["timeout_s"] = reporter.timeout_s
            # A mismatch is raised on every rank, with its message: not printed here too.
            claim = f"printed/{stuck.group}/{stuck.seq}"
            name = f"{stuck.op}-{stuck.seq}"
            Reporter.publish(report, name, claim, show=sides is None, record=stuck)

    def abort(self, reporter: type[Reporter], store: Any) -> None:
        """Gloo would abort this process: compare its open collectives across ranks now."""
        aborts.aborting.clear()
        stuck = reporter.blocked_in()
        if stuck is None:
            stuck = next((r for r in records.open_records() if r.gloo), None)
        sides = None
        if stuck is not None:
            sides = reports.mismatched(stuck.as_dict(), ask(range(reporter._world)))
            if sides is not None:
                _fail_everywhere(store, stuck, sides)
        aborts.decide(sides is not None)

    def quiet(self, reporter: type[Reporter]) -> None:
        """No rank in a collective, none issued one for ``report_after``: say where each is."""
        # No collective is open: no timeout will end the job, the threshold is the one asked.
        quiet, after = _quiet_s(records.recent(16)), configured_after()
        if quiet is None or quiet < after or time.monotonic() < self.quiet_survey:
            return
        self.quiet_survey = time.monotonic() + max(1.0, after / 2)
        answers = ask(range(reporter._world))
        if len(answers) < reporter._world or any(
            a["exited"] or a["quiet_s"] is None or a["quiet_s"] < after for a in answers.values()
        ):
            return
        period = [answers[r]["last"]["start"] for r in range(reporter._world)]
        if period != self.quiet_reported:  # once per quiet period
            self.quiet_reported = period
            report = reports.deadlock_report(answers, reporter._world)
            Reporter.publish(report, f"deadlock-{int(time.time())}")


def _fail_everywhere(store: Any, stuck: records.Record, sides: dict[int, dict[str, Any]]) -> None:
    """Every rank raises the mismatch: the first finder's words, through the store."""
    text = mismatch.message(stuck.group, stuck.seq, sides)
    _take(store, store.compare_set("fatal", "", text).decode())


def _take(store: Any, text: str, kind: type[RuntimeError] | None = None) -> None:
    mismatch.fail(text, kind)
    store.set(f"taken/{Reporter._rank}", "1")


def _until_everyone_took_it() -> None:
    """Before this rank raises the mismatch (and may exit), until every rank has it: a peer
    whose collective failed first ("Connection reset by peer") would name nothing, and the
    store goes with rank 0."""
    keys = [f"taken/{r}" for r in range(Reporter._world)]
    deadline = time.monotonic() + _TAKEN_WITHIN_S
    with contextlib.suppress(Exception):  # the store gone: nobody is left to tell
        while time.monotonic() < deadline and not Reporter._store.check(keys):
            time.sleep(0.05)


def ask(ranks: Iterable[int], within_s: float = reports.ANSWER_WITHIN_S) -> dict[int, Any]:
    """Every rank's answer (``Reporter.state()``) among ``ranks``, through the store; a rank
    that exited gives its last one (``exited``), one that does not answer within ``within_s``
    is left out. Raises RuntimeError when the store is gone (its host, rank 0, has exited).

    Example::

        where = {r: a["where"] for r, a in hang.ask(range(world)).items()}
    """
    store = Reporter._store
    if store is None:
        return {}
    ranks = list(ranks)
    wanted = [r for r in ranks if r != Reporter._rank]
    answers = {Reporter._rank: Reporter.state()} if len(wanted) < len(ranks) else {}
    query = int(store.add("queries", 1))
    deadline = time.monotonic() + within_s
    while wanted and time.monotonic() < deadline:
        Reporter._poll(store)  # another rank may be asking this thread at the same time
        for r in list(wanted):
            for key in (f"exit/{r}", f"answer/{query}/{r}"):
                if store.check([key]):
                    answers[r] = json.loads(store.get(key))
                    wanted.remove(r)
                    break
        time.sleep(0.05)
    return answers


def answer_queries(store: Any, answered: int, rank: int, state: Callable[[], dict]) -> int:
    """Answer the questions put in ``store`` since question ``answered``; the last one answered.

    The protocol of :func:`ask`: an asker increments ``queries`` and reads
    ``answer/<query>/<rank>`` from every rank.
    """
    asked = int(store.add("queries", 0))
    if asked > answered:
        text = json.dumps(state())
        for query in range(answered + 1, asked + 1):
            store.set(f"answer/{query}/{rank}", text)
    return max(asked, answered)


def _quiet_s(newest: list[records.Record]) -> float | None:
    """Seconds since this process last started or finished a collective (of ``newest``); None
    while one is open (a thread blocked in it, or asynchronous work not done) or before any."""
    if records.blocked or not newest or not all(r.poll() for r in newest):
        return None
    return time.time() - max(r.end or r.start for r in newest)
