"""The commit's state is the one the step leaves, however the step moves its generators.

Proves, with ``tandem run --recover in-memory`` (3 real processes over Gloo, one launch; this
module is also the worker, ``python -m tests.recovery.test_rng_after_backward``):

- the state a rank leaves in the store for a step (taken on a thread from the start of the
  backward, off the step's path, as ``TANDEM_COMMIT_OFF_PATH=1`` asks) is exactly what that
  step leaves: after every step each rank compares its own slot in the store (what a survivor
  would load) with its generators as the step left them, bitwise. The model holds a custom
  autograd Function that draws random numbers in its backward, between the backward's start
  and its last bucket, once the early take is done (it waits for it): that take is stale and
  must be taken again on the path. At one step the state is taken slowly (the taking sleeps
  0.3 s): the vote must wait for it rather than pass with the store behind;
- a step function that draws random numbers after ``loss.backward()`` (ranks 1 and 2, at step
  2; the vote had passed on every rank) ends the run with the same
  :class:`tandem.recovery.StateAfterVoteError` on **every** rank at step 3, naming both ranks
  and the step (no hang, no rank counted lost and no re-form: it is raised by the commit of a
  vote that passed); meanwhile the store held the true state of step 2 for each of them
  (republished before step 3's vote);
- every process is accounted for: the launcher exits non-zero and no worker is left behind.

And in one process, the vote's calls as the reducer makes them (no launch): the state is taken
once, on the sender thread, while nothing moves; taken again before the last bucket once the
generators moved after that take, and in the store then; an error taking it on the thread is
raised before the last bucket, not lost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.launching import run_job
from tests.recovery.test_recovery import leftovers

launched = [pytest.mark.launch, pytest.mark.xdist_group("recovery")]

WORKER = "tests.recovery.test_rng_after_backward"
NPROC = 3
DRAW_AFTER = ("1:2", "2:2")  # RANK:STEP: these ranks draw after their backward at step 2
SLOW = 1  # the step whose state is taken slowly (on every rank)


@pytest.mark.timeout(200)
@launched[0]
@launched[1]
def test_random_numbers_after_the_backward_stop_every_rank_and_the_store_holds_the_truth(
    tmp_path,
):
    out = tmp_path / "out"
    args = [str(out), "--slow", str(SLOW)]
    for spec in DRAW_AFTER:
        args += ["--draw-after", spec]
    job = run_job(
        NPROC, ["--recover", "in-memory", "--heartbeat-timeout", "2"], WORKER, *args,
        timeout=150, check=False,
    )  # fmt: skip
    assert job.returncode != 0, job.stderr[-3000:]
    records = {}
    for rank in range(NPROC):
        path = Path(f"{out}.rank-{rank}")
        assert path.exists(), f"rank {rank} wrote no record:\n{job.stderr[-3000:]}"
        records[rank] = json.loads(path.read_text())
    # Every rank stopped with the same error, at step 3, naming both ranks and their step.
    errors = {rank: r["error"] for rank, r in records.items()}
    for rank, error in errors.items():
        assert error is not None, f"rank {rank} ended without an error: {records[rank]}"
        assert error["type"] == "StateAfterVoteError", error
        assert "rank 1 after step 2, rank 2 after step 2" in error["text"], error
        assert "Every rank stops at step 3" in error["text"], error
        assert "before loss.backward()" in error["text"], error
    assert len({e["text"] for e in errors.values()}) == 1, errors
    assert all(r["steps"] == 3 for r in records.values()), records  # steps 0-2 committed
    # After every committed step, the store held exactly what the step left (the backward
    # draws: the early take was stale; step 1's take was slow), on every rank.
    for rank, record in records.items():
        assert record["checked"] == [0, 1, 2], (rank, record)
        assert record["differ"] == [], (rank, record)
        assert record["late"] == [0, 1, 2, 3], (rank, record)  # the early take was stale
    # The moved ranks' state of step 2 in the store, read by rank 0 as the run stopped: their
    # true state (republished), not the one taken at the vote.
    truths = records[0]["stored_of_moved"]
    for rank in (1, 2):
        assert truths[str(rank)] == records[rank]["true_state_of_moved_step"], rank
        assert truths[str(rank)] != records[rank]["state_at_vote"], rank
    assert "lost rank" not in job.stderr, job.stderr[-3000:]  # nobody counted lost
    pids = {r["pid"] for r in records.values()}
    assert leftovers(pids) == []


def _vote(own):
    """A vote of an active rank (its store in memory), as a commit of step 4 left it."""
    import torch.distributed as dist

    from tandem.recovery import Membership, Recoverer
    from tandem.recovery.vote import _Sender

    store = dist.HashStore()
    recoverer = Recoverer()  # inactive here (one process): given members by hand
    recoverer.members = Membership(store, me=0, members=[0, 1], heartbeat_timeout=10.0)
    recoverer.last_commit = (4, [0, 1])
    vote = recoverer._vote
    vote.own = own
    vote.off_path = True  # whatever this machine's cores would choose
    vote._sender = _Sender(recoverer.members)
    vote._sender.store = store  # its own client is the launcher's store: here, the same one
    vote._sender.start()
    return vote, recoverer.members


def test_the_state_goes_off_the_path_and_again_on_it_if_the_backward_drew():
    """One process, no launch: the vote's calls as the reducer makes them."""
    import torch

    from tandem.recovery import RngText

    rng = RngText()
    takes: list[str] = []

    def own() -> str:
        takes.append(threading.current_thread().name)
        return RngText().value()  # taken anew every time: the count says where it was taken

    vote, members = _vote(own)
    vote.starting()  # the backward starts: the sender takes and sends step 5's state
    assert vote._sender is not None
    vote._sender.wait(lambda: None)
    vote.entering()  # nothing moved: the sender's state, not taken again
    assert takes == ["tandem-commit-sender"]
    assert vote.published == rng.value() == members.own_value(0, 5)
    taken = vote.published
    vote.starting()
    vote._sender.wait(lambda: None)  # the early take is done, then the backward draws
    torch.rand(1)
    vote.entering()
    assert takes == ["tandem-commit-sender"] * 2 + ["MainThread"]  # again, on the path
    assert vote.published == rng.value() != taken
    assert members.own_value(0, 5) == vote.published  # and in the store before the vote


def test_an_error_taking_the_state_off_the_path_is_raised_on_the_path():
    def own() -> str:
        if threading.current_thread().name == "tandem-commit-sender":
            raise ValueError("the state cannot be taken")
        return "1"  # on the path it could: the error must not be lost for that

    vote, _ = _vote(own)
    vote.starting()
    with pytest.raises(ValueError, match="cannot be taken"):
        vote.entering()


def test_the_commit_goes_off_the_path_only_where_a_core_is_spare(monkeypatch):
    from tandem.recovery import OFF_PATH_VARIABLE, commit_off_path

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert commit_off_path({"LOCAL_WORLD_SIZE": "8"})  # 2 cores a rank
    assert not commit_off_path({"LOCAL_WORLD_SIZE": "9"})
    assert commit_off_path({})  # one rank
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert not commit_off_path({"LOCAL_WORLD_SIZE": "2"})  # this VM's tests: a core a rank
    assert commit_off_path({"LOCAL_WORLD_SIZE": "2", OFF_PATH_VARIABLE: "1"})
    assert not commit_off_path({"LOCAL_WORLD_SIZE": "1", OFF_PATH_VARIABLE: "0"})
    with pytest.raises(ValueError, match=f"{OFF_PATH_VARIABLE}='yes': use 1"):
        commit_off_path({OFF_PATH_VARIABLE: "yes"})


# -- the worker ---------------------------------------------------------------------------------


def main() -> None:
    import faulthandler
    import signal

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    import tandem
    import tandem.recovery
    from tandem.checkpoint.rng import compact_rng_state
    from tandem.recovery import Run, encode

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--draw-after", action="append", default=[])
    parser.add_argument("--slow", type=int, default=None)
    args = parser.parse_args()
    # The early take this module proves, whatever the cores (by default a rank per core takes
    # its state on the path: tandem.recovery.commit_off_path).
    os.environ[tandem.recovery.OFF_PATH_VARIABLE] = "1"
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    me = int(os.environ["RANK"])
    draw_after = {int(s) for r, s in (x.split(":") for x in args.draw_after) if int(r) == me}
    moved_ranks = sorted({int(x.split(":")[0]) for x in args.draw_after})
    tandem.init()

    late: list[int] = []  # the steps whose draw came after the state was taken off the path

    class Noisy(torch.autograd.Function):
        """The identity, whose backward draws a random number (and adds nothing of it), once
        the state was taken off the path (as a slower backward would): that take is stale."""

        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            sender = run.recoverer._vote._sender
            deadline = time.monotonic() + 5
            while sender is not None and sender.jobs and time.monotonic() < deadline:
                time.sleep(0.002)
            if sender is not None and not sender.jobs:
                late.append(run.step_count)
            torch.rand(1)  # moves the generator inside the backward, before its last bucket
            return grad

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(Noisy.apply(torch.tanh(self.a(x))))

    torch.manual_seed(0)
    net = Net()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(48, 6, generator=g)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    run = Run(net, torch.optim.SGD(net.parameters(), lr=0.1), data, batch_size=4, seed=3)
    torch.manual_seed(100 + me)
    vote = run.recoverer._vote
    own = vote.own

    def slow_own() -> str:
        if run.step_count == args.slow:
            time.sleep(0.3)  # the state comes late: the vote must wait for it
        return own()

    vote.own = slow_own
    record: dict = {"pid": os.getpid(), "checked": [], "differ": [], "error": None, "steps": 0}
    members = run.recoverer.members
    assert members is not None

    def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        if run.step_count in draw_after:
            record["state_at_vote"] = vote.published
            torch.rand(1)  # after the backward: the vote has passed
        return loss.item()

    try:
        while not run.finished:
            step = run.step_count
            run.step(train_step)
            actual = encode(compact_rng_state())
            record["checked"].append(step)
            if members.own_value(me, step) != actual:
                record["differ"].append(step)
            if step in draw_after:
                record["true_state_of_moved_step"] = actual
            record["steps"] = run.step_count
    except tandem.recovery.StateAfterVoteError as error:
        record["late"] = late
        record["error"] = {"type": type(error).__name__, "text": str(error)}
        if me == 0:
            record["stored_of_moved"] = {r: members.own_value(r, 2) for r in moved_ranks}
        Path(f"{args.out}.rank-{me}").write_text(json.dumps(record))
        run.close()
        sys.exit(1)
    Path(f"{args.out}.rank-{me}").write_text(json.dumps(record))
    run.close()
    tandem.shutdown()


if __name__ == "__main__":
    main()
