"""Ranks out of step: a DDP wait that lasts asks every rank where it is, and names the culprit.

A rank that runs out of data before the others leaves its training loop; the others then wait
in their next gradient all-reduce for a rank that will never send. Left alone, that wait ends at
the collective timeout (30 minutes by default), with an error that blames the waiting rank.

tandem.DDP waits on its collectives in slices instead. Once a wait has lasted ``CHECK_AFTER_S``
(or the collective failed because a peer closed its connection), the waiting rank asks every
rank of the group, through the rendezvous store, how many training steps its DDP has started
and where its main thread is. A small thread in each process answers. A rank that has started
fewer steps and is blocked in another ``torch.distributed`` call (a barrier, an all-reduce of
metrics, the teardown at the end of its script) can never join this step: that is a deadlock,
and every rank raises :class:`RanksOutOfStepError` naming it, its step and its line. A rank
that exited is named likewise. A rank that is merely busy (saving a checkpoint, a slow batch)
is not an error: the wait goes on.

Example of what the waiting rank raises::

    RanksOutOfStepError: tandem.DDP: rank 1 started 12 training steps and is now in
    torch.distributed.barrier at train.py:41 in main, while rank 0 waits in step 13 (gradient
    all-reduce, bucket 0). The ranks ran different numbers of steps: give every rank the same
    number of batches (tandem.data.DistributedSampler pads the data set to a multiple of the
    world size), or wrap the loop in `with tandem.join([model]):` for uneven inputs.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import json
import logging
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tandem._dist import global_ranks, group_size, initialized
from tandem.doctor import records
from tandem.doctor.hang import answer_queries

log = logging.getLogger("tandem.lockstep")

# How long a DDP wait lasts before the ranks are asked where they are; the answers take a few
# tenths of a second, so a rank that ran out is named within a few seconds.
CHECK_AFTER_S = 3.0
_SLICE = timedelta(seconds=0.25)
_POLL_S = 0.2
_ANSWER_WITHIN_S = 2.0


class RanksOutOfStepError(RuntimeError):
    """The ranks of a DDP model stopped running the same training steps."""


@dataclass
class Progress:
    """One DDP model's progress on this rank, as its peers are told."""

    index: int  # the n-th DDP model built in this process: the same model on every rank
    group: dist.ProcessGroup | None
    step: int = 0  # training forwards started


def track(group: dist.ProcessGroup | None) -> Progress:
    """Register a DDP model; the first one starts this process's answering thread."""
    progress = Progress(next(_built), group)
    _models[progress.index] = progress
    if group_size(group) > 1:
        _Answerer.start()
    return progress


def wait(work: dist.Work, progress: Progress, what: str) -> None:
    """``work.wait()``, but a wait that lasts checks that every rank is still in step."""
    try:
        work.wait(timeout=_SLICE)
        return
    except RuntimeError as e:
        if not _timed_out(e):  # a peer closed its connection: say which rank left
            _raise_if_out_of_step(progress, what, e)
            raise
    # A wait that lasts: the hang reporter is told what it is for, and the ranks are surveyed.
    with records.waiting(records.of(work)):
        next_check = time.monotonic() + CHECK_AFTER_S - _SLICE.total_seconds()
        while True:
            try:
                work.wait(timeout=_SLICE)
                return
            except RuntimeError as e:
                if not _timed_out(e):
                    _raise_if_out_of_step(progress, what, e)
                    raise
            if time.monotonic() >= next_check:
                _raise_if_out_of_step(progress, what, None)
                log.debug("rank waits in %s (step %d); every rank is in step", what, progress.step)
                next_check = time.monotonic() + CHECK_AFTER_S


def _timed_out(error: RuntimeError) -> bool:
    return "timed out" in str(error).lower()


def _raise_if_out_of_step(progress: Progress, what: str, cause: RuntimeError | None) -> None:
    found = _survey(progress, what)
    if found:
        _Answerer.stuck = True
        raise RanksOutOfStepError(found) from cause


def _survey(progress: Progress, what: str) -> str | None:
    """Ask every rank where it is; the error message if some rank can never join this step."""
    store = _Answerer.store
    if store is None:
        return None
    me = dist.get_rank()
    try:
        query = store.add("queries", 1)
        deadline = time.monotonic() + _ANSWER_WITHIN_S
        answers: dict[int, dict] = {}
        peers = [r for r in global_ranks(progress.group) if r != me]
        while time.monotonic() < deadline and len(answers) < len(peers):
            for r in peers:
                if r not in answers:
                    for key in (f"exit/{r}", f"answer/{query}/{r}"):
                        if store.check([key]):
                            answers[r] = json.loads(store.get(key))
                            break
            time.sleep(0.05)
    except RuntimeError:  # the store is gone: its host (rank 0) has exited
        return (
            f"tandem.DDP: rank {me} waits in step {progress.step} ({what}), and the rendezvous "
            "store hosted by rank 0 no longer answers: rank 0 has exited or crashed."
        )
    culprits: dict[int, str] = {}
    for r in sorted(answers):
        answer = answers[r]
        step = answer["steps"].get(str(progress.index), 0)
        if answer.get("exited"):
            culprits[r] = f"rank {r} exited after starting {step} training steps"
        elif step < progress.step and answer["in"] is not None:
            culprits[r] = (
                f"rank {r} started {step} training steps and is now in {answer['in']} at "
                f"{answer['where']}"
            )
    if not culprits:
        return None
    message = (
        f"tandem.DDP: {'; '.join(culprits.values())}, while rank {me} waits in step "
        f"{progress.step} ({what}). The ranks ran different numbers of steps: give every rank "
        "the same number of batches (tandem.data.DistributedSampler pads the data set to a "
        "multiple of the world size), or wrap the loop in `with tandem.join([model]):` for "
        "uneven inputs."
    )
    for r in culprits:
        store.set(f"verdict/{r}", message)
    # Let each culprit take the verdict before this rank raises: once this rank exits, the
    # culprit's own collective fails with the backend's words, naming nobody.
    deadline = time.monotonic() + _ANSWER_WITHIN_S
    while time.monotonic() < deadline and not all(store.check([f"ack/{r}"]) for r in culprits):
        time.sleep(0.05)
    return message


class _Answerer:
    """The thread that tells peers where this rank is (one per process)."""

    store: Any = None
    _base: Any = None
    _thread: threading.Thread | None = None
    _main = 0  # the main thread's ident, where a verdict is raised
    _rank = -1  # this process's global rank, under which it answers
    _stop = threading.Event()
    # A collective of this process can never complete: the backend would wait for it forever
    # while the interpreter exits, so the exit is made immediate (see _exiting).
    stuck = False

    @classmethod
    def start(cls) -> None:
        base = dist.distributed_c10d._get_default_store()
        if cls._thread is not None and cls._thread.is_alive() and cls._base is base:
            return
        # A first model, or a process group made anew (its store is another): answer there.
        if cls._thread is None:
            atexit.register(cls._exiting)
        cls._base = base
        cls.store = dist.PrefixStore("tandem/lockstep/", base)
        main = threading.main_thread().ident
        assert main is not None  # only a thread not yet started has no ident
        cls._main = main
        cls._rank = dist.get_rank()
        cls._thread = threading.Thread(
            target=cls._run, args=(cls.store, cls._rank), name="tandem-lockstep", daemon=True
        )
        cls._thread.start()

    @classmethod
    def _run(cls, store: Any, rank: int) -> None:
        answered = 0
        try:
            # Until the process exits or its group is destroyed, or a newer group's thread
            # takes over: never inside a store call while the interpreter tears down.
            while not cls._stop.wait(_POLL_S) and store is cls.store and initialized():
                answered = answer_queries(store, answered, rank, cls._state)
                if store.check([f"verdict/{rank}"]):
                    cls._convicted(store.get(f"verdict/{rank}").decode())
                    store.set(f"ack/{rank}", "1")
                    return
        except Exception:  # the store went away with the job: nothing left to answer
            return

    @classmethod
    def _state(cls, exited: bool = False) -> dict:
        inside, where = _main_thread_position(cls._main)
        return {
            "steps": {str(p.index): p.step for p in list(_models.values())},
            "in": inside,
            "where": where,
            "exited": exited,
        }

    @classmethod
    def _convicted(cls, message: str) -> None:
        # This rank is the one out of step. Its main thread may be blocked in a collective
        # that will now fail with the backend's own words; raise ours in it as well.
        log.error("%s", message)
        cls.stuck = True
        error = type("RanksOutOfStepError", (RanksOutOfStepError,), {"__init__": _with(message)})
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(cls._main), ctypes.py_object(error)
        )

    @classmethod
    def _exiting(cls) -> None:
        if cls.stuck:
            # The error has been printed; tearing the process group down would hang on the
            # collective that never completes.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        with contextlib.suppress(Exception):
            cls.store.set(f"exit/{cls._rank}", json.dumps(cls._state(exited=True)))
        cls._stop.set()
        if cls._thread is not None:
            cls._thread.join(timeout=2 * _POLL_S)


def _with(message: str) -> Any:
    def __init__(self: RanksOutOfStepError) -> None:
        RanksOutOfStepError.__init__(self, message)

    return __init__


def _main_thread_position(ident: int | None) -> tuple[str | None, str]:
    """(the torch.distributed call the main thread is in, or None; its innermost user line)."""
    top = sys._current_frames().get(ident) if ident is not None else None
    inside = None
    frame = top
    while frame is not None:
        if frame.f_code.co_filename.endswith("distributed_c10d.py"):
            inside = f"torch.distributed.{frame.f_code.co_name}"
        frame = frame.f_back
    return inside, records.user_line(top)


# The DDP models alive in this process, by the order they were built (the same on every rank).
_models: weakref.WeakValueDictionary[int, Progress] = weakref.WeakValueDictionary()
_built = itertools.count()
