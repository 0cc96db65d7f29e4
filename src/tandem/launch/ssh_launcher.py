"""The launching side of ``tandem run --hostfile``: one ssh per host, its output relayed, the
job stopped everywhere at the first failure or signal (:mod:`tandem.launch.hostfile` reads the
host file and builds each host's command; :mod:`tandem.launch.ssh_agent` is the far end).

Per host:

1. ``ssh -T -o BatchMode=yes -o ConnectTimeout=10 HOST 'cd CWD && exec PYTHON -u -m
   tandem.launch.ssh_agent'``: a password prompt or an unknown host key is an error at once,
   an unreachable host one within ``ConnectTimeout`` seconds. ``TANDEM_SSH`` replaces ``ssh``
   (``TANDEM_SSH="ssh -F ~/cluster/ssh_config"``; its own ``-o`` options win over ours, since
   ssh keeps the first value it reads).
2. The agent's stdin gets the request: the host's ``tandem run`` command line and the
   variables to add. On stdin, not on the command line: the job's secret shows in no ``ps``.
3. Every line the host prints is relayed prefixed ``[HOST]``; the end of its stderr is kept.
4. The first host to exit non-zero fails the job. The others get ``grace_s`` seconds to stop on
   their own (node 0's store tells each host's launcher of a failed rank; a host ssh never
   reached gets none), then SIGTERM, then after ``grace_s`` SIGKILL. SIGINT, SIGTERM and SIGHUP
   to this launcher go to every host (``term_timeout_s`` for checkpoints before SIGKILL; a
   second one kills at once); SIGUSR1 too, and the job goes on.

Stopping goes through each host's agent, over the connection that started it (a line on its
stdin): no second login, no ``pkill`` by name. If this launcher dies without stopping them
(SIGKILL), its ssh clients die with it (PR_SET_PDEATHSIG), each agent reads the end of its
stdin and stops its host's launcher, whose workers die with it: nothing is left on any host.

Example::

    code = HostfileLauncher(hosts, 2, ["--nnodes", "2", ..., "train.py"], env, 3, 30).run()
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.launch.failures import describe_exit
from tandem.launch.hostfile import (
    DEFAULT_PORT,
    Host,
    check_placement,
    forwarded_env,
    forwarded_flags,
    read_hostfile,
    workers_per_host,
)
from tandem.launch.relay import relay
from tandem.launch.rendezvous import LaunchError

# One rule in one place: workers and ssh clients die with their launcher the same way.
from tandem.launch.supervisor import in_own_group_dying_with_parent

#: The ssh command (and options) to reach the hosts, split as a shell would; default ``ssh``.
SSH_VARIABLE = "TANDEM_SSH"
#: Options first on the command line win over ``TANDEM_SSH``'s config files, after its own ``-o``.
SSH_OPTIONS = (
    "-T",  # no terminal: stdout and stderr stay apart, and the agent's stdin stays ours
    "-o", "BatchMode=yes",  # a password or passphrase prompt fails instead of waiting
    "-o", "ConnectTimeout=10",
    "-o", "ServerAliveInterval=15",  # a host that vanishes fails the job within a minute
    "-o", "ServerAliveCountMax=4",
)  # fmt: skip
SSH_FAILED = 255  # ssh's own exit status: no connection, or no login
TAIL_LINES = 20
# The summary line of a host's launcher (failures.Failure.summary): which rank failed first.
_FAILED_FIRST = re.compile(r"tandem run: rank (\d+) \(local rank \d+ on .*?\) failed first: (.*)$")


def ssh_command(host: str, cwd: str, pythonpath: str | None = None) -> list[str]:
    """The ssh command line that starts ``host``'s agent in ``cwd`` (``TANDEM_SSH`` or ssh).

    Example::

        ssh_command("node1", "/work")
        # ['ssh', '-T', '-o', 'BatchMode=yes', ..., 'node1',
        #  'cd /work && exec /usr/bin/python3 -u -m tandem.launch.ssh_agent']
    """
    ssh = shlex.split(os.environ.get(SSH_VARIABLE) or "ssh")
    python = shlex.quote(sys.executable)
    env = f"env PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    remote = f"cd {shlex.quote(cwd)} && exec {env}{python} -u -m tandem.launch.ssh_agent"
    return [*ssh, *SSH_OPTIONS, host, remote]


@dataclass
class Node:
    """One host's ssh client: the node rank, its process, the end of what it wrote to stderr."""

    rank: int
    host: Host
    proc: subprocess.Popen[bytes]
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    relays: list[threading.Thread] = field(default_factory=list)
    ended: float | None = None  # time.monotonic() when its exit was seen

    def tell(self, signum: int) -> None:
        """Ask the host's agent to send ``signum`` to the host's launcher (if it still listens)."""
        self.send(f"signal {signum}")

    def send(self, line: str) -> None:
        # A host whose ssh has ended has a closed pipe here: its exit status says the rest.
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{line}\n".encode())
            self.proc.stdin.flush()


class HostfileLauncher:
    """Starts, relays, watches and stops one ``tandem run`` per host; ``run()`` is the status.

    Args:
        hosts: the host file's hosts; node ``i`` is ``hosts[i]``.
        nproc: workers per host (in the command already; it maps a failed rank to its host).
        node_flags: ``tandem run``'s flags and the script, the same for every host (the node
            rank is added per host).
        env: variables each host's launcher gets (:func:`forwarded_env`).
        grace_s: after a host failed: seconds the others get to stop on their own, and then
            between SIGTERM and SIGKILL.
        term_timeout_s: after SIGINT/SIGTERM to this launcher: seconds the hosts get before
            SIGKILL (their workers may be saving a checkpoint).

    Example::

        code = HostfileLauncher(hosts, 2, ["--nnodes", "2", ..., "train.py"], env, 3, 30).run()
    """

    def __init__(
        self,
        hosts: list[Host],
        nproc: int,
        node_flags: list[str],
        env: dict[str, str],
        grace_s: float,
        term_timeout_s: float,
    ) -> None:
        self.hosts, self.nproc, self.node_flags, self.env = hosts, nproc, node_flags, env
        self.grace_s, self.term_timeout_s = grace_s, term_timeout_s
        self.nodes: list[Node] = []
        self.signals: list[int] = []  # received by the handler, not yet acted on
        self.stop_signal: int | None = None
        self.stage = 0  # of stopping the hosts: 0 none, 1 SIGTERM (or the user's), 2 SIGKILL
        self.escalate_at = float("inf")  # when stopping moves on to the next stage

    def run(self) -> int:
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            self._start()
            failed = self._watch()
        finally:
            for node in self.nodes:  # only after an error of our own: their agents see EOF
                if node.proc.poll() is None:
                    node.proc.kill()
                node.proc.wait()
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.stop_signal is not None:
            _say(f"stopped by {signal.Signals(self.stop_signal).name} on every host")
            return 128 + self.stop_signal
        if failed is None:
            return 0
        _say(self._failure_summary(failed))
        code = failed.proc.returncode
        return code if code > 0 else 128 + (-code or 1)

    def command(self, rank: int) -> list[str]:
        """Node ``rank``'s ``tandem run`` command line, as its agent starts it."""
        launcher = [sys.executable, "-m", "tandem.cli", "run"]
        return [*launcher, "--node-rank", str(rank), *self.node_flags]

    def _start(self) -> None:
        cwd = os.getcwd()
        for rank, host in enumerate(self.hosts):
            proc = subprocess.Popen(
                ssh_command(host.name, cwd, self.env.get("PYTHONPATH")),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Out of the terminal's process group (Ctrl-C is ours to pass on), and killed
                # with this launcher: its agent then reads EOF and stops the host's launcher.
                preexec_fn=in_own_group_dying_with_parent,
            )
            node = Node(rank, host, proc)
            request = {
                "argv": self.command(rank),
                "env": self.env,
                "kill_after": self.term_timeout_s + self.grace_s,
            }
            node.send(json.dumps(request))
            prefix = f"[{host.name}] "
            node.relays = [
                relay(proc.stdout, sys.stdout, prefix, None, "stdout", None),
                relay(proc.stderr, sys.stderr, prefix, None, "stderr", node.tail),
            ]
            self.nodes.append(node)

    def _watch(self) -> Node | None:
        """Until every host's launcher has exited; the first to fail, if one did."""
        failed: Node | None = None
        while any(node.ended is None for node in self.nodes):
            now = time.monotonic()
            for node in self.nodes:
                if node.ended is None and node.proc.poll() is not None:
                    node.ended = now
                    if node.proc.returncode != 0 and failed is None and self.stage == 0:
                        failed = node
                        # The others hear of a failed rank from node 0's store: give them that
                        # moment. Not of a host that ssh could not reach: stop them now.
                        unreached = node.proc.returncode == SSH_FAILED
                        self.escalate_at = now + (0.0 if unreached else self.grace_s)
            while self.signals:
                signum = self.signals.pop(0)
                if signum == signal.SIGUSR1:  # checkpoint now: the job carries on
                    self._tell_running(signum)
                elif self.stop_signal is None:
                    self.stop_signal, self.stage = signum, max(self.stage, 1)
                    self._tell_running(signum)
                    self.escalate_at = now + self.term_timeout_s + self.grace_s
                else:  # a second Ctrl-C: no more waiting
                    self.escalate_at = now
            if now >= self.escalate_at:
                self._escalate(now)
            time.sleep(0.02)
        for node in self.nodes:  # the last lines a host wrote before its exit
            for thread in node.relays:
                thread.join(timeout=2.0)
        return failed

    def _escalate(self, now: float) -> None:
        """The next stage of stopping the hosts still running: SIGTERM, SIGKILL, end of ssh."""
        self.stage += 1
        if self.stage == 1:
            self._tell_running(signal.SIGTERM)
            self.escalate_at = now + self.grace_s
        elif self.stage == 2:
            self._tell_running(signal.SIGKILL)
            self.escalate_at = now + 5.0
        else:  # an agent that does not answer: the end of its stdin stops the host's launcher
            for node in self.nodes:
                if node.ended is None:
                    node.proc.kill()
            self.escalate_at = float("inf")

    def _tell_running(self, signum: int) -> None:
        for node in self.nodes:
            if node.ended is None:
                node.tell(signum)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def _failure_summary(self, failed: Node) -> str:
        """Who failed first: the rank a host's launcher named, else the host whose ssh ended."""
        for node in sorted(self.nodes, key=lambda n: n.ended or 0.0):
            for line in node.tail:
                match = _FAILED_FIRST.search(line)
                if match is not None:
                    rank, how = int(match.group(1)), match.group(2)
                    host = self.hosts[rank // self.nproc]
                    return (
                        f"rank {rank} failed first, on host {host.name} (node rank "
                        f"{rank // self.nproc}): {how}; the job is stopped on every host (the "
                        f"report of its launcher is above, prefixed [{host.name}])"
                    )
        code = failed.proc.returncode
        how = describe_exit(code)
        if code == SSH_FAILED:
            how += (
                " from ssh: it could not connect or log in (unreachable host, no sshd, a key "
                "refused, an unknown host key: BatchMode=yes never asks); try `ssh -o "
                f"BatchMode=yes {failed.host.name} true`"
            )
        lines = "\n".join(failed.tail) or "(nothing on stderr)"
        return (
            f"host {failed.host.name} (node rank {failed.rank}, line {failed.host.line} of the "
            f"host file) failed first: {how}; every other host is stopped. Its last lines:\n"
            f"{lines}"
        )


def _say(message: str) -> None:
    print(f"tandem run: {message}", file=sys.stderr, flush=True)


def run_hostfile(args: argparse.Namespace, actions: Iterable[argparse.Action]) -> int:
    """``tandem run --hostfile FILE ...``: every host's launcher over ssh; the exit status.

    ``actions``: the ``run`` parser's, to pass every other flag on (:func:`forwarded_flags`).

    Example::

        code = run_hostfile(parser.parse_args(["run", "--hostfile", "h.txt", "t.py"]), actions)
    """
    hosts = read_hostfile(Path(args.hostfile))
    check_placement(args)
    nproc = workers_per_host(hosts, args.nproc_per_node)
    port = args.master_port if args.master_port is not None else DEFAULT_PORT
    if not 1 <= port <= 65535:
        raise LaunchError(f"--master-port {port} is outside 1..65535")
    if args.rdzv_id == "none":  # one id for the job, not one per host (its run id, its logs)
        args = argparse.Namespace(**{**vars(args), "rdzv_id": uuid.uuid4().hex[:12]})
    node_flags = [
        "--nnodes", str(len(hosts)),
        "--nproc-per-node", str(nproc),
        "--master-addr", hosts[0].name,
        "--master-port", str(port),
        *forwarded_flags(args, actions),
        args.script, *args.script_args,
    ]  # fmt: skip
    term = args.term_timeout if args.shutdown_timeout is None else args.shutdown_timeout
    launcher = HostfileLauncher(hosts, nproc, node_flags, forwarded_env(), args.grace_period, term)
    return launcher.run()
