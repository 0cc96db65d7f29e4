"""A bad hand-made environment fails every process within the rendezvous timeout, saying why.

Real processes, each started with the variables a user would export by hand (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE), running tests/launch/rdzv_worker.py: ``tandem.init()`` and an
all-reduce. The rendezvous timeout is 4 s here (60 s by default). Each case checks every
process: its exit status, its message, and that it ended well before torch's 30-minute wait.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.harness import free_port

WORKER = Path(__file__).with_name("rdzv_worker.py")
TIMEOUT_S = 4.0
# Every process must be done by then: the rendezvous timeout, plus starting Python and torch.
DONE_WITHIN_S = TIMEOUT_S + 20.0

pytestmark = [pytest.mark.timeout(120), pytest.mark.distributed]


def _start(
    rank: int, world_size: int, port: int, stdin: int | None = None, **extra: str
) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "TANDEM"))}
    env.update(
        TANDEM_REPORT_DIR=os.environ["TANDEM_REPORT_DIR"],  # hang reports: not in the checkout
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        TANDEM_RENDEZVOUS_TIMEOUT=str(TIMEOUT_S),
        **extra,
    )
    return subprocess.Popen(
        [sys.executable, str(WORKER)],
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    started = time.monotonic()
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(DONE_WITHIN_S - (time.monotonic() - started), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            pytest.fail(f"a process was still running after {DONE_WITHIN_S} s:\n{text}")
        out.append((p.returncode, text))
    return out


_OURS = re.compile(r"^\w+: .* \[\d+\.\d s\]$")  # how rdzv_worker.py reports an error


def _all_fail_with(results: list[tuple[int, str]], *needles: str) -> None:
    for code, text in results:
        assert code == 3, text
        # The worker's own last line: torch's C++ may log a retry warning after it.
        ours = [line for line in text.strip().splitlines() if _OURS.match(line)]
        last = ours[-1] if ours else ""
        for needle in needles:
            assert needle in last, text


def test_a_well_formed_job_still_meets():
    port = free_port()
    results = _finish([_start(0, 2, port), _start(1, 2, port)])
    for code, text in results:
        assert code == 0 and "ok 2.0" in text, text


def test_world_size_that_differs_fails_every_rank():
    port = free_port()
    results = _finish([_start(0, 2, port), _start(1, 3, port)])
    _all_fail_with(
        results, "RendezvousError", "WORLD_SIZE differs", "says WORLD_SIZE=2", "says WORLD_SIZE=3"
    )


def test_a_rank_that_never_arrives_is_named_at_the_timeout():
    port = free_port()
    started = time.monotonic()
    results = _finish([_start(0, 3, port), _start(2, 3, port)])
    _all_fail_with(results, "rank 1 of WORLD_SIZE=3 never arrived within 4 s", "rank 2 (pid")
    assert time.monotonic() - started >= TIMEOUT_S


def test_rank_out_of_range_is_named_by_the_others():
    port = free_port()
    zero, stray = _finish([_start(0, 2, port), _start(5, 2, port)])
    assert stray[0] == 3 and "RANK=5 is not < WORLD_SIZE=2" in stray[1], stray[1]
    _all_fail_with([zero], "RANK=5 (pid", "outside 0..1 for WORLD_SIZE=2")


def test_a_rank_registered_twice_is_named_with_both_pids():
    """The launcher's store (as under torchrun): both rank-1 processes have checked in before
    rank 0 comes, so the duplicate is certain, not a race."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), False)
    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    twins = [_start(1, 2, port, **agent), _start(1, 2, port, **agent)]
    arrived = dist.PrefixStore("/worker/attempt_0", store)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if int(arrived.add("tandem/rendezvous/arrived", 0)) >= 2:
            break
        time.sleep(0.05)
    results = _finish([_start(0, 2, port, **agent), *twins])
    pids = sorted(str(p.pid) for p in twins)
    _all_fail_with(results, "rank 1 checked in twice: pids")
    for _, text in results:
        assert all(pid in text for pid in pids), text
        # Under the launcher's store, the torchrun restart that leaves such entries is named.
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text, text


@pytest.mark.parametrize("twice", [0, 1])
def test_a_rank_given_twice_fails_every_process_every_time(twice):
    """Three processes for WORLD_SIZE=2, one RANK given twice (0: the second rank 0 finds the
    port taken by the first one's store and checks in there; 1: both check in), started by hand
    and each calling tandem.init() and one all-reduce: every process exits non-zero naming the
    duplicate and both pids, whatever the order of arrival. Three jobs, each started once its
    processes have imported torch: two released together (any of the three may be left out of
    the first two to arrive: a verdict at the rendezvous, or a duplicate that finds the job
    formed) and one whose duplicate comes 0.5 s later (always after the job formed: the job, one
    all-reduce long, fails at tandem.shutdown())."""
    ranks = [0, 1, twice]
    for stagger in (0.0, 0.0, 0.5):
        port = free_port()
        job = [_start(r, 2, port, stdin=subprocess.PIPE, GO="1") for r in ranks]
        for proc in job:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "imported"
        for i, proc in enumerate(job):
            if i == 2:
                time.sleep(stagger)
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        pids = [str(p.pid) for p, r in zip(job, ranks, strict=True) if r == twice]
        for code, text in _finish(job):
            # Non-zero: 3 from the worker, or 1 where the doctor ends a process whose collective
            # the error interrupted (it cannot complete).
            assert code != 0, text
            ours = [line for line in text.strip().splitlines() if _OURS.match(line)]
            said = ours[-1] if ours else ""
            assert f"RendezvousError: rank {twice} checked in twice: pids" in said, text
            assert all(pid in said for pid in pids), text
            assert "torchrun" not in said, text  # by hand: no launcher's restart to blame


def test_a_script_without_shutdown_checks_out_at_exit():
    """The same late duplicate (RANK=1, 0.5 s after the others) for a script that never calls
    tandem.shutdown(): the two that formed finished their work, and fail at exit (status 1)
    with the error; the duplicate fails at once."""
    port = free_port()
    job = [_start(r, 2, port, stdin=subprocess.PIPE, GO="1", NO_SHUTDOWN="1") for r in (0, 1, 1)]
    for proc in job:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "imported"
    for i, proc in enumerate(job):
        if i == 2:
            time.sleep(0.5)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = _finish(job)
    said = "RendezvousError: rank 1 checked in twice: pids"
    for code, text in results[:2]:
        assert code == 1 and "ok 2.0 (no shutdown)" in text, text
        assert f"tandem: {said}" in text and str(job[2].pid) in text, text
    assert results[2][0] == 3 and said in results[2][1], results[2][1]


def test_a_duplicate_that_comes_after_the_job_formed_stops_the_job():
    """Ranks 0 and 1 have formed and train; a second rank 1 comes: it raises, and the two
    that formed raise the same RendezvousError at their next collective (the doctor's fatal
    key), instead of training on as if nothing were wrong."""
    port = free_port()
    formed = [_start(0, 2, port, HOLD="30"), _start(1, 2, port, HOLD="30")]
    for p in formed:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "formed"
    started = time.monotonic()
    late = _start(1, 2, port)
    results = _finish([late, *formed])
    assert time.monotonic() - started < 15, results
    assert results[0][0] == 3 and "rank 1 checked in twice: pids" in results[0][1], results[0]
    for code, text in results[1:]:
        assert code != 0, text
        assert "RendezvousError: rank 1 checked in twice: pids" in text, text
        assert f"{late.pid}" in text and "ok " not in text, text


@pytest.mark.parametrize("reply", [b"", b"HTTP/1.0 400 Bad Request\r\n\r\n"])
def test_a_foreign_program_on_the_port_fails_every_rank(reply):
    """Rank 0 cannot listen; rank 1 reaches the foreign program, which never answers as a
    store (silent) or answers something else (an HTTP server)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            if reply:
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    try:
        zero, one = _finish([_start(0, 2, port), _start(1, 2, port)])
    finally:
        listener.close()
        for conn in held:
            conn.close()
    _all_fail_with([zero], f"rank 0 cannot listen on MASTER_PORT={port}", "already in use")
    _all_fail_with([one], f"127.0.0.1:{port} is not rank 0's store")


def test_a_program_on_another_address_does_not_disturb_a_loopback_job():
    """A one-node job's store listens on loopback only: a program holding the same port on
    another address is no conflict (torch's own store listens on every address, and fails)."""
    address = _outward_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    listener = socket.create_server((address, 0))
    port = listener.getsockname()[1]
    try:
        results = _finish([_start(0, 2, port), _start(1, 2, port)])
    finally:
        listener.close()
    for code, text in results:
        assert code == 0 and "ok 2.0" in text, text


def test_the_store_of_a_loopback_job_listens_on_loopback_only():
    port = free_port()
    procs = [_start(0, 2, port, HOLD="3"), _start(1, 2, port, HOLD="3")]
    try:
        deadline = time.monotonic() + 20
        listening: list[str] = []
        while time.monotonic() < deadline and not listening:
            listening = _listening_on(port)
            time.sleep(0.05)
        assert listening == ["127.0.0.1"], listening
    finally:
        results = _finish(procs)
    for code, text in results:
        assert code == 0, text


def _outward_address() -> str | None:
    """This host's address on its default route (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") else address


def _listening_on(port: int) -> list[str]:
    """The addresses with a TCP socket listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                host, hexport = local.split(":")
                if state != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(host)
                # The kernel prints each 32-bit word in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(str(ipaddress.ip_address(words)))
    return found
