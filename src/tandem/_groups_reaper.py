"""Free the process groups a re-form leaves behind, on a thread of their own, in bounded time.

A re-form (``tandem.recovery``) forgets the old groups in torch's bookkeeping and hands them
here. What makes freeing them hard is Gloo (torch 2.13, read in its sources and measured):

- ``ProcessGroupGloo`` has no ``abort()`` nor ``shutdown()`` of its own: ``group.abort()``
  returns at once and leaves a collective waiting on a peer as it was.
- Its destructor waits until its queue of work is empty, then joins its worker threads. A
  worker blocked on a peer that says nothing (SIGSTOPped, or behind a link that went down: no
  reset ever comes) is released only by the work's own timeout (the group's: 60 s and more
  for a re-formed group, 30 min by torch's default), which then closes every connection of
  the group. Whichever thread drops the last reference waits that long, with the GIL
  released.
- A connection of the group that reads end-of-file makes Gloo fail every wait of the group at
  once and close its connections itself: the destructor then returns in milliseconds.

So :func:`cut_gloo_connections` shuts down (``shutdown(2)``: local, a FIN queued for the peer,
nothing awaited from it) every connected socket that a Gloo device of this process watches,
found through the epoll instance its loop thread waits in, and :func:`reap` drops the groups
on a daemon thread, which the interpreter's exit waits for (briefly: a destructor returning
while the interpreter finalizes would abort the process). Where some device's sockets cannot
be found (no ``/proc``, or its loop thread never seen waiting), :func:`keep` keeps the groups
alive for the process's life instead, as torch's destructor would wait there. A ``Work`` of an
old group that the caller still holds keeps that group's Gloo context (its device's loop
thread) until it is dropped; its connections are cut all the same.

Example::

    groups = list(torch.distributed.distributed_c10d._world.pg_names)
    ...                                      # torch's bookkeeping forgets them
    if cut_gloo_connections() is None:       # before the next group exists
        keep(groups)
    else:
        reap(groups)                         # takes over the last references
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: The name Gloo's TCP transport gives the thread that watches a device's sockets (epoll).
LOOP_THREAD = "gloo_tcp_loop"
#: How long to look for a loop thread inside its epoll wait (it may be handling an event).
_FIND_S = 0.2
#: How long the interpreter's exit waits for the reaper (a cut group's destructor takes
#: milliseconds).
EXIT_WAIT_S = 5.0


@dataclass(frozen=True)
class Reaped:
    """What :func:`reap` and :func:`cut_gloo_connections` did in this process so far.

    Example::

        >>> Reaped(handed=2, freed=1, held=0, kept=0, cut=4, longest_s=0.01).pending
        1
    """

    #: Groups handed to :func:`reap`.
    handed: int
    #: Groups whose last reference the reaper dropped: their destructor returned.
    freed: int
    #: Groups still referenced elsewhere when the reaper dropped its own (freed when that goes).
    held: int
    #: Groups kept alive for the process's life: their connections could not be cut, and their
    #: destructor would wait for work blocked on a silent peer (:func:`keep`).
    kept: int
    #: Sockets shut down by :func:`cut_gloo_connections`.
    cut: int
    #: The longest time a destructor took on the reaper, in seconds.
    longest_s: float

    @property
    def pending(self) -> int:
        """Groups handed to :func:`reap` and not yet dropped by the reaper."""
        return self.handed - self.freed - self.held


_lock = threading.Lock()
_counts = {"handed": 0, "freed": 0, "held": 0, "kept": 0, "cut": 0}
_longest_s = 0.0
_exit_hook = False
_done = threading.Condition(_lock)


def reaped() -> Reaped:
    """The counts so far (:class:`Reaped`).

    Example::

        >>> reaped().pending
        0
    """
    with _lock:
        return Reaped(longest_s=_longest_s, **_counts)


def wait_reaped(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for every group handed over to be dropped; whether they
    were (tests, and a caller that would rather know).

    Example::

        >>> wait_reaped(1.0)
        True
    """
    deadline = time.monotonic() + timeout
    with _done:
        while _counts["handed"] > _counts["freed"] + _counts["held"]:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _done.wait(left)
    return True


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread or descriptor went away meanwhile
        return None


def _loop_epolls() -> tuple[set[int], bool]:
    """The epoll descriptors the Gloo loop threads of this process wait in: the first argument
    of the system call each is blocked in (``/proc/self/task/<tid>/syscall``), checked to be an
    epoll instance. A thread busy with an event is asked again until :data:`_FIND_S` passes."""
    found: set[int] = set()
    tasks = [t for t in os.listdir("/proc/self/task") if t != str(threading.get_native_id())]
    loops = [t for t in tasks if (_read(f"/proc/self/task/{t}/comm") or "").strip() == LOOP_THREAD]
    deadline = time.monotonic() + _FIND_S
    while loops:
        for tid in list(loops):
            fields = (_read(f"/proc/self/task/{tid}/syscall") or "gone").split()
            if fields[0] == "gone":
                loops.remove(tid)
                continue
            if len(fields) > 1 and fields[0].isdigit():
                with contextlib.suppress(OSError, ValueError):
                    fd = int(fields[1], 16)
                    if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventpoll]":
                        found.add(fd)
                        loops.remove(tid)
        if not loops or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    if loops:
        log.debug("gloo loop threads %s were never seen waiting: their sockets stay", loops)
    return found, not loops


def _watched(epoll: int) -> list[tuple[int, int]]:
    """(descriptor, inode) of everything the epoll instance ``epoll`` watches (its fdinfo)."""
    watched = []
    for line in (_read(f"/proc/self/fdinfo/{epoll}") or "").splitlines():
        fields = line.split()
        if fields[:1] != ["tfd:"]:
            continue
        inode = next((f[4:] for f in fields if f.startswith("ino:")), None)
        if inode is not None:
            watched.append((int(fields[1]), int(inode, 16)))
    return watched


def _shut(fd: int, inode: int) -> bool:
    """Shut down the connected TCP socket at ``fd`` if it still is the one of ``inode``."""
    try:
        # A duplicate of our own: the number may have been closed and reused since it was
        # read, and the inode tells whether the socket is still the same one.
        dup = os.dup(fd)
    except OSError:
        return False  # Gloo closed it meanwhile
    info = os.fstat(dup)
    if info.st_ino != inode or not stat.S_ISSOCK(info.st_mode):
        os.close(dup)
        return False
    with socket.socket(fileno=dup) as sock:  # closes the duplicate only
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            # A device's listening socket: Gloo's listener takes a failed accept for a fatal
            # error and aborts the process; it closes with its device.
            return False
        try:
            sock.getpeername()
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected (yet, or any more)
            return False
    return True


def cut_gloo_connections() -> int | None:
    """Shut down every connected socket of every Gloo device in this process; the count, or
    None where some device's sockets could not be found (a loop thread never seen in its
    epoll wait, or no ``/proc``): a group of that device may still wait on a silent peer.

    Call it only when every Gloo group of the process is being let go (a re-form, before the
    next group exists): a wait on any of them then fails at once instead of at its timeout.
    A Gloo group made outside ``torch.distributed``'s bookkeeping would be cut too.

    Example::

        forget_every_group()                 # torch's bookkeeping (tandem.recovery's)
        if cut_gloo_connections() is None:   # their waits fail now, or some may not
            ...
    """
    if not os.path.isdir("/proc/self/task"):
        return None
    try:
        epolls, complete = _loop_epolls()
        cut = sum(_shut(fd, inode) for epoll in epolls for fd, inode in _watched(epoll))
    except Exception as error:  # a /proc that reads otherwise: the groups are kept, not lost
        log.warning("could not cut the old Gloo groups' connections: %s", error)
        return None
    with _lock:
        _counts["cut"] += cut
    log.debug("shut down %d socket(s) of old Gloo groups (all found: %s)", cut, complete)
    return cut if complete else None


def reap(groups: list[Any]) -> None:
    """Take over ``groups`` (process groups torch no longer knows of, whose connections
    :func:`cut_gloo_connections` cut) and free them on a daemon thread: each is aborted
    (NCCL's tears its communicators down; Gloo's does nothing) and its reference dropped
    there, so that a destructor never runs on the caller's thread. Empties ``groups``: the
    caller must hold no other reference to them. The interpreter's exit waits up to
    :data:`EXIT_WAIT_S` for the thread (a destructor still running when the interpreter
    finalizes would abort the process as it returns).

    Example::

        >>> reap([])
    """
    global _exit_hook
    if not groups:
        return
    mine = list(groups)
    groups.clear()
    with _lock:
        _counts["handed"] += len(mine)
        if not _exit_hook:
            _exit_hook = True
            atexit.register(wait_reaped, EXIT_WAIT_S)
    threading.Thread(target=_free, args=(mine,), name="tandem-reaper", daemon=True).start()


def keep(groups: list[Any]) -> None:
    """Keep ``groups`` alive for the rest of the process, not even dropped by the interpreter's
    teardown: their connections could not be cut, and the destructor of a Gloo group whose
    work waits on a silent peer waits with it, up to the work's timeout, on whichever thread
    drops the last reference. Their threads and sockets stay until the process exits.
    Empties ``groups``.

    Example::

        >>> keep([])
    """
    for group in groups:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    with _lock:
        _counts["kept"] += len(groups)
    if groups:
        log.warning(
            "the old process group's connections could not be cut: it is kept, with its "
            "threads and sockets, until the process exits"
        )
    groups.clear()


def _free(groups: list[Any]) -> None:
    global _longest_s
    while groups:
        group = groups.pop()
        try:
            group.abort()
        except Exception as error:  # a backend that refuses: its destructor still runs
            log.debug("aborting an old process group: %s", error)
        # This frame's name and getrefcount's argument: any more is a holder elsewhere.
        held = sys.getrefcount(group) > 2
        started = time.monotonic()
        del group
        took = time.monotonic() - started
        with _done:
            _counts["held" if held else "freed"] += 1
            _longest_s = max(_longest_s, took)
            _done.notify_all()
        log.debug("old process group %s in %.3f s", "let go" if held else "freed", took)
