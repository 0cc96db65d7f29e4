"""The out-of-step check's record of this process's DDP models, and its waits, without processes.

Each model gets the next index (the same on every rank, since every rank builds its models in
the same order), and a model that is gone is forgotten: a process that builds many models (a
sweep, a test suite) neither grows the record nor reports the steps of dead models to its peers.

A collective that completes just as a slice of its wait runs out is a success, not a failure;
one that completed with an error is raised, named as it failed. A communication hook's future
is waited on in slices too: it gives its value, raises its own error, or raises a failure that
another thread declares while it waits (a member gone) within a slice, though it never completes.
"""

from __future__ import annotations

import gc
import threading
import time
from datetime import timedelta

import pytest
import torch

from tandem.doctor import mismatch
from tandem.parallel.ddp import out_of_step


def test_models_are_numbered_in_build_order_and_forgotten_when_gone():
    first = out_of_step.track(None)
    second = out_of_step.track(None)
    assert second.index == first.index + 1
    assert out_of_step._models[first.index] is first
    index = first.index
    del first
    gc.collect()
    assert index not in out_of_step._models
    assert out_of_step._models[second.index] is second


class _Work:
    """A collective's work as Gloo's behaves: a wait with a timeout that runs out raises, and
    the work may complete meanwhile; a wait on a complete work returns, or raises its error."""

    def __init__(self, completes_during_slice: bool, error: str | None = None) -> None:
        self.completes_during_slice = completes_during_slice
        self.error = error
        self.done = False
        self.waits: list[timedelta | None] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if self.done:
            if self.error is not None:
                raise RuntimeError(self.error)
            return True
        self.done = self.completes_during_slice
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc] Timed out")

    def is_completed(self) -> bool:
        return self.done


def test_a_collective_that_completes_as_its_slice_runs_out_is_not_a_failure():
    progress = out_of_step.track(None)
    work = _Work(completes_during_slice=True)
    out_of_step._wait(work, progress, "all_reduce of bucket 0")  # returns: no error
    assert work.waits == [out_of_step._SLICE, None]


def test_a_collective_that_completed_with_an_error_is_raised(monkeypatch):
    progress = out_of_step.track(None)
    monkeypatch.setattr(out_of_step, "survey_lost_peers", False)
    work = _Work(completes_during_slice=True, error="Connection closed by peer [10.0.0.2]:1234")
    with pytest.raises(RuntimeError, match="Timed out"):
        out_of_step._wait(work, progress, "all_reduce of bucket 0")
    assert work.waits == [out_of_step._SLICE, None]


def _later(seconds: float, fn) -> threading.Timer:
    timer = threading.Timer(seconds, fn)
    timer.start()
    return timer


def test_a_hook_future_completed_by_another_thread_gives_its_value():
    progress = out_of_step.track(None)
    future: torch.futures.Future = torch.futures.Future()
    _later(0.3, lambda: future.set_result(torch.ones(2)))
    assert torch.equal(out_of_step.wait_future(future, progress, "hook"), torch.ones(2))


def test_a_failure_declared_while_waiting_on_a_hook_future_raises_within_a_slice():
    # A future that never completes: only the declared failure (a member gone, the doctor's
    # verdict) can end the wait, as the slices of a collective's wait do.
    progress = out_of_step.track(None)
    future: torch.futures.Future = torch.futures.Future()
    timer = _later(0.3, lambda: mismatch.fail("rank 1 is gone", wait_for_others=False))
    started = time.monotonic()
    try:
        with pytest.raises(mismatch.CollectiveMismatchError, match="rank 1 is gone"):
            out_of_step.wait_future(future, progress, "hook")
    finally:
        timer.join()
        mismatch.reset()
    assert time.monotonic() - started < 0.3 + 2 * out_of_step._SLICE.total_seconds() + 0.5


def test_a_hook_future_that_failed_raises_its_own_error():
    progress = out_of_step.track(None)
    future: torch.futures.Future = torch.futures.Future()
    _later(0.2, lambda: future.set_exception(RuntimeError("Connection closed by peer")))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        out_of_step.wait_future(future, progress, "hook")
