"""The workers' rendezvous: every process checks in, and a bad environment fails fast and clearly.

torch's ``env://`` and ``tcp://`` rendezvous trust the environment: a WORLD_SIZE that differs
between processes, a RANK given to two processes, a rank that never starts or a port that
another program holds leave the others waiting until the collective timeout (30 minutes), or
fail on some ranks only. :func:`meet` opens the same kind of store (rank 0's TCPStore, or the
launcher's agent store) and, before any process group exists, has every process check in:

- each process adds itself under ``tandem/rendezvous/`` (its rank, WORLD_SIZE, pid and host);
- once as many have checked in as WORLD_SIZE says, each reads every entry and raises
  :class:`RendezvousError` on every rank if they disagree ("rank 1 checked in twice: pids 4411
  and 4420", "WORLD_SIZE differs between the processes");
- at the rendezvous timeout (default 60 s, ``tandem.init(rendezvous_timeout=...)`` or
  ``TANDEM_RENDEZVOUS_TIMEOUT``) the ones that came say which never did ("ranks 2, 3 never
  arrived");
- a port held by another program fails on rank 0 within seconds (once it has found that the
  program is not a tandem job's store), and on the others within the timeout (a program that
  accepts the connection but never answers would otherwise hold them forever); a port held by
  a tandem job's store (a second ``RANK=0``, or another job on the same port) makes this rank 0
  check in there as a duplicate, so that every process names rank 0 twice.

A one-node job's store (MASTER_ADDR on loopback) listens on loopback only, so no other host can
read or write its keys. A process that checks in after the job has formed (a late duplicate)
raises, and leaves a fatal note that the doctor of every other rank raises at its next
collective (:data:`FATAL_KEY`, :func:`fatal_note`). So that a short job cannot finish before a
duplicate started with it arrives, the ranks check out at the end (:func:`check_out`, from
``tandem.shutdown()`` or at exit): where the ranks were numbered by hand (no launcher did it),
rank 0 lets the job end no sooner than :data:`SETTLE_S` after it formed, then judges every
arrival once more, and every rank raises its verdict. A duplicate that comes after the job has
ended fails alone: there is no job left to stop.

Example::

    store = meet("127.0.0.1", 29500, rank=1, world_size=2, timeout=60.0)
    dist.init_process_group("gloo", store=store, rank=1, world_size=2)
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from tandem.job.secret import key_scope

PREFIX = "tandem/rendezvous/"
DEFAULT_TIMEOUT_S = 60.0
#: Where a process that found the job broken after it formed leaves its message, in the store
#: the job met in. The doctor of every rank that met there (:data:`joined`) reads it
#: (:func:`fatal_note`) and raises it as :class:`RendezvousError` at its next collective.
FATAL_KEY = PREFIX + "fatal"
#: Where rank 0 publishes its verdict at the end (:func:`check_out`).
CLOSED_KEY = PREFIX + "closed"
#: How long after the job formed rank 0 lets it end, where the ranks were numbered by hand: a
#: duplicate started together with the others (Python and torch take a moment to import, more on
#: a busy machine) has arrived by then, and fails the job at its end however short the job is.
SETTLE_S = 1.5
#: How long a rank other than 0 waits at the end for rank 0's verdict.
CHECK_OUT_WAIT_S = 30.0
#: The store this process met its job in (the last :func:`meet` that succeeded), or None.
joined: Any = None
#: What this process learned about its job after it formed (a late duplicate's fatal note).
noted: str | None = None
_POLL_S = 0.01
# How long a judge keeps its store up after a bad verdict, for the others to read it.
_LINGER_S = 5.0
# How long a rank 0 that cannot listen looks for a tandem store on the port (then: "busy").
_PROBE_S = 1.0
# When the job this process met formed, and whether its ranks were numbered by hand.
_formed_at = 0.0
_by_hand = False
# How long past its own timeout torch's store client may still be retrying (its last back-off).
_CLIENT_BACKOFF_S = 3.0


class RendezvousError(RuntimeError):
    """The processes of a job could not meet: a bad environment, a missing rank or a busy port."""


class _PortBusy(RendezvousError):
    """Rank 0 cannot listen on MASTER_PORT."""


def rendezvous_timeout_s(value: float | None = None) -> float:
    """Seconds the processes wait for each other: ``value``, ``TANDEM_RENDEZVOUS_TIMEOUT``, 60.

    Example::

        >>> rendezvous_timeout_s(5)
        5.0
    """
    if value is None:
        text = os.environ.get("TANDEM_RENDEZVOUS_TIMEOUT")
        if not text:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"TANDEM_RENDEZVOUS_TIMEOUT={text!r} is not a number of seconds"
            ) from None
    if not 0 < value < float("inf"):
        raise ValueError(f"rendezvous_timeout must be a positive number of seconds, got {value!r}")
    return float(value)


def meet(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    agent_store: bool = False,
    restart: int = 0,
    store_timeout: timedelta | None = None,
    numbered_by_hand: bool = False,
) -> Any:
    """Open the job's store and check in every process; the store for ``init_process_group``.

    Args:
        host, port: where rank 0's store listens (MASTER_ADDR, MASTER_PORT).
        rank, world_size: this process's, as its environment says.
        timeout: seconds to wait for the store and for every process.
        agent_store: the launcher hosts the store (``TORCHELASTIC_USE_AGENT_STORE``); every
            rank connects, under a prefix per restart (``restart``) so that a restarted job
            never reads the keys of the failed attempt, and per job secret
            (``TANDEM_JOB_SECRET``) so that a client without it cannot touch them.
        store_timeout: how long the group's store operations wait afterwards (the collective
            timeout; torch's default when None).
        numbered_by_hand: no launcher gave the processes their RANK (a hand-made environment,
            where a RANK given twice happens): the ranks check out at the end (:func:`check_out`)
            no sooner than :data:`SETTLE_S` after the job formed.

    Raises:
        RendezvousError: naming what is wrong, on every process that can tell.

    Example::

        store = meet("127.0.0.1", 29500, rank=0, world_size=2, timeout=60.0)
    """
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    judge = rank == 0  # rank 0 judges what arrived, unless it found another rank 0 hosting
    if agent_store:
        # Under the job's secret, if it has one (see tandem.job.secret).
        prefix = f"/worker/{key_scope()}attempt_{restart}"
        base = dist.PrefixStore(prefix, _connect(host, port, deadline))
    elif rank == 0:
        try:
            base = _host(host, port, timeout)
        except _PortBusy:
            # Another rank 0 may host this job's store already: a duplicate, to be named as such
            # by every process. Anything else on the port is another program's.
            found = _tandem_store_at(host, port, min(deadline, time.monotonic() + _PROBE_S))
            if found is None:
                raise
            base, judge = found, False
    else:
        base = _connect(host, port, deadline)
    try:
        _check_in(base, rank, world_size, deadline, timeout, judge)
    except RendezvousError as error:
        if agent_store and "checked in" in str(error):
            raise RendezvousError(f"{error}{_TORCHRUN_HINT}") from None
        raise
    base.set_timeout(store_timeout or dist.default_pg_timeout)
    global joined, noted, _formed_at, _by_hand
    joined, noted = base, None
    _formed_at, _by_hand = time.monotonic(), numbered_by_hand
    return base


# Under torchrun's agent store a RANK checked in twice is often no mistake of the user's: after a
# restart torchrun's nodes can disagree on TORCHELASTIC_RESTART_COUNT (the node whose worker
# failed counts the restart, one restarted for a waiting node does not), which scopes the
# check-in, and its shared rendezvous store keeps the failed attempt's entries; so a process
# of that attempt is among the "duplicates". Nothing a worker sees names torchrun's round.
_TORCHRUN_HINT = (
    " (under torchrun after a restart, a process of the failed attempt may be one of them: "
    "torchrun's nodes can disagree on TORCHELASTIC_RESTART_COUNT, and its shared rendezvous "
    "store keeps that attempt's entries; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
    "torchrun, or launch with tandem run)"
)


def check_out(rank: int, world_size: int, wait_s: float = CHECK_OUT_WAIT_S) -> None:
    """At the end of the job (``tandem.shutdown()``, or exit), on every rank: raise
    :class:`RendezvousError` if a process checked in after the job formed (a duplicate RANK),
    the same verdict on every rank. Where the ranks were numbered by hand, rank 0 first lets the
    job reach :data:`SETTLE_S` of age, then judges every arrival and publishes its verdict, and
    keeps its store up until the others have read a bad one; the others wait up to ``wait_s``
    for it. Where a launcher numbered them, only a fatal note already left counts. No-op without
    a job met here, or once checked out.

    Example::

        checkin.check_out(w.rank, w.world_size)   # tandem.shutdown(), before the group goes
    """
    global joined
    store, problem = joined, noted
    if store is None:
        return
    joined = None
    try:
        if not _by_hand:
            problem = problem or fatal_note(store)
        elif rank == 0:
            time.sleep(max(0.0, _formed_at + SETTLE_S - time.monotonic()))
            problem = problem or _arrived_late(store, world_size)
            store.set(CLOSED_KEY, problem or "")
            if problem is not None:
                _linger(store, CLOSED_KEY + "/read", world_size - 1)
        else:
            give_up = time.monotonic() + wait_s
            while not store.check([CLOSED_KEY]) and time.monotonic() < give_up:
                time.sleep(_POLL_S * 5)
            verdict = store.get(CLOSED_KEY).decode() if store.check([CLOSED_KEY]) else ""
            if verdict:
                store.add(CLOSED_KEY + "/read", 1)
            problem = problem or verdict or None
    except Exception:  # the store went with rank 0: what this rank knows stands
        pass
    if problem is not None:
        raise RendezvousError(problem)


def _arrived_late(store: Any, world_size: int) -> str | None:
    """What is wrong, if more processes than WORLD_SIZE have checked in."""
    note = fatal_note(store)
    if note is not None:
        return note
    arrived = int(store.add(PREFIX + "arrived", 0))
    if arrived <= world_size:
        return None
    entries = _entries(store, arrived)
    return diagnose(entries, world_size) or (
        f"{arrived} processes checked in for WORLD_SIZE={world_size} ({_who(entries)}): one "
        "came after the job had formed. Every process needs its own RANK"
    )


def fatal_note(store: Any = None) -> str | None:
    """What a process that came after this job formed found wrong (a duplicate RANK), or None.
    One store lookup (``store``: the one this process met its job in); None when this process
    did not meet its job there. A note found is kept for :func:`check_out`.

    Example::

        note = fatal_note()     # the doctor's thread, every half second
    """
    global noted
    store = store if store is not None else joined
    if store is None or not store.check([FATAL_KEY]):
        return None
    note = store.get(FATAL_KEY).decode()
    noted = noted or note
    return note


def announce(host: str, port: int, entry: dict[str, Any], seconds: float = 5.0) -> None:
    """Best effort: check in a process whose own environment is invalid (RANK out of range), so
    that the others name it instead of waiting for a rank that never comes. Never raises.

    Example::

        announce("127.0.0.1", 29500, {"rank": 5, "world_size": 2})
    """
    with contextlib.suppress(Exception):
        store = _connect(host, port, time.monotonic() + seconds)
        _enter(store, dict(entry, bad=True))


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (a store there is
    reachable from this machine only).

    Example::

        >>> is_loopback("127.0.0.1"), is_loopback("10.0.0.1")
        (True, False)
    """
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _host(host: str, port: int, timeout: float) -> Any:
    """Rank 0: start the store, on loopback only where MASTER_ADDR is a loopback address."""
    import torch.distributed as dist

    delta = timedelta(seconds=timeout)
    fd = None
    if is_loopback(host):
        family, _, _, _, address = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(address)
            listener.listen(socket.SOMAXCONN)
        except OSError as exc:
            listener.close()
            raise _PortBusy(_busy(host, port, exc.strerror or str(exc))) from exc
        fd = listener.detach()  # the store owns the socket from here on
    try:
        return dist.TCPStore(
            host, port, None, True, delta, wait_for_workers=False, master_listen_fd=fd
        )
    except (RuntimeError, OSError) as exc:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise _PortBusy(_busy(host, port, str(exc).splitlines()[0])) from exc


def _busy(host: str, port: int, why: str) -> str:
    return (
        f"rank 0 cannot listen on MASTER_PORT={port} at {host} ({why}): another program or "
        "job holds that port. Choose a free port (or let `tandem run` pick one); the other "
        "ranks fail within the rendezvous timeout"
    )


def _tandem_store_at(host: str, port: int, deadline: float) -> Any:
    """A client of the store at ``host:port`` if it is a tandem job's rendezvous store (someone
    has checked in there), else None."""
    try:
        store = _connect(host, port, deadline)
    except RendezvousError:
        return None
    with contextlib.suppress(Exception):
        while True:
            if store.check([PREFIX + "arrived"]):
                return store
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
    return None


def _connect(host: str, port: int, deadline: float) -> Any:
    """A client of the store at ``host:port``, or RendezvousError by ``deadline``."""
    import torch.distributed as dist

    # torch's client backs off for most of a second after a refused connection: polling the
    # port every 10 ms gets every rank in as soon as rank 0 listens.
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                break
        except socket.gaierror as exc:
            raise RendezvousError(
                f"MASTER_ADDR={host} does not resolve ({exc.strerror}): set it to rank 0's "
                "host name or address"
            ) from exc
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"nothing listens at MASTER_ADDR:MASTER_PORT={host}:{port}: rank 0 did not "
                    "start its store in time (did it start, and with the same MASTER_ADDR and "
                    "MASTER_PORT? see its error), or a firewall blocks the port"
                ) from None
            time.sleep(_POLL_S)
    # A program that accepts connections but does not speak the store's protocol holds torch's
    # client forever, whatever its timeout: connect from a thread, and give up at the deadline.
    outcome: dict[str, Any] = {}

    def attempt() -> None:
        try:
            left = max(deadline - time.monotonic(), 1.0)
            outcome["store"] = dist.TCPStore(host, port, None, False, timedelta(seconds=left))
        except Exception as exc:  # handed to the caller below
            outcome["error"] = exc

    thread = threading.Thread(target=attempt, name="tandem-store-connect", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 1.0) + 1.0)
    if thread.is_alive():
        # A client that keeps retrying (the program answers, wrongly) ends by itself, one
        # back-off (up to about 2 s) past its timeout: let it, so that no thread is inside
        # torch's C++ when this process exits (it would abort: "terminate called"). One that
        # waits on a silent program never ends; it stays blocked, harmlessly, at exit.
        thread.join(_CLIENT_BACKOFF_S)
    if "store" in outcome:
        return outcome["store"]
    why = f" ({str(outcome['error']).splitlines()[0]})" if "error" in outcome else ""
    raise RendezvousError(
        f"the program listening at MASTER_ADDR:MASTER_PORT={host}:{port} is not rank 0's store"
        f"{why}: another program holds that port. Choose a free MASTER_PORT"
    )


def _enter(store: Any, entry: dict[str, Any]) -> int:
    """Check ``entry`` in; its place in the order of arrival (from 1)."""
    place = int(store.add(PREFIX + "arrived", 1))
    store.set(f"{PREFIX}entry/{place}", json.dumps(entry))
    return place


def _check_in(
    store: Any, rank: int, world_size: int, deadline: float, timeout: float, judge: bool
) -> None:
    """Check in; the judge (rank 0, hosting the store) judges what arrived and every rank raises
    its verdict if it is bad."""
    me = {"rank": rank, "world_size": world_size, "pid": os.getpid(), "host": socket.gethostname()}
    place = _enter(store, me)
    if judge:
        problem = _judge(store, world_size, deadline, timeout)
    else:
        problem = _await_verdict(store, world_size, deadline, timeout)
    if problem is None and place > world_size:
        # Came after the job was judged complete: a duplicate or a stray. Diagnose from what
        # arrived, and stop the job that formed without us.
        problem = diagnose(_entries(store, int(store.add(PREFIX + "arrived", 0))), world_size)
        problem = problem or f"a process with RANK={rank} came after the job had formed"
        _leave_fatal(store, problem)
    if problem is not None:
        raise RendezvousError(problem)


def _judge(store: Any, world_size: int, deadline: float, timeout: float) -> str | None:
    """Rank 0: wait for WORLD_SIZE arrivals (or the deadline), and publish the verdict."""
    while True:
        arrived = int(store.add(PREFIX + "arrived", 0))
        if arrived >= world_size or time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)
    entries = _entries(store, arrived)
    problem = diagnose(entries, world_size)
    if problem is None and arrived < world_size:
        problem = _missing(entries, world_size, timeout)
    store.set(PREFIX + "verdict", problem or "")
    if problem is not None:
        # This process hosts the store: keep it up until the others have read the verdict,
        # those that checked in already and, when the verdict came before the deadline (a
        # duplicate, say), a rank still missing that may be on its way.
        bad = len([e for e in entries if e.get("bad")])
        absent = 0 if arrived < world_size else world_size - len({e["rank"] for e in entries})
        _linger(store, PREFIX + "read", arrived - 1 - bad, expected=max(absent, 0), counted=True)
    return problem


def _linger(store: Any, key: str, readers: int, expected: int = 0, counted: bool = False) -> None:
    """Keep this process (and the store it hosts) until ``readers`` have added 1 to ``key``, or
    for :data:`_LINGER_S` at most. ``counted``: the processes that check in meanwhile read too,
    and ``expected`` more are waited for (ranks missing from a verdict reached early)."""
    until = time.monotonic() + _LINGER_S
    before = int(store.add(PREFIX + "arrived", 0)) if counted else 0
    while time.monotonic() < until:
        came = int(store.add(PREFIX + "arrived", 0)) - before if counted else 0
        if came >= expected and int(store.add(key, 0)) >= readers + came:
            return
        time.sleep(_POLL_S)


def _await_verdict(store: Any, world_size: int, deadline: float, timeout: float) -> str | None:
    """Every other rank: rank 0's verdict; without one by the deadline, judge on our own."""
    key = PREFIX + "verdict"
    while not store.check([key]):
        if time.monotonic() > deadline + 2.0:  # rank 0 never came (under an agent store)
            entries = _entries(store, int(store.add(PREFIX + "arrived", 0)))
            return diagnose(entries, world_size) or _missing(entries, world_size, timeout)
        time.sleep(_POLL_S)
    verdict = store.get(key).decode()
    if verdict:
        store.add(PREFIX + "read", 1)
    return verdict or None


def _entries(store: Any, arrived: int) -> list[dict[str, Any]]:
    keys = [f"{PREFIX}entry/{i}" for i in range(1, arrived + 1)]
    # An entry is set a moment after its place is taken: wait briefly for the last ones.
    give_up = time.monotonic() + 5.0
    while keys and not store.check(keys) and time.monotonic() < give_up:
        time.sleep(_POLL_S)
    present = [k for k in keys if store.check([k])]
    return [json.loads(v) for v in store.multi_get(present)] if present else []


def diagnose(entries: list[dict[str, Any]], world_size: int) -> str | None:
    """What is wrong with the processes that checked in (None: nothing, so far).

    Example::

        >>> diagnose([{"rank": 0, "world_size": 2, "pid": 7, "host": "a"},
        ...           {"rank": 0, "world_size": 2, "pid": 9, "host": "a"}], 2)
        'rank 0 checked in twice: pids 7 and 9 on a. Every process needs its own RANK (0..1)'
    """
    sizes = sorted({e["world_size"] for e in entries})
    if len(sizes) > 1:
        groups = [[e for e in entries if e["world_size"] == s] for s in sizes]
        says = "; ".join(
            f"{_who(g)} {'says' if len(g) == 1 else 'say'} WORLD_SIZE={g[0]['world_size']}"
            for g in groups
        )
        return (
            f"WORLD_SIZE differs between the processes: {says}. Every process of a job must "
            "get the same WORLD_SIZE"
        )
    outside = [e for e in entries if e.get("bad") or not 0 <= e["rank"] < world_size]
    if outside:
        return (
            f"{_who(outside, 'RANK=')} outside 0..{world_size - 1} for WORLD_SIZE={world_size}: "
            f"RANK must be below WORLD_SIZE"
        )
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for e in entries:
        by_rank.setdefault(e["rank"], []).append(e)
    twice = {r: es for r, es in sorted(by_rank.items()) if len(es) > 1}
    if twice:
        parts = []
        for r, es in twice.items():
            count = "twice" if len(es) == 2 else f"{len(es)} times"
            hosts = sorted({e["host"] for e in es})
            pids = " and ".join(str(e["pid"]) for e in es)
            parts.append(f"rank {r} checked in {count}: pids {pids} on {', '.join(hosts)}")
        return f"{'; '.join(parts)}. Every process needs its own RANK (0..{world_size - 1})"
    return None


def _missing(entries: list[dict[str, Any]], world_size: int, timeout: float) -> str:
    came = sorted({e["rank"] for e in entries})
    never = [r for r in range(world_size) if r not in came]
    ranks = "rank" if len(never) == 1 else "ranks"
    listed = ", ".join(str(r) for r in never[:16]) + (" ..." if len(never) > 16 else "")
    return (
        f"{ranks} {listed} of WORLD_SIZE={world_size} never arrived within {timeout:.0f} s "
        f"(arrived: {_who(entries) if entries else 'none'}). Start every rank, or raise the "
        "rendezvous timeout (tandem.init(rendezvous_timeout=...), TANDEM_RENDEZVOUS_TIMEOUT)"
    )


def _who(entries: list[dict[str, Any]], label: str = "rank ") -> str:
    return ", ".join(f"{label}{e['rank']} (pid {e['pid']} on {e['host']})" for e in entries)


def _leave_fatal(store: Any, message: str) -> None:
    """Tell a job that formed without this late process why it must stop (see FATAL_KEY)."""

    with contextlib.suppress(Exception):
        store.set(FATAL_KEY, message)
