"""Stop and checkpoint requests: raised on any rank, acted on by all ranks at the same step.

A signal reaches the ranks at different moments (SLURM signals one process per node, a user
may ``kill`` one rank, the launcher forwards in turn), so a rank that acted on its own signal
at once would save a different step than the others or wait alone in a collective. Instead a
request only sets a local flag; at step boundaries every rank sends its flags through one tiny
all-reduce, and every rank then sees the same sums and takes the same action at the same step.

The all-reduce is waited for at once at the log steps and the epoch's end, which need the sums
now (:meth:`Requests.agree`). Between them the requests cost no wait: with tandem.DDP they ride
in the engine's own end-of-backward check (this object is its
:class:`tandem.parallel.ddp.end_of_backward.Rider`; on the CPU that check is a mark in the last
bucket, and a collective is spent only at a step where some rank has a request); with the other
engines they are sent in the background at a step boundary (:meth:`Requests.send`). Either
way the result is acted on at the next step boundary (:meth:`Requests.collect`), whichever
engine runs: a request made during step k (before its backward) is acted on after step k + 1,
by every rank alike (on a GPU, where tandem.DDP reads its count at the next forward, after
step k + 2).

- SIGTERM (a scheduler's preemption, ``tandem run`` stopping): save, then stop cleanly.
- SIGUSR1 (``tandem run`` forwards it; SLURM's ``--signal``): save and carry on.

With ``Trainer(checkpoint_async=True)`` the save's files are written in the background; the
next save and the end of ``train()`` (a SIGTERM's stop too) wait for them to be committed.
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import FrameType

from tandem._dist import start_sum_over_ranks

STOP_SIGNAL = signal.SIGTERM
CHECKPOINT_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class Decision:
    """What every rank decided at one step boundary (the same on every rank)."""

    save: bool  # some rank asked for a checkpoint (or a stop, which saves first)
    stop: bool  # some rank asked to stop
    reason: str | None  # "SIGTERM" if a signal asked to stop, else "request_stop()"
    sums: list[float]  # the caller's extra numbers, summed over ranks

    def then(self, later: Decision) -> Decision:
        """Both decisions at once (a stop or save in either), with ``later``'s sums.

        Example::

            >>> early = Decision(save=True, stop=False, reason=None, sums=[1.0])
            >>> early.then(Decision(save=False, stop=False, reason=None, sums=[2.0]))
            Decision(save=True, stop=False, reason=None, sums=[2.0])
        """
        stop = self.stop or later.stop
        reason = (self.reason or later.reason) if stop else None
        return replace(later, save=self.save or later.save, stop=stop, reason=reason)


class Requests:
    """This rank's pending requests, and the all-reduce that turns them into a joint decision."""

    def __init__(self) -> None:
        # Counters, not booleans: a signal handler may run between agree()'s read and its reset,
        # and a count taken and subtracted loses nothing that arrived in between.
        self._checkpoints = 0
        self._stops_by_call = 0
        self._stops_by_signal = 0
        self._pending: Callable[[], Decision] | None = None
        # Summed by a collective the engine issued: delivered during a step, acted on at the
        # boundary after the next (as a background send's), then ready.
        self._delivered: Decision | None = None
        self._ready: Decision | None = None
        self.riding = False  # the engine carries the requests (Trainer: engine.carry(self))

    def checkpoint(self) -> None:
        """Ask for a checkpoint at the next agreement; training continues."""
        self._checkpoints += 1

    def stop(self) -> None:
        """Ask all ranks to save a checkpoint and stop at the next agreement."""
        self._stops_by_call += 1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == STOP_SIGNAL:
            self._stops_by_signal += 1
        else:
            self._checkpoints += 1

    @contextmanager
    def signals(self) -> Iterator[None]:
        """Route SIGTERM and SIGUSR1 to this object while the block runs; restore after.

        Python runs handlers in the main thread only: elsewhere the signals keep their handlers
        (with a warning), and ``request_stop()``/``request_checkpoint()`` still work.
        """
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "Trainer.train() is not running in the main thread, so SIGTERM and SIGUSR1 "
                "cannot be caught: they will not checkpoint the run",
                stacklevel=3,
            )
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (STOP_SIGNAL, CHECKPOINT_SIGNAL)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                # None: the old handler was installed outside Python and cannot be put back.
                signal.signal(s, signal.SIG_DFL if handler is None else handler)

    def agree(self, extra: Sequence[float] = ()) -> Decision:
        """Every rank's requests (and ``extra`` numbers) summed: one all-reduce, on every rank.

        Args:
            extra: numbers to sum over ranks in the same collective (the running loss).
        """
        return self._start(extra)()

    def send(self, extra: Sequence[float] = ()) -> None:
        """Start :meth:`agree`'s all-reduce without waiting; :meth:`collect` reads it.

        Every rank calls it at the same step boundary; nothing is pending when it is called.
        """
        assert self._pending is None, "collect() the agreement sent before sending another"
        self._pending = self._start(extra)

    def collect(self, everything: bool = False) -> Decision | None:
        """What the ranks agreed for this boundary, None if nothing: the agreement :meth:`send`
        started at the previous one (waited for if still in flight), and what the engine
        delivered before the previous one. ``everything``: also what it delivered since (the
        epoch's end, where the run may stop)."""
        pending, self._pending = self._pending, None
        agreed, self._ready, self._delivered = self._ready, self._delivered, None
        if everything and self._ready is not None:
            agreed = self._ready if agreed is None else agreed.then(self._ready)
            self._ready = None
        if pending is not None:
            sent = pending()
            agreed = sent if agreed is None else agreed.then(sent)
        return agreed

    def discard(self) -> None:
        """Forget what was sent or delivered (a run that ended with an error)."""
        self._pending = self._delivered = self._ready = None

    # -- as the engine's rider (tandem.parallel.ddp.end_of_backward.Rider) -------------------

    def values(self) -> list[int]:
        """The requests since the last send, taken off: they are on their way to every rank
        and will be acted on."""
        sent = [self._checkpoints, self._stops_by_call, self._stops_by_signal]
        self._checkpoints -= sent[0]
        self._stops_by_call -= sent[1]
        self._stops_by_signal -= sent[2]
        return sent

    def deliver(self, sums: list[int]) -> None:
        """Every rank's requests, summed: kept for the next :meth:`collect`."""
        checkpoints, by_call, by_signal = sums
        agreed = _decided(checkpoints, by_call, by_signal, sums=[])
        self._delivered = agreed if self._delivered is None else self._delivered.then(agreed)

    def _start(self, extra: Sequence[float]) -> Callable[[], Decision]:
        result = start_sum_over_ranks([*self.values(), *extra])

        def agreement() -> Decision:
            checkpoints, by_call, by_signal, *sums = result()
            return _decided(checkpoints, by_call, by_signal, sums=sums)

        return agreement


def _decided(checkpoints: float, by_call: float, by_signal: float, sums: list[float]) -> Decision:
    stop = by_call + by_signal > 0
    reason = None if not stop else (STOP_SIGNAL.name if by_signal else "request_stop()")
    return Decision(save=stop or checkpoints > 0, stop=stop, reason=reason, sums=sums)
