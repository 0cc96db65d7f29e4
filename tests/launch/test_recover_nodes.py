"""`tandem run --recover in-memory` on many nodes: a lost worker replaced on its own node, and the
fall-back to a restart of every node's workers.

Each node is a network namespace behind one switch (:mod:`tests.launch.netns_switch`), running
its own `tandem run --nnodes N --node-rank i --recover in-memory --max-restarts ...`; node 0's
launcher hosts the job's store. Proves:

- **replacement on many nodes** (2 nodes of 2 ranks, ``tandem.recovery.Run``'s worker of the
  recovery tests): rank 1 (node 0, the store's) and rank 3 (node 1) SIGKILLed at the same step;
  each node's launcher starts the replacement of its own worker, on its own node, and the two
  get launch ranks 4 and 5, one each (taken from the job's counter in the store: two launchers
  counting on their own would both give out 4); the survivors admit them at a step boundary
  (rank 0 waits at step 4 until both have started, so that the run does not end first),
  and the run ends **bitwise** where the chain of saves and resumes with the observed
  membership schedule ends; every one of the 6 workers and both launchers are accounted for;
- **fall-back to restart on many nodes**, with the real Trainer of the one-node fall-back test
  (tandem.ShardedOptimizer, 2 nodes of 1 rank, a checkpoint every 2 steps): rank 1 SIGKILLed
  at step 5 makes node 1's launcher end the attempt on every node; both launchers stop their
  workers and start them again together (restart 1 of 1), the workers resume from the
  checkpoint of step 4, and the final checkpoint equals, bitwise, that of the run without the
  kill;
- the restarted workers of every node meet in a **fresh store**: none of the keys of the
  attempt before (its dead mark, the workers' own) is there (``recover_worker.py``'s FRESH);
  with no restart left (``--max-restarts 0``) every node stops its workers and ends non-zero;
- a replacement on a node whose members are all gone, while the members on the other node
  run to their end, is stopped once no member is left on any node (nobody can admit it).

Skipped, with the reason, where network namespaces or a bridge cannot be made.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.launch.netns_switch import Switch
from tests.launch.test_recover_fallback import assert_bitwise
from tests.launch.test_recover_partition import BEAT_S, Launchers, start_nodes
from tests.launching import final_checkpoint, run_job
from tests.recovery.chains import Chains, resumes
from tests.recovery.test_recovery import assert_equal_runs, leftovers

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

RECOVERY_WORKER = "tests.recovery.recovery_worker"
FALLBACK_WORKER = "tests.launch.fallback_worker"
RECOVER_WORKER = str(Path(__file__).with_name("recover_worker.py"))


class Job(Launchers):
    """One `tandem run` per node (``nproc`` ranks each, ``flags`` more), the outputs in files."""

    def __init__(
        self, net: Switch, logs: Path, nproc: int, flags: list[str], worker: list[str],
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.logs = [logs / f"node{i}.log" for i in range(len(net.nodes))]
        super().__init__(self.logs, start_nodes(net, self.logs, nproc, [*flags, *worker], env))

    def shown(self) -> str:
        return "\n".join(
            f"--- node {i} (exit {p.poll()}) ---\n{self.text(i)[-6000:]}"
            for i, p in enumerate(self.procs)
        )

    def started(self, ranks: list[int], out: Path, within: float) -> None:
        """Wait until the worker of every launch rank of ``ranks`` wrote its pid file."""
        deadline = time.monotonic() + within
        while not all(out.with_name(f"{out.name}.pid-{r}").exists() for r in ranks):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                pytest.fail(f"ranks {ranks} never started\n{self.shown()}")
            time.sleep(0.1)

    def accounted_for(self, marker: Path, workers: set[int] = frozenset()) -> None:
        """No launcher (nor its session), no worker of ``workers`` (nor its process group), and
        no process at all whose command line names ``marker`` (every worker's does) is left."""
        pids = set(workers) | {p.pid for p in self.procs}
        deadline = time.monotonic() + 5
        while (leftovers(pids) or naming(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not leftovers(pids), f"{leftovers(pids)}\n{self.shown()}"
        assert not naming(marker), f"{naming(marker)}\n{self.shown()}"


def naming(marker: Path) -> list[str]:
    """The processes whose command line holds ``marker`` (this test's directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                if str(marker) in command:
                    found.append(f"{entry.name}: {command[:200]}")
    return found


@contextlib.contextmanager
def job(*args, **kwargs) -> Iterator[Job]:
    started = Job(*args, **kwargs)
    try:
        yield started
    finally:
        started.stop()


def chain(chains: Chains, size: int, recoveries: list[dict], epochs: tuple[str, ...]) -> dict:
    """The oracle of a run with ``recoveries`` (each: the step, the members after it): train at
    ``size`` ranks to the first one's step and save, resume at its members' count to the next
    one's step and save, ... and resume to the end (the one-node chain of
    tests/recovery/test_replacement.py, for any schedule), in one launch
    (:mod:`tests.recovery.chains`)."""
    steps = [(recovery["step"], len(recovery["members"])) for recovery in recoveries]
    (end,) = chains.get(resumes(size, steps, epochs))
    return torch.load(end, weights_only=True)


@pytest.mark.timeout(400)
def test_a_lost_worker_is_replaced_on_its_own_node_with_a_launch_rank_unique_in_the_job(
    net_of, tmp_path, chains
):
    net = net_of(2)
    out = tmp_path / "grown.pt"
    epochs = ("--epochs", "2")
    worker = ["-m", RECOVERY_WORKER, str(out), *epochs, "--pause", "0:4", "--step-sleep", "0.1"]
    worker += ["--kill", "1:2:forward", "--kill", "3:2:forward"]
    with job(net, tmp_path, 2, ["--max-restarts", "1"], worker) as run:
        # Rank 0 waits before its backward at step 4 until both replacements are up and have
        # asked to join (a moment after their start), so that the run does not end first.
        run.started([4, 5], out, within=150)
        time.sleep(3 * BEAT_S)
        out.with_name(f"{out.name}.go-0").touch()
        codes = run.finish(150)
        pids = {int(p.read_text()) for p in tmp_path.glob("grown.pt.pid-*")}
        run.accounted_for(tmp_path, pids)
    shown = run.shown()
    assert codes == [0, 0], shown
    # Each node's launcher replaced its own worker, on its own node, with a rank of its own.
    started = {}
    for node in (0, 1):
        found = re.findall(
            rf"starting rank (\d+) to replace rank (\d+) \(replacement 1 of 1 on node {node}\)",
            run.text(node),
        )
        assert len(found) == 1, shown
        started[int(found[0][1])] = int(found[0][0])
    assert sorted(started) == [1, 3], shown
    assert sorted(started.values()) == [4, 5], shown  # unique in the job, not per node
    assert len(pids) == 6, shown  # 4 workers and 2 replacements, each its own launch rank

    grown = torch.load(out, weights_only=True)
    recoveries = grown["recoveries"]
    lost = sorted(r for rec in recoveries for r in rec["lost"])
    joined = sorted(r for rec in recoveries for r in rec.get("joined") or [])
    assert lost == [1, 3] and joined == [4, 5], recoveries
    assert all(rec["step"] == 2 for rec in recoveries if rec["lost"]), recoveries
    assert grown["world_size"] == 4, recoveries
    assert sorted(recoveries[-1]["members"]) == [0, 2, 4, 5], recoveries
    for rec in recoveries:
        if rec.get("joined"):
            said = f"replacement rank{'s' if len(rec['joined']) > 1 else ''} "
            assert said + ", ".join(map(str, rec["joined"])) in run.text(0), shown
    assert_equal_runs(grown, chain(chains, 4, recoveries, epochs))


@pytest.mark.timeout(400)
def test_a_loss_not_recoverable_in_memory_restarts_every_nodes_workers_from_the_checkpoint(
    net_of, tmp_path
):
    net = net_of(2)
    oracle = tmp_path / "oracle"
    run_job(2, [], FALLBACK_WORKER, str(oracle))
    killed = tmp_path / "killed"
    worker = ["-m", FALLBACK_WORKER, str(killed), "--kill", "1:5"]
    with job(net, tmp_path, 1, ["--max-restarts", "1"], worker) as run:
        codes = run.finish(240)
        run.accounted_for(tmp_path)
    shown = run.shown()
    assert codes == [0, 0], shown
    # Node 1 saw its worker lost and rank 0 unable (sharded): it ended the attempt everywhere.
    assert re.search(
        r"^tandem run: rank 1 \(killed by SIGKILL\) was lost and rank 0 cannot be recovered in "
        r"memory \(.*sharded across ranks.*\): restarting every worker on every node from the "
        r"last checkpoint \(restart 1 of 1; --recover in-memory falls back to restart\)$",
        run.text(1),
        re.M,
    ), shown
    assert re.search(
        r"^tandem run: another node ended the attempt; this node's workers were stopped and start "
        r"again \(restart 1 of 1\): rank 1 \(killed by SIGKILL\) was lost",
        run.text(0),
        re.M,
    ), shown
    for node in (0, 1):  # the summary lists the fall-back on every node
        assert re.search(
            r"^tandem run: recovery 1: rank 1 \(killed by SIGKILL\) lost [\d.]+ s into the run; "
            r"not recoverable in memory \(rank 0: .*\): every worker on every node restarted "
            r"\(restart 1 of 1\) from the last checkpoint$",
            run.text(node),
            re.M,
        ), shown
    # The restarted workers resumed from the checkpoint before the kill.
    assert re.search(
        r"^\[rank 0\] resumed from .*ckpt-e0000-s00000004\.pt: epoch 1, batch 4, step 4$",
        run.text(0),
        re.M,
    ), shown
    got, expected = final_checkpoint(killed), final_checkpoint(oracle)
    assert expected["trainer"]["step"] == 12
    assert_same_trainer_run(got, expected)


@pytest.mark.timeout(200)
def test_every_nodes_restarted_workers_meet_in_a_fresh_store(net_of, tmp_path):
    net = net_of(2)
    # Rank 0 (node 0) says it cannot recover in memory; rank 1 (node 1) dies once every rank
    # has said so: a fall-back; restarted, each rank looks for the attempt before's keys.
    able = json.dumps(["no: the model is sharded", "1"])
    worker = [RECOVER_WORKER, "kill", "1"]
    with job(net, tmp_path, 1, ["--max-restarts", "1"], worker, env={"TEST_ABLE": able}) as run:
        codes = run.finish(120)
        run.accounted_for(tmp_path)
    shown = run.shown()
    assert codes == [0, 0], shown
    for node in (0, 1):
        assert f"[rank {node}] FRESH" in run.text(node), shown
        assert f"[rank {node}] DONE rank {node}" in run.text(node), shown
        assert "STALE" not in run.text(node), shown
        assert '"TORCHELASTIC_RESTART_COUNT": "1"' in run.text(node), shown


@pytest.mark.timeout(200)
def test_a_replacement_on_another_node_than_the_members_is_stopped_once_they_are_done(
    net_of, tmp_path
):
    """Rank 1 (node 1) is lost while rank 0 (node 0) goes on; node 1 starts its replacement,
    which these workers never admit (``recover_worker.py``'s replacement waits 120 s). Once rank
    0 is done, node 1's launcher sees no member left on any node and stops it: nothing waits
    for an admission that cannot come."""
    net = net_of(2)
    worker = [RECOVER_WORKER, "kill", "1"]
    begun = time.monotonic()
    with job(net, tmp_path, 1, ["--max-restarts", "1"], worker, env={"TEST_ADMITS": "1"}) as run:
        codes = run.finish(100)
        took = time.monotonic() - begun
        run.accounted_for(tmp_path)
    shown = run.shown()
    assert codes[0] == 0, shown  # its worker ran to completion
    assert codes[1] != 0, shown  # every worker of node 1 was lost (the replacement stopped)
    assert "starting rank 2 to replace rank 1 (replacement 1 of 1 on node 1)" in run.text(1)
    assert "[rank 2] JOINING" in run.text(1), shown
    assert "replacement rank 2 was not admitted: the job ended first" in run.text(1), shown
    assert "replace" not in run.text(0), shown  # node 0 lost nothing: it starts nothing
    assert took < 90, shown  # not the replacement's 120 s


@pytest.mark.timeout(200)
def test_with_no_restart_left_every_node_stops_its_workers_and_ends_non_zero(net_of, tmp_path):
    """The same fall-back with ``--max-restarts 0``: node 1 says no restart is left, both
    launchers stop their workers and end non-zero at once (left alone, rank 0 would give up
    waiting for a dead mark that the fall-back never writes after 30 s), and neither starts a
    worker again."""
    net = net_of(2)
    able = json.dumps(["no: the model is sharded", "1"])
    worker = [RECOVER_WORKER, "kill", "1"]
    begun = time.monotonic()
    with job(net, tmp_path, 1, [], worker, env={"TEST_ABLE": able}) as run:
        codes = run.finish(100)
        took = time.monotonic() - begun
        run.accounted_for(tmp_path)
    shown = run.shown()
    assert codes[0] != 0 and codes[1] != 0, shown
    assert (
        "was lost and rank 0 cannot be recovered in memory (the model is sharded): stopping "
        "every worker on every node; no restart is left to resume them from the last checkpoint "
        "(--max-restarts 0; --recover in-memory falls back to restart)"
    ) in run.text(1), shown
    assert "another node ended the job; this node's workers were stopped" in run.text(0), shown
    for node in (0, 1):
        assert "every worker on every node stopped, no restart left" in run.text(node), shown
        assert '"TORCHELASTIC_RESTART_COUNT": "1"' not in run.text(node), shown
    # Rank 0 was stopped by its launcher, not by its own 30 s wait for a dead mark.
    assert "rank 0: no " not in run.text(0), shown
    assert took < 60, shown


def assert_same_trainer_run(got: dict, expected: dict) -> None:
    """Two Trainer checkpoints hold the same run, bitwise: model, optimizer, the Trainer's
    position and every rank's generator."""
    assert_bitwise(got["model"], expected["model"], "model")
    assert_bitwise(got["optimizer"], expected["optimizer"], "optimizer")
    for key in ("world_size", "epoch", "step", "batch", "sampler"):
        assert got["trainer"][key] == expected["trainer"][key], key
    for rank, (a, b) in enumerate(
        zip(got["trainer"]["ranks"], expected["trainer"]["ranks"], strict=True)
    ):
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]), f"rank {rank}'s generator"
