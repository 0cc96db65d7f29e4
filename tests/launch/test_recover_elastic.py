"""`tandem run --recover in-memory --nnodes MIN:MAX`: a node that was down rejoins the running job.

Each node is a network namespace behind one switch (:mod:`tests.launch.netns_switch`) running
its own `tandem run --nnodes MIN:MAX --rdzv-backend c10d --rdzv-endpoint NODE0:PORT --recover
in-memory --heartbeat-timeout 2` of one rank of the recovery tests' worker
(:mod:`tests.recovery.recovery_worker`); node 0 (the endpoint's host) hosts the job's store.
The other nodes are numbered in order of arrival, so the test finds which namespace holds a
node by its launcher's line. Proves:

- **a node down and back** (``--nnodes 2:3``, 3 nodes): the node of rank 2 (its launcher and
  its worker: the launcher's process group SIGKILLed while rank 2 waits before its backward at
  step 3) is lost; ranks 0 and 1 go on in memory, nothing is restarted; the same `tandem run`
  started again on that namespace joins the running job: its worker gets launch rank 3 (the
  job's counter) and is admitted at a step boundary, with no ``--max-restarts`` given (growing
  back is no restart). The run ends **bitwise** where the chain of saves and resumes with the
  observed membership schedule ends (3 ranks to step 3, 2 ranks to the admission, 3 to the
  end); every launcher but the killed one exits 0; every process is accounted for;
- **fewer than MIN left** (``--nnodes 3:3``, no restart left): the node of rank 2 killed; once
  its beat is stale node 0 ends the job on every node, saying that 2 nodes are left of at least
  3; both launchers end non-zero within seconds and leave nothing behind;
- **fewer than MIN left, a restart left** (``--nnodes 2:2 --max-restarts 1``, the sharded
  Trainer of ``fallback_worker.py``): node 1 gone at step 5; node 0 waits for nodes; the same
  `tandem run` started again on that namespace arrives at the restart's store and both restart
  from the checkpoint of step 4, ending **bitwise** where the job run without the kill ends;
- **a node arriving at MAX** (``--nnodes 1:2``, a third node started while two run): it waits,
  saying the job runs on its maximum of 2 nodes; when the job ends it is told so and ends 0,
  having started no worker;
- **a fall-back restarts at the nodes still there** (``--nnodes 2:3 --max-restarts 1``, the
  sharded Trainer of ``fallback_worker.py``, which cannot recover in memory): at step 5 rank
  2's worker is SIGKILLed and rank 1's node is gone (its launcher SIGKILLed with its worker);
  the job restarts from the checkpoint of step 4 at the 2 nodes still there, node 2
  renumbered node 1, and ends **bitwise** where 2 ranks resumed from that checkpoint end;
  both launchers end 0 and every process is accounted for.

Cheap, in-process: the flags' checks (a static MIN:MAX, MIN > MAX, a host file of many hosts,
c10d without an endpoint, a heartbeat timeout of 0 are refused naming the value; a c10d
MIN:MAX is accepted); node 0's decisions over a real TCPStore (a node asking while MAX run is
told to wait, then admitted once a node's beat is stale; one asking while a member admits no
newcomer is refused, naming the ranks; fewer than MIN left ends the job, naming the nodes);
node 0's decision at a fall-back (a restart at the nodes not silent, renumbered, each follower
learning its number, below MIN too; the restart's store numbering a later node after them; a
node waiting to be admitted sent to the restart's store); a restart below MIN (a node arriving
at its store is one of the restart's, the size once MIN are there and the last call passed,
learnt by the other nodes; none within join_timeout ends the job on every node, saying why);
fewer than MIN left while the job runs asks for that restart when one is left.

Skipped, with the reason, where network namespaces or a bridge cannot be made.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.cli import build_parser
from tandem.cli.run import build_spec, run_command
from tandem.launch.rendezvous import LaunchError
from tests.launch.netns_switch import Switch
from tests.launch.test_recover_nodes import assert_same_trainer_run, chain, naming
from tests.launch.test_recover_partition import PORT, Launchers, start_nodes
from tests.launching import final_checkpoint, run_job
from tests.recovery.test_recovery import assert_equal_runs, leftovers

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

WORKER = "tests.recovery.recovery_worker"
EPOCHS = ("--epochs", "2")


class Nodes(Launchers):
    """One elastic `tandem run` per namespace (started with :meth:`start`: again after a kill),
    one rank each; the outputs in files, one per launcher started."""

    def __init__(self, net: Switch, directory: Path, nnodes: str, worker: list[str]) -> None:
        super().__init__([], [])
        self.net, self.directory, self.nnodes, self.worker = net, directory, nnodes, worker
        self.where: list[int] = []  # the namespace of each launcher started

    def meet(self, namespace: int) -> list[str]:
        endpoint = f"{self.net.nodes[0].address}:{PORT}"
        return [
            "--nnodes", self.nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-conf", f"is_host={int(namespace == 0)},last_call_timeout=20",
        ]  # fmt: skip

    def start(self, namespace: int) -> int:
        """Start `tandem run` on ``namespace``; its index among the launchers started."""
        log = self.directory / f"launcher{len(self.procs)}.log"
        (proc,) = start_nodes(
            self.net, [log], 1, self.worker, meet=self.meet, only=[namespace]
        )  # fmt: skip
        self.logs.append(log)
        self.procs.append(proc)
        self.where.append(namespace)
        return len(self.procs) - 1

    def shown(self) -> str:
        return "\n".join(
            f"--- launcher {i} on namespace {self.where[i]} (exit {p.poll()}) ---\n"
            f"{self.text(i)[-6000:]}"
            for i, p in enumerate(self.procs)
        )

    def wait_for(self, launcher: int, pattern: str, within: float = 90) -> re.Match[str]:
        """The first match of ``pattern`` in ``launcher``'s output, once it is there."""
        deadline = time.monotonic() + within
        while True:
            found = re.search(pattern, self.text(launcher), re.M)
            if found:
                return found
            if time.monotonic() > deadline or self.procs[launcher].poll() is not None:
                pytest.fail(f"launcher {launcher} never said {pattern!r}\n{self.shown()}")
            time.sleep(0.1)

    def holding(self, node: int, among: list[int], within: float = 90) -> int:
        """Which of the launchers ``among`` is node ``node`` of the job (its line says so)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for i in among:
                if f"this is node {node} (" in self.text(i):
                    return i
            time.sleep(0.1)
        pytest.fail(f"no launcher said it is node {node}\n{self.shown()}")

    def kill(self, launcher: int) -> None:
        """SIGKILL ``launcher``'s process group: the launcher; its workers die with it."""
        os.killpg(self.procs[launcher].pid, signal.SIGKILL)
        self.procs[launcher].wait()

    def start_and_lose(self, out: Path, node: int) -> int:
        """Start `tandem run` on every namespace, wait until the rank of node ``node`` (one a
        node) pauses (``--pause``), then SIGKILL that node's launcher with its worker: which
        launcher it was."""
        every = list(range(len(self.net.nodes)))
        for namespace in every:
            self.start(namespace)
        victim = self.holding(node, every)
        paused(out, node)
        self.kill(victim)
        return victim

    def accounted_for(self, out: Path) -> None:
        """No launcher (nor its session), no worker that wrote a pid file (nor its process
        group), and no process naming the test's directory is left."""
        pids = {int(p.read_text()) for p in out.parent.glob(f"{out.name}.pid-*")}
        pids |= {p.pid for p in self.procs}
        deadline = time.monotonic() + 5
        while (leftovers(pids) or naming(self.directory)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not leftovers(pids), f"{leftovers(pids)}\n{self.shown()}"
        assert not naming(self.directory), f"{naming(self.directory)}\n{self.shown()}"


@contextlib.contextmanager
def nodes(net: Switch, directory: Path, nnodes: str, worker: list[str]) -> Iterator[Nodes]:
    started = Nodes(net, directory, nnodes, worker)
    try:
        yield started
    finally:
        started.stop()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def paused(out: Path, rank: int, within: float = 90) -> None:
    deadline = time.monotonic() + within
    while not out.with_name(f"{out.name}.paused-{rank}").exists():
        assert time.monotonic() < deadline, f"rank {rank} never paused"
        time.sleep(0.05)


def go(out: Path, rank: int) -> None:
    out.with_name(f"{out.name}.go-{rank}").touch()


@pytest.mark.timeout(300)
def test_a_node_that_was_down_rejoins_the_running_job_and_the_run_equals_its_schedule(
    net_of, tmp_path, chains
):
    net = net_of(3)
    out = tmp_path / "rejoined.pt"
    worker = ["-m", WORKER, str(out), *EPOCHS, "--step-sleep", "0.05"]
    # Rank 2 waits before its backward at step 3 (its node is killed there); rank 0 waits at
    # step 6 until the rejoined worker has asked to join, so that the run does not end first.
    worker += ["--pause", "2:3", "--pause", "0:6"]
    with nodes(net, tmp_path, "2:3", worker) as run:
        victim = run.start_and_lose(out, 2)
        paused(out, 0)  # ranks 0 and 1 went on in memory to step 6
        back = run.start(run.where[victim])  # the same `tandem run`, on the same namespace
        run.wait_for(back, r"this node \(node \d+\) joins it")
        deadline = time.monotonic() + 60
        while not out.with_name(f"{out.name}.pid-3").exists():
            assert time.monotonic() < deadline, run.shown()
            time.sleep(0.1)
        time.sleep(3.0)  # it asked to join (a moment after its start)
        go(out, 0)
        codes = run.finish(120)
        run.accounted_for(out)
    shown = run.shown()
    assert [c for i, c in enumerate(codes) if i != victim] == [0, 0, 0], shown
    for i in range(len(codes)):  # nothing was restarted, no replacement started
        assert "restart" not in run.text(i).replace("--max-restarts", ""), shown
        assert "starting rank" not in run.text(i), shown
    assert "[rank 3]" in run.text(back), shown

    rejoined = torch.load(out, weights_only=True)
    recoveries = rejoined["recoveries"]
    assert [(r["lost"], r["step"], r["members"]) for r in recoveries[:1]] == [([2], 3, [0, 1])]
    assert [(r["lost"], r.get("joined"), r["members"]) for r in recoveries[1:]] == [
        ([], [3], [0, 1, 3])
    ], recoveries
    assert rejoined["world_size"] == 3
    assert f"replacement rank 3 admitted after step {recoveries[1]['step']}" in run.text(0)
    assert_equal_runs(rejoined, chain(chains, 3, recoveries, EPOCHS))


@pytest.mark.timeout(200)
def test_fewer_than_min_nodes_left_ends_the_job_on_every_node_saying_so(net_of, tmp_path):
    net = net_of(3)
    out = tmp_path / "below.pt"
    # Rank 0 waits at step 6 for a go that never comes: only its launcher can end the job.
    worker = ["-m", WORKER, str(out), *EPOCHS, "--pause", "2:3", "--pause", "0:6"]
    with nodes(net, tmp_path, "3:3", worker) as run:
        victim = run.start_and_lose(out, 2)
        killed = time.monotonic()
        codes = run.finish(60)
        took = time.monotonic() - killed
        run.accounted_for(out)
    shown = run.shown()
    rest = [i for i in range(3) if i != victim]
    assert [codes[i] for i in rest] == [1, 1], shown
    why = (
        "node(s) 2 went silent (no `tandem run` beat for 5 s: killed, host down, or cut off) "
        "and 2 node(s) are left, fewer than the --nnodes minimum 3: every node's workers are "
        "stopped"
    )
    host, other = rest  # launcher 0 runs on namespace 0: node 0
    assert f"tandem run: the job ends: {why}" in run.text(host), shown
    assert f"another node ended the job; this node's workers were stopped: {why}" in (
        run.text(other)
    ), shown
    for i in rest:
        assert re.search(
            r"^tandem run: recovery \d: node\(s\) 2 lost; 2 node\(s\) left, fewer than --nnodes "
            r"MIN 3: every worker on every node stopped$",
            run.text(i),
            re.M,
        ), shown
    assert not out.exists(), shown  # the job did not run on to its end
    assert took < 30, shown


@pytest.mark.timeout(200)
def test_a_node_arriving_while_max_nodes_run_waits_and_is_told_the_job_ended(net_of, tmp_path):
    net = net_of(3)
    out = tmp_path / "full.pt"
    worker = ["-m", WORKER, str(out), *EPOCHS, "--pause", "0:2"]
    with nodes(net, tmp_path, "1:2", worker) as run:
        run.start(0)
        run.start(1)
        run.wait_for(0, r"the job formed with 2 node\(s\)")
        late = run.start(2)
        run.wait_for(late, r"runs on 2 nodes, its --nnodes maximum 2: this node waits")
        paused(out, 0)
        go(out, 0)
        codes = run.finish(90)
        run.accounted_for(out)
    shown = run.shown()
    assert codes == [0, 0, 0], shown
    assert "the job ended before this node was admitted; nothing ran here" in run.text(late)
    assert "[rank" not in run.text(late), shown
    assert sorted(p.name for p in tmp_path.glob("full.pt.pid-*")) == [
        "full.pt.pid-0",
        "full.pt.pid-1",
    ], shown
    assert torch.load(out, weights_only=True)["world_size"] == 2


def _spec(*argv: str):
    return build_spec(build_parser().parse_args(["run", "--recover", "in-memory", *argv, "t.py"]))


def test_the_flags_of_an_elastic_in_memory_job_are_checked_naming_the_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    c10d = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400")
    _, meeting = _spec("--nnodes", "2:3", *c10d)
    assert meeting.backend == "c10d" and meeting.elastic is not None
    assert (meeting.elastic.min_nodes, meeting.elastic.max_nodes) == (2, 3)
    with pytest.raises(LaunchError, match=r"--nnodes 1:2: only a fixed number of nodes .*c10d"):
        _spec("--nnodes", "1:2", "--master-addr", "10.0.0.1", "--node-rank", "0")
    with pytest.raises(LaunchError, match="--nnodes '3:2': MIN 3 is larger than MAX 2"):
        _spec("--nnodes", "3:2", *c10d)
    with pytest.raises(LaunchError, match="--nnodes 1:2 needs --rdzv-endpoint"):
        _spec("--nnodes", "1:2", "--rdzv-backend", "c10d")
    with pytest.raises(LaunchError, match="--heartbeat-timeout 0 must be > 0"):
        _spec("--nnodes", "2:3", *c10d, "--heartbeat-timeout", "0")
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    args = build_parser().parse_args(
        ["run", "--recover", "in-memory", "--hostfile", str(hosts), "--nnodes", "1:2", "t.py"]
    )
    with pytest.raises(LaunchError, match="--hostfile of 2 hosts: only a fixed number"):
        run_command(args)


def test_node_0_admits_below_max_refuses_where_nobody_admits_and_ends_below_min():
    """Node 0's part alone, in-process, over a real TCPStore: the decisions the namespace tests
    see end to end, each case at once (the beat's timeout shortened to 0.3 s)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from tandem.launch.in_memory import (
        able_key,
        admits_key,
        fallback_key,
        launcher_key,
        members_key,
        node_key,
    )
    from tandem.launch.membership import ElasticInMemoryCoordinator, ElasticSettings

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    node0 = ElasticInMemoryCoordinator(ElasticSettings(2, 3), "127.0.0.1", store.port, 2.0)
    node0.serving, node0.store, node0.nnodes, node0.store_timeout = True, store, 3, 0.3
    store.set(launcher_key("nodes"), "[0, 1, 2]")
    for rank in range(3):
        store.set(able_key(rank), "1")
        store.set(admits_key(rank), "1")

    def ask(node: int) -> None:
        store.add(launcher_key("arrivals"), 1)
        store.set(node_key(node, "asks"), "1")

    def look_while(beating: list[int], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for node in beating:
                store.add(node_key(node, "beat"), 1)
            node0._look()
            time.sleep(0.05)

    store.add(launcher_key("arrivals"), 2)  # nodes 1 and 2 formed the job with node 0
    ask(3)
    look_while([1, 2], 0.5)  # three nodes run: MAX
    assert store.get(node_key(3, "full")) == b"3"
    assert not store.check([node_key(3, "admitted")])
    look_while([1, 3], 0.6)  # node 2 went silent: node 3 takes its place
    assert store.check([node_key(3, "admitted")])
    assert node0.nodes() == [0, 1, 2, 3]
    assert node0.ended() is None

    # The workers re-formed and admitted rank 3, which admits no newcomer: node 4 is refused.
    store.set(members_key(1), "[0, 1]")
    store.set(members_key(2), "[0, 1, 3]")
    store.set(able_key(3), "1")
    ask(4)
    look_while([1, 3], 0.2)
    refused = store.get(node_key(4, "refused")).decode()
    assert "cannot take this node: its workers (ranks 0, 1, 3) admit no newcomer" in refused
    assert node0.nodes() == [0, 1, 2, 3]

    look_while([], 0.6)  # nodes 1 and 3 went silent: 1 node left, fewer than MIN 2
    end = node0.ended()
    assert end is not None and end.node == 0 and end.restart == 0, end
    assert "node(s) 1, 2, 3 went silent" in end.why, end  # every node of the job gone
    assert "1 node(s) are left, fewer than the --nnodes minimum 2" in end.why, end
    assert "no restart is left to wait for more: --max-restarts 0" in end.why, end

    # With a restart left, the same loss asks for one, which waits for MIN nodes (_gather).
    node0.max_restarts, node0._below = 2, False
    store.delete_key(fallback_key())
    look_while([], 0.1)
    end = node0.ended()
    assert end is not None and end.restart == 1, end
    assert (
        "fewer than the --nnodes minimum 2: every node's workers are stopped; the job restarts "
        "from its last checkpoint (restart 1 of 2) once 2 nodes are there"
    ) in end.why, end
    assert end.line.endswith("restarted (restart 1 of 2) once 2 were there again"), end


def test_node_0_restarts_a_fall_back_at_the_nodes_still_there_renumbered_even_below_min():
    """Node 0's decision at a fall-back's end (``settle``), in-process over a real TCPStore: a
    restart asked for is made at the job's nodes that are not silent, renumbered in the job's
    order (node 0 first), each follower learning its new number, below MIN too (the restart
    then waits for nodes: the next test); none when none is asked for; the restart's fresh
    store numbers a node arriving later after them; a node waiting to be admitted is sent to
    the restart's store, not told the end."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from tandem.launch.in_memory import JobEnd, launcher_key, node_key
    from tandem.launch.membership import (
        ElasticInMemoryCoordinator,
        ElasticSettings,
        _Restarting,
    )

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)

    def coordinator(node: int) -> ElasticInMemoryCoordinator:
        made = ElasticInMemoryCoordinator(ElasticSettings(2, 4), "127.0.0.1", store.port, 2.0)
        made.serving, made.store, made.nnodes, made.node_rank = node == 0, store, 4, node
        return made

    node0, node1, node3 = coordinator(0), coordinator(1), coordinator(3)
    store.set(launcher_key("nodes"), "[0, 1, 2, 3]")
    asked = JobEnd("rank 1 was lost", "rank 1 lost", restart=1, node=1)
    said = node0._decide(asked, gone=[2])
    assert said == {"restart": 1, "why": "", "nodes": [0, 1, 3], "attempt": 1}
    assert [c._follow(said) for c in (node0, node1, node3)] == [(1, "")] * 3
    assert (node0._next, node1._next, node3._next) == ((0, 3, 1), (1, 3, 1), (2, 3, 1))
    restart, why = coordinator(2)._follow(said)  # a node node 0 found silent: left out
    assert restart == 0 and "restarts the job without this node (node 2)" in why
    every = node0._decide(asked, gone=[])  # every node there: the same numbers
    assert every["nodes"] == [0, 1, 2, 3] and every["restart"] == 1
    below = node0._decide(asked, gone=[1, 2, 3])  # one node left of MIN 2: it waits
    assert below == {"restart": 1, "why": "", "nodes": [0], "attempt": 1}, below
    assert node0._decide(JobEnd("x", "x", restart=0), gone=[])["restart"] == 0  # none left

    # The restart's store (node 0 writes it before the others connect): 3 nodes, and a node
    # arriving later takes number 3.
    fresh = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    node0.store, node0.nnodes, node0._attempt, node0._next = fresh, 3, 1, None
    node0._fresh_store()
    assert node0.nodes() == [0, 1, 2]
    assert int(fresh.add(launcher_key("arrivals"), 1)) == 3
    assert fresh.get(launcher_key("restarts")) == b"1"

    # A node waiting to be admitted while the job restarts: sent to the restart's store.
    waiting = coordinator(5)
    waiting.store = store
    node0.store, node0._attempt = store, 0
    assert node0._told_the_end(restart=1) == []
    with pytest.raises(_Restarting) as sent:
        waiting._admitted(time.monotonic() + 5)
    assert sent.value.attempt == 1 and store.check([node_key(5, "left")])
    assert not store.check([launcher_key("closed")])


def test_a_restart_below_min_waits_for_nodes_to_arrive_or_ends_the_job_saying_so():
    """A restart agreed with fewer than MIN nodes (``--nnodes 3:4``, one node left), in-process
    over real TCPStores: node 0's fresh store names no size yet, so a node arriving there is
    one of the restart's (not a late one); node 0 forms once MIN are there and the last call
    passed, and the restart's other node and the arriving one learn that size. With nobody
    coming within join_timeout node 0 closes the store saying why, and raises it; the other
    nodes raise node 0's why, not a timeout of their own."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from tandem.launch.in_memory import launcher_key
    from tandem.launch.membership import ElasticInMemoryCoordinator, ElasticSettings

    def restart(join_timeout: float) -> tuple[TCPStore, ElasticInMemoryCoordinator]:
        store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
        settings = ElasticSettings(3, 4, last_call=0.3, join_timeout=join_timeout)
        node0 = ElasticInMemoryCoordinator(settings, "127.0.0.1", store.port, 2.0)
        node0.serving, node0.store, node0.nnodes, node0._attempt = True, store, 2, 1
        node0._fresh_store()  # node 0 and node 1 are the restart's: fewer than MIN 3
        store.set(launcher_key("attempt"), "1")  # as _join sets it once the store is ready
        return store, node0

    def other(store: TCPStore, node: int) -> ElasticInMemoryCoordinator:
        made = ElasticInMemoryCoordinator(node0.settings, "127.0.0.1", store.port, 2.0)
        made.store, made.node_rank, made.nnodes = store, node, 2
        return made

    store, node0 = restart(join_timeout=30)
    assert not store.check([launcher_key("formed")])  # no size yet
    follower = other(store, 1)
    gathered: list[int] = []
    waiting = threading.Thread(target=lambda: (follower._gathered(), gathered.append(1)))
    waiting.start()
    arrived = int(store.add(launcher_key("arrivals"), 1))  # a node arrives: number 2
    assert arrived == 2
    started = time.monotonic()
    node0._gather()
    waiting.join(10)
    assert 0.3 <= time.monotonic() - started < 5  # MIN at once, then the last call for MAX
    assert node0.nnodes == 3 and node0.nodes() == [0, 1, 2]
    assert gathered == [1] and follower.nnodes == 3
    assert store.get(launcher_key("restarts")) == b"1"

    store, node0 = restart(join_timeout=0.5)
    follower = other(store, 1)
    why = (
        r"only 2 of at least 3 nodes \(--nnodes 3:4\) were there to restart the job within "
        r"join_timeout=0.5 s: the job ends"
    )
    with pytest.raises(LaunchError, match=why):
        node0._gather()
    with pytest.raises(LaunchError, match=r"only 2 of at least 3 nodes .* the job ends"):
        follower._gathered()
    late = ElasticInMemoryCoordinator(node0.settings, "127.0.0.1", store.port, 2.0)
    with pytest.raises(LaunchError, match=r"only 2 of at least 3 nodes .* the job ends"):
        late._arrive_at(None)  # a node arriving after that is told so too


FALLBACK_WORKER = "tests.launch.fallback_worker"


def restarted_as(run: Nodes, launcher: int, node: int) -> bool:
    """Whether ``launcher`` said the job restarted (restart 1) at 2 nodes, this one ``node``."""
    said = (
        rf"^tandem run: the job restarted \(restart 1\) with 2 node\(s\), world size 2: "
        rf"this is node {node} \(ranks {node}\.\.{node} here\)$"
    )
    return re.search(said, run.text(launcher), re.M) is not None


@pytest.mark.timeout(300)
def test_a_fall_back_restarts_every_node_from_the_checkpoint_at_the_nodes_still_there(
    net_of, tmp_path
):
    """``--nnodes 2:3 --max-restarts 1``, 3 nodes of one rank, the sharded Trainer of
    ``fallback_worker.py`` (it cannot recover in memory). At step 5 rank 2's worker is
    SIGKILLed (its launcher sees it: a fall-back) and rank 1 SIGKILLs its launcher and itself
    (node 1 is gone). Every node still there stops its workers; node 0 restarts the job from
    the checkpoint of step 4 at the 2 nodes still beating, node 2 renumbered node 1 (rank 1).
    The run ends, bitwise, where 2 ranks resumed from that checkpoint end."""
    net = net_of(3)
    killed = tmp_path / "killed"
    worker = ["--max-restarts", "1", "-m", FALLBACK_WORKER, str(killed), "--keep", "9"]
    worker += ["--kill", "2:5", "--kill-node", "1:5:0"]
    fourth = killed / "checkpoints" / "ckpt-e0001-s00000004.pt"
    oracle = tmp_path / "oracle"  # 2 ranks resumed from the checkpoint the restart finds
    made: list[subprocess.CompletedProcess[str]] = []
    with nodes(net, tmp_path, "2:3", worker) as run:
        for namespace in range(3):
            run.start(namespace)
        host, middle, last = (run.holding(n, [0, 1, 2]) for n in range(3))
        # The oracle runs meanwhile (the job waits much of its time), from that checkpoint
        # once the Trainer's `latest` names it (written and sealed).
        deadline = time.monotonic() + 120
        while b"s00000004" not in _read(killed / "checkpoints" / "latest"):
            assert time.monotonic() < deadline, run.shown()
            time.sleep(0.1)
        oracle_run = threading.Thread(
            target=lambda: made.append(
                run_job(2, [], FALLBACK_WORKER, str(oracle), "--resume", str(fourth), check=False)
            )
        )
        oracle_run.start()
        codes = run.finish(240)
        oracle_run.join(240)  # its processes too name the test's directory
        run.accounted_for(killed)
    shown = run.shown()
    assert (codes[host], codes[last], codes[middle]) == (0, 0, -signal.SIGKILL), shown
    assert made and made[0].returncode == 0, made and made[0].stderr[-4000:]
    # Node 2's launcher saw its worker lost, the others unable (sharded): a fall-back.
    assert re.search(
        r"^tandem run: rank 2 \(killed by SIGKILL\) was lost and ranks? [\d, ]+ cannot be "
        r"recovered in memory \(.*sharded across ranks.*\): restarting every worker on every "
        r"node from the last checkpoint \(restart 1 of 1; --recover in-memory falls back to "
        r"restart\)$",
        run.text(last),
        re.M,
    ), shown
    for launcher, node in ((host, 0), (last, 1)):
        assert restarted_as(run, launcher, node), shown
        assert re.search(  # the summary lists the fall-back
            r"^tandem run: recovery 1: rank 2 \(killed by SIGKILL\) lost [\d.]+ s into the run; "
            r"not recoverable in memory \(.*\): every worker on every node restarted \(restart "
            r"1 of 1\) from the last checkpoint$",
            run.text(launcher),
            re.M,
        ), shown
    assert "this node (node 2) is node 1 there" in run.text(last), shown
    assert re.search(
        rf"^\[rank 0\] resumed from {re.escape(str(fourth))}: .*written by 3 processes, now 2",
        run.text(host),
        re.M,
    ), shown

    got, expected = final_checkpoint(killed), final_checkpoint(oracle)
    assert expected["trainer"]["step"] == 10
    assert_same_trainer_run(got, expected)


@pytest.mark.timeout(300)
def test_a_job_below_min_waits_for_a_node_started_again_and_restarts_with_it(net_of, tmp_path):
    """``--nnodes 2:2 --max-restarts 1``, 2 nodes of one rank, the sharded Trainer of
    ``fallback_worker.py``. At step 5 rank 1 SIGKILLs its launcher and itself: node 1 is gone
    and node 0's worker, which cannot go on in memory, is stopped. One node is left of MIN 2:
    node 0 does not end the job but waits for nodes; `tandem run` started again on node 1's
    namespace arrives at the restart's store, and the job restarts at 2 nodes from the last
    checkpoint (restart 1 of 1, the arriving node at the job's restart count). The run ends,
    bitwise, where the same job run without the kill ends; every process is accounted for."""
    net = net_of(2)
    run_dir = tmp_path / "killed"
    worker = ["--max-restarts", "1", "-m", FALLBACK_WORKER, str(run_dir), "--keep", "9"]
    oracle = tmp_path / "oracle"  # 2 ranks, nothing killed
    made: list[subprocess.CompletedProcess[str]] = []
    oracle_run = threading.Thread(
        target=lambda: made.append(run_job(2, [], FALLBACK_WORKER, str(oracle), check=False))
    )
    worker += ["--kill-node", "1:5:0"]
    with nodes(net, tmp_path, "2:2", worker) as run:
        for namespace in range(2):
            run.start(namespace)
        host, victim = (run.holding(n, [0, 1]) for n in range(2))
        oracle_run.start()  # meanwhile: the job waits much of its time
        run.procs[victim].wait(120)
        run.wait_for(host, r"the job restarts once 2 nodes are there \(--nnodes 2:2; 1 now\)")
        # The same command: its kill is for restart 0, and the node arriving at the restart
        # runs at the job's count (1), else its worker would kill it again at step 5.
        again = run.start(run.where[victim])
        codes = run.finish(200)
        oracle_run.join(200)
        run.accounted_for(run_dir)
    shown = run.shown()
    assert (codes[host], codes[victim], codes[again]) == (0, -signal.SIGKILL, 0), shown
    assert made and made[0].returncode == 0, made and made[0].stderr[-4000:]
    for launcher, node in ((host, 0), (again, 1)):
        assert restarted_as(run, launcher, node), shown
    assert "waiting up to join_timeout=600 s for nodes to arrive" in run.text(host), shown
    resumed = r"^\[rank 0\] resumed from .*ckpt-e\d+-s0+4\.pt: epoch 1, batch 4, step 4$"
    assert re.search(resumed, run.text(host), re.M), shown
    got, expected = final_checkpoint(run_dir), final_checkpoint(oracle)
    assert expected["trainer"]["step"] == 12  # 48 samples, 2 ranks of 4, 2 epochs
    assert_same_trainer_run(got, expected)
