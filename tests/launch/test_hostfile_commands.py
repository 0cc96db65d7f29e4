"""`tandem run --hostfile` without ssh: what each host is told to run, and its agent's signals.

Proves: the flags passed on to every host, parsed again by ``tandem run``'s own parser, give
each flag the value this command line gave it (so a host runs what the user typed, with none
of this shell's ``PET_*`` defaults needed); the placement flags that the host file owns are
refused by name; the slots rule (equal slots, or ``--nproc-per-node`` for every host); the
job's secret is made once when unset and kept when set; the remote command line survives a
real shell in a directory whose name needs quoting; ``TANDEM_SSH``'s own options come before
ours (ssh keeps the first value); and the agent passes ``signal N`` lines to the host's
launcher and, at the end of its stdin, stops it (SIGTERM, then SIGKILL after its timeout).
The real ssh runs are in ``tests/launch/test_hostfile.py``.
"""

from __future__ import annotations

import io
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandem.cli import build_parser
from tandem.launch.hostfile import (
    Host,
    check_placement,
    forwarded_env,
    forwarded_flags,
    workers_per_host,
)
from tandem.launch.rendezvous import LaunchError
from tandem.launch.ssh_agent import listen
from tandem.launch.ssh_launcher import SSH_OPTIONS, ssh_command

USER_LINE = [
    "run", "--hostfile", "h.txt", "--max-restarts", "2", "--ranks", "0,3", "--no-prefix",
    "--term-timeout", "7.5", "--signals-to-handle", "SIGTERM,SIGINT", "-m", "--tee", "3",
    "--log-dir=-logs", "pkg.train", "--lr", "0.1", "--hostfile", "theirs",
]  # fmt: skip


def _run_args(argv: list[str]):
    return build_parser().parse_args(argv)


def test_forwarded_flags_give_every_host_the_users_values() -> None:
    given = _run_args(USER_LINE)
    flags = forwarded_flags(given, given.run_actions)
    placed = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "1"]
    again = _run_args(["run", *placed, "--nproc-per-node", "2", *flags, given.script])
    again.script_args = given.script_args
    skipped = {"hostfile", "nnodes", "node_rank", "master_addr", "master_port", "nproc_per_node"}
    for name, value in vars(given).items():
        if name not in skipped and name != "run_actions":
            assert getattr(again, name) == value, (name, flags)
    assert (given.module, given.log_dir, given.max_restarts) == (True, "-logs", 2)
    assert given.script_args == ["--lr", "0.1", "--hostfile", "theirs"]  # the script's own


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--nnodes", "2"], "--nnodes '2' with --hostfile"),
        (["--node-rank", "1"], "--node-rank 1 with --hostfile"),
        (["--master-addr", "10.0.0.1"], "--master-addr '10.0.0.1' with --hostfile"),
        (["--rdzv-backend", "c10d"], "--rdzv-backend 'c10d' with --hostfile"),
        (["--standalone"], "--standalone True with --hostfile"),
    ],
)
def test_placement_flags_are_the_host_files(extra: list[str], named: str) -> None:
    with pytest.raises(LaunchError, match="leave it out") as error:
        check_placement(_run_args(["run", "--hostfile", "h", *extra, "t.py"]))
    assert named in str(error.value)


def test_master_port_and_other_flags_go_with_a_hostfile() -> None:
    check_placement(_run_args(["run", "--hostfile", "h", "--master-port", "29700", "t.py"]))


def test_slots_rule() -> None:
    equal = [Host("a", 4, 1), Host("b", 4, 2)]
    uneven = [Host("a", 2, 1), Host("b", 4, 2)]
    assert workers_per_host(equal, "1") == 4
    assert workers_per_host(uneven, "2") == 2
    with pytest.raises(LaunchError, match=r"slots differ \(a slots=2, b slots=4\).*--nproc"):
        workers_per_host(uneven, "1")
    with pytest.raises(LaunchError, match="'auto' with --hostfile must be a number"):
        workers_per_host(equal, "auto")
    with pytest.raises(LaunchError, match="--nproc-per-node 0 must be >= 1"):
        workers_per_host(equal, "0")


def test_job_secret_is_made_once_when_unset_and_kept_when_set() -> None:
    made = forwarded_env({"TANDEM_SSH_ENV": "NCCL_DEBUG, MISSING", "NCCL_DEBUG": "INFO"})
    assert set(made) == {"TANDEM_JOB_SECRET", "NCCL_DEBUG"}
    assert len(made["TANDEM_JOB_SECRET"]) == 32
    assert made["TANDEM_JOB_SECRET"] != forwarded_env({})["TANDEM_JOB_SECRET"]
    assert forwarded_env({"TANDEM_JOB_SECRET": "mine"})["TANDEM_JOB_SECRET"] == "mine"


def test_remote_command_survives_a_real_shell(tmp_path: Path, monkeypatch) -> None:
    odd = tmp_path / "it's a dir; $(touch x)"
    odd.mkdir()
    monkeypatch.setenv("TANDEM_SSH", "ssh -F '/my config' -o ConnectTimeout=3")
    argv = ssh_command("node1", str(odd), pythonpath="/a b:/c")
    assert argv[:5] == ["ssh", "-F", "/my config", "-o", "ConnectTimeout=3"]
    assert argv[5 : 5 + len(SSH_OPTIONS)] == list(SSH_OPTIONS)
    assert argv[-2] == "node1"
    # What sshd does with the last argument: the user's shell runs it. The agent, given no
    # request, says so: it ran, in that directory, with that PYTHONPATH.
    probe = argv[-1].replace("-m tandem.launch.ssh_agent", "-c " + shlex.quote(_PROBE))
    done = subprocess.run(["sh", "-c", probe], capture_output=True, text=True, timeout=30)
    assert done.stdout.splitlines() == [str(odd), "/a b:/c"], done.stderr
    assert not (tmp_path / "x").exists()
    agent = subprocess.run(
        ["sh", "-c", argv[-1]], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )
    assert agent.returncode == 2 and "no request on stdin" in agent.stdout, agent


_PROBE = "import os; print(os.getcwd()); print(os.environ['PYTHONPATH'])"


def _child(code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


READY = "import signal, sys, time\n{setup}\nprint('ready', flush=True)\ntime.sleep(30)\n"


@pytest.mark.timeout(30)
def test_agent_passes_signals_and_stops_its_launcher_at_eof() -> None:
    # A signal line reaches the launcher (USR1 here: it stops nothing by itself).
    usr1 = _child(READY.format(setup="signal.signal(signal.SIGUSR1, lambda *a: sys.exit(10))"))
    read, write = os.pipe()
    with open(read) as stdin, open(write, "w") as lines:
        listening = threading.Thread(target=listen, args=(stdin, usr1, 5.0))
        listening.start()
        lines.write("noise\nsignal 10\n")
        lines.flush()
        assert usr1.wait(timeout=10) == 10
    listening.join(timeout=10)
    # The end of stdin (the launching machine is gone): SIGTERM.
    plain = _child(READY.format(setup=""))
    listen(io.StringIO(""), plain, kill_after=5)
    assert plain.wait(timeout=10) == -signal.SIGTERM
    # A launcher that ignores SIGTERM is killed after kill_after.
    stubborn = _child(READY.format(setup="signal.signal(signal.SIGTERM, signal.SIG_IGN)"))
    started = time.monotonic()
    listen(io.StringIO(""), stubborn, kill_after=0.5)
    assert stubborn.wait(timeout=10) == -signal.SIGKILL
    assert 0.4 < time.monotonic() - started < 5
