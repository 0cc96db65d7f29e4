"""``tandem run --recover in-memory``, the launcher's part: a lost worker does not stop the others.

On one node (``--nnodes 1``) the launcher hosts the job's TCPStore itself, before any worker
starts, at the MASTER_ADDR:MASTER_PORT the workers get, and gives them
``TORCHELASTIC_USE_AGENT_STORE=True``: every rank connects as a client (torch's ``env://`` and
``tandem.init()`` then start no store of their own), so rank 0 dying no longer takes the store
with it. The workers also get ``TANDEM_RECOVER=in-memory``.

A worker that exits non-zero or dies by a signal is *lost*, not the end of the job: the
supervisor records it (rank, how it ended, when) and the coordinator writes the store key
:func:`dead_key` (``tandem/recover/dead/<global rank>``, under the job secret's scope when
``TANDEM_JOB_SECRET`` is set) as JSON ``{"rank", "how", "at", ...}``, which the survivors poll;
they re-form among themselves and redo the step (the worker side, :mod:`tandem.recovery`). The
job ends when every worker has exited: status 0 if at least one ran to completion (every
other exit being a loss the survivors went on without), else the usual failure report. With
``--max-restarts`` (one node), a rank lost while the others go on is replaced when every
member said it admits one (:func:`admits_key`): the supervisor starts a worker with a new
launch rank and ``TANDEM_RECOVER_JOIN``, which the members admit at a step boundary
(:mod:`tandem.job.join`, :mod:`tandem.recovery`).

Only workers that said so are left to go on: each worker that recovers in memory sets
:func:`able_key` (``tandem/recover/able/<global rank>``) to ``"1"`` at its start
(``tandem.recovery.Recoverer``); a Trainer whose set-up cannot (a model or optimizer state
sharded across ranks: FullyShardedDataParallel, ShardedOptimizer) sets ``"no: <reason>"``;
a script that uses neither ``tandem.Trainer`` nor ``tandem.recovery.Run`` sets nothing. When a
worker is lost and one still running has not said ``"1"`` (:func:`unable`; a loss during
start-up, before every worker got that far, counts too), the launcher **falls back to
``restart``**: it says so in one line (:func:`fallback_summary`), stops every worker (SIGTERM,
then SIGKILL after ``--grace-period``) and, while ``--max-restarts`` allows, starts them all
again (``TORCHELASTIC_RESTART_COUNT`` counts it, as under ``restart``) to resume from the last
checkpoint; else the job ends with the usual failure report. So does a loss that leaves no
worker running while restarts remain. Each restart gets a fresh store
(:meth:`InMemoryCoordinator.begin`: the old one is closed, the new one listens on the same
``--master-port`` if one was given), so the restarted workers see no key of the attempt
before (dead marks, ``able``, generations) and recover in memory again from the start.

Many nodes (a fixed ``--nnodes N``, static rendezvous; an elastic ``MIN:MAX`` with the c10d
rendezvous is :class:`tandem.launch.membership.ElasticInMemoryCoordinator`, which forms the job
once and lets nodes join it while it runs): node 0's launcher hosts the store at
``--master-addr:--master-port`` (reachable by the other nodes) and the others are clients of it,
each call bounded (a call on a cut link waits for an answer that never comes:
:class:`_RemoteStore`). Every launcher marks its own lost workers dead, fences its own workers
that the survivors left out (:func:`members_key`), and replaces its own lost workers on its own
node (``--max-restarts`` counts this node's replacements, as torchrun's counts per node), each
with a launch rank taken from a counter in the store (:meth:`InMemoryCoordinator.launch_rank`),
so that no two nodes give one out twice. A loss that cannot be recovered in memory makes the
launcher that saw it end the attempt on every node (:meth:`InMemoryCoordinator.end_job`,
:class:`JobEnd`): every launcher stops its workers, they meet in the store
(:meth:`InMemoryCoordinator.settle`: node 0 decides, once every node has stopped, whether every
node restarts), node 0 starts a fresh store on the same port and the others connect to it again
(:meth:`InMemoryCoordinator.begin`), and every node starts its workers again to resume from the
last checkpoint, while ``--max-restarts`` allows (the fall-backs are counted for the job: every
node restarts at each). A launcher that loses the store (node 0 down, or this node cut off) ends
with :func:`lost_store_message`, as torch's c10d store's loss ends a job; a node whose launcher
is gone gets no replacement, and node 0 says so (:func:`no_replacement_line`).

The survivors note each recovery in the report directory (``TANDEM_REPORT_DIR``) as
``tandem-recovery-*.json``; the exit summary joins them with the launcher's record
(:func:`recovery_lines`), and one line for each fall-back to ``restart``.

Imports no torch at import time: only :meth:`InMemoryCoordinator.begin` does, to host the store.

Example::

    coordinator = InMemoryCoordinator("127.0.0.1", port=None)
    attempt = coordinator.begin(0)   # the store listens at attempt.addr:attempt.port
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from tandem.job.checkin import is_loopback
from tandem.job.secret import key_scope
from tandem.launch.failures import Failure, describe_exit
from tandem.launch.rendezvous import (
    ROUND_VARIABLE,
    Attempt,
    LaunchError,
    LocalCoordinator,
    check_port_free,
    free_port,
    warn_without_secret,
)

#: How a lost worker is handled: ``tandem run --recover``'s choices, the default first.
MODES = ("restart", "in-memory")
#: The workers' environment variable that says the mode (set only under ``in-memory``).
RECOVER_VARIABLE = "TANDEM_RECOVER"
#: Seconds of silence after which the workers count one of theirs as lost (tandem.recovery).
HEARTBEAT_VARIABLE = "TANDEM_HEARTBEAT_TIMEOUT"
#: What the launcher gives the workers so that every rank is a client of its store (torch's).
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"
#: The report files the survivors write, one or more per recovery, in ``TANDEM_REPORT_DIR``.
REPORT_GLOB = "tandem-recovery-*.json"
#: What a worker that will recover in memory sets under :func:`able_key` (``tandem.recovery.ABLE``;
#: one that will not sets ``"no: <reason>"``).
ABLE = "1"
#: Why a worker that set nothing under :func:`able_key` is not recovered in memory.
NOT_STARTED = (
    "recovery in memory never started: a script that uses neither tandem.Trainer nor "
    "tandem.recovery.Run, or a loss during start-up"
)
#: The end of the launcher's line when it falls back.
FALLS_BACK = "--recover in-memory falls back to restart"
# How long the store's own operations (in the launcher) wait.
_STORE_TIMEOUT = timedelta(seconds=60)


def dead_key(rank: int, environ: Mapping[str, str] = os.environ) -> str:
    """The store key under which the launcher announces that global ``rank`` was lost, in the
    job secret's scope (:func:`tandem.job.secret.key_scope`) so that only the job's own
    processes can read or forge it.

    Example::

        >>> dead_key(2, {})
        'tandem/recover/dead/2'
        >>> dead_key(2, {"TANDEM_JOB_SECRET": "s3cret"})
        'tandem/job-1ec1c26b50d5d3c58d9583181af80766/recover/dead/2'
    """
    return f"tandem/{key_scope(environ)}recover/dead/{rank}"


def able_key(rank: int, environ: Mapping[str, str] = os.environ) -> str:
    """The store key under which the worker of global ``rank`` says at its start whether it will
    recover in memory: ``"1"`` (:data:`ABLE`), or ``"no: <reason>"``; a worker that sets nothing
    cannot (:func:`unable`).

    Example::

        >>> able_key(0, {})
        'tandem/recover/able/0'
    """
    return f"tandem/{key_scope(environ)}recover/able/{rank}"


def admits_key(rank: int, environ: Mapping[str, str] = os.environ) -> str:
    """The store key under which the worker of global ``rank`` says it admits replacements
    (``"1"``: ``tandem.recovery.Run``); the launcher starts one for a lost worker only if every
    member still running said so.

    Example::

        >>> admits_key(0, {})
        'tandem/recover/admits/0'
    """
    return f"tandem/{key_scope(environ)}recover/admits/{rank}"


def unable(said: Mapping[int, str | None]) -> dict[int, str]:
    """Of the workers still running, by global rank with what each set under :func:`able_key`
    (None: nothing), those that will not recover in memory, each with why.

    Example::

        >>> unable({0: "1", 1: "no: the model is sharded", 2: None})[1]
        'the model is sharded'
        >>> sorted(unable({0: "1", 1: "no: the model is sharded", 2: None}))
        [1, 2]
    """
    why = {}
    for rank, value in said.items():
        if value == ABLE:
            continue
        if value is None:
            why[rank] = NOT_STARTED
        elif value.startswith("no:") and value[3:].strip():
            why[rank] = value[3:].strip()
        else:
            why[rank] = f"it said {value!r}"
    return why


def why_unable(why: Mapping[int, str], ranks: bool = False) -> str:
    """The reasons :func:`unable` gave, as one text: the reason alone when every rank gave it
    (unless ``ranks``), else each reason after the ranks that gave it.

    Example::

        >>> why_unable({0: "sharded", 2: "sharded"})
        'sharded'
        >>> why_unable({0: "sharded", 2: "sharded"}, ranks=True)
        'ranks 0, 2: sharded'
        >>> why_unable({0: "sharded", 1: "not started", 2: "sharded"})
        'ranks 0, 2: sharded; rank 1: not started'
    """
    groups: dict[str, list[int]] = {}
    for rank in sorted(why):
        groups.setdefault(why[rank], []).append(rank)
    if len(groups) == 1 and not ranks:
        return next(iter(groups))
    return "; ".join(f"{_ranks(listed)}: {reason}" for reason, listed in groups.items())


def members_key(generation: int, environ: Mapping[str, str] = os.environ) -> str:
    """The store key under which the survivors write generation ``generation``'s members (a
    JSON list of global ranks), decided once (:class:`tandem.recovery.Membership`).

    Example::

        >>> members_key(1, {})
        'tandem/recover/gen1/members'
    """
    return f"tandem/{key_scope(environ)}recover/gen{generation}/members"


def death_record(failure: Failure) -> dict[str, Any]:
    """The JSON the launcher writes under :func:`dead_key`: ``rank``, ``how`` (as the exit
    summary says it), ``at`` (``time.time()`` of the exit), and the details.

    Example::

        >>> death_record(Failure(1, 1, "vm", -9, (), at=1700000000.5))["how"]
        'killed by SIGKILL'
    """
    return {
        "rank": failure.rank,
        "how": describe_exit(failure.returncode, likely=False),
        "at": failure.at,
        "returncode": failure.returncode,
        "local_rank": failure.local_rank,
        "host": failure.host,
    }


def check_one_node(what: str, one_node: bool) -> None:
    """``LaunchError`` unless ``one_node``: with the static rendezvous ``in-memory`` supports a
    fixed number of nodes (one, or ``--nnodes N``), an elastic ``MIN:MAX`` only with the c10d
    rendezvous (:class:`tandem.launch.membership.ElasticInMemoryCoordinator`), and no
    ``--hostfile`` of many hosts. ``what``: the job's size as the user gave it
    (``--nnodes 1:2``).

    Example::

        check_one_node(f"--nnodes {args.nnodes}", most == nnodes)
    """
    if one_node:
        return
    raise LaunchError(
        f"--recover in-memory with {what}: only a fixed number of nodes is supported with the "
        "static rendezvous (--nnodes N with --node-rank, --master-addr and --master-port on "
        "each node; one node by default); an elastic --nnodes MIN:MAX needs the c10d "
        "rendezvous (--rdzv-backend c10d --rdzv-endpoint HOST:PORT, HOST being node 0's, which "
        "hosts the job's store); a --hostfile of many hosts needs --recover restart (the "
        "default)"
    )


def fallback_key(environ: Mapping[str, str] = os.environ) -> str:
    """The store key under which a launcher of a job of many nodes says why the job ends on
    every node (a loss that cannot be recovered in memory): the others read it and stop their
    workers.

    Example::

        >>> fallback_key({})
        'tandem/recover/launcher/ended'
    """
    return f"tandem/{key_scope(environ)}recover/launcher/ended"


def node_key(node: int, name: str, environ: Mapping[str, str] = os.environ) -> str:
    """A launcher's own store key (``name``: ``joined``, ``beat``, ``done``) for ``node``.

    Example::

        >>> node_key(1, "done", {})
        'tandem/recover/launcher/node1/done'
    """
    return f"tandem/{key_scope(environ)}recover/launcher/node{node}/{name}"


def launcher_key(name: str, environ: Mapping[str, str] = os.environ) -> str:
    """A key the launchers of a job of many nodes share (``replacements``: the counter of launch
    ranks given to replacements; ``attempt``: the attempt node 0's store serves; ``next``: node
    0's decision at an attempt's end; ``rank<r>``: the node that started replacement ``r``).

    Example::

        >>> launcher_key("replacements", {})
        'tandem/recover/launcher/replacements'
    """
    return f"tandem/{key_scope(environ)}recover/launcher/{name}"


@dataclass(frozen=True)
class JobEnd:
    """Why a launcher of a job of many nodes ended the attempt on every node (a loss that cannot
    be recovered in memory): ``why``, its line as it said it (without ``tandem run: ``);
    ``line``, the exit summary's entry for it (:func:`fallback_line`); ``restart``, the restart
    it asks for (1 for the first; 0: none is left). Written once under :func:`fallback_key`
    (the first launcher's stands) and read by every other.

    Example::

        >>> JobEnd.loads(JobEnd("rank 1 was lost", "rank 1 lost", 1).dumps()).restart
        1
    """

    why: str
    line: str
    restart: int = 0
    node: int | None = None  # the node whose launcher ended it, where it said so

    def dumps(self) -> str:
        said = {"why": self.why, "line": self.line, "restart": self.restart, "node": self.node}
        return json.dumps(said)

    @classmethod
    def loads(cls, text: str | bytes) -> JobEnd:
        try:
            said = json.loads(_text(text))
            node = said.get("node")
            return cls(
                str(said["why"]),
                str(said["line"]),
                int(said["restart"]),
                int(node) if node is not None else None,
            )
        except (ValueError, KeyError, TypeError):  # a launcher of an older tandem: words only
            return cls(_text(text), _text(text), 0)


def no_replacement_line(rank: int, node: int, silent_s: float) -> str:
    """What node 0 says of a rank the survivors left out whose node's launcher is gone: nobody
    replaces it (a lost worker is replaced by its own node's launcher only).

    Example::

        >>> print(no_replacement_line(2, 2, 5.0))
        tandem run: no replacement is started for rank 2: its node (node 2) has had no `tandem run` beat for 5 s (killed, its host down, or cut off from the store), and only a worker's own node starts one
    """  # noqa: E501
    return (
        f"tandem run: no replacement is started for rank {rank}: its node (node {node}) has had "
        f"no `tandem run` beat for {silent_s:g} s (killed, its host down, or cut off from the "
        "store), and only a worker's own node starts one"
    )


def lost_store_message(where: str, error: BaseException | str) -> str:
    """What a launcher of many nodes says when it cannot reach the job's store any more.

    Example::

        >>> print(lost_store_message("10.0.0.1:29500", "Connection reset by peer"))
        lost the job's store at 10.0.0.1:29500 (node 0's `tandem run`): node 0 is down, or this node is cut off from it (a partition); as with torch's c10d store, the job cannot go on without it: this node's workers are stopped (Connection reset by peer)
    """  # noqa: E501
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return (
        f"lost the job's store at {where} (node 0's `tandem run`): node 0 is down, or this "
        "node is cut off from it (a partition); as with torch's c10d store, the job cannot go "
        f"on without it: this node's workers are stopped ({first})"
    )


class _RemoteStore:
    """A client of node 0's store whose failures are a LaunchError that says what they mean
    (:func:`lost_store_message`): a broken connection (node 0 gone), or a call unanswered for
    ``timeout`` seconds (a cut link: the client's own timeout does not bound a call waiting
    for an answer, so each call runs on a thread of this client's and is waited for here)."""

    def __init__(self, store: Any, where: str, timeout: float) -> None:
        self._store, self._where, self._timeout = store, where, timeout
        self._calls: queue.Queue[tuple[Callable[[], Any], list[Any], threading.Event] | None] = (
            queue.Queue()
        )
        self._broken: str | None = None
        threading.Thread(target=self._serve, name="tandem-store-client", daemon=True).start()

    def close(self) -> None:
        """Stop the thread and drop the client: its connection closes with it."""
        self._calls.put(None)

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                self._store = None
                return
            call, result, done = item
            try:
                result.append((True, call()))
            except Exception as exc:
                result.append((False, exc))
            done.set()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            if self._broken is not None:
                raise LaunchError(lost_store_message(self._where, self._broken))
            result: list[Any] = []
            done = threading.Event()
            self._calls.put((lambda: method(*args), result, done))
            if not done.wait(self._timeout):
                self._broken = f"no answer within {self._timeout:g} s"
                raise LaunchError(lost_store_message(self._where, self._broken))
            ok, value = result[0]
            if ok:
                return value
            if isinstance(value, RuntimeError):  # torch's DistNetworkError and DistStoreError
                self._broken = str(value).splitlines()[0] if str(value) else repr(value)
                raise LaunchError(lost_store_message(self._where, value)) from value
            raise value

        return call


class InMemoryCoordinator(LocalCoordinator):
    """The launcher's side of the job's TCPStore, which outlives any worker.

    One node (``nnodes`` 1): ``begin`` starts the store (on loopback only where the address is
    a loopback one, so no other host can reach its keys) on ``port``, or on a port the kernel
    picks; the attempt's environment makes every worker a client of it. A restart (an attempt
    after the first: the fall-back to ``restart``) closes the store of the attempt before and
    starts a fresh one, so the restarted workers see none of its keys.

    Many nodes (``nnodes`` N, static rendezvous): node 0's launcher hosts the store at ``addr``
    (its address, which the others reach) and ``port``; every other launcher is a client of it,
    whose calls give up after ``store_timeout`` (a cut link makes a call wait, not fail) with a
    LaunchError (:func:`lost_store_message`). ``begin`` waits (``join_timeout``) until every
    node's launcher is there; :meth:`beat` shows this launcher alive, :meth:`end_job` and
    :meth:`ended` carry the end of an attempt (a fall-back) to every node, and :meth:`settle`
    is where the nodes meet once their workers have exited: node 0 decides whether the job
    restarts, and returns only once every other node has its answer (or is silent), so the
    store outlives every worker and launcher that still uses it. A restart is a fresh store
    on the same port, which the other nodes find by the attempt it serves
    (:func:`launcher_key` ``attempt``).

    ``report_failure`` announces a lost rank under :func:`dead_key`; ``able`` reads what the
    workers said under :func:`able_key`; :meth:`launch_rank` gives a replacement its launch
    rank. ``close`` (at the launcher's end, after every worker) stops the store (node 0) or
    drops the client.
    """

    #: This node arrived after the job formed: its workers join it as replacements do.
    late = False
    #: The restarts the job had when this node arrived (a node joining an elastic job after a
    #: fall-back restarted it): its own count starts there.
    job_restarts = 0

    def __init__(
        self,
        addr: str,
        port: int | None,
        heartbeat_timeout: float = 10.0,
        *,
        nnodes: int = 1,
        node_rank: int = 0,
        join_timeout: float = 900.0,
    ) -> None:
        super().__init__(addr, port)
        self.store: Any = None
        self.heartbeat_timeout = heartbeat_timeout
        self.nnodes, self.node_rank, self.join_timeout = nnodes, node_rank, join_timeout
        # A call to node 0's store that takes this long means it is gone or cut off: longer
        # than the workers' own limit (the heartbeat timeout), so that they say it first.
        self.store_timeout = max(5.0, 2 * heartbeat_timeout)
        self._beats = 0.0  # when this launcher last beat (monotonic)
        self._seen: dict[int, tuple[int, float]] = {}  # node -> its beat count, when it moved
        self._idle: bool | None = None  # what this node last said under its "idle" key

    @property
    def many(self) -> bool:
        """A job of many nodes."""
        return self.nnodes > 1

    def begin(self, attempt: int) -> Attempt:
        env = {
            AGENT_STORE_VARIABLE: "True",
            ROUND_VARIABLE: "0",  # a fresh store each attempt: tandem.init meets in round 0
            RECOVER_VARIABLE: "in-memory",
            HEARTBEAT_VARIABLE: f"{self.heartbeat_timeout:g}",
        }
        if self.many:
            self._join(attempt)
            return Attempt(self.addr, self.where[1], env, self.node_rank, self.nnodes, attempt)
        self.close()  # the attempt before's: its workers are stopped, its keys go with it
        self.store, port = _host_store(self.addr, self.port)
        return Attempt(self.addr, port, env, 0, 1, attempt)

    @property
    def where(self) -> tuple[str, int]:
        """The store's address and port (many nodes)."""
        assert self.port is not None
        return self.addr, self.port

    def _join(self, attempt: int) -> None:
        """Host the store of ``attempt`` (node 0: a fresh one after the first) or connect to it,
        and wait for every node's launcher."""
        addr, port = self.where
        self._seen, self._idle = {}, None  # a fresh store: no beat nor mark of the last one
        if self.node_rank == 0:
            self.close()  # the attempt before's: every other node has left it (settle)
            self.store, _ = _host_store(addr, port)
            if attempt == 0:
                warn_without_secret(key_scope(), addr, port)
            self._fresh_store()
            # Last: the other nodes take the store as this attempt's once they read it.
            self.store.set(launcher_key("attempt"), str(attempt))
        else:
            self.store = self._connect(attempt)
        self.store.set(node_key(self.node_rank, "joined"), "1")
        deadline = time.monotonic() + self.join_timeout
        while True:
            keys = [node_key(n, "joined") for n in range(self.nnodes)]
            missing = [n for n, key in enumerate(keys) if not self.store.check([key])]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"node rank(s) {missing} of --nnodes {self.nnodes} never joined the job's "
                    f"store at {addr}:{port} within {self.join_timeout:.0f} s: start `tandem run "
                    f"--nnodes {self.nnodes} --node-rank N --master-addr {addr} --master-port "
                    f"{port} --recover in-memory ...` on each of them"
                )
            time.sleep(0.05)

    def _fresh_store(self) -> None:
        """Node 0, in a restart's fresh store before any other node reads it: the keys the
        attempt needs there from the start (none with a fixed ``--nnodes``)."""

    def _connect(self, attempt: int | None) -> _RemoteStore:
        """A client of node 0's store of ``attempt`` (None: of whichever attempt it serves, for
        a node arriving at an elastic job). After the first, node 0 may still serve the attempt
        before's (it waits until every node has left it): a store whose ``attempt`` key is not
        this one is dropped and asked again."""
        from torch.distributed import TCPStore

        addr, port = self.where
        self.close()
        deadline = time.monotonic() + self.join_timeout
        error: BaseException | None = None
        while time.monotonic() < deadline:
            remote = None
            try:
                # The first attempt's client waits for node 0 to start listening; a later one
                # asks again soon, since the store that answers may be the old one, closing.
                left = deadline - time.monotonic()
                wait = max(1.0, left if not attempt else min(self.store_timeout, left))
                client = TCPStore(addr, port, None, False, timedelta(seconds=wait))
                remote = _RemoteStore(client, f"{addr}:{port}", self.store_timeout)
                key = launcher_key("attempt")
                if remote.check([key]) and (
                    attempt is None or _text(remote.get(key)) == str(attempt)
                ):
                    return remote
            except (RuntimeError, LaunchError) as exc:  # refused, or the old store closing
                error = exc
            if remote is not None:
                remote.close()
            time.sleep(0.1)
        raise LaunchError(
            f"node {self.node_rank} could not reach node 0's store at {addr}:{port} (attempt "
            f"{attempt}) within {self.join_timeout:.0f} s: is node 0's `tandem run` started "
            f"with --master-addr {addr} --master-port {port}, and is that port reachable from "
            f"this host? ({error})"
        )

    def report_failure(self, round: int, failure: Failure) -> None:
        if self.store is not None:
            self.store.set(dead_key(failure.rank), json.dumps(death_record(failure)))

    def members(self, generation: int) -> list[int] | None:
        """Generation ``generation``'s members as the survivors decided them, or None yet."""
        key = members_key(generation)
        if self.store is None or not self.store.check([key]):
            return None
        return [int(r) for r in json.loads(self.store.get(key))]

    def dead(self, ranks: Iterable[int]) -> set[int]:
        """Of ``ranks``, those some launcher marked dead (:func:`dead_key`)."""
        if self.store is None:
            return set()
        return {r for r in ranks if self.store.check([dead_key(r)])}

    def able(self, ranks: Iterable[int]) -> dict[int, str | None]:
        """What each of ``ranks`` set under :func:`able_key`: ``"1"``, ``"no: <reason>"``, or
        None where it set nothing (yet)."""
        said: dict[int, str | None] = {}
        for rank in ranks:
            key = able_key(rank)
            if self.store is None or not self.store.check([key]):
                said[rank] = None
            else:
                value = self.store.get(key)
                said[rank] = value.decode(errors="replace") if isinstance(value, bytes) else value
        return said

    def admits(self, ranks: Iterable[int]) -> bool:
        """Whether every one of ``ranks`` said it admits replacements (:func:`admits_key`)."""
        return self.store is not None and all(
            self.store.check([admits_key(rank)]) for rank in ranks
        )

    def launch_rank(self, world_size: int) -> int:
        """A launch rank no worker of this attempt had, for a replacement this node starts: the
        job's counter in the store (``world_size``, then one more each), so that two nodes
        replacing a worker each at once give out two ranks. With many nodes the rank's node
        is noted (:meth:`node_of`)."""
        rank = world_size + int(self.store.add(launcher_key("replacements"), 1)) - 1
        if self.many:
            self.store.set(launcher_key(f"rank{rank}"), str(self.node_rank))
        return rank

    def node_of(self, rank: int, nproc_per_node: int) -> int | None:
        """The node whose launcher started launch rank ``rank`` (None if unknown)."""
        if rank < self.nnodes * nproc_per_node:
            return rank // nproc_per_node
        key = launcher_key(f"rank{rank}")
        if self.store is None or not self.store.check([key]):
            return None
        return int(_text(self.store.get(key)))

    def beat(self) -> None:
        """Many nodes: show this launcher alive (every half second at most)."""
        now = time.monotonic()
        if self.many and self.store is not None and now - self._beats >= 0.5:
            self.store.add(node_key(self.node_rank, "beat"), 1)
            self._beats = now

    def idle(self, idle: bool) -> None:
        """Many nodes: say whether this node runs no member of the job (only replacements not
        admitted yet, or nothing): when every node is idle, nobody is left to admit them."""
        if self.many and self.store is not None and idle != self._idle:
            self.store.set(node_key(self.node_rank, "idle"), "1" if idle else "0")
            self._idle = idle

    def nodes(self) -> list[int]:
        """The job's nodes (many nodes): every node of a fixed ``--nnodes``."""
        return list(range(self.nnodes))

    def others_idle(self) -> bool:
        """Many nodes: whether every other node is idle (:meth:`idle`), done, or silent."""
        for node in self.nodes():
            if node == self.node_rank or self.store.check([node_key(node, "done")]):
                continue
            key = node_key(node, "idle")
            if self.store.check([key]) and _text(self.store.get(key)) == "1":
                continue
            if not self.silent(node):
                return False
        return True

    def end_job(self, end: JobEnd) -> JobEnd:
        """Many nodes: end this attempt on every node (a fall-back), for ``end``'s reason; the
        first launcher's end stands and is returned."""
        return JobEnd.loads(self.store.compare_set(fallback_key(), "", end.dumps()) or "")

    def ended(self) -> JobEnd | None:
        """Many nodes: why a launcher ended this attempt on every node (:meth:`end_job`)."""
        if not self.many or self.store is None or not self.store.check([fallback_key()]):
            return None
        return JobEnd.loads(self.store.get(fallback_key()))

    def settle(
        self, tick: Callable[[], None] = lambda: None, stopped: Callable[[], bool] = lambda: False
    ) -> tuple[int, str]:
        """Many nodes: this node's workers have all exited (or were stopped). The nodes meet:
        once every node is done (or silent), node 0 decides whether the job restarts (a
        launcher asked for it with :meth:`end_job`, and every node is still there to restart:
        with a fixed ``--nnodes`` a restart cannot do without one) and writes it; every other
        node reads it and says it has; node 0 returns once each has (or is silent), so no
        launcher loses the store while it still needs it. ``tick`` runs while waiting (the
        launcher beats there). Returns the restart agreed (0: the job is over) and, if one was
        asked for and cannot be made, why."""
        if not self.many or self.store is None:
            return 0, ""
        self.store.set(node_key(self.node_rank, "done"), "1")
        decision = launcher_key("next")
        others = [n for n in self.nodes() if n != self.node_rank]
        if self.node_rank != 0:
            while not self.store.check([decision]) and not stopped():
                tick()
                time.sleep(0.05)
            if stopped():
                return 0, ""
            said = json.loads(_text(self.store.get(decision)))
            self.store.set(node_key(self.node_rank, "left"), "1")
            return self._follow(said)
        gone = self._wait_for(others, "done", tick, stopped)
        said = self._decide(self.ended(), gone)
        self.store.set(decision, json.dumps(said))
        restart, why = self._follow(said)
        left = [n for n in others if n not in gone] + self._told_the_end(restart)
        self._wait_for(left, "left", tick, stopped)
        return restart, why

    def _decide(self, end: JobEnd | None, gone: list[int]) -> dict[str, Any]:
        """Node 0, once every node is done or silent (``gone``): whether the job restarts, as
        the JSON every node reads (``restart``, ``why``). A fixed ``--nnodes`` restarts only
        with every node there."""
        restart, why = 0, ""
        if end is not None and end.restart and gone:
            why = (
                f"node(s) {', '.join(map(str, gone))} of --nnodes {self.nnodes} went silent "
                f"(no beat for {self.store_timeout:g} s: killed, host down, or cut off), and a "
                "restart needs every node"
            )
        elif end is not None:
            restart = end.restart
        return {"restart": restart, "why": why}

    def _follow(self, said: Mapping[str, Any]) -> tuple[int, str]:
        """Every node: node 0's decision (:meth:`_decide`) as the restart agreed and why none."""
        return int(said["restart"]), str(said["why"])

    def _told_the_end(self, restart: int) -> list[int]:
        """Node 0, once it decided how the job's attempt ends (``restart``: the restart agreed,
        0 for none): the nodes outside the job still waiting to be admitted, told so (none with
        a fixed ``--nnodes``); it keeps the store until each has read it and left (or went
        silent)."""
        return []

    def _wait_for(
        self, nodes: list[int], name: str, tick: Callable[[], None], stopped: Callable[[], bool]
    ) -> list[int]:
        """Until each of ``nodes`` set its ``name`` key or went silent; the silent ones."""
        waiting, silent = set(nodes), []
        while waiting and not stopped():
            tick()
            for node in sorted(waiting):
                if self.store.check([node_key(node, name)]):
                    waiting.discard(node)
                elif self.silent(node):
                    waiting.discard(node)
                    silent.append(node)
            time.sleep(0.05)
        return sorted(silent)

    def silent(self, node: int) -> bool:
        """Whether ``node``'s launcher beat has not moved for ``store_timeout`` (on this
        launcher's clock: no clocks compared)."""
        count = int(self.store.add(node_key(node, "beat"), 0))
        now = time.monotonic()
        seen = self._seen.get(node)
        if seen is None or seen[0] != count:
            self._seen[node] = (count, now)
            return False
        return now - seen[1] > self.store_timeout

    def close(self) -> None:
        if isinstance(self.store, _RemoteStore):
            self.store.close()
        self.store = None  # node 0: the server stops with its last reference


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _host_store(addr: str, port: int | None) -> tuple[Any, int]:
    """A TCPStore server at ``addr`` (``port``, or a free one) and its port."""
    # torch only here: the launcher of a `restart` job never imports it.
    from torch.distributed import TCPStore

    if port is not None:
        check_port_free(addr, port)  # names the port, as a one-node restart job would
    if not is_loopback(addr):  # torch's store listens on every interface, as torchrun's
        chosen = port if port is not None else free_port(addr)
        try:
            store = TCPStore(addr, chosen, None, True, _STORE_TIMEOUT, wait_for_workers=False)
        except RuntimeError as exc:
            raise LaunchError(f"could not start the job's store at {addr}:{chosen}: {exc}") from exc
        return store, chosen
    family, _, _, _, address = socket.getaddrinfo(addr, port or 0, proto=socket.IPPROTO_TCP)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise LaunchError(
            f"could not listen at {addr}:{port or 0} for the job's store ({exc.strerror})"
        ) from exc
    chosen = listener.getsockname()[1]
    fd = listener.detach()  # the store owns the socket from here on
    try:
        store = TCPStore(
            addr, chosen, None, True, _STORE_TIMEOUT, wait_for_workers=False, master_listen_fd=fd
        )
    except (RuntimeError, OSError) as exc:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise LaunchError(f"could not start the job's store at {addr}:{chosen}: {exc}") from exc
    return store, chosen


def lost_summary(failure: Failure, going_on: int) -> str:
    """What the launcher says the moment a worker is lost: who, how, who goes on, its last
    lines.

    Example::

        >>> print(lost_summary(Failure(1, 1, "vm", -9, (), at=1.0), 2))
        tandem run: rank 1 (local rank 1 on vm) was lost: killed by SIGKILL (often the out-of-memory killer: check `dmesg` or the job's memory limit); the other 2 workers go on without it (--recover in-memory)
    """  # noqa: E501
    who = f"rank {failure.rank} (local rank {failure.local_rank} on {failure.host})"
    others = (
        f"the other {going_on} worker{'s' if going_on != 1 else ''} go on without it"
        if going_on
        else "no worker is left"
    )
    lines = [
        f"tandem run: {who} was lost: {failure.cause or describe_exit(failure.returncode)}; "
        f"{others} "
        "(--recover in-memory)"
    ]
    if failure.tail:
        lines.append(f"--- last {len(failure.tail)} lines of rank {failure.rank}'s stderr ---")
        lines.extend(failure.tail)
        lines.append("---")
    return "\n".join(lines)


@dataclass(frozen=True)
class Fallback:
    """A loss that could not be recovered in memory, so every worker was stopped: the fall-back
    to ``restart``.

    ``lost``: the workers lost at that moment (as the launcher saw them exit); ``unable``: the
    workers still running that would not recover in memory, each with why (:func:`unable`),
    empty when no worker was left running; ``restart``: the restart it led to (1 for the
    first), 0 when ``--max-restarts`` (``max_restarts``) left none.
    """

    lost: tuple[Failure, ...]
    unable: Mapping[int, str] = field(default_factory=dict)
    restart: int = 0
    max_restarts: int = 0
    nodes: int = 1  # the job's: with many, every node stops (and restarts) its workers

    @property
    def at(self) -> float:
        """When the first of ``lost`` was seen to exit (``time.time()``; 0 if unknown)."""
        return min((f.at for f in self.lost), default=0.0)


def fallback_summary(fallback: Fallback) -> str:
    """What the launcher says the moment it falls back to ``restart``: who was lost, which
    workers cannot go on in memory and why, and whether every worker restarts.

    Example::

        >>> lost = (Failure(1, 1, "vm", -9, (), at=1.0),)
        >>> why = {0: "the model is sharded", 2: "the model is sharded"}
        >>> print(fallback_summary(Fallback(lost, why, restart=1, max_restarts=1)))
        tandem run: rank 1 (killed by SIGKILL) was lost and ranks 0, 2 cannot be recovered in memory (the model is sharded): restarting every worker from the last checkpoint (restart 1 of 1; --recover in-memory falls back to restart)
        >>> print(fallback_summary(Fallback(lost, why, restart=0, max_restarts=0)))
        tandem run: rank 1 (killed by SIGKILL) was lost and ranks 0, 2 cannot be recovered in memory (the model is sharded): stopping every worker; no restart is left to resume them from the last checkpoint (--max-restarts 0; --recover in-memory falls back to restart)
    """  # noqa: E501
    were = "was" if len(fallback.lost) == 1 else "were"
    text = f"tandem run: {_lost_ranks(fallback.lost)} {were} lost and "
    if fallback.unable:
        cannot = f"{_ranks(sorted(fallback.unable))} cannot be recovered in memory"
        text += f"{cannot} ({why_unable(fallback.unable)}): "
    else:
        text += "no worker is left to go on in memory: "
    every = "every worker on every node" if fallback.nodes > 1 else "every worker"
    if fallback.restart:
        return (
            f"{text}restarting {every} from the last checkpoint (restart "
            f"{fallback.restart} of {fallback.max_restarts}; {FALLS_BACK})"
        )
    return (
        f"{text}stopping {every}; no restart is left to resume them from the last "
        f"checkpoint (--max-restarts {fallback.max_restarts}; {FALLS_BACK})"
    )


def fallback_line(fallback: Fallback, started: float) -> str:
    """A fall-back as the exit summary lists it among the recoveries (without its number);
    ``started``: the run's start (``time.time()``).

    Example::

        >>> lost = (Failure(1, 1, "vm", -9, (), at=107.2),)
        >>> fallback_line(Fallback(lost, {0: "sharded", 2: "sharded"}, 1, 1), started=100.0)
        'rank 1 (killed by SIGKILL) lost 7.2 s into the run; not recoverable in memory (ranks 0, 2: sharded): every worker restarted (restart 1 of 1) from the last checkpoint'
    """  # noqa: E501
    into = f"{fallback.at - started:.1f} s into the run" if fallback.at else "at its end"
    text = f"{_lost_ranks(fallback.lost)} lost {into}; "
    if fallback.unable:
        text += f"not recoverable in memory ({why_unable(fallback.unable, ranks=True)}): "
    else:
        text += "no worker left to go on in memory: "
    every = "every worker on every node" if fallback.nodes > 1 else "every worker"
    if fallback.restart:
        return (
            f"{text}{every} restarted (restart {fallback.restart} of "
            f"{fallback.max_restarts}) from the last checkpoint"
        )
    return f"{text}{every} stopped, no restart left (--max-restarts {fallback.max_restarts})"


def _lost_ranks(lost: Sequence[Failure]) -> str:
    """``rank 1 (killed by SIGKILL)``, ``ranks 1 (killed by SIGKILL), 3 (exit code 1)``."""
    hows = [f"{f.rank} ({f.cause or describe_exit(f.returncode, likely=False)})" for f in lost]
    return f"{'rank' if len(lost) == 1 else 'ranks'} {', '.join(hows)}"


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 1, 3``."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(str(r) for r in ranks)}"


def recovery_reports(
    directory: Path, since: float = 0.0, run_id: str | None = None
) -> list[dict[str, Any]]:
    """The recoveries the survivors noted in ``directory`` (``tandem-recovery-*.json``) since
    ``since`` (a ``time.time()``; older files are another run's), one per generation, oldest
    generation first. A file naming another ``run_id`` is skipped; files of one generation
    (one per survivor, say) are merged: the lost ranks joined, the slowest survivor's times.

    Each has ``generation`` (int), ``lost`` and ``members`` (global ranks), ``detected_s``
    (seconds from the failure to the survivors noticing), ``step`` (the step redone) and
    ``recovered_s`` (seconds from detection to the next committed step); unreadable files and
    missing fields are left out.

    Example::

        for report in recovery_reports(Path(os.environ["TANDEM_REPORT_DIR"]), since=started):
            print(report["generation"], report["lost"])
    """
    merged: dict[Any, dict[str, Any]] = {}
    for path in sorted(directory.glob(REPORT_GLOB)):
        with contextlib.suppress(OSError, ValueError, TypeError):
            if path.stat().st_mtime < since:
                continue
            report = json.loads(path.read_text())
            if not isinstance(report, dict) or not isinstance(report.get("lost"), list):
                continue
            if run_id is not None and report.get("run_id") not in (None, run_id):
                continue
            generation = report.get("generation")
            key = int(generation) if isinstance(generation, int) else str(path)
            lost = [int(r) for r in report["lost"]]
            members = [int(r) for r in report.get("members") or []]
            if key not in merged:
                merged[key] = dict(report, lost=sorted(set(lost)), members=members)
                continue
            seen = merged[key]
            seen["lost"] = sorted(set(seen["lost"]) | set(lost))
            for name in ("detected_s", "recovered_s"):
                if _number(report.get(name)) is not None:
                    seen[name] = max(_number(seen.get(name)) or 0.0, float(report[name]))
    return [merged[k] for k in sorted(merged, key=lambda k: (isinstance(k, str), k))]


def recovery_lines(
    lost: Sequence[Failure],
    reports: Iterable[dict[str, Any]],
    started: float,
    fallback: Fallback | str | None = None,
    first: int = 1,
) -> list[str]:
    """The exit summary's line per recovery: the launcher's record of each lost rank (which
    rank, how it ended, when) joined with the survivors' report naming it (the step lost and
    redone, by whom, how fast); a loss no report names says the survivors did not report a
    recovery; ``fallback``, the loss that ended the attempt by a fall-back to ``restart``
    (:func:`fallback_line`; or its line as another node's launcher made it). In the order they happened, numbered from ``first`` (one call per
    attempt: each attempt's ranks and generations count anew); ``started``: the run's start
    (``time.time()``).

    Example::

        >>> lost = [Failure(2, 2, "vm", -9, (), at=107.0)]
        >>> report = {"generation": 1, "lost": [2], "members": [0, 1, 3], "detected_s": 0.31,
        ...           "step": 7, "recovered_s": 0.94}
        >>> recovery_lines(lost, [report], started=100.0)
        ['recovery 1: rank 2 (killed by SIGKILL) lost at step 7; detected in 0.3 s; step 7 redone by ranks 0,1,3 in 0.9 s']
        >>> recovery_lines(lost, [], started=100.0)
        ['recovery 1: rank 2 (killed by SIGKILL) lost 7.0 s into the run; the survivors did not report a recovery']
    """  # noqa: E501
    by_rank = {f.rank: f for f in lost}
    told: set[int] = set()
    entries: list[tuple[float, int, str]] = []
    reports = list(reports)
    when = -math.inf
    for order, report in enumerate(reports):
        ranks = list(report["lost"])
        seen = [by_rank[r] for r in ranks if r in by_rank]
        told.update(r for r in ranks if r in by_rank)
        # An admission (no loss) keeps its generation's place: right after the one before.
        when = min((f.at for f in seen), default=when)
        after = reports[order + 1] if order + 1 < len(reports) else None
        entries.append((when, order, _reported(ranks, by_rank, report, after)))
    for failure in lost:
        if failure.rank not in told:
            how = failure.cause or describe_exit(failure.returncode, likely=False)
            into = f"{failure.at - started:.1f} s into the run" if failure.at else "at its end"
            text = (
                f"rank {failure.rank} ({how}) lost {into}; the survivors did not report a recovery"
            )
            entries.append((failure.at, len(entries), text))
    if fallback is not None:  # it ended the attempt: nothing after it
        text = fallback if isinstance(fallback, str) else fallback_line(fallback, started)
        entries.append((math.inf, len(entries), text))
    entries.sort(key=lambda e: (e[0], e[1]))
    return [f"recovery {i}: {text}" for i, (_, _, text) in enumerate(entries, first)]


def _reported(
    ranks: list[int],
    by_rank: Mapping[int, Failure],
    report: dict[str, Any],
    after: dict[str, Any] | None = None,
) -> str:
    """One recovery a survivors' report describes, as its summary line says it; ``after``:
    the next generation's report (an admission a loss cut short is followed by a re-form whose
    newcomers, those that hold no run yet, are still its replacements)."""
    joined = [str(r) for r in report.get("joined") or []]
    if joined and not ranks:  # a replacement admitted (tandem.recovery's grow)
        going_on = ",".join(str(r) for r in report.get("members") or [])
        text = (
            f"replacement rank{'s' if len(joined) > 1 else ''} {', '.join(joined)} admitted "
            f"after step {report.get('step')}; ranks {going_on} go on"
        )
        again = [str(r) for r in (after or {}).get("joined") or []]
        cut = [str(r) for r in (after or {}).get("lost") or []]
        if cut and set(joined) & set(again):
            text += (
                f"; cut short by the loss of rank{'s' if len(cut) > 1 else ''} {', '.join(cut)}"
                " before the run was handed over"
            )
        return text
    hows = [
        f"{r} ({by_rank[r].cause or describe_exit(by_rank[r].returncode, likely=False)})"
        if r in by_rank
        else f"{r} (no exit seen by the launcher)"
        for r in ranks
    ]
    step = report.get("step")
    text = f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(hows)} lost"
    text += f" at step {step}" if step is not None else ""
    detected = _number(report.get("detected_s"))
    if detected is not None:
        text += f"; detected in {detected:.1f} s"
    members = [str(r) for r in report.get("members") or []]
    by = f" by {'rank' if len(members) == 1 else 'ranks'} {','.join(members)}" if members else ""
    recovered = _number(report.get("recovered_s"))
    if recovered is not None:
        text += f"; step {step} redone{by} in {recovered:.1f} s"
    else:
        text += f"; no step committed after it{by}"
    if joined:  # replacements whose admission a loss cut short, handed the run in this one
        text += (
            f" (replacement rank{'s' if len(joined) > 1 else ''} {', '.join(joined)} handed the "
            "run in it)"
        )
    return text


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
