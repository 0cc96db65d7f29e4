"""`tandem run --recover in-memory` on many nodes: a cut link, partitions, the store's node down.

Each node is a network namespace behind one switch (:mod:`tests.launch.netns_switch`), running
its own `tandem run --nnodes N --node-rank i --recover in-memory --heartbeat-timeout 2` of one
rank of the recovery tests' worker (:mod:`tests.recovery.recovery_worker`); node 0's launcher
hosts the job's store. The victims pause before their backward at a known step (``--pause``)
while the test cuts their network, then go on into it. Proves:

- a link down (3 nodes, node 2's link cut at the switch): nodes 0 and 1 (2 of the 3 ranks, the
  store's side) leave rank 2 out and go on: they exit 0, and the run ends **bitwise** equal to
  its oracle (trained to the step at 3 ranks, saved, resumed at 2: the recovery tests'); the
  recovery (detection included) takes at most the issue's 5 s; rank 2 stops with the error
  that names the partition, and node 2's launcher ends non-zero saying it lost the store; with
  ``--max-restarts 1`` nobody starts a replacement for rank 2 and node 0 says why (node 2's
  launcher is gone);
- a partition 3|1 (4 nodes, node 3 split off at the switch): the same, at 4 ranks then 3;
- a partition 2|2 (4 nodes): no side holds a majority: ranks 0 and 1 (the store's side) stop
  saying so, ranks 2 and 3 stop saying they are cut off from the store, every launcher ends
  non-zero, none hangs;
- node 0 (the store's host) dying: the other node's launcher ends within seconds, saying it
  lost the job's store;
- every process accounted for: no worker, nor anything in its process group, nor any launcher
  is left in any namespace.

Skipped, with the reason, where network namespaces or a bridge cannot be made.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.launch.netns_switch import Switch
from tests.launching import clean_env, python_path
from tests.recovery.chains import Chains, resumes
from tests.recovery.test_recovery import assert_equal_runs, leftovers

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.recovery.recovery_worker"
PORT = 29400  # node 0's namespace is brand new: nothing in it holds a port
BEAT_S = 2.0
# The target for a link down, detection included.
RECOVERED_WITHIN_S = 5.0
CUT_OFF = "cut off from the job's store at {addr}:{port}: this rank is on the side of a partition"
NO_MAJORITY = "without a majority this side of a partition stops"
LOST_STORE = "lost the job's store at {addr}:{port}"
# The oracles of the majority tests below: 3 ranks (4) to step 3, saved, resumed at 2 (3).
MAJORITY_ORACLES = (resumes(3, [(3, 2)]), resumes(4, [(3, 3)]))


def start_nodes(
    net: Switch,
    logs: list[Path],
    nproc: int,
    tail: list[str],
    env: dict[str, str] | None = None,
    meet: Callable[[int], list[str]] | None = None,
    only: list[int] | None = None,
) -> list[subprocess.Popen]:
    """One ``tandem run --recover in-memory`` per node of ``net`` (``nproc`` ranks each; node 0's
    launcher hosts the store), ``tail`` its further flags and the worker, each node's output in
    its file of ``logs``; each launcher in a session of its own, so that killing its process
    group reaches what it started. ``meet(i)``: node ``i``'s rendezvous flags (default: the
    static ones, ``--nnodes N --node-rank i --master-addr --master-port``); ``only``: start
    these nodes alone (``logs`` then holds theirs, in that order)."""

    def static(rank: int) -> list[str]:
        return [
            "--nnodes", str(len(net.nodes)), "--node-rank", str(rank),
            "--master-addr", net.nodes[0].address, "--master-port", str(PORT),
        ]  # fmt: skip

    chosen = only if only is not None else list(range(len(net.nodes)))
    procs = []
    for rank, log in zip(chosen, logs, strict=True):
        node = net.nodes[rank]
        environ = {
            **clean_env(),
            "PYTHONPATH": python_path(),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        # The namespaces share the host's name, which may resolve to an address the other
        # nodes cannot reach: Gloo uses the node's interface instead.
        environ["GLOO_SOCKET_IFNAME"] = node.interface
        command = node.exec(
            [
                sys.executable, "-m", "tandem.cli", "run", *(meet or static)(rank),
                "--nproc-per-node", str(nproc),
                "--recover", "in-memory", "--heartbeat-timeout", f"{BEAT_S:g}", *tail,
            ]
        )  # fmt: skip
        with log.open("w") as sink:
            started = subprocess.Popen(
                command, stdout=sink, stderr=subprocess.STDOUT, env=environ, cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip
        procs.append(started)
    return procs


class Launchers:
    """The launchers of one job's nodes (:func:`start_nodes`), each node's output in its file."""

    def __init__(self, logs: list[Path], procs: list[subprocess.Popen]) -> None:
        self.logs, self.procs = logs, procs

    def shown(self) -> str:
        return "\n".join(
            f"--- node {i} (exit {p.poll()}) ---\n{self.text(i)}" for i, p in enumerate(self.procs)
        )

    def text(self, node: int) -> str:
        return self.logs[node].read_text()

    def finish(self, within: float) -> list[int]:
        """Every launcher's exit status; fails the test if one runs past ``within``."""
        deadline = time.monotonic() + within
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        running = [i for i, p in enumerate(self.procs) if p.poll() is None]
        assert not running, f"node(s) {running} still running after {within} s\n{self.shown()}"
        return [int(p.returncode) for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class Job(Launchers):
    """One `tandem run` per node, one rank each, the outputs in files."""

    def __init__(
        self, net: Switch, out: Path, args: list[str], flags: tuple[str, ...] = ()
    ) -> None:
        self.net, self.out = net, out
        self.logs = [out.with_name(f"node{i}.log") for i in range(len(net.nodes))]
        tail = [*flags, "-m", WORKER, str(out), *args]
        super().__init__(self.logs, start_nodes(net, self.logs, 1, tail))

    def paused(self, ranks: list[int], within: float = 90) -> None:
        """Wait until every one of ``ranks`` paused (``--pause``)."""
        deadline = time.monotonic() + within
        while not all(self.out.with_name(f"{self.out.name}.paused-{r}").exists() for r in ranks):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                pytest.fail(f"ranks {ranks} never paused\n{self.shown()}")
            time.sleep(0.05)

    def go(self, ranks: list[int]) -> None:
        for r in ranks:
            self.out.with_name(f"{self.out.name}.go-{r}").touch()

    def worker_pids(self) -> set[int]:
        found = set()
        for r in range(len(self.procs)):
            path = self.out.with_name(f"{self.out.name}.pid-{r}")
            if path.exists():
                found.add(int(path.read_text()))
        return found

    def accounted_for(self) -> None:
        """No worker (nor its process group) and no launcher (nor its session) is left."""
        pids = self.worker_pids() | {p.pid for p in self.procs}
        deadline = time.monotonic() + 5
        while leftovers(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(self.worker_pids()) == len(self.procs), self.shown()
        assert not leftovers(pids), f"{leftovers(pids)}\n{self.shown()}"


@contextlib.contextmanager
def job(net: Switch, out: Path, args: list[str], flags: tuple[str, ...] = ()) -> Iterator[Job]:
    started = Job(net, out, args, flags)
    try:
        yield started
    finally:
        started.stop()


def _majority_goes_on(
    net: Switch,
    tmp_path: Path,
    chains: Chains,
    cut: str,
    step: int = 3,
    flags: tuple[str, ...] = (),
) -> None:
    """The last node is cut off (``cut``: "link" or "split") at ``step``; the others hold a
    majority, go on, and end as the oracle does. With ``--max-restarts`` in ``flags``, node 0
    says that nobody replaces the victim (its node's launcher is gone with the store)."""
    n = len(net.nodes)
    victim = n - 1
    out = tmp_path / "recovered.pt"
    addr = net.nodes[0].address
    with job(net, out, ["--pause", f"{victim}:{step}"], flags) as run:
        run.paused([victim])
        if cut == "link":
            net.cut(victim)
        else:
            net.split([victim])
        run.go([victim])
        codes = run.finish(90)
        run.accounted_for()
    shown = run.shown()
    assert codes[:victim] == [0] * victim, shown
    assert codes[victim] != 0, shown
    assert CUT_OFF.format(addr=addr, port=PORT) in run.text(victim), shown
    assert LOST_STORE.format(addr=addr, port=PORT) in run.text(victim), shown
    for node in range(victim):  # nobody on the majority's side was stopped or lost
        assert "was lost" not in run.text(node), shown
    assert f"recovery 1: rank {victim} (no exit seen by the launcher) lost at step {step}" in (
        run.text(0)
    ), shown
    no_replacement = (
        f"no replacement is started for rank {victim}: its node (node {victim}) has had no "
        "`tandem run` beat"
    )
    assert (no_replacement in run.text(0)) == ("--max-restarts" in flags), shown
    assert "starting rank" not in "".join(run.text(i) for i in range(n)), shown

    recovered = torch.load(out, weights_only=True)
    (recovery,) = recovered["recoveries"]
    assert recovery["lost"] == [victim] and recovery["step"] == step, recovery
    assert recovery["members"] == list(range(victim)), recovery
    # From the victim's last beat (the cut, within half a second) to the next committed step.
    assert recovery["detected_s"] + recovery["recovered_s"] < RECOVERED_WITHIN_S, recovery
    assert recovered["world_size"] == victim
    # The oracle (trained to the step at n ranks, saved, resumed at n - 1); both tests' oracles
    # run in the first one's launch.
    (oracle, *_) = chains.get(resumes(n, [(step, victim)]), *MAJORITY_ORACLES)
    assert_equal_runs(recovered, torch.load(oracle, weights_only=True))


@pytest.mark.timeout(300)
def test_a_link_down_leaves_the_cut_node_out_and_the_others_end_as_the_oracle(
    net_of, tmp_path, chains
):
    # A replacement is allowed: nobody can start one (node 2's launcher lost the store).
    _majority_goes_on(net_of(3), tmp_path, chains, "link", flags=("--max-restarts", "1"))


@pytest.mark.timeout(300)
def test_a_partition_3_1_lets_the_majority_go_on_and_stops_the_one(net_of, tmp_path, chains):
    _majority_goes_on(net_of(4), tmp_path, chains, "split")


@pytest.mark.timeout(200)
def test_a_partition_2_2_stops_every_rank_naming_the_partition(net_of, tmp_path):
    net = net_of(4)
    out = tmp_path / "split.pt"
    addr = net.nodes[0].address
    with job(net, out, ["--pause", "2:2", "--pause", "3:2"]) as run:
        run.paused([2, 3])
        net.split([2, 3])
        cut = time.monotonic()
        run.go([2, 3])
        codes = run.finish(60)
        took = time.monotonic() - cut
        run.accounted_for()
    shown = run.shown()
    assert all(code != 0 for code in codes), shown
    for node in (0, 1):  # the store's side: 2 of the 4 ranks, no majority
        assert NO_MAJORITY in run.text(node), shown
        assert "every worker of this node failed" in run.text(node), shown
    for node in (2, 3):  # the other side: cut off from the store
        assert CUT_OFF.format(addr=addr, port=PORT) in run.text(node), shown
        assert LOST_STORE.format(addr=addr, port=PORT) in run.text(node), shown
    assert not out.exists(), "a side without a majority trained on"
    assert took < 30, shown


@pytest.mark.timeout(200)
def test_the_store_nodes_death_ends_the_job_on_the_other_node(net_of, tmp_path):
    net = net_of(2)
    out = tmp_path / "store.pt"
    addr = net.nodes[0].address
    with job(net, out, ["--pause", "1:2"]) as run:
        run.paused([1])
        run.procs[0].send_signal(signal.SIGKILL)  # node 0's launcher: its worker dies with it
        killed = time.monotonic()
        run.procs[0].wait()
        codes = run.finish(30)
        took = time.monotonic() - killed
        run.accounted_for()
    shown = run.shown()
    assert codes[1] == 2, shown
    assert LOST_STORE.format(addr=addr, port=PORT) in run.text(1), shown
    assert "as with torch's c10d store, the job cannot go on without it" in run.text(1), shown
    assert took < 10, shown
