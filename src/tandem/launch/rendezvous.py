"""Where the workers of an attempt meet: a free local port, or node 0's TCPStore for many nodes.

A coordinator answers four questions per attempt: which address and port the workers'
rendezvous uses (and this node's place, an :class:`Attempt`), whether another node's worker
has failed, whether the membership changes (a node waits to join), and whether every node is
done. One node needs no network service at all (and no torch in the launcher); many nodes meet
at node 0 through torch's TCPStore, with keys named by attempt so a restart never reads what
the failed attempt left behind. Elastic node counts (c10d, ``--nnodes MIN:MAX``) are
:mod:`tandem.launch.membership`'s.

Example::

    coordinator = LocalCoordinator("127.0.0.1", port=None)
    attempt = coordinator.begin(attempt=0)   # attempt.addr, attempt.port, ...
"""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from tandem.job.secret import SECRET_VARIABLE, key_scope
from tandem.launch.failures import Failure

#: The rendezvous round the workers' store keys live under (``tandem.init`` reads it before
#: ``TORCHELASTIC_RESTART_COUNT``): every node agrees on it, while torch's restart count only
#: counts this node's failure restarts (a node admitted later starts it at 0).
ROUND_VARIABLE = "TANDEM_RDZV_ROUND"


class LaunchError(RuntimeError):
    """The launch cannot go on: a port in use, a node that never joined, an unreachable store."""


@dataclass(frozen=True)
class Attempt:
    """One attempt's world, as the rendezvous formed it: where the workers meet, this node's
    rank among ``nnodes`` (fixed, or this round's under ``--nnodes MIN:MAX``), and the
    rendezvous ``round`` every node of the attempt agrees on."""

    addr: str
    port: int
    env: dict[str, str]
    node_rank: int
    nnodes: int
    round: int
    elastic: bool = False  # the node count may change from one attempt to the next


@dataclass(frozen=True)
class Restart:
    """Healthy workers must restart anyway: the membership changes (a node waits to join)."""

    reason: str


class Coordinator(Protocol):
    """What the supervisor needs from the rendezvous, per attempt (``round``: its Attempt's)."""

    def begin(self, attempt: int) -> Attempt: ...

    def remote_failure(self, round: int) -> Failure | None: ...

    def report_failure(self, round: int, failure: Failure) -> None: ...

    def membership_change(self, round: int) -> Restart | None: ...

    def finish(self, round: int) -> Failure | Restart | None: ...

    def close(self) -> None: ...


def is_store_host(addr: str, is_host: bool | None) -> bool:
    """Whether this machine is ``addr``: the c10d store's host (``is_host`` overrides)."""
    if is_host is not None:
        return is_host
    try:
        # torch's own test (hostname, FQDN, every address of this machine), so that tandem and
        # torchrun pick the same host for the same endpoint.
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:  # pragma: no cover - a torch without elastic
        return addr in ("localhost", "127.0.0.1", "::1", socket.gethostname())
    return bool(_matches_machine_hostname(addr))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel reports free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise LaunchError naming ``port`` if something already listens there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise LaunchError(
                f"--master-port {port} is already in use on {host} ({exc.strerror}): another "
                "job, or a previous run still shutting down. Pick another port, or leave "
                "--master-port out and tandem run picks a free one."
            ) from exc


class LocalCoordinator:
    """One node: a fresh free loopback port per attempt (or the one given, checked)."""

    def __init__(self, addr: str, port: int | None) -> None:
        self.addr = addr
        self.port = port

    def begin(self, attempt: int) -> Attempt:
        if self.port is not None:
            check_port_free(self.addr, self.port)
            return Attempt(self.addr, self.port, {}, 0, 1, attempt)
        # A new port each attempt: a restarted rank 0 never races the dying one for its port.
        return Attempt(self.addr, free_port(self.addr), {}, 0, 1, attempt)

    def remote_failure(self, round: int) -> Failure | None:
        return None

    def report_failure(self, round: int, failure: Failure) -> None:
        return None

    def membership_change(self, round: int) -> Restart | None:
        return None

    def finish(self, round: int) -> Failure | Restart | None:
        return None

    def close(self) -> None:
        return None


def open_store(
    addr: str, port: int, timeout: float, hosting: bool, strict: bool, who: str
) -> tuple[Any, bool]:
    """The job's TCPStore at ``addr:port`` and whether this process serves it.

    ``hosting``: this node should serve it; ``strict``: that was said (``--node-rank 0``,
    ``is_host``), so failing to listen is an error rather than a reason to join as a client.
    """
    from datetime import timedelta

    # torch only here: a one-node launch never imports it and starts in a fraction of a second.
    from torch.distributed import TCPStore

    delta = timedelta(seconds=timeout)
    if hosting:
        try:
            check_port_free("0.0.0.0", port)
            return TCPStore(addr, port, None, True, delta, wait_for_workers=False), True
        except (LaunchError, RuntimeError):
            # As torch's c10d: a host found by its address that cannot listen (another
            # launcher on this machine is the host) joins as a client instead.
            if strict:
                raise
    try:
        return TCPStore(addr, port, None, False, delta), False
    except RuntimeError as exc:
        raise LaunchError(
            f"{who} could not reach node 0's rendezvous at {addr}:{port} within "
            f"{timeout:.0f} s: is node 0's `tandem run` started, with --master-addr "
            f"{addr} --master-port {port} (or --rdzv-endpoint {addr}:{port}), and is that "
            f"port reachable from this host? (A c10d store's host is the node whose "
            f"address the endpoint is; where the check misses it, give that node "
            f"--rdzv-conf is_host=1.) ({exc})"
        ) from exc


def warn_without_secret(scope: str, addr: str, port: int) -> None:
    """Node 0's warning that its store takes keys from anyone, unless the job has a secret."""
    if not scope:
        print(
            f"tandem run: warning: the job's store at {addr}:{port} takes keys from any "
            f"host that reaches it; export the same {SECRET_VARIABLE} (e.g. from `openssl "
            "rand -hex 16`) on every node to keep other programs out",
            file=sys.stderr,
            flush=True,
        )


class StoreCoordinator:
    """A fixed number of nodes with given ranks (static rendezvous): node 0 hosts a TCPStore at
    MASTER_ADDR:MASTER_PORT, the others connect. (``--rdzv-backend c10d`` is
    :class:`tandem.launch.membership.ElasticCoordinator`.)

    Workers use the same store for their own rendezvous (torch's "agent store", under a prefix
    per attempt), so node 0's launcher must outlive every node's workers: it waits in finish().
    """

    def __init__(self, nnodes: int, node_rank: int, addr: str, port: int, timeout: float) -> None:
        self.nnodes, self.node_rank, self.addr, self.port = nnodes, node_rank, addr, port
        self.timeout = timeout
        self.scope = key_scope()
        self.host = socket.gethostname()
        self.store, _ = open_store(
            addr, port, timeout, node_rank == 0, strict=True, who=f"node {node_rank}"
        )
        if node_rank == 0:
            warn_without_secret(self.scope, addr, port)

    def _key(self, attempt: int, name: str) -> str:
        return f"tandem/{self.scope}attempt_{attempt}/{name}"

    def begin(self, attempt: int) -> Attempt:
        self.store.set(self._key(attempt, f"node_{self.node_rank}"), self.host)
        deadline = time.monotonic() + self.timeout
        while True:
            missing = [
                i
                for i in range(self.nnodes)
                if not self.store.check([self._key(attempt, f"node_{i}")])
            ]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"node rank(s) {missing} of --nnodes {self.nnodes} never joined the "
                    f"rendezvous at {self.addr}:{self.port} within {self.timeout:.0f} s: start "
                    f"`tandem run --nnodes {self.nnodes} --node-rank N --master-addr "
                    f"{self.addr} --master-port {self.port} ...` on each of them"
                )
            time.sleep(0.05)
        # The workers' own rendezvous is this store, under a prefix per restart count.
        env = {"TORCHELASTIC_USE_AGENT_STORE": "True", ROUND_VARIABLE: str(attempt)}
        return Attempt(self.addr, self.port, env, self.node_rank, self.nnodes, attempt)

    def remote_failure(self, round: int) -> Failure | None:
        return read_failure(self.store, self._key(round, "failed"))

    def report_failure(self, round: int, failure: Failure) -> None:
        write_failure(self.store, self._key(round, "failed"), failure)

    def membership_change(self, round: int) -> Restart | None:
        return None

    def finish(self, round: int) -> Failure | Restart | None:
        # Every node waits for every other: a node whose peers fail after it finished must take
        # part in the restart, and node 0 must keep hosting the store until all are done.
        self.store.set(self._key(round, f"done_{self.node_rank}"), "1")
        deadline = time.monotonic() + self.timeout
        keys = [self._key(round, f"done_{i}") for i in range(self.nnodes)]
        while not all(self.store.check([k]) for k in keys):
            failure = self.remote_failure(round)
            if failure is not None:
                return failure
            if time.monotonic() > deadline:
                late = [i for i, k in enumerate(keys) if not self.store.check([k])]
                raise LaunchError(
                    f"node rank(s) {late} did not finish within {self.timeout:.0f} s of node "
                    f"{self.node_rank}"
                )
            time.sleep(0.05)
        # Node 0 hosts the store: it leaves last, once every other node has seen the outcome.
        self.store.set(self._key(round, f"left_{self.node_rank}"), "1")
        if self.node_rank == 0:
            left = [self._key(round, f"left_{i}") for i in range(1, self.nnodes)]
            while not all(self.store.check([k]) for k in left) and time.monotonic() < deadline:
                time.sleep(0.05)
        return None

    def close(self) -> None:
        return None


def read_failure(store: Any, key: str) -> Failure | None:
    """The failure another node wrote under ``key``, or None."""
    if not store.check([key]):
        return None
    fields = json.loads(store.get(key))
    fields["tail"] = tuple(fields["tail"])
    return Failure(**fields)


def write_failure(store: Any, key: str, failure: Failure) -> None:
    """Record ``failure`` under ``key`` unless one is there already (the first one counts)."""
    if not store.check([key]):
        store.set(key, json.dumps(asdict(failure)))
