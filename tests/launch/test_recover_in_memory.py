"""`tandem run --recover in-memory` on one node: a lost worker does not stop the others.

- The launcher hosts the job's store before the workers start; the workers get
  `TORCHELASTIC_USE_AGENT_STORE=True` and `TANDEM_RECOVER=in-memory` (neither under the
  default `restart`), so every rank is a client of it.
- A SIGKILLed rank (1, or rank 0: the store survives it) is announced at
  `tandem/recover/dead/<rank>` ({"rank", "how", "at"}); the others go on, read it, still use
  the store, and finish; the launcher exits 0 and its summary names the rank and SIGKILL.
- `tandem.init()` and torch's own `env://` rendezvous work over the launcher's store.
- Every worker failing is a failure, reported as under `restart`, with a non-zero status.
- A survivor's `tandem-recovery-*.json` is joined with the launcher's record in the summary.
- A static MIN:MAX (elastic needs c10d), a host file of several hosts: refused, naming the value.
- The default `restart` is unchanged (`test_run.py`: the first failure stops the others).
- A loss with a worker still running that did not say `able` "1" (a sharded Trainer's "no:
  ...", or nothing: a plain script) falls back to `restart`: one line at once, every worker
  stopped; with `--max-restarts 1` all restarted (TORCHELASTIC_RESTART_COUNT 1, the user's
  port, a fresh store: no key of the attempt before) and the job ends 0; with none left the
  failure report and status. The restarted workers recover in memory again; the last survivors
  failing restarts too while a restart is left; the summary numbers every recovery and
  fall-back across attempts. `--max-restarts` starts a replacement for a worker the others go on
  without, stopped at the end if nobody admits it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launching import clean_env

pytestmark = [pytest.mark.launch, pytest.mark.timeout(120)]

HERE = Path(__file__).parent
WORKER = str(HERE / "recover_worker.py")
WORKERS = str(HERE / "workers.py")
TANDEM = [sys.executable, "-m", "tandem.cli", "run"]


def tandem_run(*args: str, timeout: float = 60, env: dict | None = None):
    return subprocess.run(
        [*TANDEM, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean_env(), **(env or {})},
    )


def _lines(stdout: str, word: str) -> dict[int, str]:
    """rank -> the rest of its line starting with ``word``."""
    found = {}
    for line in stdout.splitlines():
        m = re.match(rf"\[rank (\d+)\] {word} ?(.*)", line)
        if m:
            found[int(m.group(1))] = m.group(2)
    return found


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_does_not_stop_the_others(victim):
    start = time.time()
    result = tandem_run(
        "--recover", "in-memory", "--nproc-per-node", "3", WORKER, "kill", str(victim)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    survivors = sorted({0, 1, 2} - {victim})
    # Every worker was a client of the launcher's store, told so by the environment.
    envs = {r: json.loads(text) for r, text in _lines(result.stdout, "ENV").items()}
    assert sorted(envs) == [0, 1, 2]
    for env in envs.values():
        assert env["TANDEM_RECOVER"] == "in-memory"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    # Each survivor read the launcher's record of the victim, then used the store (after rank 0
    # died too) and finished: nobody stopped it.
    seen = {r: json.loads(text) for r, text in _lines(result.stdout, "SAW").items()}
    assert sorted(seen) == survivors
    for record in seen.values():
        assert record["rank"] == victim
        assert record["how"] == "killed by SIGKILL"
        assert start <= record["at"] <= time.time()
    assert _lines(result.stdout, "ALIVE") == {r: str(r) for r in survivors}
    assert sorted(_lines(result.stdout, "DONE")) == survivors
    # The summary: the loss when it happened, and the recovery at the end.
    assert f"rank {victim} (local rank {victim} on" in result.stderr
    assert "was lost: killed by SIGKILL" in result.stderr
    assert "the other 2 workers go on without it" in result.stderr
    assert re.search(
        rf"recovery 1: rank {victim} \(killed by SIGKILL\) lost [\d.]+ s into the run; the "
        "survivors did not report a recovery",
        result.stderr,
    ), result.stderr
    assert "failed first" not in result.stderr


def test_survivors_report_joins_the_summary():
    result = tandem_run(
        "--recover", "in-memory", "--nproc-per-node", "3", WORKER, "kill", "2", "report"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(
        r"tandem run: recovery 1: rank 2 \(killed by SIGKILL\) lost at step 7; detected in "
        r"([\d.]+) s; step 7 redone by ranks 0,1 in 0\.9 s",
        result.stderr,
    )
    assert match, result.stderr
    assert float(match.group(1)) < 10
    assert "did not report" not in result.stderr


def test_every_worker_failing_is_a_failure():
    result = tandem_run("--recover", "in-memory", "--nproc-per-node", "3", WORKER, "fail_all")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "every worker failed (3 of 3)" in result.stderr
    assert "rank 0 (local rank 0 on" in result.stderr
    assert "failed first: exit code 3" in result.stderr
    for rank in range(3):
        assert f"rank {rank} (exit code 3) lost" in result.stderr


def test_tandem_init_over_the_launchers_store_survives_rank_0():
    """tandem.init() checks in and forms its group at the launcher's store (every rank a
    client); with rank 0 gone, the others still use the store they met in."""
    result = tandem_run(
        "--recover", "in-memory", "--nproc-per-node", "3", WORKER, "init", "0", timeout=90
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert _lines(result.stdout, "SUM") == {r: f"3.0 RANK {r}" for r in range(3)}
    assert sorted(_lines(result.stdout, "SAW")) == [1, 2]
    assert _lines(result.stdout, "ALIVE") == {1: "ok", 2: "ok"}


def test_torchs_env_rendezvous_over_the_launchers_store():
    result = tandem_run(
        "--recover", "in-memory", "--nproc-per-node", "2", WORKERS, "torchrun_script", timeout=90
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "SUM" in line)
    assert lines == ["[rank 0] SUM 1.0 WORLD 2 RANK 0", "[rank 1] SUM 1.0 WORLD 2 RANK 1"]


def test_the_default_restart_is_unchanged():
    """No launcher's store, no agent-store variable; the killed rank stops the others."""
    start = time.monotonic()
    result = tandem_run("--nproc-per-node", "3", WORKER, "kill", "1")
    assert result.returncode == 128 + 9, result.stdout + result.stderr
    assert time.monotonic() - start < 30  # the others wait 60 s: they were stopped
    envs = {r: json.loads(text) for r, text in _lines(result.stdout, "ENV").items()}
    assert 1 in envs  # the others may be stopped before they print
    for env in envs.values():
        assert env["TANDEM_RECOVER"] is None
        assert env["TORCHELASTIC_USE_AGENT_STORE"] is None
    assert "rank 1 (local rank 1 on" in result.stderr
    assert "failed first: killed by SIGKILL" in result.stderr
    assert "DONE" not in result.stdout and "recovery" not in result.stderr


def test_a_static_min_max_is_refused():
    # MIN:MAX needs the c10d rendezvous (tests/launch/test_recover_elastic.py): with the
    # static one the node count could not change.
    start = time.monotonic()
    result = tandem_run(
        "--recover", "in-memory", "--nnodes", "1:2", WORKER, "kill", "1", timeout=30
    )
    assert result.returncode == 2, result.stderr
    assert "--recover in-memory with --nnodes 1:2: only a fixed number of nodes" in result.stderr
    assert "--nnodes N with --node-rank" in result.stderr
    assert "READY" not in result.stdout
    assert time.monotonic() - start < 20


def test_a_hostfile_of_several_hosts_is_refused(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\nnode-b slots=1\n")
    result = tandem_run(
        "--recover", "in-memory", "--hostfile", str(hosts), WORKER, "kill", "1", timeout=30
    )
    assert result.returncode == 2, result.stderr
    assert "--recover in-memory with --hostfile of 2 hosts: only a fixed number" in result.stderr


def test_help_says_what_in_memory_does_not_do_yet():
    out = subprocess.run(
        [*TANDEM, "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**clean_env(), "COLUMNS": "1000"},  # no word broken at a hyphen
    )
    text = " ".join(out.stdout.split())
    assert "--recover {restart,in-memory}" in text
    assert "A lost worker is replaced while --max-restarts allows" in text
    assert "falls back to restart, up to --max-restarts" in text
    assert "(default: restart" in text


@pytest.mark.timeout(120)
def test_max_restarts_starts_a_replacement_and_stops_it_if_nobody_admits_it():
    """The survivors go on without the lost rank and, as they say they admit replacements, the
    launcher starts one (these workers never admit it: tandem.recovery's do,
    tests/recovery/test_replacement.py); when the members are done it is stopped, and the job
    still succeeds."""
    result = tandem_run(
        "--recover", "in-memory", "--max-restarts", "2", "--nproc-per-node", "2", WORKER,
        "kill", "1", env={"TEST_ADMITS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the other 1 worker go on without it" in result.stderr
    assert "starting rank 2 to replace rank 1 (replacement 1 of 2)" in result.stderr
    assert "JOINING" in result.stdout
    assert "replacement rank 2 was not admitted: the job ended first" in result.stderr
    assert "ended before it was admitted" not in result.stderr
    assert "warning" not in result.stderr
    assert "FRESH" not in result.stdout  # no worker was started again from scratch
    assert os.environ.get("TANDEM_RECOVER") is None  # the test's own environment untouched


@pytest.mark.timeout(120)
def test_no_replacement_is_started_for_workers_that_do_not_admit_one():
    """Workers that recover in memory without saying they admit replacements (a hand-written
    loop over the recovery API that cannot hand a newcomer its state): no process is started
    that nobody would let in."""
    result = tandem_run(
        "--recover", "in-memory", "--max-restarts", "2", "--nproc-per-node", "2", WORKER,
        "kill", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the other 1 worker go on without it" in result.stderr
    assert "replace" not in result.stderr and "JOINING" not in result.stdout


SHARDED = "the model is sharded across ranks (FullyShardedDataParallel)"
# Rank 0 says it cannot (a sharded Trainer), rank 1 can, rank 2 says nothing (a plain script).
MIXED = json.dumps([f"no: {SHARDED}", "1", None])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_a_loss_the_others_cannot_recover_from_restarts_every_worker():
    """Rank 2 is lost while rank 0 (sharded) and rank 1 (no key: a plain script) run on: the
    launcher says so at once, stops every worker and starts them all again (a restart, counted
    as under `restart`) in a fresh store on the user's fixed port; the job then ends 0."""
    port = _free_port()
    result = tandem_run(
        "--recover", "in-memory", "--max-restarts", "1", "--master-port", str(port),
        "--nproc-per-node", "3", WORKER, "kill", "2",
        env={"TEST_ABLE": json.dumps([f"no: {SHARDED}", None, "1"])},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    line = (
        "tandem run: rank 2 (killed by SIGKILL) was lost and ranks 0, 1 cannot be recovered in "
        f"memory (rank 0: {SHARDED}; rank 1: recovery in memory never started: a script that "
        "uses neither tandem.Trainer nor tandem.recovery.Run, or a loss during start-up): "
        "restarting every worker from the last checkpoint (restart 1 of 1; --recover "
        "in-memory falls back to restart)"
    )
    assert line in result.stderr.splitlines(), result.stderr
    assert "rank 2 (local rank 2 on" in result.stderr  # the usual failure report
    assert "failed first: killed by SIGKILL" in result.stderr
    assert "go on without it" not in result.stderr  # nobody went on in memory
    assert "SAW" not in result.stdout  # the launcher marked no rank dead
    # The restarted workers: counted as a restart, on the same port, in a fresh store.
    envs = {r: json.loads(text) for r, text in _lines(result.stdout, "ENV").items()}
    assert sorted(envs) == [0, 1, 2]
    for env in envs.values():
        assert env["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert env["MASTER_PORT"] == str(port)
        assert env["TANDEM_RECOVER"] == "in-memory"
    assert _lines(result.stdout, "FRESH") == {0: "", 1: "", 2: ""}
    assert "STALE" not in result.stdout
    assert sorted(_lines(result.stdout, "DONE")) == [0, 1, 2]
    assert re.search(
        r"tandem run: recovery 1: rank 2 \(killed by SIGKILL\) lost [\d.]+ s into the run; not "
        rf"recoverable in memory \(rank 0: {re.escape(SHARDED)}; rank 1: recovery in memory "
        r"never started: .*\): every worker restarted \(restart 1 of 1\) from the last "
        r"checkpoint$",
        result.stderr,
        re.M,
    ), result.stderr
    assert "recovery 2" not in result.stderr


@pytest.mark.timeout(120)
def test_a_fallback_without_restarts_left_is_a_failure():
    result = tandem_run(
        "--recover", "in-memory", "--nproc-per-node", "3", WORKER, "kill", "1",
        env={"TEST_ABLE": json.dumps([f"no: {SHARDED}", "1", f"no: {SHARDED}"])},
    )  # fmt: skip
    assert result.returncode == 128 + 9, result.stdout + result.stderr
    line = (
        f"tandem run: rank 1 (killed by SIGKILL) was lost and ranks 0, 2 cannot be recovered in "
        f"memory ({SHARDED}): stopping every worker; no restart is left to resume them from the "
        "last checkpoint (--max-restarts 0; --recover in-memory falls back to restart)"
    )
    assert line in result.stderr.splitlines(), result.stderr
    assert "rank 1 (local rank 1 on" in result.stderr
    assert "failed first: killed by SIGKILL" in result.stderr
    assert re.search(
        r"^tandem run: recovery 1: rank 1 \(killed by SIGKILL\) lost [\d.]+ s into the run; not "
        rf"recoverable in memory \(ranks 0, 2: {re.escape(SHARDED)}\): every worker stopped, no "
        r"restart left \(--max-restarts 0\)$",
        result.stderr,
        re.M,
    ), result.stderr
    assert "FRESH" not in result.stdout and "DONE" not in result.stdout  # no second attempt
    assert "every worker failed" not in result.stderr


@pytest.mark.timeout(120)
def test_the_restarted_workers_recover_in_memory_again():
    """After the fall-back, the restarted workers all say they recover in memory: the next
    loss is recovered in memory, and the summary numbers both in order."""
    result = tandem_run(
        "--recover", "in-memory", "--max-restarts", "1", "--nproc-per-node", "3", WORKER,
        "kill", "1",
        env={"TEST_ABLE": MIXED, "TEST_KILL_AGAIN": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "restarting every worker from the last checkpoint (restart 1 of 1;" in result.stderr
    assert "rank 1 (local rank 1 on" in result.stderr
    assert "the other 2 workers go on without it" in result.stderr
    assert _lines(result.stdout, "FRESH") == {0: "", 1: "", 2: ""}
    assert sorted(_lines(result.stdout, "SAW")) == [0, 2]  # the second loss, in memory
    assert sorted(_lines(result.stdout, "DONE")) == [0, 2]
    summary = [line for line in result.stderr.splitlines() if "tandem run: recovery " in line]
    assert len(summary) == 2, result.stderr
    assert summary[0].startswith("tandem run: recovery 1: rank 1 (killed by SIGKILL) lost ")
    assert "every worker restarted (restart 1 of 1) from the last checkpoint" in summary[0]
    assert summary[1].startswith("tandem run: recovery 2: rank 1 (killed by SIGKILL) lost ")
    assert summary[1].endswith("the survivors did not report a recovery")


@pytest.mark.timeout(120)
def test_every_worker_failing_restarts_while_restarts_are_left():
    """The last worker lost leaves none to go on in memory: with a restart left every worker
    restarts, as under `restart`; the second attempt failing too ends the job as before."""
    result = tandem_run(
        "--recover", "in-memory", "--max-restarts", "1", "--nproc-per-node", "2", WORKER,
        "fail_all",
    )  # fmt: skip
    assert result.returncode == 3, result.stdout + result.stderr
    assert re.search(
        r"^tandem run: ranks? .*(were|was) lost and no worker is left to go on in memory: "
        r"restarting every worker from the last checkpoint \(restart 1 of 1; ",
        result.stderr,
        re.M,
    ), result.stderr
    assert result.stdout.count("READY") == 4  # two attempts
    assert "every worker failed (2 of 2)" in result.stderr  # the second
    summary = [line for line in result.stderr.splitlines() if "tandem run: recovery " in line]
    assert len(summary) == 4, result.stderr
    # Each attempt loses both ranks; rank 1 exits 0.2 s after rank 0, but on a loaded machine
    # the launcher may see them in either order: the numbering and the ranks per attempt hold.
    pattern = re.compile(r"^tandem run: recovery (\d): rank (\d) \(exit code 3\) lost ")
    seen = [pattern.match(line) for line in summary]
    assert all(seen), summary
    assert [int(m.group(1)) for m in seen] == [1, 2, 3, 4]
    assert {m.group(2) for m in seen[:2]} == {m.group(2) for m in seen[2:]} == {"0", "1"}
    assert summary[1].endswith(
        "no worker left to go on in memory: every worker restarted (restart 1 of 1) from the "
        "last checkpoint"
    )
