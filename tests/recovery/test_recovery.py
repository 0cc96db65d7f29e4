"""Recovery in memory: survivors of a SIGKILLed rank re-form and end as a resume would.

Proves, with real processes over Gloo and a real TCPStore hosted outside the workers (as
``tandem run --recover in-memory`` hosts it):

- a rank SIGKILLed during a step (before its backward: the others are inside the gradient
  all-reduce; or after it: the others' all-reduce is done and they wait in the commit) costs
  that step only: the survivors re-form a group of 2 and redo it;
- the run then ends **bitwise** equal to the oracle: the same job trained to that step at 3
  ranks, saved, and resumed at 2 ranks (parameters and optimizer state);
- the recovery is recorded (lost rank, members, the step redone, times), and a rank that the
  others left out stops with an error instead of training alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import free_port
from tests.launching import clean_env

pytestmark = pytest.mark.launch

WORKER = "tests.recovery.recovery_worker"
ROOT = Path(__file__).resolve().parents[2]


def start(nproc: int, args: list[str], recover: bool, port: int) -> list[subprocess.Popen]:
    procs = []
    for rank in range(nproc):
        env = {
            **clean_env(),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_RUN_ID": "recovery-test",
            "PYTHONPATH": str(ROOT),
        }
        if recover:
            env["TANDEM_RECOVER"] = "in-memory"
            env["TANDEM_HEARTBEAT_TIMEOUT"] = "3"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", WORKER, *args],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def launch(nproc: int, args: list[str], recover: bool = False, timeout: float = 120) -> list:
    """Start ``nproc`` workers around a store this process hosts (the launcher's part: a
    worker that dies is marked dead in the store, the others go on); each one's exit code."""
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    procs = start(nproc, args, recover, port)
    deadline = time.monotonic() + timeout
    marked: set[int] = set()
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]  # every one polled, every time
        if None not in codes:
            break
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in marked:
                marked.add(rank)
                how = json.dumps({"rank": rank, "how": f"exit {code}", "at": time.time()})
                store.set(f"tandem/recover/dead/{rank}", how)
        time.sleep(0.02)
    for p in procs:
        if p.poll() is None:
            p.kill()
    outputs = [p.communicate()[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outputs, strict=True)]


def oracle(tmp_path: Path, step: int) -> dict:
    """Train at 3 ranks to ``step``, save, resume at 2 ranks to the end."""
    half = tmp_path / "half.pt"
    first = launch(3, [str(half), "--stop-after", str(step)])
    assert all(code == 0 for code, _ in first), first
    end = tmp_path / "oracle.pt"
    second = launch(2, [str(end), "--resume", str(half)])
    assert all(code == 0 for code, _ in second), second
    return torch.load(end, weights_only=True)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("where", ["forward", "commit"])
def test_a_killed_rank_costs_one_step_and_the_run_equals_a_resume(tmp_path, where):
    step = 3
    out = tmp_path / "recovered.pt"
    results = launch(3, [str(out), "--kill", f"2:{step}:{where}"], recover=True)
    codes = [code for code, _ in results]
    assert codes[:2] == [0, 0] and codes[2] == -9, results
    recovered = torch.load(out, weights_only=True)
    (recovery,) = recovered["recoveries"]
    assert recovery["lost"] == [2] and recovery["members"] == [0, 1], recovery
    assert recovery["step"] == step and recovery["generation"] == 1, recovery
    assert recovery["recovered_s"] is not None and recovery["recovered_s"] < 30, recovery
    assert recovered["world_size"] == 2

    expected = oracle(tmp_path, step)
    assert recovered["steps"] == expected["steps"]
    assert recovered["run"] == expected["run"]
    for key, value in expected["model"].items():
        assert torch.equal(recovered["model"][key], value), key
    for k, state in expected["optimizer"]["state"].items():
        got = recovered["optimizer"]["state"][k]["momentum_buffer"]
        assert torch.equal(got, state["momentum_buffer"]), k
