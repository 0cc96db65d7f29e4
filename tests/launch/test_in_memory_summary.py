"""The exit summary of `--recover in-memory`, in this process: the launcher's record of each lost
rank joined with the survivors' `tandem-recovery-*.json` (one line per recovery, in order; a
loss no survivor reported says so), the store key and the record the launcher writes, and the
refusal of more than one node. The fall-back to `restart`: the `able` keys (the worker side's
own), why a worker cannot go on, the line said at once and the summary's line, numbered across
attempts; the coordinator's fresh store per attempt on the same fixed port."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

import pytest

from tandem.launch.failures import Failure
from tandem.launch.in_memory import (
    NOT_STARTED,
    Fallback,
    InMemoryCoordinator,
    able_key,
    check_one_node,
    dead_key,
    death_record,
    fallback_line,
    fallback_summary,
    recovery_lines,
    recovery_reports,
    unable,
    why_unable,
)
from tandem.launch.rendezvous import LaunchError


def _write(directory, name, **report):
    path = directory / f"tandem-recovery-{name}.json"
    path.write_text(json.dumps(report))
    return path


def test_each_loss_joined_with_its_report_in_order(tmp_path):
    lost = [
        Failure(2, 2, "vm", -9, (), at=110.0),
        Failure(3, 3, "vm", 1, (), at=120.0),
        Failure(0, 0, "vm", -11, (), at=130.0),
    ]
    # Generation 2 covers two ranks lost at once (3, and 1 which the launcher never saw exit).
    _write(tmp_path, "b", generation=2, lost=[3, 1], members=[0], detected_s=0.52, step=12,
           recovered_s=1.26)  # fmt: skip
    _write(tmp_path, "a", generation=1, lost=[2], members=[0, 1, 3], detected_s=0.31, step=7,
           recovered_s=0.94)  # fmt: skip
    reports = recovery_reports(tmp_path)
    assert [r["generation"] for r in reports] == [1, 2]
    assert recovery_lines(lost, reports, started=100.0) == [
        "recovery 1: rank 2 (killed by SIGKILL) lost at step 7; detected in 0.3 s; step 7 "
        "redone by ranks 0,1,3 in 0.9 s",
        "recovery 2: ranks 1 (no exit seen by the launcher), 3 (exit code 1) lost at step 12; "
        "detected in 0.5 s; step 12 redone by rank 0 in 1.3 s",
        "recovery 3: rank 0 (killed by SIGSEGV) lost 30.0 s into the run; the survivors did "
        "not report a recovery",
    ]


def test_admissions_keep_their_place_and_one_cut_short_says_so(tmp_path):
    """Generation 2 admits rank 3; rank 2 is lost in its hand-over, so generation 3 re-forms
    with rank 3 still a newcomer (handed the run there); generation 4 admits rank 4. Each
    admission is told in its generation's place, not after every loss."""
    _write(tmp_path, "g1", generation=1, lost=[1], members=[0, 2], detected_s=0.1, step=3,
           recovered_s=0.9)  # fmt: skip
    _write(tmp_path, "g2", generation=2, lost=[], joined=[3], members=[0, 2, 3], step=5,
           recovered_s=2.0)  # fmt: skip
    _write(tmp_path, "g3", generation=3, lost=[2], joined=[3], members=[0, 3], detected_s=0.2,
           step=5, recovered_s=1.8)  # fmt: skip
    _write(tmp_path, "g4", generation=4, lost=[], joined=[4], members=[0, 3, 4], step=7,
           recovered_s=0.5)  # fmt: skip
    lost = [Failure(1, 1, "vm", -9, (), at=110.0), Failure(2, 2, "vm", -9, (), at=130.0)]
    assert recovery_lines(lost, recovery_reports(tmp_path), started=100.0) == [
        "recovery 1: rank 1 (killed by SIGKILL) lost at step 3; detected in 0.1 s; step 3 "
        "redone by ranks 0,2 in 0.9 s",
        "recovery 2: replacement rank 3 admitted after step 5; ranks 0,2,3 go on; cut short by "
        "the loss of rank 2 before the run was handed over",
        "recovery 3: rank 2 (killed by SIGKILL) lost at step 5; detected in 0.2 s; step 5 "
        "redone by ranks 0,3 in 1.8 s (replacement rank 3 handed the run in it)",
        "recovery 4: replacement rank 4 admitted after step 7; ranks 0,3,4 go on",
    ]


def test_one_generation_written_by_several_survivors_is_one_recovery(tmp_path):
    for rank, (detected, recovered) in enumerate([(0.2, 0.8), (0.4, 0.7)]):
        _write(tmp_path, f"g1-r{rank}", generation=1, lost=[2], members=[0, 1], step=3,
               detected_s=detected, recovered_s=recovered)  # fmt: skip
    (tmp_path / "tandem-recovery-broken.json").write_text("{not json")
    reports = recovery_reports(tmp_path)
    assert len(reports) == 1
    assert reports[0]["detected_s"] == 0.4 and reports[0]["recovered_s"] == 0.8
    lines = recovery_lines([Failure(2, 2, "vm", -9, (), at=5.0)], reports, started=0.0)
    assert lines == [
        "recovery 1: rank 2 (killed by SIGKILL) lost at step 3; detected in 0.4 s; step 3 "
        "redone by ranks 0,1 in 0.8 s"
    ]


def test_reports_of_other_runs_are_left_out(tmp_path):
    old = _write(tmp_path, "old", generation=1, lost=[1], members=[0])
    os.utime(old, (time.time() - 100, time.time() - 100))
    _write(tmp_path, "other", generation=2, lost=[1], members=[0], run_id="someone-else")
    _write(tmp_path, "ours", generation=3, lost=[1], members=[0], run_id="ours")
    found = recovery_reports(tmp_path, since=time.time() - 50, run_id="ours")
    assert [r["generation"] for r in found] == [3]


def test_a_report_without_a_committed_step_says_so(tmp_path):
    _write(tmp_path, "x", generation=1, lost=[1], members=[0, 2], detected_s=0.1, step=4)
    lines = recovery_lines([Failure(1, 1, "vm", -9, (), at=2.0)], recovery_reports(tmp_path), 0.0)
    assert lines == [
        "recovery 1: rank 1 (killed by SIGKILL) lost at step 4; detected in 0.1 s; no step "
        "committed after it by ranks 0,2"
    ]


def test_the_dead_key_and_its_record():
    assert dead_key(3, {}) == "tandem/recover/dead/3"
    assert dead_key(3, {"TANDEM_JOB_SECRET": "x"}).endswith("/recover/dead/3")
    assert dead_key(3, {"TANDEM_JOB_SECRET": "x"}).startswith("tandem/job-")
    record = death_record(Failure(3, 1, "vm", 2, ("Traceback",), at=12.5))
    assert json.loads(json.dumps(record)) == {
        "rank": 3,
        "how": "exit code 2",
        "at": 12.5,
        "returncode": 2,
        "local_rank": 1,
        "host": "vm",
    }


def test_more_than_one_node_is_refused():
    check_one_node("--nnodes 1", True)
    with pytest.raises(LaunchError, match="--nnodes 1:2: only a fixed number of nodes"):
        check_one_node("--nnodes 1:2", False)


SHARDED = "the model is sharded across ranks (FullyShardedDataParallel)"


def test_the_able_key_is_the_worker_sides():
    from tandem import recovery

    assert able_key(3, {}) == "tandem/recover/able/3"
    assert (
        able_key(3, {"TANDEM_JOB_SECRET": "x"})
        == dead_key(3, {"TANDEM_JOB_SECRET": "x"})[: -len("dead/3")] + "able/3"
    )
    # What tandem.recovery writes (Recoverer, declare_unable), in this process's scope.
    assert able_key(3) == f"{recovery.PREFIX}able/3"
    assert dead_key(3) == f"{recovery.PREFIX}dead/3"
    assert recovery.ABLE == "1"


def test_who_cannot_go_on_in_memory_and_why():
    said = {0: "1", 1: f"no: {SHARDED}", 2: None, 3: "no:", 4: "maybe"}
    assert unable(said) == {
        1: SHARDED,
        2: NOT_STARTED,
        3: "it said 'no:'",
        4: "it said 'maybe'",
    }
    assert unable({0: "1", 2: "1"}) == {}
    assert why_unable({0: SHARDED, 2: SHARDED}) == SHARDED
    assert why_unable({2: SHARDED}, ranks=True) == f"rank 2: {SHARDED}"
    assert why_unable({2: SHARDED, 0: "x", 1: SHARDED}) == f"rank 0: x; ranks 1, 2: {SHARDED}"


def test_the_fallback_line_said_at_once():
    lost = (Failure(1, 1, "vm", -9, ("Traceback", "boom"), at=7.0),)
    restarting = Fallback(lost, {0: SHARDED, 2: NOT_STARTED}, restart=2, max_restarts=3)
    assert fallback_summary(restarting) == (
        "tandem run: rank 1 (killed by SIGKILL) was lost and ranks 0, 2 cannot be recovered in "
        f"memory (rank 0: {SHARDED}; rank 2: {NOT_STARTED}): restarting every worker from the "
        "last checkpoint (restart 2 of 3; --recover in-memory falls back to restart)"
    )
    two = (Failure(1, 1, "vm", -9, (), at=7.0), Failure(3, 3, "vm", 1, (), at=7.01))
    ending = Fallback(two, {}, restart=0, max_restarts=0)
    assert fallback_summary(ending) == (
        "tandem run: ranks 1 (killed by SIGKILL), 3 (exit code 1) were lost and no worker is "
        "left to go on in memory: stopping every worker; no restart is left to resume them from "
        "the last checkpoint (--max-restarts 0; --recover in-memory falls back to restart)"
    )
    assert ending.at == 7.0
    assert "\n" not in fallback_summary(restarting)  # one line; the tail is the failure report's


def test_the_fallback_in_the_summary():
    lost = (Failure(1, 1, "vm", -9, (), at=107.2),)
    assert fallback_line(Fallback(lost, {0: SHARDED, 2: SHARDED}, 1, 1), started=100.0) == (
        "rank 1 (killed by SIGKILL) lost 7.2 s into the run; not recoverable in memory (ranks "
        f"0, 2: {SHARDED}): every worker restarted (restart 1 of 1) from the last checkpoint"
    )
    assert fallback_line(Fallback(lost, {0: SHARDED}, 0, 0), started=100.0) == (
        "rank 1 (killed by SIGKILL) lost 7.2 s into the run; not recoverable in memory (rank 0: "
        f"{SHARDED}): every worker stopped, no restart left (--max-restarts 0)"
    )
    nobody = Fallback((Failure(0, 0, "vm", 3, (), at=0.0),), {}, 1, 2)
    assert fallback_line(nobody, started=100.0) == (
        "rank 0 (exit code 3) lost at its end; no worker left to go on in memory: every worker "
        "restarted (restart 1 of 2) from the last checkpoint"
    )


def test_a_fallback_ends_its_attempt_and_the_next_attempt_counts_on(tmp_path):
    """Attempt 0: rank 2 lost and recovered in memory, then rank 1 lost with rank 0 unable (a
    fall-back, last whatever the times). Attempt 1 (its ranks anew): rank 1 lost, recovered."""
    _write(tmp_path, "a", generation=1, lost=[2], members=[0, 1], detected_s=0.2, step=4,
           recovered_s=0.5)  # fmt: skip
    first = recovery_lines(
        [Failure(2, 2, "vm", -9, (), at=103.0)],
        recovery_reports(tmp_path),
        started=100.0,
        fallback=Fallback((Failure(1, 1, "vm", 1, (), at=105.0),), {0: SHARDED}, 1, 1),
    )
    assert first == [
        "recovery 1: rank 2 (killed by SIGKILL) lost at step 4; detected in 0.2 s; step 4 "
        "redone by ranks 0,1 in 0.5 s",
        "recovery 2: rank 1 (exit code 1) lost 5.0 s into the run; not recoverable in memory "
        f"(rank 0: {SHARDED}): every worker restarted (restart 1 of 1) from the last checkpoint",
    ]
    second = recovery_lines(
        [Failure(1, 1, "vm", -9, (), at=109.0)], [], started=100.0, first=len(first) + 1
    )
    assert second == [
        "recovery 3: rank 1 (killed by SIGKILL) lost 9.0 s into the run; the survivors did not "
        "report a recovery"
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_attempt_gets_a_fresh_store_on_the_same_port():
    from torch.distributed import TCPStore

    def client(port: int) -> TCPStore:
        return TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))

    port = _free_port()
    coordinator = InMemoryCoordinator("127.0.0.1", port)
    try:
        first = coordinator.begin(0)
        assert (first.port, first.round) == (port, 0)
        worker = client(port)
        worker.set(able_key(0), "1")
        worker.set(able_key(1), f"no: {SHARDED}")
        assert coordinator.able([0, 1, 2]) == {0: "1", 1: f"no: {SHARDED}", 2: None}
        coordinator.report_failure(0, Failure(2, 2, "vm", -9, (), at=1.0))
        assert worker.check([dead_key(2)])
        del worker
        second = coordinator.begin(1)  # the restart: the old store closed, the port bound anew
        assert (second.port, second.round) == (port, 1)
        assert second.env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert second.env["TANDEM_RECOVER"] == "in-memory"
        again = client(port)
        assert not again.check([able_key(0)]) and not again.check([dead_key(2)])
        assert coordinator.able([0, 1]) == {0: None, 1: None}
    finally:
        coordinator.close()
    assert coordinator.able([0]) == {0: None}


def test_a_replacement_admitted_is_a_line_of_its_own():
    lost = [Failure(1, 1, "vm", -9, (), at=103.0)]
    reports = [
        {"generation": 1, "lost": [1], "members": [0, 2], "step": 2, "detected_s": 0.1,
         "recovered_s": 0.4},
        {"generation": 2, "lost": [], "joined": [3], "members": [0, 2, 3], "step": 9,
         "detected_s": None, "recovered_s": 1.2},
    ]  # fmt: skip
    assert recovery_lines(lost, reports, started=100.0) == [
        "recovery 1: rank 1 (killed by SIGKILL) lost at step 2; detected in 0.1 s; step 2 "
        "redone by ranks 0,2 in 0.4 s",
        "recovery 2: replacement rank 3 admitted after step 9; ranks 0,2,3 go on",
    ]
