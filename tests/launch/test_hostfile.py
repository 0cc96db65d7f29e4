"""`tandem run --hostfile` for real: two network-namespace hosts, each with its own OpenSSH server.

Each host is a namespace of :mod:`tests.launch.netns` running ``sshd -D`` on port 22 of its
address (:mod:`tests.launch.sshd`: key-based root login only, keys and known_hosts made in the
test's directory, ``TANDEM_SSH="ssh -F <its config>"``). The launching ``tandem run`` runs in
the first host's namespace, as a user's shell on the first node of a cluster would.

Proves:

- two hosts x 2 slots train ``train_nodes.py`` to the end: every rank's line reaches the
  launching terminal once, prefixed with the host that ran it; ranks 0..3, world size 4, node
  ranks in the host file's order, the same parameters everywhere, equal to one process trained
  on all the data;
- a rank failing on the second host: the launcher exits with that rank's code within seconds,
  naming the host and the rank; every process of the job is gone from both hosts;
- a host that does not answer (an address with no machine behind it): a clear error naming it
  within seconds, and the job already started on the first host is gone too;
- SIGTERM to the launcher stops every host; SIGKILL to the launcher too (its ssh clients die
  with it, and each host's agent stops its launcher at the end of its stdin);
- a bad host file is one clear line (line number, the line, what is expected), exit 2, and
  ssh never runs.

"No process of the job remains" is read from the kernel: ``ip netns pids`` of each namespace
must list nothing but its sshd daemon. Skipped, with the reason, where namespaces or sshd
cannot be made.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.launch.netns import Node, can_make_namespaces, two_nodes
from tests.launch.sshd import Servers, leftovers, ssh_servers, sshd_missing
from tests.launching import python_path

pytestmark = pytest.mark.launch

TRAIN = Path(__file__).with_name("train_nodes.py")
# An address on the nodes' subnet with no machine behind it: ARP gets no answer.
NOBODY = "10.77.0.3"
# Each rank says it is up, then rank FAIL_RANK (if any) fails; the others wait to be stopped.
SLEEPER = """\
import os, sys, time
rank = int(os.environ["RANK"])
print(f"UP {rank}", flush=True)
if rank == int(os.environ.get("FAIL_RANK", "-1")):
    time.sleep(0.5)
    print(f"rank {rank} fails on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(120)
"""
_REPORT = re.compile(
    r"^\[(\S+)\] \[rank (\d+)\] RANK (\d+) LOCAL (\d+) WORLD (\d+) NODE (\d+) HASH (\w+) "
    r"MAXDIFF (\S+)$",
    re.MULTILINE,
)


@dataclass
class Cluster:
    nodes: tuple[Node, Node]
    servers: Servers
    directory: Path
    launched: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def hostfile(self, text: str) -> Path:
        path = self.directory / "hosts.txt"
        path.write_text(text)
        return path

    def launch(self, hostfile: Path, *argv: str, env: dict[str, str] | None = None) -> Launch:
        """``tandem run --hostfile`` in node 0's namespace, its output in a file."""
        log = self.directory / f"launcher-{len(self.launched)}.log"
        command = [sys.executable, "-m", "tandem.cli", "run", "--hostfile", str(hostfile), *argv]
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                self.nodes[0].exec(command),  # `ip netns exec` execs: the pid is the launcher's
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.directory,
                env={
                    **os.environ,
                    "TANDEM_SSH": f"ssh -F {self.servers.config}",
                    "PYTHONPATH": python_path(),
                    **(env or {}),
                },
                start_new_session=True,
            )
        self.launched.append(proc)
        return Launch(proc, log, time.monotonic())

    def leftovers(self) -> list[str]:
        return leftovers(self.nodes, keep=self.servers.pids)


@dataclass
class Launch:
    proc: subprocess.Popen[bytes]
    log: Path
    started: float

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> tuple[int, float]:
        """The exit status and the seconds since the start."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still runs after {timeout} s\n{self.output()}")
        return code, time.monotonic() - self.started

    def wait_for(self, text: str, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.output().count(text) < count:
            assert self.proc.poll() is None, f"launcher ended early\n{self.output()}"
            assert time.monotonic() < deadline, f"no {count} x {text!r}\n{self.output()}"
            time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    missing = sshd_missing()
    if missing:
        pytest.skip(missing)
    ok, reason = can_make_namespaces()
    if not ok:
        pytest.skip(reason)
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    with two_nodes() as nodes, ssh_servers(nodes, tmp_path / "ssh") as servers:
        made = Cluster(nodes, servers, tmp_path)
        try:
            yield made
        finally:
            for proc in made.launched:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            # Whatever a failed test left in the namespaces would keep them alive.
            for line in leftovers(nodes, keep=servers.pids, wait_s=0):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[1]), signal.SIGKILL)


@pytest.mark.timeout(90)
def test_two_hosts_train_one_job(cluster: Cluster) -> None:
    hosts = [n.address for n in cluster.nodes]
    hostfile = cluster.hostfile(f"# two hosts\n{hosts[0]} slots=2\n\n{hosts[1]} slots=2\n")
    run = cluster.launch(hostfile, str(TRAIN))
    code, _ = run.wait(timeout=75)
    out = run.output()
    assert code == 0, out
    reports = _REPORT.findall(out)
    assert sorted(int(r[1]) for r in reports) == [0, 1, 2, 3], out
    for host, prefix, rank, local, world, node, _, maxdiff in reports:
        assert prefix == rank, out
        assert int(world) == 4, out
        assert hosts.index(host) == int(node), f"rank {rank} of node {node} ran on {host}\n{out}"
        assert int(rank) == int(node) * 2 + int(local), out
        assert float(maxdiff) < 1e-5, out
    assert len({r[6] for r in reports}) == 1, f"replicas differ\n{out}"
    left = cluster.leftovers()
    assert not left, "left running:\n" + "\n".join(left) + f"\n{out}"


@pytest.mark.timeout(60)
def test_failing_rank_on_second_host_stops_every_host(cluster: Cluster) -> None:
    a, b = (n.address for n in cluster.nodes)
    run = cluster.launch(
        cluster.hostfile(f"{a} slots=2\n{b} slots=2\n"),
        "sleeper.py",
        env={"FAIL_RANK": "3", "TANDEM_SSH_ENV": "FAIL_RANK"},  # a host has only what is sent
    )
    code, seconds = run.wait(timeout=45)
    out = run.output()
    assert code == 3, out
    assert seconds < 20, f"{seconds:.1f} s\n{out}"
    assert f"rank 3 failed first, on host {b} (node rank 1)" in out, out
    assert f"[{b}] [rank 3] rank 3 fails on purpose" in out, out
    left = cluster.leftovers()
    assert not left, "left running:\n" + "\n".join(left) + f"\n{out}"


@pytest.mark.timeout(60)
def test_unreachable_host_is_named_and_nothing_is_left(cluster: Cluster) -> None:
    a = cluster.nodes[0].address
    run = cluster.launch(cluster.hostfile(f"{a} slots=1\n{NOBODY} slots=1\n"), "sleeper.py")
    code, seconds = run.wait(timeout=45)
    out = run.output()
    assert code == 255, out
    assert seconds < 20, f"{seconds:.1f} s\n{out}"
    assert f"host {NOBODY} (node rank 1, line 2 of the host file) failed first" in out, out
    assert f"BatchMode=yes {NOBODY} true" in out, out
    left = cluster.leftovers()
    assert not left, "left running:\n" + "\n".join(left) + f"\n{out}"


REFUSALS = {
    # The second host's key is not in known_hosts: BatchMode cannot ask whether to trust it.
    "unknown host key": ("UserKnownHostsFile /dev/null", "Host key verification failed"),
    # A user with no key there (sshd allows keys only): no password is asked for.
    "login refused": ("User tandem-no-such-user", "Permission denied (publickey)"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_ssh_is_named_and_nothing_is_left(cluster: Cluster, case: str) -> None:
    a, b = (n.address for n in cluster.nodes)
    option, said = REFUSALS[case]
    config = cluster.directory / "ssh_config_refused"
    # ssh keeps the first value it reads: this block, for the second host only, comes first.
    config.write_text(f"Host {b}\n    {option}\n" + cluster.servers.config.read_text())
    run = cluster.launch(
        cluster.hostfile(f"{a} slots=1\n{b} slots=1\n"),
        "sleeper.py",
        env={"TANDEM_SSH": f"ssh -F {config}"},
    )
    code, seconds = run.wait(timeout=45)
    out = run.output()
    assert code == 255, out
    assert seconds < 15, f"{seconds:.1f} s\n{out}"
    assert f"host {b} (node rank 1, line 2 of the host file) failed first" in out, out
    assert f"[{b}] " in out and said in out, out
    left = cluster.leftovers()
    assert not left, "left running:\n" + "\n".join(left) + f"\n{out}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_signal_to_the_launcher_stops_every_host(cluster: Cluster, signum: int) -> None:
    a, b = (n.address for n in cluster.nodes)
    run = cluster.launch(cluster.hostfile(f"{a} slots=2\n{b} slots=2\n"), "sleeper.py")
    run.wait_for("UP ", 4, timeout=30)
    os.kill(run.proc.pid, signum)
    code, _ = run.wait(timeout=30)
    out = run.output()
    assert code == -signum if signum == signal.SIGKILL else code == 128 + signum, out
    if signum == signal.SIGTERM:
        assert "stopped by SIGTERM on every host" in out, out
    left = cluster.leftovers()
    assert not left, "left running:\n" + "\n".join(left) + f"\n{out}"


BAD_HOSTFILES = [
    ("node1 slots=2\nnode2 slot=2\n", "line 2: 'node2 slot=2' is not `hostname slots=N`"),
    ("node1 slots=2\nnode2\n", "line 2: 'node2' is not `hostname slots=N`"),
    ("node1 slots=0\n", "line 1: slots=0 for host 'node1' must be a whole number >= 1"),
    ("node1 slots=two\n", "line 1: slots=two for host 'node1' must be a whole number >= 1"),
    ("a slots=1\nb slots=1\na slots=1\n", "line 3: host 'a' is listed again (first on line 1)"),
    ("a slots=2\nb slots=4\n", "the hosts' slots differ (a slots=2, b slots=4)"),
    ("# nothing\n\n", "lists no host"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("text", "expected"), BAD_HOSTFILES)
def test_bad_hostfile_is_one_clear_error_before_any_ssh(
    tmp_path: Path, text: str, expected: str
) -> None:
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(text)
    marker = tmp_path / "ssh-ran"
    fake_ssh = tmp_path / "fake-ssh"
    fake_ssh.write_text(f"#!/bin/sh\ntouch {marker}\n")
    fake_ssh.chmod(0o755)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "run", "--hostfile", str(hostfile), "train.py"],
        capture_output=True,
        text=True,
        timeout=20,
        env={**os.environ, "TANDEM_SSH": str(fake_ssh)},
    )
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - started < 10
    assert done.stderr.startswith("tandem run: error: "), done.stderr
    assert expected in done.stderr, done.stderr
    if "line" in expected:  # a syntax error: which file
        assert f"host file {str(hostfile)!r}, line" in done.stderr, done.stderr
    assert not marker.exists(), "ssh ran although the host file is bad"
