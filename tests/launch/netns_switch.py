"""N "nodes" on one machine behind one switch, whose links can be cut and which can be split.

Each node is a Linux network namespace (as in :mod:`tests.launch.netns`) joined by a veth pair
to a bridge in a namespace of its own (the switch), so every node reaches every other over the
switch. :meth:`Switch.cut` takes a node's link down at the switch (its cable pulled: the node
keeps its address, its packets are dropped, its peers see silence, not a reset);
:meth:`Switch.split` moves some nodes' links to a second bridge: two sides that each still reach
their own nodes but not the other side (a partition). Needs root, iproute2 and the bridge
driver; :func:`can_make_switch` says whether this machine allows it, and why not.

Example::

    ok, reason = can_make_switch()
    if not ok:
        pytest.skip(reason)
    with switch(3) as net:
        subprocess.Popen(net.nodes[2].exec(["python", "-c", "..."]))
        net.cut(2)
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.launch.netns import Node, _checked_ip, _ip, address_and_up, can_make_namespaces

SUBNET_PREFIX = "10.78.0."  # not netns.py's: a test may use both kinds at once
PREFIX_LENGTH = 24
_serial = itertools.count()


@dataclass(frozen=True)
class Switch:
    """The nodes (node i at ``10.78.0.<i+1>``), the switch's namespace and its port per node."""

    nodes: tuple[Node, ...]
    namespace: str
    ports: tuple[str, ...]

    def cut(self, node: int) -> None:
        """Take ``node``'s link down at the switch."""
        _checked_ip("-n", self.namespace, "link", "set", self.ports[node], "down")

    def split(self, side: Iterable[int]) -> None:
        """Move the links of ``side`` to the second bridge: they reach each other, not the
        rest."""
        for node in side:
            _checked_ip("-n", self.namespace, "link", "set", self.ports[node], "master", "br1")


def can_make_switch() -> tuple[bool, str]:
    """Whether :func:`switch` can work here, and if not the reason, for a skip message."""
    ok, reason = can_make_namespaces()
    if not ok:
        return ok, reason
    try:
        with switch(2):
            pass
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return False, f"cannot make a bridge between network namespaces here: {error}"
    return True, ""


@contextmanager
def switch(n: int) -> Iterator[Switch]:
    """``n`` fresh namespaces on one fresh switch, all removed on exit whatever happened.

    Processes started in a namespace keep it alive after its name is removed: stop them first.
    """
    tag = f"{os.getpid()}{next(_serial)}"
    hub = f"tandem-switch-{tag}"
    nodes = tuple(
        # Interface names are limited to 15 bytes: "ts" + pid and serial + "n" + node.
        Node(f"tandem-sw-{tag}-{i}", f"ts{tag}n{i}", f"{SUBNET_PREFIX}{i + 1}")
        for i in range(n)
    )
    ports = tuple(f"ts{tag}p{i}" for i in range(n))
    made: list[str] = []
    try:
        _checked_ip("netns", "add", hub)
        made.append(hub)
        for bridge in ("br0", "br1"):
            _checked_ip("-n", hub, "link", "add", bridge, "type", "bridge")
            _checked_ip("-n", hub, "link", "set", bridge, "up")
        for node, port in zip(nodes, ports, strict=True):
            _checked_ip("netns", "add", node.namespace)
            made.append(node.namespace)
            _checked_ip("link", "add", node.interface, "type", "veth", "peer", "name", port)
            _checked_ip("link", "set", node.interface, "netns", node.namespace)
            _checked_ip("link", "set", port, "netns", hub)
            _checked_ip("-n", hub, "link", "set", port, "master", "br0")
            _checked_ip("-n", hub, "link", "set", port, "up")
            address_and_up(node)
        yield Switch(nodes, hub, ports)
    finally:
        # A veth end still in the host namespace (set-up failed half-way) would outlive the
        # namespaces; the ends inside them go with them. Errors here mean "already gone".
        for node, port in zip(nodes, ports, strict=True):
            _ip("link", "del", node.interface)
            _ip("link", "del", port)
        for namespace in made:
            _ip("netns", "del", namespace)
