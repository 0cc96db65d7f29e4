"""Stop and checkpoint requests: raised on any rank, acted on by all ranks at the same step.

A signal reaches the ranks at different moments (SLURM signals one process per node, a user
may ``kill`` one rank, the launcher forwards in turn), so a rank that acted on its own signal
at once would save a different step than the others or wait alone in a collective. Instead a
request only sets a local flag; at step boundaries every rank sends its flags through one tiny
all-reduce (:meth:`Requests.agree`), and every rank then sees the same sums and takes the same
action at the same step.

- SIGTERM (a scheduler's preemption, ``tandem run`` stopping): save, then stop cleanly.
- SIGUSR1 (``tandem run`` forwards it; SLURM's ``--signal``): save and carry on.
"""

from __future__ import annotations

import signal
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from tandem.train.collective import sum_over_ranks

STOP_SIGNAL = signal.SIGTERM
CHECKPOINT_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class Agreement:
    """What every rank decided at one step boundary (the same on every rank)."""

    save: bool  # some rank asked for a checkpoint (or a stop, which saves first)
    stop: bool  # some rank asked to stop
    reason: str | None  # "SIGTERM" if a signal asked to stop, else "request_stop()"
    sums: list[float]  # the caller's extra numbers, summed over ranks


class Requests:
    """This rank's pending requests, and the all-reduce that turns them into a joint decision."""

    def __init__(self) -> None:
        # Counters, not booleans: a signal handler may run between agree()'s read and its reset,
        # and a count taken and subtracted loses nothing that arrived in between.
        self._checkpoints = 0
        self._stops_by_call = 0
        self._stops_by_signal = 0

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

    def agree(self, extra: Sequence[float] = ()) -> Agreement:
        """Every rank's requests (and ``extra`` numbers) summed: one all-reduce, on every rank.

        Args:
            extra: numbers to sum over ranks in the same collective (the running loss).
        """
        sent = (self._checkpoints, self._stops_by_call, self._stops_by_signal)
        checkpoints, by_call, by_signal, *sums = sum_over_ranks([*sent, *extra])
        # Sent requests are now known to every rank and will be acted on: take them off.
        self._checkpoints -= sent[0]
        self._stops_by_call -= sent[1]
        self._stops_by_signal -= sent[2]
        stop = by_call + by_signal > 0
        reason = None if not stop else (STOP_SIGNAL.name if by_signal else "request_stop()")
        return Agreement(save=stop or checkpoints > 0, stop=stop, reason=reason, sums=sums)
