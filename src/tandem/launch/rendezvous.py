"""Where the workers of an attempt meet: a free local port, or node 0's TCPStore for many nodes.

A coordinator answers three questions per attempt: which address and port the workers'
rendezvous uses, whether another node's worker has failed, and whether every node is done.
One node needs no network service at all (and no torch in the launcher); many nodes meet at
node 0 through torch's TCPStore, with keys named by attempt so a restart never reads what the
failed attempt left behind.

Example::

    coordinator = LocalCoordinator("127.0.0.1", port=None)
    addr, port, env = coordinator.begin(attempt=0)
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, Protocol

from tandem.launch.failures import Failure

#: A secret every node of a job shares (``tandem slurm`` makes one per job): the store keys of
#: the launchers and of ``tandem.init`` live under a name derived from it, so a client without it
#: can neither read them nor forge one (a "failed" key that would stop the job).
SECRET_VARIABLE = "TANDEM_JOB_SECRET"


def key_scope(environ: Mapping[str, str] = os.environ) -> str:
    """The store-key prefix the job's secret gives (``""`` without one); never the secret itself.

    Example::

        >>> key_scope({"TANDEM_JOB_SECRET": "s3cret"})
        'job-1ec1c26b50d5d3c58d9583181af80766/'
        >>> key_scope({})
        ''
    """
    secret = environ.get(SECRET_VARIABLE)
    if not secret:
        return ""
    return f"job-{hashlib.sha256(secret.encode()).hexdigest()[:32]}/"


class LaunchError(RuntimeError):
    """The launch cannot go on: a port in use, a node that never joined, an unreachable store."""


class Coordinator(Protocol):
    """What the supervisor needs from the rendezvous, per attempt."""

    def begin(self, attempt: int) -> tuple[str, int, dict[str, str]]: ...

    def remote_failure(self, attempt: int) -> Failure | None: ...

    def report_failure(self, attempt: int, failure: Failure) -> None: ...

    def finish(self, attempt: int) -> Failure | None: ...


def _is_host(addr: str, is_host: bool | None) -> bool:
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

    def begin(self, attempt: int) -> tuple[str, int, dict[str, str]]:
        if self.port is not None:
            check_port_free(self.addr, self.port)
            return self.addr, self.port, {}
        # A new port each attempt: a restarted rank 0 never races the dying one for its port.
        return self.addr, free_port(self.addr), {}

    def remote_failure(self, attempt: int) -> Failure | None:
        return None

    def report_failure(self, attempt: int, failure: Failure) -> None:
        return None

    def finish(self, attempt: int) -> Failure | None:
        return None


class StoreCoordinator:
    """Many nodes: node 0 hosts a TCPStore at MASTER_ADDR:MASTER_PORT, the others connect.

    Workers use the same store for their own rendezvous (torch's "agent store", under a prefix
    per attempt), so node 0's launcher must outlive every node's workers: it waits in finish().

    ``node_rank=None`` is torchrun's c10d rendezvous (``--rdzv-endpoint``, no ``--node-rank``):
    the node whose address is the endpoint's (torch's own test, or ``is_host`` from
    ``--rdzv-conf``) hosts the store and is node 0; the others are numbered 1, 2, ... in the
    order they reach it (an atomic counter in the store). torch numbers c10d nodes by their
    sorted descriptors instead, so there the store's host need not be node 0; both give each
    node a distinct rank, which is all a torchrun script may rely on. A node arriving when
    ``nnodes`` are there already is refused with an error (no elastic admission yet).
    """

    def __init__(
        self,
        nnodes: int,
        node_rank: int | None,
        addr: str,
        port: int,
        timeout: float,
        is_host: bool | None = None,
        job: str = "none",
    ) -> None:
        from datetime import timedelta

        # torch only here: a one-node launch never imports it and starts in a fraction of a second.
        from torch.distributed import TCPStore

        self.nnodes, self.addr, self.port = nnodes, addr, port
        self.timeout = timeout
        self.scope = key_scope()
        self.host = socket.gethostname()
        delta = timedelta(seconds=timeout)
        hosting = node_rank == 0 if node_rank is not None else _is_host(addr, is_host)
        self.store: Any = None
        serving = False
        if hosting:
            try:
                check_port_free("0.0.0.0", port)
                self.store = TCPStore(addr, port, None, True, delta, wait_for_workers=False)
                serving = True
            except (LaunchError, RuntimeError):
                # As torch's c10d: a host found by its address that cannot listen (another
                # launcher on this machine is the host) joins as a client instead.
                if node_rank is not None or is_host is not None:
                    raise
        if self.store is None:
            self.store = self._connect(TCPStore, addr, port, delta, node_rank)
        if node_rank is None:
            # The host is node 0 (it listens before anyone can arrive); the others count their
            # arrival on the store's atomic counter (1, 2, ...): no two get the same rank.
            node_rank = 0 if serving else self.store.add(f"tandem/{self.scope}{job}/arrivals", 1)
            if node_rank >= nnodes:
                raise LaunchError(
                    f"this node arrived as node {node_rank} at the rendezvous {addr}:{port} "
                    f"(--rdzv-id {job}), but the job has --nnodes {nnodes}: the job is full "
                    "(a later node is not admitted until elastic membership lands)"
                )
        self.node_rank = node_rank
        if not self.scope and node_rank == 0:
            print(
                f"tandem run: warning: the job's store at {addr}:{port} takes keys from any "
                f"host that reaches it; export the same {SECRET_VARIABLE} (e.g. from `openssl "
                "rand -hex 16`) on every node to keep other programs out",
                file=sys.stderr,
                flush=True,
            )

    def _connect(
        self, store_type: type, addr: str, port: int, delta: object, node_rank: int | None
    ) -> Any:
        who = f"node {node_rank}" if node_rank is not None else "this node"
        try:
            return store_type(addr, port, None, False, delta)
        except RuntimeError as exc:
            raise LaunchError(
                f"{who} could not reach node 0's rendezvous at {addr}:{port} within "
                f"{self.timeout:.0f} s: is node 0's `tandem run` started, with --master-addr "
                f"{addr} --master-port {port} (or --rdzv-endpoint {addr}:{port}), and is that "
                f"port reachable from this host? (A c10d store's host is the node whose "
                f"address the endpoint is; where the check misses it, give that node "
                f"--rdzv-conf is_host=1.) ({exc})"
            ) from exc

    def _key(self, attempt: int, name: str) -> str:
        return f"tandem/{self.scope}attempt_{attempt}/{name}"

    def begin(self, attempt: int) -> tuple[str, int, dict[str, str]]:
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
        return self.addr, self.port, {"TORCHELASTIC_USE_AGENT_STORE": "True"}

    def remote_failure(self, attempt: int) -> Failure | None:
        key = self._key(attempt, "failed")
        if not self.store.check([key]):
            return None
        fields = json.loads(self.store.get(key))
        fields["tail"] = tuple(fields["tail"])
        return Failure(**fields)

    def report_failure(self, attempt: int, failure: Failure) -> None:
        key = self._key(attempt, "failed")
        if not self.store.check([key]):
            self.store.set(key, json.dumps(asdict(failure)))

    def finish(self, attempt: int) -> Failure | None:
        # Every node waits for every other: a node whose peers fail after it finished must take
        # part in the restart, and node 0 must keep hosting the store until all are done.
        self.store.set(self._key(attempt, f"done_{self.node_rank}"), "1")
        deadline = time.monotonic() + self.timeout
        keys = [self._key(attempt, f"done_{i}") for i in range(self.nnodes)]
        while not all(self.store.check([k]) for k in keys):
            failure = self.remote_failure(attempt)
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
        self.store.set(self._key(attempt, f"left_{self.node_rank}"), "1")
        if self.node_rank == 0:
            left = [self._key(attempt, f"left_{i}") for i in range(1, self.nnodes)]
            while not all(self.store.check([k]) for k in left) and time.monotonic() < deadline:
                time.sleep(0.05)
        return None
