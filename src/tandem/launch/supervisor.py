"""The supervisor: start one node's workers, watch them, stop them all at the first failure.

Per attempt:

1. Rendezvous (``rendezvous.py``): the address and port the workers meet at, fresh per attempt.
2. Start ``nproc_per_node`` workers, each with torchrun's environment, in a process group of its
   own (so its DataLoader workers are stopped with it) that dies with the launcher
   (PR_SET_PDEATHSIG: even a SIGKILLed launcher leaves no orphans).
3. Watch: every line a worker prints is passed on prefixed ``[rank N]`` (and logged); the end
   of its stderr is kept for the failure report. On a terminal, rank 0's live progress bar
   is relayed as it redraws, below the lines (``relay.py``).
4. The first worker to exit non-zero, or to die by a signal, fails the attempt: the others get
   SIGTERM, then SIGKILL after a grace period, and the launcher says who failed, how, and what
   the worker last wrote; a rank that failed waiting in a collective its hang report was about
   (the collective's timeout) is summed up under the laggards that report named
   (:func:`held_up_by`), followed by the report. With restarts left, a new attempt starts with
   a new rendezvous.
5. Under elastic node counts (``membership.py``) a healthy attempt also ends when a node
   waits to join: the workers stop and the next rendezvous round admits it (not counted
   against ``--max-restarts``, as in torch's agent); each round may give this node another
   rank and the job another size.

Under ``--recover in-memory`` (``in_memory.py``; one node, a fixed number of nodes, or an
elastic ``MIN:MAX`` formed once, whose nodes arriving later start their workers as joiners) a
worker that fails is recorded and announced in the job's store (which the launcher, node 0's,
hosts), the others go on, and the job ends when every worker has exited: successfully if one ran
to completion. Unless a worker still running did not say it recovers in memory (a sharded
Trainer, a plain script): then the job falls back to ``restart`` (every worker stopped, and
started again with a fresh store while ``--max-restarts`` allows; with many nodes every node's
workers, together). Each node's launcher watches its own workers and replaces its own lost ones
(``--max-restarts`` per node); node 0's hosts the store until the others are done, and a
launcher that loses the store ends. The exit summary lists each recovery and fall-back.

SIGINT, SIGTERM and SIGUSR1 sent to the launcher are passed to every worker.

Example::

    spec = LaunchSpec(command=[sys.executable, "-u", "train.py"], nproc_per_node=2)
    sys.exit(Supervisor(spec, LocalCoordinator("127.0.0.1", None)).run())
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tandem.doctor import stragglers
from tandem.launch.failures import Failure
from tandem.launch.in_memory import (
    RECOVER_VARIABLE,
    Fallback,
    InMemoryCoordinator,
    JobEnd,
    fallback_line,
    fallback_summary,
    lost_summary,
    no_replacement_line,
    recovery_lines,
    recovery_reports,
    unable,
)
from tandem.launch.logfiles import LogPlan
from tandem.launch.relay import CONSOLE_COLUMNS, CONSOLE_TTY, Console, console_env, relay
from tandem.launch.rendezvous import ROUND_VARIABLE, Attempt, Coordinator, Restart

TAIL_LINES = 30
#: How a worker that the others left out of the job (``--recover in-memory``) was lost.
LEFT_OUT = "hung or cut off: the others went on without it, and it was killed"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LaunchSpec:
    """What to run, and where this node sits. Rank arithmetic lives in ``global_rank``."""

    command: list[str]
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    max_restarts: int = 0
    log_dir: Path | None = None
    show_ranks: frozenset[int] | None = None
    prefix: bool = True
    backend: str | None = None
    grace_s: float = 3.0  # after a worker failed: the others get this long before SIGKILL
    # After SIGTERM/SIGINT to the launcher: the workers get this long (a Trainer saves its
    # checkpoint on SIGTERM; a large model's takes seconds) before SIGKILL.
    term_timeout_s: float = 30.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    logs: LogPlan | None = None  # per-rank files in torchrun's layout (logfiles.py)
    role: str = "default"  # ROLE_NAME
    virtual_local_rank: bool = False  # LOCAL_RANK=0, CUDA_VISIBLE_DEVICES narrowed to one GPU
    signals: tuple[int, ...] = FORWARDED  # passed on to every worker
    local_ranks: frozenset[int] | None = None  # --local-ranks-filter: shown on the console
    # What a failed worker costs: "restart" (stop all; --max-restarts) or "in-memory" (the
    # others go on; one node, with an InMemoryCoordinator hosting the store).
    recover: str = "restart"

    def shown(self, local_rank: int) -> bool:
        """Whether this local rank's output reaches the console (both filters agree)."""
        rank = self.global_rank(local_rank)
        return (self.show_ranks is None or rank in self.show_ranks) and (
            self.local_ranks is None or local_rank in self.local_ranks
        )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        """The guides' rule: node_rank * nproc_per_node + local_rank."""
        return self.node_rank * self.nproc_per_node + local_rank


class Worker:
    """One worker process, the threads relaying its output, and the tail of its stderr."""

    def __init__(
        self,
        spec: LaunchSpec,
        local_rank: int,
        env: dict[str, str],
        logs: LogPlan | None,
        console: Console | None = None,
        rank: int | None = None,
    ):
        self.local_rank = local_rank
        self.rank = spec.global_rank(local_rank) if rank is None else rank
        self.env = env
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(
            spec.command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            preexec_fn=in_own_group_dying_with_parent,
        )
        show = spec.shown(local_rank)
        prefix = f"[rank {self.rank}] " if spec.prefix else ""
        out_log, out_shown = logs.stream(local_rank, "stdout") if logs else (None, True)
        err_log, err_shown = logs.stream(local_rank, "stderr") if logs else (None, True)
        # Rank 0's stderr carries its live bar when the console is a terminal (relay.py).
        live = console is not None and self.rank == 0 and err_shown
        out_echo = prefix if show and out_shown else None
        err_echo = prefix if show and err_shown else None
        filtered = logs.filtered if logs else {}  # --duplicate-*-filters: the console's lines
        self.threads = [
            relay(
                self.proc.stdout, sys.stdout, out_echo, out_log, "stdout", None, console,
                duplicate=filtered.get("stdout"),
            ),
            relay(
                self.proc.stderr, sys.stderr, err_echo, err_log, "stderr", self.tail, console,
                live, duplicate=filtered.get("stderr"),
            ),
        ]  # fmt: skip

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def drained_tail(self) -> tuple[str, ...]:
        # The reader may still be on the last lines of a traceback when the exit is noticed.
        for t in self.threads:
            t.join(timeout=0.5)
        return tuple(self.tail)


class Supervisor:
    """Runs the attempts of one node; ``run()`` returns the launcher's exit status."""

    def __init__(self, spec: LaunchSpec, coordinator: Coordinator) -> None:
        self.spec = spec
        self.coordinator = coordinator
        self.workers: list[Worker] = []
        self.stop_signal: int | None = None
        self.host = socket.gethostname()
        # Where the workers write their step times and checkpoint notes (TANDEM_REPORT_DIR):
        # the user's, --log-dir, or a temporary directory removed at the end.
        chosen = os.environ.get("TANDEM_REPORT_DIR") or spec.log_dir
        self.own_reports = chosen is None
        self.reports = Path(chosen if chosen is not None else tempfile.mkdtemp(prefix="tandem-"))
        # Where they write hang reports (tandem.doctor.hang, TANDEM_HANG_REPORT_DIR), which
        # outlive the run: the report directory when the user chose one, else the working
        # directory. The exit summary of a job that a collective's timeout ended carries the
        # newest one, and names its laggards.
        hang_dir = os.environ.get("TANDEM_HANG_REPORT_DIR")
        self.hang_reports = (
            Path(hang_dir) if hang_dir else Path.cwd() if self.own_reports else self.reports
        ).absolute()
        # A terminal behind the launcher, and rank 0's output shown here: rank 0 draws a bar.
        shows_rank0 = spec.node_rank == 0 and spec.shown(0)
        self.console, self.console_env = (
            console_env(len("[rank 0] ") if spec.prefix else 0) if shows_rank0 else (None, {})
        )

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in self.spec.signals}
        try:
            return self._attempts()
        finally:
            self._stop_all(signal.SIGKILL, grace=0)
            self.coordinator.close()
            steps = stragglers.summary(self.reports, self.spec.run_id)  # per rank; the slowest
            if steps is not None:
                _say(steps)
            if self.own_reports:
                shutil.rmtree(self.reports, ignore_errors=True)
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _attempts(self) -> int:
        if self.spec.recover == "in-memory":
            return self._in_memory()
        failure: Failure | None = None
        restarts = 0  # after failures only: torch's TORCHELASTIC_RESTART_COUNT
        attempt = 0
        while True:
            placement = self.coordinator.begin(attempt)
            # Elastic rounds may change this node's rank and the node count.
            self.spec = dataclasses.replace(
                self.spec, node_rank=placement.node_rank, nnodes=placement.nnodes
            )
            if placement.elastic:
                first = self.spec.global_rank(0)
                _say(
                    f"round {placement.round}: node {placement.node_rank} of "
                    f"{placement.nnodes}, world size {self.spec.world_size} (ranks {first}.."
                    f"{first + self.spec.nproc_per_node - 1} here)"
                )
            started = time.time()  # hang reports older than this are another attempt's
            self._start(attempt, restarts, placement)
            outcome = self._watch(placement.round)
            ended = time.time()  # the signal or failure, within _watch's 20 ms poll
            if self.stop_signal is not None:
                return self._stopped(self.stop_signal, ended)
            if outcome is None:
                outcome = self.coordinator.finish(placement.round)
                if outcome is None:
                    return 0
            self._stop_all(signal.SIGTERM, self.spec.grace_s)
            attempt += 1
            if isinstance(outcome, Restart):  # a membership change, not a failure (as torch)
                _say(outcome.reason)
                continue
            failure = outcome
            self._say_failure(failure, started)
            if restarts == self.spec.max_restarts:
                break
            restarts += 1
            _say(f"restarting all workers (restart {restarts} of {self.spec.max_restarts})")
        self._say_checkpoint(ended)
        return failure.exit_code()

    def _say_failure(self, failure: Failure, started: float) -> None:
        """Who failed and how, headed by the laggards a hang report written since ``started``
        names, followed by that report."""
        written = hang_reports(self.hang_reports, since=started)
        _say(failure.summary(*held_up_by(failure.rank, written)))
        if written:
            _say(hang_report_text(*written[-1]))

    def _say_checkpoint(self, ended: float) -> None:
        """The checkpoint committed by the time the job ended, if any: what a restart resumes."""
        saved = committed_checkpoint(self.reports, self.spec.run_id, ended, "the failure")
        if saved is not None:
            _say(saved)

    def _stopped(self, signum: int, ended: float) -> int:
        """A signal to the launcher ended the job at ``ended``: the workers have it already;
        those still saving get ``--term-timeout``, then SIGKILL. The exit status."""
        name = signal.Signals(signum).name
        self._wait_all(self.spec.term_timeout_s)
        killed = [w.rank for w in self.workers if w.proc.poll() is None]
        self._stop_all(signal.SIGKILL, 0)
        _say(f"stopped by {name}")
        if killed:
            _say(
                f"rank(s) {killed} still running {self.spec.term_timeout_s:g} s after "
                f"{name} were killed: a checkpoint being written then is lost (give "
                "them longer with --term-timeout)"
            )
        saved = committed_checkpoint(self.reports, self.spec.run_id, ended, name)
        if saved is not None:
            _say(saved)
        return 128 + signum

    def _in_memory(self) -> int:
        """``--recover in-memory``: a failed worker is lost, not the job's end, while every
        worker still running recovers in memory; else the job falls back to ``restart``.

        Each loss the others can go on from is announced in the store at once
        (``coordinator.report_failure``: the survivors poll for it), then said here with the
        worker's last lines; what it left behind (DataLoader workers in its process group) is
        killed. A loss with a worker still running that did not say it recovers in memory
        (``coordinator.able``), or one that leaves no worker running, is a fall-back
        (:meth:`_in_memory_attempt`): said at once, every worker stopped as under ``restart``,
        the usual failure report, and, while ``--max-restarts`` allows, every worker started
        again (a restart, counted as under ``restart``) with a fresh store. With many nodes
        every node's launcher stops its workers, the nodes meet (``coordinator.settle``: node
        0 decides), and every node restarts its workers together. When every worker of the last
        attempt has exited, the summary lists each recovery and fall-back; the status is 0 if
        one worker ran to completion, else the first loss's, reported as a failure is under
        ``restart``.
        """
        coordinator = self.coordinator
        assert isinstance(coordinator, InMemoryCoordinator)
        self.replaced = 0  # replacements this node started (--max-restarts), over the job
        self.unadmitted: set[int] = set()  # replacements that never joined
        # Node 0: ranks the survivors left out that no launcher marked dead, by their node: if
        # that node's launcher goes silent, nobody replaces them, and node 0 says so.
        self.unreplaced: dict[int, int] = {}
        self.started = time.time()  # the run's: the summary says when each loss came from it
        lines: list[str] = []  # the summary's recoveries, attempt after attempt
        restarts = 0
        attempt = 0
        while True:
            placement = coordinator.begin(attempt)  # a fresh store each attempt
            began = time.time()
            # A node that joins the job as it runs, or arrives at a restart waiting for MIN
            # nodes: at the job's restart count.
            restarts = max(restarts, coordinator.job_restarts)
            if placement.elastic:  # --nnodes MIN:MAX: this node's number, the attempt's size
                # A restart renumbers the nodes still there (node 0 decided: settle).
                self.spec = dataclasses.replace(
                    self.spec, node_rank=placement.node_rank, nnodes=placement.nnodes
                )
                if not coordinator.late:
                    first = self.spec.global_rank(0)
                    formed = f"restarted (restart {restarts})" if restarts else "formed"
                    _say(
                        f"the job {formed} with {placement.nnodes} node(s), world size "
                        f"{self.spec.world_size}: this is node {placement.node_rank} (ranks "
                        f"{first}..{first + self.spec.nproc_per_node - 1} here)"
                    )
            self._start(attempt, restarts, placement)
            lost, fallback, ended_by = self._in_memory_attempt(coordinator, restarts)
            ended = time.time()
            if self.stop_signal is not None:
                return self._stopped(self.stop_signal, ended)
            if fallback is not None or ended_by is not None:
                self._stop_all(signal.SIGTERM, self.spec.grace_s)
            if fallback is not None:
                self._say_failure(fallback.lost[0], began)
            for w in self.workers:
                w.drained_tail()
            # Many nodes: the nodes meet once each one's workers have exited; node 0 says
            # whether every node restarts, and keeps the store until every other node knows.
            agreed, refused = coordinator.settle(self._tick, lambda: self.stop_signal is not None)
            if self.stop_signal is not None:
                return self._stopped(self.stop_signal, ended)
            reports = recovery_reports(self.reports, since=began, run_id=self.spec.run_id)
            ending = fallback if fallback is not None else ended_by.line if ended_by else None
            lines += recovery_lines(lost, reports, started=self.started, fallback=ending,
                                    first=len(lines) + 1)  # fmt: skip
            restart = agreed if coordinator.many else fallback.restart if fallback else 0
            if restart:
                if ended_by is not None:  # the deciding node said why; this one follows
                    _say(
                        f"another node ended the attempt; this node's workers were stopped and "
                        f"start again (restart {restart} of {self.spec.max_restarts}): "
                        f"{ended_by.why}"
                    )
                restarts = restart
                attempt += 1
                continue
            for line in lines:
                _say(line)
            if refused:
                _say(f"no restart: {refused}")
            if ended_by is not None:
                if ended_by.node == self.spec.node_rank:  # this node decided it
                    _say(f"the job ends: {ended_by.why}")
                else:
                    _say(
                        "another node ended the job; this node's workers were stopped: "
                        f"{ended_by.why}"
                    )
                self._say_checkpoint(ended)
                return 1
            if fallback is not None:
                self._say_checkpoint(ended)
                return fallback.lost[0].exit_code()
            if any(w.proc.returncode == 0 for w in self.workers):  # one ran to completion
                return 0
            if not lost:  # a node that joined a running job whose end came first
                _say(
                    "the job ended before this node's workers were admitted; nothing ran here "
                    "(--recover in-memory)"
                )
                return 0
            failure = lost[0]
            members = [w for w in self.workers if w.rank not in self.unadmitted]
            if coordinator.many:
                _say(
                    f"every worker of this node failed ({len(lost)} of {len(self.workers)}); "
                    "the other nodes' workers go on without them if they hold a majority of "
                    "the job (--recover in-memory)"
                )
            else:
                _say(
                    f"every worker failed ({len(lost)} of {len(members)}): no survivor was "
                    "left to go on (--recover in-memory)"
                )
            self._say_failure(failure, began)
            self._say_checkpoint(ended)
            return failure.exit_code()

    def _tick(self) -> None:
        """Many nodes, while this launcher waits: beat, and (node 0) say of each rank left out
        whose node's launcher went silent that nobody replaces it."""
        coordinator = self.coordinator
        assert isinstance(coordinator, InMemoryCoordinator)
        coordinator.beat()
        for rank, node in list(self.unreplaced.items()):
            if coordinator.dead([rank]):  # its launcher is there, and deals with it
                del self.unreplaced[rank]
            elif coordinator.silent(node):
                del self.unreplaced[rank]
                _say(no_replacement_line(rank, node, coordinator.store_timeout))

    def _in_memory_attempt(
        self, coordinator: InMemoryCoordinator, restarts: int
    ) -> tuple[list[Failure], Fallback | None, JobEnd | None]:
        """Watch one attempt's workers until every one has exited, a signal, or a fall-back to
        ``restart`` (the workers then still running are left to the caller to stop). The
        workers lost while the others went on, the fall-back if one came, and (many nodes) the
        end another node's launcher gave the attempt, if it did.

        With many nodes every launcher watches its own workers: it marks its own lost ones dead
        in node 0's store, fences its own that the survivors left out, and replaces its own
        (with a launch rank from the job's counter); who goes on is every member of the job's
        latest generation not known dead. A loss that cannot be recovered in memory ends the
        attempt on every node (:meth:`InMemoryCoordinator.end_job`), asking for a restart while
        ``--max-restarts`` allows. A store that cannot be reached (node 0 down, or this node
        cut off) is a LaunchError that ends this launcher (its workers are killed on the way
        out)."""
        running = list(self.workers)
        lost: list[Failure] = []
        completed = 0
        generation = 1
        self.unreplaced = {}  # this attempt's: its store's ranks
        fenced: set[int] = set()
        many = coordinator.many
        # The members of the job's latest generation (launch ranks, every node's): a
        # replacement not yet admitted is not one.
        members = set(range(self.spec.world_size))
        # Replacements started here, not admitted yet (a node that joined a running job:
        # each of its workers).
        waiting: set[int] = {w.rank for w in running} if coordinator.late else set()
        dismissed: set[int] = set()  # ... and stopped, the job having ended first
        while running and self.stop_signal is None:
            if many:
                self._tick()
                said = coordinator.ended()
                if said is not None:
                    return lost, None, said
            # The survivors decided a new membership: a worker left out of it (hung, or cut
            # off) is killed, so that it can neither hold their collectives nor come back
            # into a job that went on without it.
            decided = coordinator.members(generation)
            if decided is not None:
                waiting -= set(decided)
                for worker in running:
                    left_out = worker.rank in members and worker.rank not in decided
                    if left_out and worker.proc.poll() is None:
                        _say(
                            f"rank {worker.rank} was left out of the job by the others (hung or "
                            "cut off): killing it"
                        )
                        fenced.add(worker.rank)
                        worker.signal(signal.SIGKILL)
                if many and self.spec.node_rank == 0 and self.spec.max_restarts:
                    for rank in members - set(decided):
                        node = coordinator.node_of(rank, self.spec.nproc_per_node)
                        if node not in (None, 0) and not coordinator.dead([rank]):
                            self.unreplaced[rank] = node
                members = set(decided)
                generation += 1
            only_waiting = all(w.rank in waiting for w in running)
            if many:
                coordinator.idle(only_waiting)
            if waiting - dismissed and only_waiting and self._nobody_admits(generation):
                for worker in running:  # the members are done: nobody is left to admit them
                    _say(f"replacement rank {worker.rank} was not admitted: the job ended first")
                    worker.signal(signal.SIGKILL)
                dismissed |= waiting
            failed: list[tuple[Worker, Failure]] = []
            for worker in list(running):
                code = worker.proc.poll()
                if code is None:
                    continue
                running.remove(worker)
                if worker.rank in waiting:  # a replacement that ended before it was admitted
                    waiting.discard(worker.rank)
                    self.unadmitted.add(worker.rank)
                    if worker.rank not in dismissed:
                        _say(f"replacement rank {worker.rank} ended before it was admitted")
                    continue
                if code == 0:
                    completed += 1
                    continue
                cause = LEFT_OUT if worker.rank in fenced else ""
                failure = Failure(
                    worker.rank, worker.local_rank, self.host, code, (), cause, time.time()
                )
                failed.append((worker, failure))
            if failed:
                # Who goes on must have said it recovers in memory: with one node, its workers
                # still running (a replacement not admitted yet is no member to go on); with
                # many, every member of the job not known dead. With nobody left, a restart
                # (while any is left) is what --recover restart would do.
                if many:
                    gone = {f.rank for f in lost} | {f.rank for _, f in failed}
                    gone |= coordinator.dead(r for r in members if r not in gone)
                    members_left = sorted(r for r in members if r not in gone)
                else:
                    members_left = [w.rank for w in running if w.rank not in waiting]
                why = unable(coordinator.able(members_left)) if members_left else {}
                nobody = not members_left and not completed
                left = restarts < self.spec.max_restarts
                if why or (nobody and left):
                    for worker, _ in failed:
                        worker.signal(signal.SIGKILL)  # its children, in its process group
                    fallback = Fallback(
                        tuple(dataclasses.replace(f, tail=w.drained_tail()) for w, f in failed),
                        why,
                        restart=restarts + 1 if left else 0,
                        max_restarts=self.spec.max_restarts,
                        nodes=self.spec.nnodes,
                    )
                    summary = fallback_summary(fallback)
                    if many:  # every other node stops its workers too; the first end stands
                        mine = JobEnd(
                            summary.removeprefix("tandem run: "),
                            fallback_line(fallback, self.started),
                            fallback.restart,
                        )
                        first = coordinator.end_job(mine)
                        if first != mine:  # another node's came first: this one follows it
                            return [*lost, *fallback.lost], None, first
                    _say(summary)
                    return lost, fallback, None
                for worker, failure in failed:
                    coordinator.report_failure(0, failure)  # the survivors: now
                    worker.signal(signal.SIGKILL)  # its children, still in its process group
                for worker, failure in failed:
                    failure = dataclasses.replace(failure, tail=worker.drained_tail())
                    lost.append(failure)
                    _say(lost_summary(failure, len(members_left)))
                    if (
                        members_left
                        and self.replaced < self.spec.max_restarts
                        and coordinator.admits(members_left)
                    ):
                        self.replaced += 1
                        rank = coordinator.launch_rank(self.spec.world_size)
                        new = self._replacement(worker, rank)
                        self.workers.append(new)
                        running.append(new)
                        waiting.add(new.rank)
                        here = f" on node {self.spec.node_rank}" if many else ""
                        _say(
                            f"starting rank {new.rank} to replace rank {worker.rank} "
                            f"(replacement {self.replaced} of {self.spec.max_restarts}{here}): "
                            "the others admit it at their next step"
                        )
            if running:
                time.sleep(0.02)
        return lost, None, None

    def _nobody_admits(self, generation: int) -> bool:
        """Whether no member of the job runs any more, so that a replacement waiting here will
        never be admitted: with many nodes, every other node is idle (or done, or silent) and
        no generation was decided since (one admitting the replacement is decided before its
        members' node goes idle)."""
        coordinator = self.coordinator
        assert isinstance(coordinator, InMemoryCoordinator)
        if not coordinator.many:
            return True
        return coordinator.others_idle() and coordinator.members(generation) is None

    def _replacement(self, lost: Worker, rank: int) -> Worker:
        """A worker in ``lost``'s place (its local rank, so its device) with launch rank
        ``rank``, which asks the others to admit it (``tandem.job.join``)."""
        env = dict(
            lost.env,
            RANK=str(rank),
            ROLE_RANK=str(rank),
            WORLD_SIZE=str(rank + 1),  # a consistent pair until the members admit it
            TANDEM_RECOVER_JOIN=str(rank),
        )
        return Worker(self.spec, lost.local_rank, env, self.spec.logs, self.console, rank=rank)

    def _start(self, attempt: int, restarts: int, placement: Attempt) -> None:
        spec = self.spec
        base = dict(os.environ)
        base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        base.pop(ROUND_VARIABLE, None)
        base.pop(RECOVER_VARIABLE, None)  # a launcher's launcher's: ours come with placement
        for name in (CONSOLE_TTY, CONSOLE_COLUMNS):  # a launcher's launcher's, not ours
            base.pop(name, None)
        base.update(self.console_env)
        base.update(placement.env)
        base.update(
            WORLD_SIZE=str(spec.world_size),
            LOCAL_WORLD_SIZE=str(spec.nproc_per_node),
            GROUP_RANK=str(spec.node_rank),
            NODE_RANK=str(spec.node_rank),
            ROLE_NAME=spec.role,
            TANDEM_REPORT_DIR=str(self.reports),
            TANDEM_HANG_REPORT_DIR=str(self.hang_reports),
            ROLE_WORLD_SIZE=str(spec.world_size),
            MASTER_ADDR=placement.addr,
            MASTER_PORT=str(placement.port),
            TORCHELASTIC_RESTART_COUNT=str(restarts),
            TANDEM_RESTART_COUNT=str(attempt),
            TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
            TORCHELASTIC_RUN_ID=spec.run_id,
            GROUP_WORLD_SIZE=str(spec.nnodes),
            TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            PYTHONUNBUFFERED="1",
        )
        if spec.backend:
            base["TANDEM_BACKEND"] = spec.backend
        if spec.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            # N workers each starting one thread per core would oversubscribe the node N times.
            base["OMP_NUM_THREADS"] = "1"
        self.workers = []
        if spec.logs is not None:
            spec.logs.begin(attempt)
        # A node arriving while an elastic in-memory job runs: its workers join it as
        # replacements do, each with a launch rank from the job's counter.
        coordinator = self.coordinator
        late = isinstance(coordinator, InMemoryCoordinator) and coordinator.late
        for local_rank in range(spec.nproc_per_node):
            rank = spec.global_rank(local_rank)
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(local_rank), ROLE_RANK=str(rank))
            if late:
                assert isinstance(coordinator, InMemoryCoordinator)
                rank = coordinator.launch_rank(spec.world_size)
                env.update(
                    RANK=str(rank),
                    ROLE_RANK=str(rank),
                    WORLD_SIZE=str(rank + 1),  # a consistent pair until the members admit it
                    TANDEM_RECOVER_JOIN=str(rank),
                )
            if spec.virtual_local_rank:
                env.update(virtual_local_rank(local_rank, os.environ.get("CUDA_VISIBLE_DEVICES")))
            rank_dir = spec.logs.rank_dir(local_rank) if spec.logs is not None else None
            if rank_dir is not None:  # where torch's @record writes the worker's traceback
                env["TORCHELASTIC_ERROR_FILE"] = str(rank_dir / "error.json")
            self.workers.append(Worker(spec, local_rank, env, spec.logs, self.console, rank))

    def _watch(self, round: int) -> Failure | Restart | None:
        """Until all workers succeed (None), one fails, another node fails, the membership
        changes (a node waits to join), or a signal."""
        while self.stop_signal is None:
            codes = [w.proc.poll() for w in self.workers]
            for worker, code in zip(self.workers, codes, strict=True):
                if code is not None and code != 0:
                    # Stop the others first: reading the failed worker's last lines can wait.
                    for other in self.workers:
                        other.signal(signal.SIGTERM)
                    failure = Failure(
                        worker.rank, worker.local_rank, self.host, code, worker.drained_tail()
                    )
                    self.coordinator.report_failure(round, failure)
                    return failure
            if all(code == 0 for code in codes):
                for w in self.workers:
                    w.drained_tail()
                return None
            remote = self.coordinator.remote_failure(round)
            if remote is not None:
                return remote
            change = self.coordinator.membership_change(round)
            if change is not None:
                return change
            time.sleep(0.02)
        return None

    def _wait_all(self, seconds: float) -> None:
        """Until every worker has exited, or ``seconds`` have passed."""
        deadline = time.monotonic() + seconds
        while any(w.proc.poll() is None for w in self.workers) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _stop_all(self, signum: int, grace: float) -> None:
        alive = [w for w in self.workers if w.proc.poll() is None]
        for w in alive:
            w.signal(signum)
        deadline = time.monotonic() + grace
        while any(w.proc.poll() is None for w in alive) and time.monotonic() < deadline:
            time.sleep(0.02)
        for w in alive:
            if w.proc.poll() is None:
                w.signal(signal.SIGKILL)
            w.proc.wait()

    def _on_signal(self, signum: int, frame: object) -> None:
        for w in self.workers:
            w.signal(signum)
        if signum != signal.SIGUSR1:  # USR1 asks the workers to checkpoint: they carry on
            self.stop_signal = signum


def virtual_local_rank(local_rank: int, visible: str | None) -> dict[str, str]:
    """torchrun's ``--virtual-local-rank``: every worker is local rank 0 of its own one GPU.

    Example::

        >>> virtual_local_rank(1, "4,5")
        {'LOCAL_RANK': '0', 'CUDA_VISIBLE_DEVICES': '5'}
    """
    devices = visible.split(",") if visible else [str(local_rank)]
    device = devices[local_rank] if local_rank < len(devices) else str(local_rank)
    return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": device.strip()}


def _say(message: str) -> None:
    text = message if message.startswith("tandem run") else f"tandem run: {message}"
    print(text, file=sys.stderr, flush=True)


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def in_own_group_dying_with_parent() -> None:
    """``preexec_fn`` of every process a launcher starts (workers, ssh clients, a host's
    launcher): a session and process group of its own, so that a signal to it reaches its
    children too; and SIGKILL when its parent dies, so that nothing outlives the launcher.

    Example::

        subprocess.Popen(argv, preexec_fn=in_own_group_dying_with_parent)
    """
    os.setsid()
    if _libc is not None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def hang_reports(directory: Path, since: float = 0.0) -> list[tuple[Path, dict]]:
    """The hang reports the workers wrote in ``directory`` since ``since`` (a ``time.time()``;
    older files are another run's), oldest first, each as (its file, its content).

    Example::

        for path, report in hang_reports(Path.cwd(), since=started):
            print(path, report["laggard_ranks"])
    """
    found = []
    for path in directory.glob("tandem-hang-*.json"):
        with contextlib.suppress(OSError, ValueError):
            modified = path.stat().st_mtime
            report = json.loads(path.read_text())
            if modified >= since and isinstance(report, dict) and "text" in report:
                found.append((modified, path, report))
    found.sort(key=lambda item: item[0])
    return [(path, report) for _, path, report in found]


def hang_report_text(path: Path, report: dict) -> str:
    """A hang report as the exit summary repeats it, headed by its file."""
    return f"--- the newest hang report ({path}) ---\n{report['text']}\n---"


def held_up_by(rank: int, written: list[tuple[Path, dict]]) -> tuple[list[int], str, list[str]]:
    """Who ``rank`` failed waiting for: from its newest hang report whose collective was still
    unfinished when it exited (the collective's timeout, or an error, ended it while it waited),
    the laggards it named, the collective, and their lines. Empty when there is none, or when
    ``rank`` is a laggard itself: then ``rank`` is the one to blame.

    Example::

        laggards, collective, details = held_up_by(failure.rank, hang_reports(Path.cwd()))
        print(failure.summary(laggards, collective, details))
    """
    for _, report in reversed(written):
        if report.get("rank") != rank or not report.get("unfinished_at_exit"):
            continue
        late = [int(r) for r in report.get("laggard_ranks") or report.get("silent") or []]
        if not late or rank in late:
            break
        stuck = report.get("collective") or {}
        collective = f"{stuck.get('op')} #{stuck.get('seq')} of {stuck.get('group')}"
        details = report.get("laggards") or [f"rank {r} did not answer" for r in late]
        return late, collective, list(details)
    return [], "", []


def committed_checkpoint(directory: Path, run_id: str, when: float, event: str) -> str | None:
    """The exit summary's line on the newest checkpoint the run ``run_id`` committed (None if
    none): its path, step and epochs, how long before or after ``event`` (which happened at
    ``when``, a ``time.time()``), and how to resume.

    The Trainer's rank 0 notes each commit in ``directory`` (``TANDEM_REPORT_DIR``; see
    ``tandem.checkpoint.checkpointer.report_commit``) as ``tandem-checkpoint-<run_id>.json``: the
    launcher's run id, so a report directory shared with other jobs is no confusion.

    Example::

        line = committed_checkpoint(Path("logs"), spec.run_id, time.time(), "SIGTERM")
        # 'checkpoint committed at runs/x/checkpoints/ckpt-e0003-s00001200.pt (step 1200,
        #  3 epochs done) 2.1 s after SIGTERM (the save took 1.2 s); run the same command
        #  again to resume from it (a Trainer with resume="latest")'
    """
    try:
        note = json.loads((directory / f"tandem-checkpoint-{run_id}.json").read_text())
        path, step, epoch = note["path"], note["step"], note["epoch"]
        offset = float(note["committed"]) - when
        took = float(note["committed"]) - float(note["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    # The launcher notices an event within its 20 ms poll: a commit a few ms "before" it is the
    # event's own (a small model's SIGTERM checkpoint).
    after = offset > -0.05
    seconds = max(offset, 0.0) if after else -offset
    ago = f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min"
    return (
        f"checkpoint committed at {path} (step {step}, {epoch} epochs done) {ago} "
        f"{'after' if after else 'before'} {event} (the save took {took:.1f} s); run the "
        'same command again to resume from it (a Trainer with resume="latest")'
    )
