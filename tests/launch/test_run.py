"""`tandem run` launches, supervises and stops real worker processes as promised.

- Workers get torchrun's environment (the same variables torchrun sets), an unmodified
  torchrun script runs, every line is prefixed `[rank N]` and a filter shows chosen ranks.
- The first failure stops the others within 5 s and is reported with rank, host, exit code or
  signal name (SIGKILL: the OOM hint) and the tail of the traceback; the exit status is non-zero.
- SIGINT, SIGTERM and SIGUSR1 reach every worker; afterwards no worker or worker's child is left
  in the process table; a SIGKILLed launcher takes its workers with it.
- --max-restarts restarts all workers with the restart count set and a fresh rendezvous port.
- Many nodes on loopback: two launchers meet through node 0's TCPStore, ranks follow
  node_rank * nproc_per_node + local_rank, and one node's failure stops the other.
- Bad input: a port in use (named), --node-rank >= --nnodes, a missing script or module,
  --nproc-per-node 0, a node that never joins (named), all clear errors, none a hang.
- The launcher does not import torch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.harness import free_port

HERE = Path(__file__).parent
WORKERS = str(HERE / "workers.py")
TANDEM = [sys.executable, "-m", "tandem.cli"]


def tandem_run(*args: str, timeout: float = 60, env: dict | None = None):
    return subprocess.run(
        [*TANDEM, "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _env_lines(stdout: str) -> dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"\[rank (\d+)\] ENV (.*)", line)
        if m:
            found[int(m.group(1))] = json.loads(m.group(2))
    return found


@pytest.mark.launch
def test_workers_get_torchruns_environment(tmp_path):
    ours = _env_lines(tandem_run("--nproc-per-node", "3", WORKERS, "env").stdout)
    port = str(free_port())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "3",
            "--master-port",
            port,
            WORKERS,
            "env",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "ENV_OUT": str(tmp_path)},  # torchrun's output lines interleave
    )
    theirs_env = {
        json.loads(p.read_text())["RANK"]: json.loads(p.read_text())
        for p in tmp_path.glob("rank*.json")
    }
    assert sorted(ours) == [0, 1, 2]
    for rank, env in ours.items():
        reference = theirs_env[str(rank)]
        for name, value in reference.items():
            if value is None:
                continue  # torchrun does not set it (NODE_RANK: tandem adds it)
            if name in ("MASTER_PORT", "TORCHELASTIC_RUN_ID"):
                assert env[name], name  # set, to values of its own
            else:
                assert env[name] == value, (name, env[name], value)
        assert env["NODE_RANK"] == env["GROUP_RANK"] == "0"
    assert len({env["MASTER_PORT"] for env in ours.values()}) == 1


@pytest.mark.launch
def test_unmodified_torchrun_script_and_prefixes():
    result = tandem_run("--nproc-per-node", "2", WORKERS, "torchrun_script")
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "SUM" in line)
    assert lines == ["[rank 0] SUM 1.0 WORLD 2 RANK 0", "[rank 1] SUM 1.0 WORLD 2 RANK 1"]


@pytest.mark.launch
def test_rank_filter_shows_chosen_ranks_only():
    result = tandem_run("--nproc-per-node", "3", "--ranks", "1", WORKERS, "env")
    assert result.returncode == 0
    assert sorted(_env_lines(result.stdout)) == [1]


@pytest.mark.launch
def test_first_failure_stops_the_others_and_is_summarized():
    start = time.monotonic()
    result = tandem_run("--nproc-per-node", "3", WORKERS, "fail", "1")
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    # the others sleep 60 s: they were stopped, within 5 s of rank 1's failure (0.5 s in)
    assert elapsed < 0.5 + 5 + 2, elapsed
    err = result.stderr
    assert f"rank 1 (local rank 1 on {socket.gethostname()}) failed first: exit code 1" in err
    assert "ValueError: boom on rank 1" in err.split("failed first")[1]  # in the summary's tail


@pytest.mark.launch
def test_sigkill_is_named_with_its_likely_cause():
    result = tandem_run("--nproc-per-node", "2", WORKERS, "kill9", "0")
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 0" in result.stderr and "killed by SIGKILL" in result.stderr
    assert "out-of-memory killer" in result.stderr


def _processes_with(token: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmdline:
                pids.append(int(entry.name))
    return pids


def _start_lingering(token: str, nproc: int = 2) -> subprocess.Popen:
    launcher = subprocess.Popen(
        [
            *TANDEM,
            "run",
            "--nproc-per-node",
            str(nproc),
            "--grace-period",
            "1",
            WORKERS,
            "linger",
            token,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = 0
    while ready < nproc:
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        ready += "READY" in line
    # every worker and its child exist (a /proc entry can lag the READY line a moment)
    deadline = time.monotonic() + 5
    while len(_processes_with(token)) < 1 + 2 * nproc and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_processes_with(token)) == 1 + 2 * nproc
    return launcher


@pytest.mark.launch
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signals_reach_every_worker_and_leave_no_orphans(signum):
    token = f"tandem-test-{uuid.uuid4().hex}"
    launcher = _start_lingering(token)
    launcher.send_signal(signal.SIGUSR1)
    seen = set()
    while len(seen) < 2:
        line = launcher.stdout.readline()
        match = re.search(r"USR1 on rank (\d)", line)
        if match:
            seen.add(int(match.group(1)))
    launcher.send_signal(signum)
    assert launcher.wait(timeout=10) == 128 + signum
    time.sleep(0.2)
    assert _processes_with(token) == [], "orphans left behind"


@pytest.mark.launch
def test_killed_launcher_takes_its_workers_along():
    token = f"tandem-test-{uuid.uuid4().hex}"
    launcher = _start_lingering(token, nproc=2)
    workers_before = [p for p in _processes_with(token) if p != launcher.pid]
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [p for p in workers_before if Path(f"/proc/{p}").exists()]
        # the workers' own children are stopped by the workers' parent-death signal of
        # their own where they set one (DataLoader workers do); the workers must be gone
        if not [p for p in alive if b"workers.py" in Path(f"/proc/{p}/cmdline").read_bytes()]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("workers outlived a SIGKILLed launcher")
    for pid in _processes_with(token):  # clean up the lingering grandchildren
        os.kill(pid, signal.SIGKILL)


@pytest.mark.launch
def test_max_restarts_restarts_everyone_with_a_fresh_rendezvous():
    result = tandem_run("--nproc-per-node", "2", "--max-restarts", "2", WORKERS, "restart")
    assert result.returncode == 0, result.stderr
    attempts = re.findall(r"\[rank (\d)\] ATTEMPT (\d) PORT (\d+)", result.stdout)
    assert {(r, a) for r, a, _ in attempts} == {("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")}
    ports = {a: p for _, a, p in attempts}
    assert ports["0"] != ports["1"]
    assert "restarting all workers (restart 1 of 2)" in result.stderr


@pytest.mark.launch
def test_restarts_exhausted_report_the_failure():
    result = tandem_run("--nproc-per-node", "2", "--max-restarts", "1", WORKERS, "fail", "0")
    assert result.returncode == 1
    assert result.stderr.count("failed first") == 2


@pytest.mark.launch
def test_port_in_use_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = tandem_run("--nproc-per-node", "2", "--master-port", str(port), WORKERS, "env")
    assert result.returncode == 2
    assert f"--master-port {port} is already in use" in result.stderr


@pytest.mark.launch
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
            "--node-rank 2 must be < --nnodes 2",
        ),
        (["--nproc-per-node", "0"], "--nproc-per-node 0 must be >= 1"),
        (["--nproc-per-node", "two"], "--nproc-per-node 'two' is not an integer"),
        (["--nnodes", "2"], "--nnodes 2 needs --master-addr"),
        (["--hang-report-after", "0"], "--hang-report-after must be > 0 seconds, got 0.0"),
    ],
)
def test_bad_arguments(args, message):
    result = tandem_run(*args, WORKERS, "env")
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.launch
def test_missing_script_and_module():
    result = tandem_run("--nproc-per-node", "2", "no_such_script.py")
    assert result.returncode == 2 and "script 'no_such_script.py' not found" in result.stderr
    result = tandem_run("--nproc-per-node", "2", "-m", "no_such_module_xyz")
    assert result.returncode == 2 and "module 'no_such_module_xyz' not found" in result.stderr


def _two_nodes(worker_args: list[str], extra: list[str] = ()) -> list[subprocess.CompletedProcess]:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                *TANDEM,
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                *extra,
                WORKERS,
                *worker_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, err)
        for p, (out, err) in zip(procs, outs, strict=True)
    ]


@pytest.mark.launch
def test_two_nodes_on_loopback_meet_and_number_ranks():
    results = _two_nodes(["torchrun_script"])
    for r in results:
        assert r.returncode == 0, r.stderr
    lines = sorted(line for r in results for line in r.stdout.splitlines() if "SUM" in line)
    # 0+1+2+3 = 6 on every rank; node 1 holds ranks 2 and 3
    assert lines == [f"[rank {k}] SUM 6.0 WORLD 4 RANK {k}" for k in range(4)]
    assert "[rank 2]" in results[1].stdout and "[rank 2]" not in results[0].stdout


@pytest.mark.launch
def test_one_nodes_failure_stops_the_other_node():
    start = time.monotonic()
    results = _two_nodes(["fail", "3"])
    assert time.monotonic() - start < 30
    assert all(r.returncode != 0 for r in results)
    for r in results:
        assert "rank 3 (local rank 1" in r.stderr


@pytest.mark.launch
def test_a_node_that_never_joins_is_named():
    port = str(free_port())
    result = tandem_run(
        "--nnodes",
        "3",
        "--node-rank",
        "0",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--rdzv-timeout",
        "2",
        WORKERS,
        "env",
    )
    assert result.returncode == 2
    assert "node rank(s) [1, 2] of --nnodes 3 never joined" in result.stderr


def test_launcher_does_not_import_torch():
    code = "import sys, tandem.cli, tandem.launch.supervisor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.launch
def test_the_hang_report_works_under_torchrun(tmp_path):
    # The same job under torch's own launcher: the report goes through torchrun's store (the
    # agent's), names rank 1 and its line, and is written where TANDEM_REPORT_DIR says.
    worker = str(HERE.parent / "doctor" / "hang_worker.py")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), worker],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "TANDEM_REPORT_DIR": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode != 0
    assert "rank 1 never entered all_reduce #1" in result.stderr, result.stderr
    (written,) = tmp_path.glob("tandem-hang-rank0-all_reduce-1.json")
    report = json.loads(written.read_text())
    assert "hang_worker.py:12 in read_forever" in report["text"], report["text"]


@pytest.mark.launch
@pytest.mark.parametrize(("term_timeout", "saved"), [(None, True), ("1", False)])
def test_sigterm_gives_workers_the_term_timeout_to_finish(term_timeout, saved):
    # Workers that need 3 s after SIGTERM (a checkpoint being written): the default 30 s lets
    # them finish; a 1 s term timeout kills them.
    flags = [] if term_timeout is None else ["--term-timeout", term_timeout]
    launcher = subprocess.Popen(
        [*TANDEM, "run", "--nproc-per-node", "2", *flags, WORKERS, "slow_stop", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = 0
    while ready < 2:
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        ready += "READY" in line
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=40)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert (out.count("SAVED rank") == 2) is saved, (out, err)
