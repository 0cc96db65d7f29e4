"""Two "nodes" on one machine: two Linux network namespaces joined by a veth pair.

Each namespace has its own interfaces, addresses and port space, so processes started in it with
``ip netns exec`` see a machine of their own, reachable from the other only over the veth link:
a launcher that connected to the wrong address, or bound to loopback, fails here as it would
across two real hosts. Needs root and iproute2 (``apt-get install -y iproute2``);
:func:`can_make_namespaces` says whether this machine allows it, and why not.

Example::

    ok, reason = can_make_namespaces()
    if not ok:
        pytest.skip(reason)
    with two_nodes() as (node0, node1):
        subprocess.run(node1.exec(["python", "-c", "..."]), check=True)
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# A private subnet: inside the namespaces it meets nothing of the host's, so it cannot collide
# with the machine's own networks, nor with another test run's namespaces (each run has its own).
SUBNET_PREFIX = "10.77.0."
PREFIX_LENGTH = 24

# Names carry the pid and a counter, so concurrent test runs and repeated calls never share one.
_serial = itertools.count()


@dataclass(frozen=True)
class Node:
    """One namespace and its end of the veth pair.

    Attributes:
        namespace: the ``ip netns`` name.
        interface: the veth end inside it (what ``GLOO_SOCKET_IFNAME`` should name).
        address: its IPv4 address, without the prefix length.
    """

    namespace: str
    interface: str
    address: str

    def exec(self, argv: list[str]) -> list[str]:
        """``argv`` as a command line that runs inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def address_and_up(node: Node) -> None:
    """Give ``node``'s interface (already in its namespace) its address, and bring it and the
    namespace's loopback up."""
    _checked_ip(
        "-n", node.namespace, "addr", "add",
        f"{node.address}/{PREFIX_LENGTH}", "dev", node.interface,
    )  # fmt: skip
    _checked_ip("-n", node.namespace, "link", "set", "lo", "up")
    _checked_ip("-n", node.namespace, "link", "set", node.interface, "up")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def _checked_ip(*args: str) -> None:
    done = _ip(*args)
    if done.returncode != 0:
        raise RuntimeError(
            f"`ip {' '.join(args)}` exited {done.returncode}: {done.stderr.strip() or done.stdout}"
        )


def can_make_namespaces() -> tuple[bool, str]:
    """Whether :func:`two_nodes` can work here, and if not the reason, for a skip message.

    Probes by making (and removing) a real namespace pair: being root is not enough inside a
    container without CAP_SYS_ADMIN, or without the veth driver.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces are Linux-only (platform {sys.platform})"
    if os.geteuid() != 0:
        return False, f"network namespaces need root (euid {os.geteuid()})"
    if shutil.which("ip") is None:
        return False, "`ip` not found: install iproute2 (apt-get install -y iproute2)"
    try:
        with two_nodes():
            pass
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return False, f"cannot make network namespaces here: {error}"
    return True, ""


@contextmanager
def two_nodes() -> Iterator[tuple[Node, Node]]:
    """Two fresh namespaces joined by a veth pair, removed on exit whatever happened.

    Node 0 is ``10.77.0.1``, node 1 ``10.77.0.2``, on one /24: each reaches every TCP port of
    the other. Loopback is up in both, since a process often talks to its own node's address
    (a launcher to the store it hosts, Gloo between two ranks of one node).

    Processes started in a namespace keep it alive after its name is removed: stop them first.
    """
    tag = f"{os.getpid()}-{next(_serial)}"
    nodes = tuple(
        # Interface names are limited to 15 bytes: "tdv" + pid (at most 7 digits) + serial.
        Node(f"tandem-test-{tag}-{i}", f"tdv{tag.replace('-', '')}{'ab'[i]}", address)
        for i, address in enumerate((f"{SUBNET_PREFIX}1", f"{SUBNET_PREFIX}2"))
    )
    made: list[str] = []
    try:
        for node in nodes:
            _checked_ip("netns", "add", node.namespace)
            made.append(node.namespace)
        a, b = nodes
        _checked_ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
        for node in nodes:
            _checked_ip("link", "set", node.interface, "netns", node.namespace)
            address_and_up(node)
        yield nodes
    finally:
        # A veth end still in the host namespace (setup failed half-way) would outlive the
        # namespaces; the ends inside them go with them. Errors here mean "already gone".
        for node in nodes:
            _ip("link", "del", node.interface)
        for namespace in made:
            _ip("netns", "del", namespace)
