"""Ranks out of step: a DDP wait that lasts asks every rank where it is, and names the culprit.

A rank that runs out of data before the others leaves its training loop; the others then wait
in their next gradient all-reduce for a rank that will never send. Left alone, that wait ends at
the collective timeout (30 minutes by default), with an error that blames the waiting rank.

tandem.DDP waits on its Gloo collectives in slices instead (on NCCL a wait does not block the
host, see :func:`wait`; the doctor's hang reports watch those). Once a wait has lasted
``CHECK_AFTER_S`` (or the collective failed because a peer closed its connection), the waiting
rank asks every rank of the group, through the rendezvous store, how many training steps its
DDP has started and where its main thread is. The doctor's thread in each process answers
(this module adds its part to the answers, see ``tandem.doctor.hang``). A rank that has started
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

import ctypes
import itertools
import json
import logging
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tandem._dist import global_ranks, group_size
from tandem.doctor import hang, mismatch, records, step_clock

log = logging.getLogger("tandem.lockstep")

# How long a DDP wait lasts before the ranks are asked where they are; the answers take a few
# tenths of a second, so a rank that ran out is named within a few seconds.
CHECK_AFTER_S = 3.0
_SLICE = timedelta(seconds=0.25)
_ANSWER_WITHIN_S = 2.0


class RanksOutOfStepError(RuntimeError):
    """The ranks of a DDP model stopped running the same training steps."""


@dataclass
class ModelSteps:
    """One DDP model's progress on this rank, as its peers are told."""

    index: int  # the n-th DDP model built in this process: the same model on every rank
    group: dist.ProcessGroup | None
    step: int = 0  # training forwards started
    sliced: bool = True  # waits in slices (Gloo); NCCL's stay plain (see `wait`)


def track(group: dist.ProcessGroup | None) -> ModelSteps:
    """Register a DDP model; the first one joins this process's doctor thread, which then
    answers for it and takes the verdicts of its peers."""
    progress = ModelSteps(next(_built), group, sliced=_is_gloo(group))
    _models[progress.index] = progress
    if group_size(group) > 1:
        hang.Reporter.sections["lockstep"] = _state
        hang.Reporter.hooks["lockstep"] = _take_verdict
        hang.Reporter.deferrals["lockstep"] = _steps_differ
        hang.Reporter.start()
    return progress


def wait(work: dist.Work, progress: ModelSteps, what: str) -> None:
    """``work.wait()``, but a wait that lasts checks that every rank is still in step."""
    if not progress.sliced:
        # NCCL: a plain wait makes the current stream wait for the collective and returns at
        # once, as torch's DDP waits; the host never blocks on the GPU. A wait with a timeout
        # would block it, and torch counts that timeout from the collective's start, then
        # aborts the communicator: a bucket still on the wire after 0.25 s would end the job.
        # NCCL's own watchdog and the doctor's hang reports watch these collectives instead.
        work.wait()
        return
    with step_clock.waiting:  # the time a rank waits for the others, for tandem run's summary
        _wait(work, progress, what)


def wait_future(future: Any, progress: ModelSteps, what: str) -> Any:
    """``future.wait()`` for a communication hook's future, with :func:`wait`'s checks: on Gloo
    the wait is sliced, so a failure another thread declares (the doctor's verdict, a member
    gone under ``--recover in-memory``) is raised within a slice, and a wait that lasts asks
    the ranks where they are. Returns the future's value.

    A future gives no wait with a timeout: a callback sets an event when it completes, and
    the event is waited on in slices (a hook may chain collectives in its callbacks, as
    PowerSGD does; the future returned is done only once the last of them is).

    Example::

        result = out_of_step.wait_future(hook(state, bucket), progress, "bucket 0")
    """
    if not progress.sliced or future.done():
        return future.wait()
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    with step_clock.waiting:
        next_check = time.monotonic() + CHECK_AFTER_S
        while not done.wait(_SLICE.total_seconds()):
            mismatch.raise_if_failed()
            if time.monotonic() >= next_check:
                _raise_if_out_of_step(progress, what, None)
                next_check = time.monotonic() + CHECK_AFTER_S
    mismatch.raise_if_failed()
    return future.wait()


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    try:
        return not dist.is_initialized() or dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):  # a group this rank is not in
        return True


def _wait(work: dist.Work, progress: ModelSteps, what: str) -> None:
    try:
        work.wait(timeout=_SLICE)
        return
    except RuntimeError as e:
        mismatch.raise_if_failed()  # the doctor found that the ranks' collectives differ
        if _finished(work):  # it completed as the slice ran out
            return
        if _failed(work):  # a peer closed its connection: say which rank left
            _raise_if_out_of_step(progress, what, e)
            raise
    # A wait that lasts: the hang reporter is told what it is for, and the ranks are surveyed.
    with records.waiting(records.of(work)):
        next_check = time.monotonic() + CHECK_AFTER_S - _SLICE.total_seconds()
        while True:
            mismatch.raise_if_failed()
            try:
                work.wait(timeout=_SLICE)
                return
            except RuntimeError as e:
                mismatch.raise_if_failed()
                if _finished(work):
                    return
                if _failed(work):
                    _raise_if_out_of_step(progress, what, e)
                    raise
            if time.monotonic() >= next_check:
                _raise_if_out_of_step(progress, what, None)
                log.debug("rank waits in %s (step %d); every rank is in step", what, progress.step)
                next_check = time.monotonic() + CHECK_AFTER_S


def _failed(work: dist.Work) -> bool:
    # A slice that timed out leaves the work incomplete; a failed one is complete (its error
    # may say "timed out" too: the collective's own timeout).
    return work.is_completed()


def _finished(work: dist.Work) -> bool:
    """Whether ``work``, whose sliced wait just raised, has in fact completed without error:
    the slice can run out a moment before the collective completes, and the work is then
    complete by the time its wait has raised (seen on a loaded machine: a step's all-reduce
    reported as failed with "Operation timed out!"). Waiting again on a complete work returns
    at once, or raises its own error if it failed."""
    if not work.is_completed():
        return False
    try:
        work.wait()
    except RuntimeError:
        return False
    return True


#: Whether a collective that failed because a peer left asks the others where they are
#: (naming a rank out of step). :mod:`tandem.recovery` turns it off: there a peer that left is
#: a member lost, and the survivors re-form at once instead of surveying for seconds.
survey_lost_peers = True


def _raise_if_out_of_step(progress: ModelSteps, what: str, cause: RuntimeError | None) -> None:
    if cause is not None and not survey_lost_peers:
        return
    found = _survey(progress, what)
    if found:
        hang.Reporter.stuck = True
        raise RanksOutOfStepError(found) from cause


def _survey(progress: ModelSteps, what: str) -> str | None:
    """Ask every rank where it is; the error message if some rank can never join this step."""
    me = dist.get_rank()
    try:
        peers = [r for r in global_ranks(progress.group) if r != me]
        answers = hang.ask(peers, _ANSWER_WITHIN_S)
    except RuntimeError:  # the store is gone: its host (rank 0) has exited
        return (
            f"tandem.DDP: rank {me} waits in step {progress.step} ({what}), and the rendezvous "
            "store hosted by rank 0 no longer answers: rank 0 has exited or crashed."
        )
    culprits: dict[int, str] = {}
    for r in sorted(answers):
        answer = answers[r]
        theirs = answer.get("lockstep") or {"steps": {}, "in": None}
        step = theirs["steps"].get(str(progress.index), 0)
        if answer.get("exited"):
            culprits[r] = f"rank {r} exited after starting {step} training steps"
        elif step < progress.step and theirs["in"] is not None:
            culprits[r] = (
                f"rank {r} started {step} training steps and is now in {theirs['in']} at "
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
    store = hang.Reporter._store
    for r in culprits:
        store.set(f"lockstep/verdict/{r}", message)
    # Let each culprit take the verdict before this rank raises: once this rank exits, the
    # culprit's own collective fails with the backend's words, naming nobody.
    deadline = time.monotonic() + _ANSWER_WITHIN_S
    while time.monotonic() < deadline and not all(
        store.check([f"lockstep/ack/{r}"]) for r in culprits
    ):
        time.sleep(0.05)
    return message


def _state() -> dict[str, Any]:
    """This process's part of the doctor's answers: its DDP models' steps, and the
    torch.distributed call its main thread is in (None when it is in none)."""
    return {
        "steps": {str(p.index): p.step for p in list(_models.values())},
        "in": _main_thread_call(threading.main_thread().ident),
    }


def _take_verdict(store: Any) -> None:
    """On each poll of the doctor's thread: has a peer found this rank out of step?"""
    rank = dist.get_rank()
    if store.check([f"lockstep/verdict/{rank}"]):
        hang.Reporter.hooks.pop("lockstep", None)  # once
        _convicted(store.get(f"lockstep/verdict/{rank}").decode())
        store.set(f"lockstep/ack/{rank}", "1")


def _convicted(message: str) -> None:
    # This rank is the one out of step. Its main thread may be blocked in a collective that
    # will now fail with the backend's own words; raise ours in it as well.
    log.error("%s", message)
    hang.Reporter.stuck = True
    error = type("RanksOutOfStepError", (RanksOutOfStepError,), {"__init__": _with(message)})
    main = threading.main_thread().ident
    assert main is not None  # only a thread not yet started has no ident
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(error))


def _steps_differ(answers: dict[int, dict[str, Any]]) -> bool:
    """The ranks' DDP models ran different numbers of steps: a collective that differs across
    ranks is then best named by this module (a rank ran out of data), not as a mismatch."""
    told = [a["lockstep"]["steps"] for a in answers.values() if a.get("lockstep")]
    return len({json.dumps(steps, sort_keys=True) for steps in told}) > 1


def _with(message: str) -> Any:
    def __init__(self: RanksOutOfStepError) -> None:
        RanksOutOfStepError.__init__(self, message)

    return __init__


def _main_thread_call(ident: int | None) -> str | None:
    """The torch.distributed call the main thread is in (outermost), or None."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    inside = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith("distributed_c10d.py"):
            inside = f"torch.distributed.{code.co_name}"
        elif code.co_name == "call" and code.co_filename == records.__file__:
            # The records' wrapper, waiting in slices for a blocking call on Gloo.
            record = records.blocked.get(ident) if ident is not None else None
            inside = f"torch.distributed.{record.op}" if record is not None else inside
        frame = frame.f_back
    return inside


# The DDP models alive in this process, by the order they were built (the same on every rank).
_models: weakref.WeakValueDictionary[int, ModelSteps] = weakref.WeakValueDictionary()
_built = itertools.count()
