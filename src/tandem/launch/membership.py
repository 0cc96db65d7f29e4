"""Elastic node counts: torchelastic's c10d rendezvous (``--nnodes MIN:MAX``), round by round.

The node whose address the endpoint is hosts a TCPStore and is node 0 of every round; the
others connect. Who takes part is decided per *round*, one per attempt, each under keys of its
own: a round never reads what a crashed one left behind, so the stale rendezvous state that
keeps torchelastic from re-forming after a crash (torch issue 135712) cannot arise here. Every
restart forms a new round from the nodes that register for it:

1. Registering: a launcher takes a place in round R (an atomic counter) and writes its id and
   host there. A node that arrives while round R runs registers for R + 1: it is *waiting*;
   one that arrives while MAX nodes run is refused.
2. Closing, by node 0 alone, at once when MAX nodes are registered. Otherwise, once MIN are:
   the job's first round (and one re-formed to admit waiting nodes) waits the last call
   (``last_call_timeout``, torch's 30 s) for more, then for the nodes of the previous round
   that are still alive (they come as soon as their workers have stopped). A round re-formed
   after a failure knows whom it waits for: the failed round's nodes that still beat. It
   closes as soon as each of them has registered or is lost (its beat stale for
   ``lost_after``, the same bound as while running), with no last call: a dead node costs
   the time its beat takes to go stale, not 30 s more; a node arriving later waits and is
   admitted at a restart (step 3). Either way node 0 waits for a beating node at most the
   last call plus ``lost_after``. Then it writes round R's members: itself, then the others
   in order of arrival. A registered node left out waits for the next round.
3. Running: each launcher beats (a counter in the store, every ``keep_alive_interval``); a
   member whose beat stops for ``keep_alive_interval * keep_alive_max_attempt`` is lost (its
   launcher was killed, or its host is down): the first launcher to notice records a failure
   for the round, and every node restarts, at the smaller size. A lost node's workers usually
   fail the others' collectives sooner; the beat is for workers that are not communicating.
   Node 0 restarts a healthy round when a node is waiting and the round has room (torch's
   ``num_nodes_waiting``); as in torch's agent, that restart does not count against
   ``--max-restarts``.
4. Ending: each node marks itself done; the round ends when every member has, and node 0
   keeps the store up until each has left. A node still waiting then is told the job ended.

Node 0's death ends the job (its store is gone), as with torch's c10d backend.

Under ``--recover in-memory`` there are no rounds: :class:`ElasticInMemoryCoordinator` forms the
job once (the same MIN, MAX and last call), and a node arriving later joins the running job in
memory, its workers admitted by the others at a step boundary; only a fall-back to ``restart``
restarts it, from the last checkpoint at the nodes still there.

Example::

    settings = ElasticSettings(min_nodes=1, max_nodes=2, last_call=5.0)
    coordinator = ElasticCoordinator(settings, "10.0.0.1", 29400, job="456")
    placement = coordinator.begin(attempt=0)   # this round's node_rank and nnodes
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tandem.job.secret import key_scope
from tandem.launch.failures import Failure
from tandem.launch.in_memory import (
    AGENT_STORE_VARIABLE,
    HEARTBEAT_VARIABLE,
    RECOVER_VARIABLE,
    InMemoryCoordinator,
    JobEnd,
    _host_store,
    _text,
    launcher_key,
    node_key,
    unable,
    why_unable,
)
from tandem.launch.rendezvous import (
    ROUND_VARIABLE,
    Attempt,
    LaunchError,
    Restart,
    is_store_host,
    open_store,
    read_failure,
    warn_without_secret,
    write_failure,
)

_POLL_S = 0.05
# The watch loop asks every 20 ms; the store is asked at most this often (each ask is a round
# trip to node 0 from every node).
_ASK_EVERY_S = 0.1


@dataclass(frozen=True)
class ElasticSettings:
    """The c10d rendezvous' knobs, torch's names in ``--rdzv-conf`` (seconds).

    Attributes:
        min_nodes, max_nodes: ``--nnodes MIN:MAX``.
        join_timeout: how long a round may take to reach MIN nodes (torch's 600 s).
        last_call: after MIN nodes are there, how long the first round (or one admitting
            waiting nodes) waits for more (torch's 30 s); a round re-formed after a failure
            waits only for the failed round's nodes that still beat.
        keep_alive_interval, keep_alive_max_attempt: a launcher beats every interval; a node
            whose beat stops for ``interval * max_attempt`` seconds is lost.
        is_host: this node hosts the store (None: it does if the endpoint is its address).
    """

    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call: float = 30.0
    keep_alive_interval: float = 1.0
    keep_alive_max_attempt: int = 5
    is_host: bool | None = None

    @property
    def lost_after(self) -> float:
        """Seconds without a beat after which a node counts as lost."""
        return self.keep_alive_interval * self.keep_alive_max_attempt


class _Store:
    """The store, where losing node 0's server is a LaunchError that says what it means."""

    def __init__(self, store: Any, where: str) -> None:
        self._store, self._where = store, where

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            try:
                return method(*args)
            except RuntimeError as exc:  # torch's DistNetworkError and DistStoreError
                raise LaunchError(
                    f"lost the rendezvous store at {self._where} (node 0's `tandem run`): the "
                    "job cannot go on without it; as with torch's c10d rendezvous, the store's "
                    f"host ending or dying ends the job ({str(exc).splitlines()[0]})"
                ) from exc

        return call


class _Beats:
    """When each member's beat counter last moved, on this node's clock (no clocks compared)."""

    def __init__(self, lost_after: float) -> None:
        self.lost_after = lost_after
        self.seen: dict[str, tuple[int, float]] = {}

    def lost(self, counts: dict[str, int]) -> list[str]:
        """The ids whose count has not moved for ``lost_after`` seconds."""
        now = time.monotonic()
        gone = []
        for node, count in counts.items():
            last = self.seen.get(node)
            if last is None or last[0] != count:
                self.seen[node] = (count, now)
            elif now - last[1] > self.lost_after:
                gone.append(node)
        return gone


class ElasticCoordinator:
    """``--rdzv-backend c10d``: nodes meet at the endpoint's store, between MIN and MAX of them,
    in rounds formed anew at every restart (see the module's docstring for the protocol)."""

    def __init__(self, settings: ElasticSettings, addr: str, port: int, job: str) -> None:
        self.settings, self.addr, self.port, self.job = settings, addr, port, job
        self.id = uuid.uuid4().hex[:12]
        self.host = socket.gethostname()
        hosting = is_store_host(addr, settings.is_host)
        store, self.serving = open_store(
            addr, port, settings.join_timeout, hosting, settings.is_host is not None, "this node"
        )
        self.store = _Store(store, f"{addr}:{port}")
        self.prefix = f"tandem/{key_scope()}{job}/elastic/"
        if self.serving:
            warn_without_secret(key_scope(), addr, port)
        self.round = -1
        self.members: list[dict[str, str]] = []
        self.beats = _Beats(settings.lost_after)
        self.asked, self.asked_change = 0.0, 0.0
        self.last_failure: Failure | None = None
        # Its own connection: the main thread may be inside a long store call (or none at all).
        beat_store = open_store(addr, port, settings.join_timeout, False, False, "this node")[0]
        self.stopping = threading.Event()
        self.beating = threading.Thread(
            target=self._beat, args=(beat_store,), name="tandem-beat", daemon=True
        )
        self.beating.start()

    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _beat(self, store: Any) -> None:
        key = self._key("beat", self.id)
        while not self.stopping.is_set():
            try:
                store.add(key, 1)
            except RuntimeError:
                return  # the store is gone: the main thread finds out and says so
            self.stopping.wait(self.settings.keep_alive_interval)

    def close(self) -> None:
        """Stop beating. Before the interpreter exits: a thread inside the store's C++ client
        at exit aborts the process ("terminate called without an active exception")."""
        self.stopping.set()
        self.beating.join(timeout=5.0)

    # ---- 1 and 2: registering and closing a round ----

    def begin(self, attempt: int) -> Attempt:
        """Form the next round (node 0) or join it (the others); this node's place in it."""
        if self.serving:
            self._close(0 if attempt == 0 else self.round + 1)
        else:
            self._join(None if attempt == 0 else self.round + 1)
        index = [m["id"] for m in self.members].index(self.id)
        env = {"TORCHELASTIC_USE_AGENT_STORE": "True", ROUND_VARIABLE: str(self.round)}
        self.beats = _Beats(self.settings.lost_after)  # a member's clock starts at its round
        self.asked, self.asked_change, self.last_failure = 0.0, 0.0, None
        return Attempt(
            self.addr, self.port, env, index, len(self.members), self.round, elastic=True
        )

    def _register(self, round: int) -> None:
        place = int(self.store.add(self._key(round, "arrivals"), 1))
        self.store.set(self._key(round, "slot", place), json.dumps(self._me()))

    def _me(self) -> dict[str, str]:
        return {"id": self.id, "host": self.host}

    def _registered(self, round: int, count: int) -> list[dict[str, str]]:
        keys = [self._key(round, "slot", i) for i in range(1, count + 1)]
        # A slot is written a moment after its place is taken: wait briefly for the last ones.
        give_up = time.monotonic() + 5.0
        while keys and not self.store.check(keys) and time.monotonic() < give_up:
            time.sleep(0.01)
        return [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]

    def _close(self, round: int) -> None:
        """Node 0: open ``round``, wait for MIN nodes and for the nodes it expects, write its
        members (see the module's step 2 for whom each kind of round waits for)."""
        s = self.settings
        reform = self.round >= 0 and self._failed(self.round)
        coming = [m["id"] for m in self.members if m["id"] != self.id]
        self.store.set(self._key("round"), str(round))
        started = time.monotonic()
        quorum_at: float | None = None
        while True:
            count = int(self.store.add(self._key(round, "arrivals"), 0))
            now = time.monotonic()
            if 1 + count >= s.min_nodes and quorum_at is None:
                quorum_at = now
            if 1 + count >= s.max_nodes:
                break
            if quorum_at is not None:
                waited = now - quorum_at
                # After a failure the nodes to wait for are known: the failed round's, unless
                # lost. A first round (or one admitting waiting nodes) cannot know who else is
                # starting up, so it gives them the last call; then it too waits for the
                # previous round's nodes still stopping their workers, which would otherwise be
                # left out and restart the new round at once to be admitted.
                if reform or waited >= s.last_call:
                    coming = self._still_coming(round, count, coming)
                    if not coming or waited >= s.last_call + s.lost_after:
                        break
            elif now - started > s.join_timeout:
                raise LaunchError(
                    f"only {1 + count} of at least {s.min_nodes} nodes (--nnodes "
                    f"{s.min_nodes}:{s.max_nodes}) joined the rendezvous at {self.addr}:"
                    f"{self.port} (--rdzv-id {self.job}) within join_timeout="
                    f"{s.join_timeout:g} s: start `tandem run` with the same --rdzv-endpoint "
                    "and --rdzv-id on the others, or give them longer (--rdzv-conf "
                    "join_timeout=SECONDS)"
                )
            time.sleep(_POLL_S)
        others = self._registered(round, count)[: s.max_nodes - 1]
        self.members = [self._me(), *others]
        self.round = round
        self.store.set(self._key(round, "members"), json.dumps(self.members))

    def _failed(self, round: int) -> bool:
        """Whether ``round`` ended in a failure (a worker's, or a lost node), not a membership
        change: every node records one there before it stops its workers."""
        return bool(self.store.check([self._key(round, "failed")]))

    def _still_coming(self, round: int, count: int, expected: list[str]) -> list[str]:
        """The ids of ``expected`` neither registered for ``round`` (``count`` arrivals) nor
        lost: a node of the previous round still stopping its workers beats on meanwhile, a
        dead one's beat goes stale within ``lost_after`` (the bound that tells them apart
        while the job runs, so a re-form does not judge a slow node sooner)."""
        came = {m["id"] for m in self._registered(round, count)}
        lost = set(self._lost_ids(expected))
        return [i for i in expected if i not in came and i not in lost]

    def _join(self, round: int | None) -> None:
        """Every other node: register for ``round`` (None: the one open now) until admitted."""
        s = self.settings
        deadline = time.monotonic() + s.join_timeout
        if round is None:  # first arrival: join the round forming, or wait for the next one
            round = int(self._wait_for(self._key("round"), deadline))
            running = self._members(round)
            if running is not None:
                self._refuse_if_full(round, running)
                round += 1
                _say(
                    f"round {round - 1} runs with {len(running)} node(s) of up to "
                    f"{s.max_nodes}: this node waits to join at its next restart"
                )
        while True:
            self._register(round)
            members = json.loads(self._wait_for(self._key(round, "members"), deadline))
            if self.id in [m["id"] for m in members]:
                self.members, self.round = members, round
                return
            self._refuse_if_full(round, members)
            round += 1  # registered after node 0 closed the round: wait for the next one

    def _members(self, round: int) -> list[dict[str, str]] | None:
        key = self._key(round, "members")
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _refuse_if_full(self, round: int, members: list[dict[str, str]]) -> None:
        if len(members) >= self.settings.max_nodes:
            raise LaunchError(
                f"the job at the rendezvous {self.addr}:{self.port} (--rdzv-id {self.job}) "
                f"already runs on {len(members)} nodes, its --nnodes maximum "
                f"{self.settings.max_nodes}: this node is not admitted (raise MAX in "
                "--nnodes MIN:MAX on every node to let more join)"
            )

    def _wait_for(self, key: str, deadline: float) -> str:
        """The value of ``key`` once node 0 writes it; the job's end and the deadline say so."""
        while not self.store.check([key]):
            if self.store.check([self._key("closed")]):
                raise JobEnded("the job ended before this node was admitted; nothing ran here")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"this node waited join_timeout={self.settings.join_timeout:g} s at the "
                    f"rendezvous {self.addr}:{self.port} (--rdzv-id {self.job}) without being "
                    "admitted: node 0 never formed a round with it (is the job at its "
                    "minimum node count still forming? --rdzv-conf join_timeout=SECONDS)"
                )
            time.sleep(_POLL_S)
        return self.store.get(key).decode()

    # ---- 3: running ----

    def _lost_ids(self, ids: list[str]) -> list[str]:
        counts = {i: int(self.store.add(self._key("beat", i), 0)) for i in ids}
        return self.beats.lost(counts)

    def remote_failure(self, round: int) -> Failure | None:
        """A failure another node recorded for ``round``, or a member that stopped beating."""
        if time.monotonic() - self.asked < _ASK_EVERY_S:
            return self.last_failure
        self.asked = time.monotonic()
        key = self._key(round, "failed")
        failure = read_failure(self.store, key)
        if failure is None:
            others = [m for m in self.members if m["id"] != self.id]
            lost = set(self._lost_ids([m["id"] for m in others]))
            for rank, member in enumerate(self.members):
                if member["id"] in lost:
                    cause = (
                        f"node {rank} ({member['host']}) was lost: its launcher sent no beat "
                        f"for {self.settings.lost_after:g} s (killed, or its host or network "
                        "is down)"
                    )
                    write_failure(self.store, key, Failure(-1, -1, member["host"], 1, (), cause))
                    failure = read_failure(self.store, key)  # the first recorded counts
                    break
        self.last_failure = failure
        return failure

    def report_failure(self, round: int, failure: Failure) -> None:
        """Record this node's worker failure for every node of ``round`` to see."""
        write_failure(self.store, self._key(round, "failed"), failure)

    def membership_change(self, round: int) -> Restart | None:
        """Restart healthy workers to admit waiting nodes: node 0 decides, everyone follows."""
        if time.monotonic() - self.asked_change < _ASK_EVERY_S:
            return None
        self.asked_change = time.monotonic()
        verdict = self._key(round, "verdict")
        waiting = 0
        if self.serving and len(self.members) < self.settings.max_nodes:
            waiting = int(self.store.add(self._key(round + 1, "arrivals"), 0))
            if waiting:
                # At most once, and not after a node finished its workers ("finish"): then the
                # job is ending, and a waiting node is told so instead.
                self.store.compare_set(verdict, "", "restart")
        if self.store.check([verdict]) and self.store.get(verdict) == b"restart":
            return self._admission(waiting)
        return None

    def _admission(self, waiting: int) -> Restart:
        return Restart(
            f"{waiting or 'a'} node(s) waiting to join: restarting the workers to admit them "
            f"(round {self.round + 1}; not counted against --max-restarts)"
        )

    # ---- 4: ending ----

    def finish(self, round: int) -> Failure | Restart | None:
        """This node's workers succeeded: wait for every member's, or a failure, or a loss."""
        verdict = self.store.compare_set(self._key(round, "verdict"), "", "finish")
        if verdict == b"restart":  # node 0 decided to admit a node just before we finished
            return self._admission(int(self.store.add(self._key(round + 1, "arrivals"), 0)))
        index = [m["id"] for m in self.members].index(self.id)
        self.store.set(self._key(round, "done", index), "1")
        done = [self._key(round, "done", i) for i in range(len(self.members))]
        while not self.store.check(done):
            failure = self.remote_failure(round)
            if failure is not None:
                return failure
            time.sleep(_POLL_S)
        self.store.set(self._key(round, "left", index), "1")
        if self.serving:
            # The store goes with node 0's launcher: keep it until every node has seen the end,
            # and tell a node still waiting to join that the job is over.
            self.store.set(self._key("closed"), "1")
            left = [self._key(round, "left", i) for i in range(1, len(self.members))]
            until = time.monotonic() + self.settings.lost_after + 5.0
            while not self.store.check(left) and time.monotonic() < until:
                time.sleep(_POLL_S)
            if int(self.store.add(self._key(round + 1, "arrivals"), 0)):
                time.sleep(2 * _POLL_S + self.settings.keep_alive_interval)
        return None


class _Restarting(Exception):
    """A node waiting to be admitted: a fall-back restarts the job at ``attempt``'s store."""

    def __init__(self, attempt: int) -> None:
        super().__init__(attempt)
        self.attempt = attempt


class JobEnded(LaunchError):
    """A node waiting to be admitted found the job finished: nothing to do, not a failure."""


def _ended(store: Any) -> str:
    """Why node 0 closed the job (its ``why`` key), or a plain line where it gave none."""
    key = launcher_key("why")
    if store.check([key]):
        return _text(store.get(key))
    return "the job ended before this node was admitted; nothing ran here"


def _say(message: str) -> None:
    print(f"tandem run: {message}", file=sys.stderr, flush=True)


class ElasticInMemoryCoordinator(InMemoryCoordinator):
    """``--recover in-memory`` with the c10d rendezvous (``--nnodes MIN:MAX``): the job forms
    once from the nodes that arrive, and a node that arrives later (a node that was down comes
    back) joins the *running* job in memory, with no restart of the others.

    The endpoint's host is node 0: it hosts the job's store, which the workers use too, as a
    fixed ``--nnodes N`` in-memory job's node 0 does (:class:`InMemoryCoordinator`). Each other
    launcher takes a place in the store (an atomic counter: 1, 2, ... in order of arrival,
    never given out twice), which is its node number for the job's life (its beat, its keys).

    1. Forming (node 0): at once when MAX nodes are there; else, once MIN are, after the last
       call (``last_call_timeout``) for more; ``join_timeout`` bounds the wait for MIN. The
       first nodes to arrive, up to MAX, form the job: node ``i``'s workers get launch ranks
       ``i * nproc_per_node + local_rank`` of ``nnodes * nproc_per_node``.
    2. Running: every launcher beats in the store; node 0 watches the job's nodes. A node whose
       beat stops for ``store_timeout`` (its launcher killed with its workers, its host down)
       is gone: its workers were already left out by the survivors in memory, and nothing
       restarts. If the nodes left are fewer than MIN (and no node waits to join), the job
       does not run on (as torchrun's MIN): with a restart left (``--max-restarts``) node 0
       stops every node's workers and the job restarts (step 4) once MIN nodes are there
       again, as torchrun's agents wait in a new rendezvous; with none left it ends on every
       node with a line that says so, and can be started again to resume from its last
       checkpoint.
    3. A node arriving after the job formed asks node 0 to be admitted. While fewer than MAX
       nodes run, node 0 admits it: its launcher takes launch ranks from the job's counter
       (:meth:`InMemoryCoordinator.launch_rank`, as a replacement's) and starts its workers as
       replacements are started (``TANDEM_RECOVER_JOIN``); the members admit them at a step
       boundary. This is growing back, not a restart: ``--max-restarts`` is not spent on it.
       Node 0 admits it only once every member said it admits newcomers (the ``admits`` key
       a replacement needs too); a member that said it cannot (no ``admits``, or not able to
       recover in memory) gets the node refused, with why. While MAX nodes run, it waits
       (and says so) until one is gone; if the job ends first, it is told so and ends with
       status 0, nothing having run there.

    4. A fall-back to ``restart`` (a loss the workers cannot recover in memory) stops every
       node's workers; the nodes meet (:meth:`InMemoryCoordinator.settle`) and node 0 restarts
       the job, while ``--max-restarts`` allows (counted for the job), at the nodes still
       there (:meth:`_decide`: every node of the job whose beat is not stale), renumbered
       0..n-1 in the job's order (node 0 first), each node learning its new number
       (:meth:`_follow`) and starting its workers at that size in a fresh store on the same
       port (:meth:`_fresh_store`), as a fixed ``--nnodes N`` restarts in one. A node waiting
       to be admitted asks again at the restart's store. Fewer than MIN there: the restart
       waits, up to ``join_timeout``, for nodes arriving at that store (a node started again,
       one waiting to be admitted) to make MIN, and forms with them as the first attempt does
       (:meth:`_gather`); none coming ends the job on every node, saying why. No restart left
       ends the job on every node, saying why.

    Example::

        settings = ElasticSettings(min_nodes=2, max_nodes=3, last_call=5.0)
        coordinator = ElasticInMemoryCoordinator(settings, "10.0.0.1", 29400, 10.0, 8)
        placement = coordinator.begin(0)   # this node's number, the nodes the job formed with
    """

    def __init__(
        self,
        settings: ElasticSettings,
        addr: str,
        port: int,
        heartbeat_timeout: float,
        nproc_per_node: int = 1,
        max_restarts: int = 0,
    ) -> None:
        super().__init__(
            addr,
            port,
            heartbeat_timeout,
            nnodes=settings.max_nodes,
            node_rank=0,
            join_timeout=settings.join_timeout,
        )
        self.settings, self.nproc_per_node = settings, nproc_per_node
        self.max_restarts = max_restarts  # a job below MIN waits for nodes only with one left
        self.serving = is_store_host(addr, settings.is_host)
        self._attempt = 0  # the job's attempt, which node 0's store serves (a restart's: +1)
        # A restart agreed in settle: this node's number in it, its node count, the attempt.
        self._next: tuple[int, int, int] | None = None
        self._generation = 1  # node 0: the next generation of the workers to look for
        self._members: list[int] | None = None  # ... and the latest one's members
        self._looked = 0.0  # when node 0 last looked at the job's nodes (monotonic)
        self._below: bool = False  # node 0 ended the job for fewer than MIN nodes

    @property
    def many(self) -> bool:
        return True  # even a job formed of one node may grow

    def nodes(self) -> list[int]:
        """The job's nodes: those it formed with, then each admitted later."""
        key = launcher_key("nodes")
        if self.store is None or not self.store.check([key]):
            return [self.node_rank]
        return [int(n) for n in json.loads(_text(self.store.get(key)))]

    def begin(self, attempt: int) -> Attempt:
        env = {
            AGENT_STORE_VARIABLE: "True",
            ROUND_VARIABLE: "0",
            RECOVER_VARIABLE: "in-memory",
            HEARTBEAT_VARIABLE: f"{self.heartbeat_timeout:g}",
        }
        if attempt:  # a fall-back's restart, at the nodes node 0 named (settle)
            if self._next is None:
                raise LaunchError("--nnodes MIN:MAX: a restart that node 0 did not agree to")
            self.node_rank, self.nnodes, self._attempt = self._next
            self._next, self.late = None, False
            self._generation, self._members, self._looked, self._below = 1, None, 0.0, False
            self._join(self._attempt)  # node 0: a fresh store (_fresh_store); the others meet
            if self.nnodes < self.settings.min_nodes:  # fewer than MIN left: wait for more
                self._gather() if self.node_rank == 0 else self._gathered()
        elif self.serving:
            self._form()
        else:
            self._arrive()
        return Attempt(self.addr, self.where[1], env, self.node_rank, self.nnodes, 0, True)

    def _form(self) -> None:
        """Node 0: host the store, wait for MIN nodes and the last call (or MAX), write the
        job's nodes."""
        s = self.settings
        addr, port = self.where
        self.store, _ = _host_store(addr, port)
        warn_without_secret(key_scope(), addr, port)
        self.store.set(launcher_key("attempt"), "0")
        self.store.set(node_key(0, "joined"), "1")

        def too_few(count: int) -> None:
            raise LaunchError(
                f"only {count} of at least {s.min_nodes} nodes (--nnodes "
                f"{s.min_nodes}:{s.max_nodes}) reached the job's store at {addr}:{port} "
                f"within join_timeout={s.join_timeout:g} s: start `tandem run` with the "
                "same --rdzv-endpoint on the others, or give them longer (--rdzv-conf "
                "join_timeout=SECONDS)"
            )

        self.nnodes = self._nodes_arrived(too_few)
        self._formed()

    def _nodes_arrived(self, too_few: Callable[[int], None]) -> int:
        """Node 0: wait until MIN nodes took a place in the store (node 0 and the arrivals),
        then for the last call (``last_call_timeout``) for more, or until MAX are there; their
        count, at most MAX. ``too_few(count)`` raises once ``join_timeout`` passed short of
        MIN."""
        s = self.settings
        started, quorum_at = time.monotonic(), None
        while True:
            count = 1 + int(self.store.add(launcher_key("arrivals"), 0))
            now = time.monotonic()
            if count >= s.min_nodes and quorum_at is None:
                quorum_at = now
            if count >= s.max_nodes or (quorum_at is not None and now - quorum_at >= s.last_call):
                return min(count, s.max_nodes)
            if quorum_at is None and now - started > s.join_timeout:
                too_few(count)
            time.sleep(_POLL_S)

    def _arrive(self) -> None:
        """Every other node: take a place; one of the job's first nodes, or one arriving
        later, which waits until node 0 admits it (:meth:`_admitted`). A node waiting while a
        fall-back restarts the job arrives again, at the restart's store."""
        attempt: int | None = None  # whichever attempt node 0's store serves
        while True:
            try:
                self._arrive_at(attempt)
                return
            except _Restarting as restart:
                attempt = restart.attempt
                _say(
                    "the job restarts from its last checkpoint (a fall-back): this node asks "
                    "again to join it"
                )

    def _arrive_at(self, attempt: int | None) -> None:
        s = self.settings
        self.store = self._connect(attempt)
        self._attempt = int(_text(self.store.get(launcher_key("attempt"))))
        self.node_rank = int(self.store.add(launcher_key("arrivals"), 1))
        self.store.set(node_key(self.node_rank, "joined"), "1")
        deadline = time.monotonic() + s.join_timeout
        self.nnodes = self._formed_size(
            deadline,
            JobEnded,
            f"node 0 at {self.addr}:{self.port} formed no job within join_timeout="
            f"{s.join_timeout:g} s (--nnodes {s.min_nodes}:{s.max_nodes}: fewer than MIN nodes "
            "came?)",
        )
        key = launcher_key("restarts")
        if self.store.check([key]):
            self.job_restarts = int(_text(self.store.get(key)))
        if self.node_rank >= self.nnodes:
            self.late = True
            self._admitted(deadline)

    def _admitted(self, deadline: float) -> None:
        """A node arriving after the job formed: ask node 0, beat, and wait until it admits
        this node; say so once if the job runs at MAX meanwhile. The job's end raises
        :class:`JobEnded`."""
        s = self.settings
        me = self.node_rank
        self.store.set(node_key(me, "asks"), "1")
        said = False
        while not self.store.check([node_key(me, "admitted")]):
            self.beat()
            refused = node_key(me, "refused")
            if self.store.check([refused]):
                self.store.set(node_key(me, "left"), "1")
                raise LaunchError(_text(self.store.get(refused)))
            restarting = launcher_key("restarting")
            if self.store.check([restarting]):  # a fall-back restarts the job: ask again there
                self.store.set(node_key(me, "left"), "1")
                raise _Restarting(int(_text(self.store.get(restarting))))
            end = self.ended()  # one asking for a restart is decided once the nodes meet
            if self.store.check([launcher_key("closed")]) or (end is not None and not end.restart):
                self.store.set(node_key(me, "left"), "1")
                raise JobEnded("the job ended before this node was admitted; nothing ran here")
            full = node_key(me, "full")
            if not said and self.store.check([full]):
                said = True
                _say(
                    f"the job at {self.addr}:{self.port} runs on {_text(self.store.get(full))} "
                    f"nodes, its --nnodes maximum {s.max_nodes}: this node waits until one of "
                    "them is gone, then joins (or ends when the job does)"
                )
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"this node waited join_timeout={s.join_timeout:g} s to be admitted into "
                    f"the job at {self.addr}:{self.port} (it runs on its --nnodes maximum "
                    f"{s.max_nodes}; --rdzv-conf join_timeout=SECONDS)"
                )
            time.sleep(_POLL_S)
        _say(
            f"the job runs already: this node (node {me}) joins it, its workers admitted by "
            "the others at their next step (--recover in-memory)"
        )

    def beat(self) -> None:
        super().beat()
        if self.serving and self.store is not None:
            now = time.monotonic()
            if now - self._looked >= _ASK_EVERY_S:
                self._looked = now
                self._look()

    def _look(self) -> None:
        """Node 0, while the job runs: admit the nodes asking while fewer than MAX run (the
        others are told to wait), and end the job if fewer than MIN are left."""
        s = self.settings
        store = self.store
        if store.check([launcher_key("closed")]) or self._below:
            return
        nodes = self.nodes()
        done = {n for n in nodes if store.check([node_key(n, "done")])}
        gone = [n for n in nodes if n != 0 and n not in done and self.silent(n)]
        running = [n for n in nodes if n not in gone]
        arrivals = int(store.add(launcher_key("arrivals"), 0))
        asking = [
            n
            for n in range(self.nnodes, arrivals + 1)
            if n not in nodes
            and store.check([node_key(n, "asks")])
            and not store.check([node_key(n, "left")])
        ]
        admits = self._admitting() if asking else None
        for node in asking:
            if isinstance(admits, str):
                store.set(node_key(node, "refused"), admits)
            elif done or not admits:  # the job ends (it is told so), or the workers start
                continue
            elif len(running) < s.max_nodes:
                nodes.append(node)
                running.append(node)
                store.set(launcher_key("nodes"), json.dumps(nodes))
                store.set(node_key(node, "admitted"), "1")
                _say(f"node {node} joins the running job ({len(running)} nodes now)")
            elif not store.check([node_key(node, "full")]):
                store.set(node_key(node, "full"), str(len(running)))
        if len(running) < s.min_nodes and not done:
            self._below = True
            lost = ", ".join(map(str, gone))
            why = (
                f"node(s) {lost} went silent (no `tandem run` beat for {self.store_timeout:g} "
                f"s: killed, host down, or cut off) and {len(running)} node(s) are left, fewer "
                f"than the --nnodes minimum {s.min_nodes}: every node's workers are stopped"
            )
            line = (
                f"node(s) {lost} lost; {len(running)} node(s) left, fewer than --nnodes MIN "
                f"{s.min_nodes}: every worker on every node stopped"
            )
            restart = self._attempt + 1 if self._attempt < self.max_restarts else 0
            if restart:
                why += (
                    f"; the job restarts from its last checkpoint (restart {restart} of "
                    f"{self.max_restarts}) once {s.min_nodes} nodes are there, waiting up to "
                    f"join_timeout={s.join_timeout:g} s for nodes to arrive"
                )
                line += f", restarted (restart {restart} of {self.max_restarts}) once "
                line += f"{s.min_nodes} were there again"
            else:
                why += (
                    " (the job does not run on fewer than MIN nodes, and no restart is left to "
                    f"wait for more: --max-restarts {self.max_restarts}; start it again to resume "
                    "from its last checkpoint)"
                )
            self.end_job(JobEnd(why, line, restart, node=0))

    def _admitting(self) -> bool | str:
        """Node 0: whether the job's members admit newcomers: True once every one said it
        does (:func:`admits_key`: ``tandem.recovery.Run``, the Trainer), False while some have
        not said yet whether they recover in memory, or why not (a member said it recovers
        in memory but admits no newcomer: a node arriving can never join)."""
        while True:  # the latest generation the workers decided
            decided = self.members(self._generation)
            if decided is None:
                break
            self._members, self._generation = decided, self._generation + 1
        latest = self._members or list(range(self.nnodes * self.nproc_per_node))
        members = [r for r in latest if r not in self.dead(latest)]
        said = self.able(members)
        if any(value is None for value in said.values()):
            return False
        if self.admits(members):
            return True
        why = unable(said)
        return (
            f"the job at {self.addr}:{self.port} cannot take this node: its workers (ranks "
            f"{', '.join(map(str, members))}) admit no newcomer ("
            + (why_unable(why) if why else "they recover in memory but hand no newcomer the state")
            + "; tandem.Trainer and tandem.recovery.Run do)"
        )

    def _decide(self, end: JobEnd | None, gone: list[int]) -> dict[str, Any]:
        """Node 0: a fall-back that asks for a restart restarts the job at the nodes still
        there (every node of the job but the silent ones, ``gone``), renumbered in the job's
        order (node 0 first), while they are at least MIN."""
        if end is None or not end.restart:
            return {"restart": 0, "why": ""}
        # Fewer than MIN there: the restart waits for nodes to arrive (_gather).
        there = [n for n in self.nodes() if n not in gone]
        return {"restart": end.restart, "why": "", "nodes": there, "attempt": self._attempt + 1}

    def _follow(self, said: Mapping[str, Any]) -> tuple[int, str]:
        restart, why = int(said["restart"]), str(said["why"])
        if restart:
            there = [int(n) for n in said["nodes"]]
            if self.node_rank not in there:  # node 0 found this node silent: it goes on without
                return 0, (
                    f"node 0 restarts the job without this node (node {self.node_rank}), which "
                    f"it found silent (no beat for {self.store_timeout:g} s)"
                )
            if len(there) < self.nnodes or there.index(self.node_rank) != self.node_rank:
                _say(
                    f"the job restarts with {len(there)} node(s) of the {self.nnodes} it had: "
                    f"this node (node {self.node_rank}) is node {there.index(self.node_rank)} "
                    "there"
                )
            self._next = (there.index(self.node_rank), len(there), int(said["attempt"]))
        return restart, why

    def _fresh_store(self) -> None:
        """Node 0, in a restart's store: the job's nodes (renumbered), its size, the arrivals'
        counter past them (a node arriving later is numbered after them), its restarts. Fewer
        than MIN nodes: the nodes and the size only once more have arrived (:meth:`_gather`);
        a node arriving meanwhile is one of the restart's, not a late one."""
        assert self._next is None and self.store is not None
        self.store.add(launcher_key("arrivals"), self.nnodes - 1)
        self.store.set(launcher_key("restarts"), str(self._attempt))
        if self.nnodes >= self.settings.min_nodes:
            self._formed()

    def _formed(self) -> None:
        self.store.set(launcher_key("nodes"), json.dumps(list(range(self.nnodes))))
        self.store.set(launcher_key("formed"), str(self.nnodes))

    def _gather(self) -> None:
        """Node 0, in a restart's store with fewer than MIN nodes: wait up to ``join_timeout``
        for nodes to arrive (a node started again, one that was waiting to be admitted) until
        MIN are there, then for the last call (or MAX), as the first attempt forms
        (:meth:`_form`); the restart's size. None coming ends the job on every node (the
        ``closed`` key, with why) and raises :class:`LaunchError`."""
        s = self.settings
        _say(
            f"the job restarts once {s.min_nodes} nodes are there (--nnodes {s.min_nodes}:"
            f"{s.max_nodes}; {self.nnodes} now): waiting up to join_timeout={s.join_timeout:g} "
            "s for nodes to arrive (start `tandem run` again where a node was lost)"
        )

        def too_few(count: int) -> None:
            why = (
                f"only {count} of at least {s.min_nodes} nodes (--nnodes "
                f"{s.min_nodes}:{s.max_nodes}) were there to restart the job within "
                f"join_timeout={s.join_timeout:g} s: the job ends (start it again to resume "
                "from its last checkpoint; --rdzv-conf join_timeout=SECONDS waits longer)"
            )
            self.store.set(launcher_key("why"), why)
            self.store.set(launcher_key("closed"), "1")
            raise LaunchError(why)

        self.nnodes = self._nodes_arrived(too_few)
        self._formed()

    def _gathered(self) -> None:
        """Every other node of a restart with fewer than MIN nodes: its size, once node 0 has
        gathered them (:meth:`_gather`); the job's end, if none came, raises
        :class:`LaunchError` with node 0's why."""
        deadline = time.monotonic() + self.settings.join_timeout + self.store_timeout
        self.nnodes = self._formed_size(
            deadline,
            LaunchError,
            f"node 0 at {self.addr}:{self.port} did not restart the job within "
            f"join_timeout={self.settings.join_timeout:g} s",
            beating=True,
        )

    def _formed_size(
        self,
        deadline: float,
        ended: type[LaunchError],
        late: str,
        beating: bool = False,
    ) -> int:
        """The size node 0 wrote once the attempt formed (``formed``). Its ``closed`` key
        raises ``ended`` with node 0's why; ``deadline`` passed raises :class:`LaunchError`
        saying ``late``. ``beating``: this node beats meanwhile (it is one of the job's)."""
        formed = launcher_key("formed")
        while not self.store.check([formed]):
            if self.store.check([launcher_key("closed")]):
                raise ended(_ended(self.store))
            if time.monotonic() > deadline:
                raise LaunchError(late)
            if beating:
                self.beat()
            time.sleep(_POLL_S)
        return int(_text(self.store.get(formed)))

    def _told_the_end(self, restart: int) -> list[int]:
        if restart:  # the nodes waiting to join ask again at the restart's store
            self.store.set(launcher_key("restarting"), str(self._attempt + 1))
        else:
            self.store.set(launcher_key("closed"), "1")
        nodes = set(self.nodes())
        arrivals = int(self.store.add(launcher_key("arrivals"), 0))
        return [
            n
            for n in range(self.nnodes, arrivals + 1)
            if n not in nodes and self.store.check([node_key(n, "asks")])
        ]
