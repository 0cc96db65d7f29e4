"""A real OpenSSH server on each network-namespace "node" (:mod:`tests.launch.netns`), for the
``tandem run --hostfile`` tests: key-based root login only, every key made in a test directory.

Each node's ``sshd -D`` listens on port 22 of the node's address with a host key of its own;
the client side is an ssh config file (``ssh -F``) naming the client key and a known_hosts file
with both host keys, so ``StrictHostKeyChecking yes`` holds and nothing of the machine's own
``~/.ssh`` is read or written. ``SetEnv`` gives every session what the node's own shell would
have on a real cluster: the interface Gloo should use (the namespaces share the machine's
hostname, which resolves to an address the other node cannot reach).

Example::

    with two_nodes() as nodes, ssh_servers(nodes, tmp_path) as servers:
        env = {**os.environ, "TANDEM_SSH": f"ssh -F {servers.config}"}
        ...
        assert not leftovers(nodes, keep=servers.pids)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.launch.netns import Node

SSHD = "/usr/sbin/sshd"  # sshd re-executes itself, so it must be started by its absolute path
START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Servers:
    """The running servers: the client's ssh config (``ssh -F``), the daemons' pids (``ip
    netns exec`` execs sshd, so the pid it started is the daemon's)."""

    config: Path
    pids: set[int]


def sshd_missing() -> str | None:
    """Why sshd cannot run here (for a skip message), or None."""
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
        return f"{SSHD} or ssh-keygen not found: apt-get install -y openssh-server"
    return None


def _keygen(path: Path) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
        check=True,
        timeout=30,
    )
    return Path(f"{path}.pub").read_text().strip()


def _sshd_config(node: Node, directory: Path, authorized: Path) -> Path:
    config = directory / f"sshd_config-{node.address}"
    config.write_text(
        f"ListenAddress {node.address}:22\n"
        f"HostKey {directory / f'host-{node.address}'}\n"
        f"PidFile {directory / f'sshd-{node.address}.pid'}\n"
        f"AuthorizedKeysFile {authorized}\n"
        "PermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"  # the keys live in pytest's directory, not in a checked ~/.ssh
        "PrintMotd no\n"
        "LogLevel INFO\n"
        f"SetEnv GLOO_SOCKET_IFNAME={node.interface} CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1\n"
    )
    return config


@contextlib.contextmanager
def ssh_servers(nodes: tuple[Node, ...], directory: Path) -> Iterator[Servers]:
    """One ``sshd`` per node, stopped on exit whatever happened; yields the client's config
    and the daemons' pids."""
    directory.mkdir(parents=True, exist_ok=True)
    client_key = directory / "id_ed25519"
    authorized = directory / "authorized_keys"
    authorized.write_text(_keygen(client_key) + "\n")
    known = directory / "known_hosts"
    known.write_text(
        "".join(f"{n.address} {_keygen(directory / f'host-{n.address}')}\n" for n in nodes)
    )
    # Debian's sshd refuses to start without its privilege-separation directory.
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    servers: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for node in nodes:
            log = directory / f"sshd-{node.address}.log"
            config = _sshd_config(node, directory, authorized)
            with log.open("wb") as sink:
                server = subprocess.Popen(
                    node.exec([SSHD, "-D", "-e", "-f", str(config)]),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            servers.append((server, log))
        for server, log in servers:
            deadline = time.monotonic() + START_TIMEOUT_S
            while "Server listening" not in log.read_text(errors="replace"):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not start: {log.read_text(errors='replace')}")
                time.sleep(0.05)
        client = directory / "ssh_config"
        client.write_text(
            "Host *\n"
            "    User root\n"
            f"    IdentityFile {client_key}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {known}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    LogLevel ERROR\n"
        )
        yield Servers(client, {server.pid for server, _ in servers})
    finally:
        for server, _ in servers:
            server.terminate()
            try:
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def leftovers(nodes: tuple[Node, ...], keep: set[int], wait_s: float = 10.0) -> list[str]:
    """The processes still in the nodes' namespaces besides ``keep`` (waits up to ``wait_s``
    for them to go); each as ``namespace: pid command line``."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for node in nodes:
            done = subprocess.run(
                ["ip", "netns", "pids", node.namespace], capture_output=True, text=True, timeout=10
            )
            for pid in done.stdout.split():
                if int(pid) in keep:
                    continue
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    found.append(f"{node.namespace}: {pid} {argv.decode(errors='replace')}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)
