"""The background checkpoint writer yields the CPU to the training, and only it does.

Proves, in one process, on Linux (each thread has its own scheduling there):

- :func:`tandem.checkpoint.async_save.yield_cpu` puts the calling thread in the idle class
  (``SCHED_IDLE``, as the kernel reports it in ``/proc/thread-self/stat``), and leaves every
  other thread of the process, the caller's main thread above all, in its class at its
  niceness; where the idle class is refused it gives the thread niceness 19 instead (again
  that thread's only), and where both are refused it says so and changes nothing;
- the thread that writes a ``tandem.checkpoint.save(..., async_=True)`` runs in the idle
  class while it writes, the training's thread is left as it was, and the checkpoint commits
  and loads; a synchronous save writes at the caller's class, and so does a background one
  when ``WRITER.idle`` is False (what the benchmark compares against).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem.checkpoint as ckpt
import tandem.checkpoint.sealed as sealed
from tandem.checkpoint import async_save
from tandem.checkpoint.async_save import WRITER, yield_cpu

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread scheduling is Linux's"
)


def _policy_and_nice() -> tuple[int, int]:
    """The calling thread's scheduling policy and niceness, as the kernel reports them."""
    # /proc/thread-self/stat: fields after the ")" that ends the name; niceness is field 19,
    # the policy field 41 (proc(5)), counted from 1 with the pid as field 1.
    fields = Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[41 - 3]), int(fields[19 - 3])


def _in_a_thread(body: Callable[[], Any]) -> tuple[Any, tuple[int, int]]:
    """``body()``'s result in a new thread, and that thread's policy and niceness after it."""
    out: dict[str, Any] = {}

    def run() -> None:
        out["result"] = body()
        out["after"] = _policy_and_nice()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return out["result"], out["after"]


@pytest.fixture
def main_thread_kept() -> Any:
    """The test's own thread must end in the class and niceness it began with."""
    before = _policy_and_nice()
    yield before
    assert _policy_and_nice() == before, "the caller's thread was rescheduled"


def test_yield_cpu_puts_the_calling_thread_alone_in_the_idle_class(main_thread_kept):
    assert main_thread_kept == (os.SCHED_OTHER, 0)
    said, after = _in_a_thread(yield_cpu)
    assert said == "SCHED_IDLE"
    assert after[0] == os.SCHED_IDLE


def test_yield_cpu_falls_back_to_niceness_19_then_to_nothing(monkeypatch, main_thread_kept):
    def refused(*args: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    said, after = _in_a_thread(yield_cpu)
    assert said == "nice 19" and after == (os.SCHED_OTHER, 19)

    monkeypatch.setattr(os, "setpriority", refused)
    said, after = _in_a_thread(yield_cpu)
    assert said == "unchanged" and after == main_thread_kept


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, int]]]:
    """Each main file written: the writing thread's name, policy and niceness."""
    found: list[tuple[str, tuple[int, int]]] = []
    real = sealed.write_committed

    def write_committed(payload: Any, path: Path) -> str:
        found.append((threading.current_thread().name, _policy_and_nice()))
        return real(payload, path)

    monkeypatch.setattr(sealed, "write_committed", write_committed)
    return found


def test_the_background_writer_runs_in_the_idle_class_and_the_caller_does_not(
    tmp_path, seen, main_thread_kept, monkeypatch
):
    state = {"weights": torch.arange(1000.0), "step": 3}
    handle = ckpt.save(state, tmp_path / "a.pt", async_=True)
    assert handle.wait() == tmp_path / "a.pt"
    assert seen == [(async_save.THREAD_NAME, (os.SCHED_IDLE, 0))]
    loaded = {"weights": torch.zeros(1000), "step": 0}
    ckpt.load(loaded, handle.path)
    assert torch.equal(loaded["weights"], state["weights"]) and loaded["step"] == 3

    ckpt.save(state, tmp_path / "b.pt")
    assert seen[1] == (threading.current_thread().name, main_thread_kept)

    monkeypatch.setattr(WRITER, "idle", False)
    ckpt.save(state, tmp_path / "c.pt", async_=True).wait()
    assert seen[2] == (async_save.THREAD_NAME, main_thread_kept)
