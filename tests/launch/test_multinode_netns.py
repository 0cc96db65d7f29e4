"""`tandem run` on two nodes for real: two network namespaces, one launcher in each, four ranks.

Each namespace is a node with its own address and port space (see :mod:`tests.launch.netns`),
joined to the other by a veth link, so the launchers meet over the network as on two hosts:
node 1's launcher only finds node 0 at ``--master-addr``, and Gloo connects in both directions.

Proves: both launchers exit 0; exactly the ranks 0..3 report, each once, with world size 4; a
node's launcher starts ranks ``node_rank * nproc_per_node + local_rank`` and only those (the
``[rank N]`` prefix it adds agrees with the rank the worker read); every rank ends with the same
parameter hash after training on its own data, and those parameters match the same model
trained by one process on all four ranks' data (so the gradients were averaged over the four,
not within each node). Skipped, with the reason, only where namespaces cannot be made.

Manual check of the namespace setup and the script against torchrun (same flags)::

    python -m tests.launch.test_multinode_netns torchrun
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch.netns import Node, can_make_namespaces, two_nodes

pytestmark = pytest.mark.launch

NNODES = 2
NPROC_PER_NODE = 2
WORLD_SIZE = NNODES * NPROC_PER_NODE
# Node 0's namespace is brand new: nothing in it holds a port, so a fixed one cannot be taken.
MASTER_PORT = 29400
TIMEOUT_S = 120.0
# After one launcher fails, how long the other may take to report the lost peer.
FAILURE_GRACE_S = 15.0
# The ranks train float32 on batches a quarter of the reference's: summation order differs.
MAXDIFF_TOLERANCE = 1e-5

SCRIPT = Path(__file__).with_name("train_nodes.py")
LAUNCHERS = {
    "tandem": [sys.executable, "-m", "tandem.cli", "run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}

# A launcher's variables inherited from the shell running pytest (say, an srun allocation)
# would make the workers join that job instead of this one.
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_")
_TORCHRUN_VARIABLES = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
}

_REPORT = re.compile(
    r"^(?:\[rank (\d+)\] )?RANK (\d+) LOCAL (\d+) WORLD (\d+) NODE (\d+) HASH ([0-9a-f]{64}) "
    r"MAXDIFF (\S+)$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Report:
    prefix: int | None  # the launcher's "[rank N]", None where it adds none (torchrun)
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    params_hash: str
    maxdiff: float


@dataclass(frozen=True)
class NodeRun:
    node_rank: int
    command: list[str]
    returncode: int | None  # None: stopped, still running at the timeout or after a peer failed
    output: str

    def shown(self) -> str:
        return f"node {self.node_rank}: exit {self.returncode}\n$ {' '.join(self.command)}\n" + (
            self.output
        )

    def reports(self) -> list[Report]:
        return [
            Report(
                prefix=int(prefix) if prefix else None,  # findall gives "" for no match
                rank=int(rank),
                local_rank=int(local),
                world_size=int(world),
                node_rank=int(node),
                params_hash=digest,
                maxdiff=float(maxdiff),
            )
            for prefix, rank, local, world, node, digest, maxdiff in _REPORT.findall(self.output)
        ]


def _env(node: Node) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _TORCHRUN_VARIABLES and not k.startswith(_LAUNCHER_PREFIXES)
    }
    # Gloo otherwise binds to the address the hostname resolves to: the namespaces share the
    # host's hostname, often mapped to 127.0.0.1, which the other node cannot reach (without
    # this line the run fails in Gloo's connect). Name the veth instead.
    env["GLOO_SOCKET_IFNAME"] = node.interface
    # CPU and Gloo: on a machine with one GPU, four ranks cannot have one each.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_two_nodes(launcher: list[str], logs: Path) -> list[NodeRun]:
    """Start one launcher per node at once, wait for both (at most TIMEOUT_S), return each run."""
    with two_nodes() as (node0, node1):
        started = []
        for node_rank, node in enumerate((node0, node1)):
            command = node.exec(
                [
                    *launcher,
                    "--nnodes", str(NNODES),
                    "--node-rank", str(node_rank),
                    "--nproc-per-node", str(NPROC_PER_NODE),
                    "--master-addr", node0.address,
                    "--master-port", str(MASTER_PORT),
                    str(SCRIPT),
                ]
            )  # fmt: skip
            log = logs / f"node{node_rank}.log"
            with log.open("w") as sink:
                # A session of its own, so that at the timeout the launcher and its workers can
                # be stopped together: a worker left running would keep the namespace alive.
                process = subprocess.Popen(
                    command,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    env=_env(node),
                    start_new_session=True,
                )
            started.append((node_rank, command, process, log))

        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and any(p.poll() is None for _, _, p, _ in started):
            if any(p.poll() not in (None, 0) for _, _, p, _ in started):
                # The other node now waits on a peer that is gone: give it a moment to say so.
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            time.sleep(0.1)
        runs = []
        for node_rank, command, process, log in started:
            returncode = process.poll()
            # Also reaches workers that an exited launcher left behind: each would keep its
            # namespace alive. No such process group: everyone in it is gone already.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            runs.append(NodeRun(node_rank, command, returncode, log.read_text()))
        return runs


def check_two_nodes(runs: list[NodeRun]) -> None:
    """Every assertion of this module's docstring, on the two launchers' runs."""
    shown = "\n\n".join(run.shown() for run in runs)
    # A failure first: the other node, stopped after it, is a consequence ("exit None").
    for run in runs:
        assert run.returncode in (None, 0), f"node {run.node_rank} failed\n{shown}"
    for run in runs:
        assert run.returncode is not None, f"node {run.node_rank} ran past {TIMEOUT_S} s\n{shown}"

    everyone: list[Report] = []
    for run in runs:
        reports = run.reports()
        expected = {run.node_rank * NPROC_PER_NODE + local for local in range(NPROC_PER_NODE)}
        assert sorted(r.rank for r in reports) == sorted(expected), (
            f"node {run.node_rank} should run ranks {sorted(expected)}\n{shown}"
        )
        for r in reports:
            assert r.node_rank == run.node_rank, (
                f"rank {r.rank} reports node {r.node_rank}\n{shown}"
            )
            assert r.rank == r.node_rank * NPROC_PER_NODE + r.local_rank, f"{r}\n{shown}"
            assert r.prefix in (None, r.rank), f"line of rank {r.rank} prefixed {r.prefix}\n{shown}"
        everyone += reports

    assert sorted(r.rank for r in everyone) == list(range(WORLD_SIZE)), shown
    assert {r.world_size for r in everyone} == {WORLD_SIZE}, shown
    assert len({r.params_hash for r in everyone}) == 1, f"replicas differ\n{shown}"
    assert max(r.maxdiff for r in everyone) < MAXDIFF_TOLERANCE, (
        f"parameters differ from one process trained on all {WORLD_SIZE} ranks' data\n{shown}"
    )


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_nodes_in_network_namespaces_train_as_one_job(tmp_path: Path) -> None:
    ok, reason = can_make_namespaces()
    if not ok:
        pytest.skip(reason)
    runs = run_two_nodes(LAUNCHERS["tandem"], tmp_path)
    check_two_nodes(runs)
    # The launcher's contract: every worker line carries its rank.
    assert all(r.prefix is not None for run in runs for r in run.reports()), runs[0].output


if __name__ == "__main__":
    import tempfile

    name = sys.argv[1] if len(sys.argv) > 1 else "torchrun"
    ok, reason = can_make_namespaces()
    if not ok:
        sys.exit(f"cannot run: {reason}")
    with tempfile.TemporaryDirectory() as logs:
        started = time.monotonic()
        runs = run_two_nodes(LAUNCHERS[name], Path(logs))
        print("\n\n".join(run.shown() for run in runs))
        check_two_nodes(runs)
    print(f"{name}: two nodes OK in {time.monotonic() - started:.1f} s")
