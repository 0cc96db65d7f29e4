"""The heartbeat: a thread that beats in the store every 0.5 s and, finding a member gone,
makes this process's sliced waits raise; and, when the store stops answering, the cut-off that
stops this rank (:func:`cut_off_message`).

It reads the :class:`~tandem.recovery.membership.Membership`; the
:class:`~tandem.recovery.Recoverer` starts and stops it.

Example::

    beat = _Heartbeat(members)
    beat.start()
    ...
    beat.stopped.set()
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping

from tandem.doctor import mismatch
from tandem.recovery.membership import Membership, MembershipError, _Lost
from tandem.recovery.store import _job_store

log = logging.getLogger(__name__)

_BEAT_S = 0.5


class _Heartbeat(threading.Thread):
    """Every 0.5 s, on its own store connection: sets ``hb/<me>`` to the time, and looks for a
    member gone (the launcher's mark, or silence). Finding one, it makes this process's waits
    on collectives raise :class:`_Lost` within half a second (``tandem.doctor.mismatch``'s
    sliced waits), so that a survivor blocked in a collective with a dead or hung peer leaves
    it at once instead of at the collective's timeout."""

    def __init__(self, members: Membership) -> None:
        super().__init__(name="tandem-heartbeat", daemon=True)
        self.members = members
        self.store = _job_store()
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # held by a re-form: no stale verdict lands after it
        #: Why this rank stops, once the store stopped answering (:func:`cut_off_message`).
        self.cut_off: str | None = None
        self._answered = time.monotonic()  # the end of the last beat whose calls all returned
        self._once = threading.Lock()

    def run(self) -> None:
        # A store call on a cut link waits for an answer that never comes (the client's
        # timeout does not bound it): a watchdog notices the silence instead.
        threading.Thread(target=self._watch, name="tandem-heartbeat-watchdog", daemon=True).start()
        key = self.members.key("hb", self.members.me)
        while not self.stopped.is_set():
            try:
                self.store.set(key, repr(time.time()))
                self.members.joiners_seen = int(self.store.add(self.members.key("joiners"), 0))
                # A re-form holds the lock while the members agree, as long as the slowest of
                # them takes to notice the loss, and decides who is gone itself: the beat goes
                # on meanwhile, or the others would count this rank silent and its watchdog
                # would take the wait for the store's.
                if self.lock.acquire(blocking=False):
                    try:
                        gone = self.members.gone(self.store)
                        if gone and mismatch.failed is None:
                            # Every sliced wait raises it from now on: a collective with the
                            # member gone, the commit's vote included, is left at once.
                            mismatch.fail(
                                f"rank(s) {sorted(gone)} of the job left",
                                _Lost,
                                wait_for_others=False,
                            )
                    finally:
                        self.lock.release()
                self._answered = time.monotonic()
            except Exception as error:  # the connection broke: the store's node is down
                if not self.stopped.is_set():  # else the loop is done and the job ending
                    self._cut_off(str(error).splitlines()[0] if str(error) else repr(error))
                return
            self.stopped.wait(_BEAT_S)

    def _watch(self) -> None:
        """Cut off once a beat's store calls have not returned for a heartbeat timeout: the
        others count this rank as silent after as long."""
        timeout = self.members.heartbeat_timeout
        while not self.stopped.wait(_BEAT_S / 2):
            if time.monotonic() - self._answered > timeout:
                self._cut_off(f"the store has not answered for {timeout:g} s")
                return

    def _cut_off(self, why: str) -> None:
        """The store does not answer (a partition, or its node is down): this process's
        collectives raise :class:`MembershipError` from now on; if it has not stopped within a
        heartbeat timeout (blocked in a store call, which nothing interrupts), it exits here."""
        if not self._once.acquire(blocking=False):
            return
        self.cut_off = cut_off_message(self.members.me)
        log.error("%s (%s)", self.cut_off, why)
        mismatch.reset()  # a member gone, seen before, is no longer the reason
        mismatch.fail(self.cut_off, MembershipError, wait_for_others=False)
        if not self.stopped.wait(self.members.heartbeat_timeout):
            print(f"tandem.recovery.MembershipError: {self.cut_off}", file=sys.stderr, flush=True)
            os._exit(1)


def cut_off_message(rank: int, environ: Mapping[str, str] = os.environ) -> str:
    """Why a rank that cannot reach the job's store (``MASTER_ADDR:MASTER_PORT``) stops
    (:class:`MembershipError`'s text).

    Example::

        >>> print(cut_off_message(3, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}))
        rank 3: cut off from the job's store at 10.0.0.1:29500: this rank is on the side of a partition without the store, or the store's node is down; it stops
    """  # noqa: E501
    where = f"{environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')}"
    return (
        f"rank {rank}: cut off from the job's store at {where}: this rank is on the side of a "
        "partition without the store, or the store's node is down; it stops"
    )
