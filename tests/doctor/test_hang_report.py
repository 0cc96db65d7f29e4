"""A rank that hangs is named, with its line and stack; the rank that waits is not blamed.

Real processes: rank 1 sleeps in ``load_batch`` (a slow disk, a stuck loader) while rank 0 waits,
first in the user's own ``dist.all_reduce``, then in tandem.DDP's bucket all-reduce. With the
report threshold set to 1.5 s, rank 0 reports within seconds: "rank 1 never entered
all_reduce #N", where rank 1 is (this file, ``load_batch``) and its stack; the report is printed
once and written as JSON. The job is not stopped: when rank 1 wakes, both finish. One doctor
thread per process answers for the hang reports and for tandem.DDP's lockstep check alike.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.doctor import hang
from tests.harness import run_ranks

SLEEP_S = 6.0


def load_batch() -> None:
    time.sleep(SLEEP_S)  # the hang: a slow disk, a stuck data loader


def _hung_peer(kind: str) -> dict:
    tandem.init()  # adopts the harness's group and starts the doctor
    rank = dist.get_rank()
    if kind == "user":
        if rank == 1:
            load_batch()
        dist.all_reduce(torch.ones(2))
    else:
        torch.manual_seed(0)
        model = tandem.DDP(nn.Linear(4, 2))
        x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
        for step in range(2):
            if rank == 1 and step == 1:
                load_batch()
            F.cross_entropy(model(x), y).backward()
    threads = [t.name for t in threading.enumerate()]
    return {"reports": list(hang.Reporter.reports), "threads": threads}


def _check(tmp_path: Path, kind: str, capfd) -> None:
    env = {"TANDEM_HANG_REPORT_AFTER": "1.5", "TANDEM_REPORT_DIR": str(tmp_path)}
    start = time.monotonic()
    first, second = run_ranks(_hung_peer, 2, args=(kind,), env=env, timeout=90)
    assert time.monotonic() - start < 60  # the job went on and finished once rank 1 woke
    assert second["reports"] == []  # rank 1 never waited long in a collective
    for result in (first, second):
        doctors = [n for n in result["threads"] if n in ("tandem-doctor", "tandem-lockstep")]
        assert doctors == ["tandem-doctor"], result["threads"]
    (report,) = first["reports"]
    laggards = report["laggards"]
    op = "all_reduce #" if kind == "user" else "broadcast #6"
    assert len(laggards) == 1 and laggards[0].startswith(f"rank 1 never entered {op}"), report[
        "text"
    ]
    assert "test_hang_report.py" in laggards[0] and "in load_batch" in laggards[0], laggards
    if kind == "ddp":  # rank 0 waits in step 2's first collective, the bucket rebuild (step 1
        # issued one: its bucket; the end-of-backward check rode in it)
        assert "broadcast #6 (DDP bucket rebuild, step 2)" in report["text"], report["text"]
    assert "time.sleep(SLEEP_S)" in report["text"]  # rank 1's stack
    assert "rank 0 never" not in report["text"]
    files = list(tmp_path.glob("tandem-hang-rank0-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["laggards"] == laggards
    printed = capfd.readouterr().err
    assert printed.count("tandem: rank 0 has waited") <= 1


@pytest.mark.distributed
def test_hung_peer_in_user_collective_is_named(tmp_path, capfd):
    _check(tmp_path, "user", capfd)


@pytest.mark.distributed
def test_hung_peer_in_ddp_step_is_named(tmp_path, capfd):
    _check(tmp_path, "ddp", capfd)


def test_a_threshold_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="hang_report_after must be > 0 seconds, got -1"):
        tandem.init(hang_report_after=-1)
