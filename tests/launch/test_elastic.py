"""Elastic node counts (`--nnodes MIN:MAX`, c10d rendezvous) with real launchers on real "nodes".

Each node is a Linux network namespace (:mod:`tests.launch.netns`) running its own `tandem run`;
node 0 hosts the rendezvous store at its address. The short knobs (`last_call_timeout=1`, a beat
every 0.5 s, a node lost after 4 missed beats) keep each test within seconds. Proves:

- the job starts once MIN nodes are there and the last call has passed: one node alone of
  `1:2` runs at world size nproc (after the last call, not before); two nodes there at once run
  as one job of 2 * nproc ranks, node 0 (the store's host) with ranks 0..nproc-1;
- a node whose launcher is SIGKILLed mid-training: node 0 re-forms alone within seconds (a
  bound from the kill to the new round's line), its worker resumes from the newest checkpoint
  at world size 1 (the step it resumed at is a checkpointed step at or after the one it waited
  for) and finishes with exit 0; the same when node 0's workers are idle and only the lost beat
  can tell (no hang); no process of either node is left running;
- with every knob at its default, a round re-formed after a failure waits for the failed
  round's nodes that still beat, not for the 30 s last call: a killed node costs its stale beat
  (node 0 re-forms in under 20 s, its worker resumes in under 30 s, with training and with idle
  workers); a node slow to stop its workers (longer than a node takes to be lost) but beating
  is waited for, and round 1 has both nodes; a job's first round still waits the whole last
  call (torch's rule), and a one-node re-form after a failure does not;
- a node that arrives while node 0 runs alone is admitted at a restart that does not count
  against `--max-restarts 0`, and both finish at world size 2;
- node 0's death (it hosts the store) ends the job on node 1 within seconds, saying why, with
  no process left (torch's c10d has the same limit);
- a job that never reaches MIN nodes fails within its join_timeout, naming the counts; a node
  still waiting to join when the job finishes is told so (two coordinators in one process).

(`--nnodes 3:2` and an unknown `--rdzv-backend` are tested in test_torchrun_flags.py, and a
node refused from a full job there too.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import free_port
from tests.launch.netns import Node, can_make_namespaces, two_nodes

WORKER = Path(__file__).with_name("elastic_worker.py")
PORT = 29400  # node 0's namespace is brand new: nothing in it holds a port
CONF = "last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=4"
LAST_CALL_S = 1.0
# The training runs: the worker checkpoints every 4 steps; the tests act after step 9.
STEPS = 24
# From a node's SIGKILL to node 0's next round: the lost node's beat goes stale (2 s), the
# last call (1 s), and the launchers' polls; on a loaded 2-core machine, with room.
REFORM_WITHIN_S = 20.0
# The same with every knob at its default (a 30 s last call, a node lost after 5 s without a
# beat): the stale beat and the polls; a re-form that waited the last call would take over 30 s.
DEFAULT_REFORM_WITHIN_S = 20.0
# ... and to the new worker's first line, which adds its start (`import torch` and tandem's
# checkpointing, 5-8 s on a loaded 2-core machine): the target, under 30 s.
DEFAULT_RESUME_WITHIN_S = 30.0
TANDEM = [sys.executable, "-m", "tandem.cli", "run"]
_ENV_SCRIPT = (
    "import os\n"
    "print('WORLD', *(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'GROUP_RANK', "
    "'GROUP_WORLD_SIZE')), flush=True)\n"
)
# Round 0 fails: node 0's worker exits 3 once node 1's (if any) has made itself slow to stop,
# ignoring SIGTERM, so its launcher kills it only after --grace-period. Later rounds print as
# _ENV_SCRIPT does.
_FAIL_ONCE_SCRIPT = (
    "import os, signal, sys, time\n"
    "from pathlib import Path\n"
    "slow = Path(sys.argv[1])\n"
    "if os.environ['TANDEM_RDZV_ROUND'] == '0':\n"
    "    if os.environ['GROUP_RANK'] == '0':\n"
    "        while os.environ['GROUP_WORLD_SIZE'] != '1' and not slow.exists():\n"
    "            time.sleep(0.05)\n"
    "        sys.exit(3)\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "    slow.touch()\n"
    "    time.sleep(120)\n"
) + _ENV_SCRIPT


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node]]:
    ok, reason = can_make_namespaces()
    if not ok:
        pytest.skip(reason)
    with two_nodes() as pair:
        yield pair


def _env(node: Node) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "TANDEM_", "PET_"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    # The namespaces share the host's name, which may resolve to an address the other node
    # cannot reach: Gloo uses the veth instead.
    env.update(GLOO_SOCKET_IFNAME=node.interface, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


class Launch:
    """One node's `tandem run`, its output in a file that the test reads as it grows."""

    def __init__(self, node: Node, rank: int, host: Node, log: Path, argv: list[str], **kw: str):
        """``kw``: nnodes, nproc, max_restarts, grace (--grace-period), and conf (the
        --rdzv-conf knobs; "" for the defaults)."""
        conf = ",".join(c for c in (kw.get("conf", CONF), "is_host=1" if rank == 0 else "") if c)
        flags = [
            "--nnodes", kw.get("nnodes", "1:2"),
            "--nproc-per-node", kw.get("nproc", "1"),
            "--max-restarts", kw.get("max_restarts", "3"),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host.address}:{PORT}",
            "--rdzv-id", "elastic-test",
            *(["--rdzv-conf", conf] if conf else []),
            *(["--grace-period", kw["grace"]] if "grace" in kw else []),
        ]  # fmt: skip
        self.log = log
        with log.open("w") as sink:
            # A session of its own: the finally below stops it and what it started.
            self.proc = subprocess.Popen(
                node.exec([*TANDEM, *flags, *argv]),
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=_env(node),
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str, within: float) -> float:
        """The monotonic time at which ``pattern`` (a regex) showed up in the output."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if re.search(pattern, self.text(), re.MULTILINE):
                return time.monotonic()
            if self.proc.poll() is not None and not re.search(pattern, self.text(), re.M):
                pytest.fail(f"exited {self.proc.returncode} before {pattern!r}:\n{self.text()}")
            time.sleep(0.05)
        pytest.fail(f"no {pattern!r} within {within} s:\n{self.text()}")

    def finish(self, within: float) -> int:
        try:
            return self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {within} s:\n{self.text()}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _running(tag: str) -> list[str]:
    """Processes whose command line carries ``tag`` (this test's own workers and launchers)."""
    found = subprocess.run(["pgrep", "-af", tag], capture_output=True, text=True).stdout
    return found.splitlines()


def _kill_tagged(tag: str) -> None:
    for line in _running(tag):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def _gone_within(tag: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while _running(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _running(tag)


def _worlds(text: str) -> list[tuple[int, int, int, int]]:
    found = re.findall(r"WORLD (\d+) (\d+) (\d+) (\d+)$", text, re.MULTILINE)
    return sorted(tuple(int(v) for v in row) for row in found)  # type: ignore[misc]


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_one_node_of_1_2_starts_alone_after_the_last_call(nodes, tmp_path):
    node0, _ = nodes
    script = tmp_path / "world.py"
    script.write_text(_ENV_SCRIPT)
    started = time.monotonic()
    launch = Launch(node0, 0, node0, tmp_path / "node0.log", [str(script)], nproc="2")
    try:
        assert launch.finish(40) == 0, launch.text()
        took = time.monotonic() - started
    finally:
        launch.stop()
    text = launch.text()
    assert _worlds(text) == [(0, 2, 0, 1), (1, 2, 0, 1)], text
    assert "round 0: node 0 of 1, world size 2" in text, text
    assert took >= LAST_CALL_S, f"started before the last call ended ({took:.1f} s)\n{text}"


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_two_nodes_of_1_2_there_at_once_run_as_one_job(nodes, tmp_path):
    node0, node1 = nodes
    script = tmp_path / "world.py"
    script.write_text(_ENV_SCRIPT)
    # Node 1 first: it waits for the store. Round 0 closes the moment both are registered (MAX
    # is 2), so a long last call costs nothing here; the 1 s one was too short for a loaded
    # machine, where node 1's start and its store client's connect back-off can take longer (CI
    # once saw round 0 close with node 0 alone, and node 1 admitted in round 1).
    conf = CONF.replace("last_call_timeout=1", "last_call_timeout=20")
    launches = [
        Launch(node1, 1, node0, tmp_path / "node1.log", [str(script)], nproc="2", conf=conf)
    ]
    launches.insert(
        0, Launch(node0, 0, node0, tmp_path / "node0.log", [str(script)], nproc="2", conf=conf)
    )
    try:
        codes = [launch.finish(40) for launch in launches]
    finally:
        for launch in launches:
            launch.stop()
    texts = [launch.text() for launch in launches]
    assert codes == [0, 0], texts
    assert _worlds(texts[0]) == [(0, 4, 0, 2), (1, 4, 0, 2)], texts
    assert _worlds(texts[1]) == [(2, 4, 1, 2), (3, 4, 1, 2)], texts
    assert "round 0: node 0 of 2, world size 4" in texts[0], texts


def _resumed(text: str) -> list[tuple[int, int, int, int]]:
    """(world, step, TORCHELASTIC_RESTART_COUNT, round) of every RESUMED line, in order."""
    found = re.findall(r"RESUMED world (\d+) step (\d+) restart (\d+) round (\d+)", text)
    return [tuple(int(v) for v in row) for row in found]  # type: ignore[misc]


@pytest.mark.launch
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["training", "idle-workers", "trainer"])
def test_a_node_killed_mid_run_and_node_0_reforms_alone_and_resumes(nodes, tmp_path, mode):
    """``training``: node 1's workers die with its launcher, node 0's collectives fail.
    ``idle-workers``: node 0's workers are asleep, not communicating: only the lost beat tells.
    ``trainer``: as ``training``, through tandem.Trainer's own checkpoints and resume."""
    node0, node1 = nodes
    tag = f"elastic-{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path / "ckpt"
    idle = mode == "idle-workers"
    flags = {"training": [], "idle-workers": ["--idle"], "trainer": ["--trainer"]}[mode]
    argv = [str(WORKER), str(ckpt), str(STEPS), *flags]
    launches = [
        Launch(node0, 0, node0, tmp_path / "node0.log", [*argv, "--tag", f"{tag}-n0"]),
        Launch(node1, 1, node0, tmp_path / "node1.log", [*argv, "--tag", f"{tag}-n1"]),
    ]
    try:
        zero, one = launches
        # Training: a checkpoint at step 8 is committed (saved, then printed) before the kill.
        zero.wait_for(r"IDLE world 2" if idle else r"STEP 9 world 2", within=45)
        one.proc.send_signal(signal.SIGKILL)  # the launcher alone: its workers die with it
        killed = time.monotonic()
        reformed = zero.wait_for(r"round 1: node 0 of 1, world size 1", within=REFORM_WITHIN_S)
        print(f"node 0 re-formed {reformed - killed:.1f} s after node 1's launcher was killed")
        assert reformed - killed < REFORM_WITHIN_S, zero.text()
        assert _gone_within(f"{tag}-n1", 1) == [], "node 1's workers outlived its launcher"
        assert zero.finish(45) == 0, zero.text()
        assert _gone_within(tag, 5) == [], "processes left behind"
    finally:
        for launch in launches:
            launch.stop()
        _kill_tagged(tag)
    text = zero.text()
    resumed = _resumed(text)
    if idle:
        # Round 0 never trained (its ranks slept); round 1 starts from scratch, alone.
        assert "node 1 (" in text and "was lost: its launcher sent no beat" in text, text
        assert resumed == [(1, 0, 1, 1)], text
    else:
        assert resumed[0] == (2, 0, 0, 0), text
        world, step, restart, round_ = resumed[-1]
        assert (world, restart, round_) == (1, 1, 1), text
        assert step >= 8 and step % 4 == 0, text  # the newest checkpoint, at least step 8's
    assert f"DONE world 1 step {STEPS}" in text, text


@pytest.mark.launch
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["training", "idle-workers"])
def test_with_default_settings_a_killed_node_costs_its_stale_beat_not_the_last_call(
    nodes, tmp_path, mode
):
    """Every knob at its default: node 0 re-forms alone once node 1's beat is stale (5 s), not
    after the 30 s last call, which a round re-formed after a failure does not wait (it knows
    whom it waits for: the failed round's nodes that still beat), and its worker resumes
    within 30 s of the kill."""
    node0, node1 = nodes
    tag = f"elastic-{uuid.uuid4().hex[:8]}"
    idle = mode == "idle-workers"
    argv = [str(WORKER), str(tmp_path / "ckpt"), str(STEPS), *(["--idle"] if idle else [])]
    launches = [
        Launch(node0, 0, node0, tmp_path / "node0.log", [*argv, "--tag", f"{tag}-n0"], conf=""),
        Launch(node1, 1, node0, tmp_path / "node1.log", [*argv, "--tag", f"{tag}-n1"], conf=""),
    ]
    try:
        zero, one = launches
        zero.wait_for(r"IDLE world 2" if idle else r"STEP 9 world 2", within=45)
        one.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        reformed = zero.wait_for(r"round 1: node 0 of 1, world size 1", DEFAULT_REFORM_WITHIN_S)
        resumed = zero.wait_for(r"RESUMED world 1 step \d+ restart 1 round 1", 30)
        print(
            f"node 0 re-formed {reformed - killed:.1f} s and its worker resumed "
            f"{resumed - killed:.1f} s after node 1's launcher was killed"
        )
        assert reformed - killed < DEFAULT_REFORM_WITHIN_S, zero.text()
        assert resumed - killed < DEFAULT_RESUME_WITHIN_S, zero.text()
        assert zero.finish(45) == 0, zero.text()
        assert _gone_within(tag, 5) == [], "processes left behind"
    finally:
        for launch in launches:
            launch.stop()
        _kill_tagged(tag)
    text = zero.text()
    assert f"DONE world 1 step {STEPS}" in text, text
    if idle:
        assert "was lost: its launcher sent no beat for 5 s" in text, text


@pytest.mark.launch
@pytest.mark.timeout(90)
def test_a_reform_after_a_failure_waits_for_a_slow_node_that_still_beats(nodes, tmp_path):
    """Node 0's worker fails; node 1's ignores SIGTERM, so node 1's launcher comes back for the
    next round only after its 7 s --grace-period, longer than a node takes to be lost (5 s) but
    beating all along: the re-form waits for it (round 1 has both nodes, no restart to admit
    it), and, with no last call, well within the default 30 s."""
    node0, node1 = nodes
    script = tmp_path / "fail_once.py"
    script.write_text(_FAIL_ONCE_SCRIPT)
    argv = [str(script), str(tmp_path / "slow")]
    launches = [
        Launch(node0, 0, node0, tmp_path / "node0.log", argv, conf="", grace="7"),
        Launch(node1, 1, node0, tmp_path / "node1.log", argv, conf="", grace="7"),
    ]
    try:
        zero = launches[0]
        failed = zero.wait_for(r"restarting all workers \(restart 1 of 3\)", within=45)
        reformed = zero.wait_for(r"round 1: node 0 of 2, world size 2", within=30)
        codes = [launch.finish(30) for launch in launches]
    finally:
        for launch in launches:
            launch.stop()
    texts = [launch.text() for launch in launches]
    print(f"node 0 re-formed with node 1 {reformed - failed:.1f} s after its worker failed")
    assert codes == [0, 0], texts
    assert 5 < reformed - failed < DEFAULT_REFORM_WITHIN_S, texts
    assert "round 1: node 1 of 2, world size 2" in texts[1], texts
    assert _worlds(texts[0]) == [(0, 2, 0, 2)] and _worlds(texts[1]) == [(1, 2, 1, 2)], texts
    assert "waiting to join" not in texts[0] + texts[1], texts


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_the_first_round_waits_the_whole_last_call_and_a_reform_after_a_failure_does_not(
    nodes, tmp_path
):
    """One node of 1:2 with a 6 s last call: round 0 forms only when the last call is over
    (torch's rule: a job's nodes may still be starting); its worker fails, and round 1 forms
    at once, alone, since no node of the failed round is missing."""
    node0, _ = nodes
    script = tmp_path / "fail_once.py"
    script.write_text(_FAIL_ONCE_SCRIPT)
    conf = "last_call_timeout=6,keep_alive_interval=0.5,keep_alive_max_attempt=4"
    started = time.monotonic()
    launch = Launch(
        node0, 0, node0, tmp_path / "node0.log", [str(script), str(tmp_path / "slow")],
        conf=conf, max_restarts="1",
    )  # fmt: skip
    try:
        first = launch.wait_for(r"round 0: node 0 of 1, world size 1", within=30)
        failed = launch.wait_for(r"restarting all workers \(restart 1 of 1\)", within=30)
        second = launch.wait_for(r"round 1: node 0 of 1, world size 1", within=30)
        assert launch.finish(30) == 0, launch.text()
    finally:
        launch.stop()
    assert first - started >= 6, f"round 0 formed {first - started:.1f} s after the start"
    assert second - failed < 6, f"round 1 formed {second - failed:.1f} s after the failure"
    assert _worlds(launch.text()) == [(0, 1, 0, 1)], launch.text()


@pytest.mark.launch
@pytest.mark.timeout(90)
def test_a_node_arriving_later_is_admitted_at_a_restart_that_is_not_counted(nodes, tmp_path):
    node0, node1 = nodes
    tag = f"elastic-{uuid.uuid4().hex[:8]}"
    argv = [str(WORKER), str(tmp_path / "ckpt"), str(STEPS), "--tag", tag]
    zero = Launch(node0, 0, node0, tmp_path / "node0.log", argv, max_restarts="0")
    launches = [zero]
    try:
        zero.wait_for(r"STEP 9 world 1", within=45)
        one = Launch(node1, 1, node0, tmp_path / "node1.log", argv, max_restarts="0")
        launches.append(one)
        zero.wait_for(r"round 1: node 0 of 2, world size 2", within=30)
        assert zero.finish(45) == 0, zero.text()
        assert one.finish(15) == 0, one.text()
        assert _gone_within(tag, 5) == [], "processes left behind"
    finally:
        for launch in launches:
            launch.stop()
        _kill_tagged(tag)
    text = zero.text()
    assert "node(s) waiting to join: restarting the workers to admit them" in text, text
    assert "round 1: node 1 of 2, world size 2" in one.text(), one.text()
    resumed = _resumed(text)
    assert resumed[0] == (1, 0, 0, 0), text
    world, step, restart, round_ = resumed[-1]
    # TORCHELASTIC_RESTART_COUNT stays 0: admitting a node is no failure (torch's agent)
    assert (world, restart, round_) == (2, 0, 1) and step >= 8 and step % 4 == 0, text
    assert f"DONE world 2 step {STEPS}" in text, text


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_a_job_short_of_min_nodes_fails_at_join_timeout_naming_the_counts(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not start')\n")
    port = free_port()
    flags = ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{port}", "--rdzv-conf", "join_timeout=2"]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(
        [*TANDEM, *flags, str(script)], capture_output=True, text=True, timeout=40
    )
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert "only 1 of at least 2 nodes (--nnodes 2:3)" in result.stderr, result.stderr
    assert "join_timeout=2 s" in result.stderr and "must not start" not in result.stderr
    assert 2 <= took < 20, took


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_the_store_hosts_death_ends_the_job_on_the_other_node(nodes, tmp_path):
    """As with torch's c10d: node 0 hosts the store, and nothing re-forms without it."""
    node0, node1 = nodes
    tag = f"elastic-{uuid.uuid4().hex[:8]}"
    argv = [str(WORKER), str(tmp_path / "ckpt"), "400", "--idle", "--tag", tag]
    launches = [
        Launch(node0, 0, node0, tmp_path / "node0.log", argv),
        Launch(node1, 1, node0, tmp_path / "node1.log", argv),
    ]
    try:
        zero, one = launches
        zero.wait_for(r"IDLE world 2", within=45)
        zero.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert one.finish(15) == 2, one.text()
        assert time.monotonic() - killed < 10, one.text()
        assert _gone_within(tag, 5) == [], "processes left behind"
    finally:
        for launch in launches:
            launch.stop()
        _kill_tagged(tag)
    assert f"lost the rendezvous store at {node0.address}:{PORT}" in one.text(), one.text()
    assert "the store's host ending or dying ends the job" in one.text(), one.text()


@pytest.mark.timeout(60)
def test_a_node_still_waiting_when_the_job_finishes_is_told_so():
    """In one process, two coordinators on loopback: node 0 runs round 0 alone and finishes
    while the other waits for round 1; the waiting one ends with JobEnded (`tandem run` exits 0
    with its message), not a lost-store error or a wait until join_timeout."""
    from tandem.launch.membership import ElasticCoordinator, ElasticSettings, JobEnded

    port = free_port()
    settings = ElasticSettings(1, 2, join_timeout=30, last_call=0.2, keep_alive_interval=0.2)
    host = ElasticCoordinator(dataclasses.replace(settings, is_host=True), "127.0.0.1", port, "t")
    late = ElasticCoordinator(dataclasses.replace(settings, is_host=False), "127.0.0.1", port, "t")
    try:
        placement = host.begin(0)
        assert (placement.node_rank, placement.nnodes, placement.round) == (0, 1, 0)
        outcome: list[BaseException | object] = []
        waiter = threading.Thread(target=lambda: outcome.append(_begin(late)))
        waiter.start()
        deadline = time.monotonic() + 20
        while not int(host.store.add(host._key(1, "arrivals"), 0)):  # it registered for round 1
            assert time.monotonic() < deadline, "the late node never registered"
            time.sleep(0.02)
        assert host.finish(0) is None
        waiter.join(timeout=20)
        assert not waiter.is_alive(), "the waiting node was never told"
    finally:
        late.close()
        host.close()
    assert len(outcome) == 1 and isinstance(outcome[0], JobEnded), outcome
    assert "the job ended before this node was admitted" in str(outcome[0])


def _begin(coordinator: object) -> BaseException | object:
    try:
        return coordinator.begin(0)  # type: ignore[attr-defined]
    except BaseException as error:  # handed to the test's thread
        return error
