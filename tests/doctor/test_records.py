"""Every collective is recorded (tandem.doctor.records), on every rank alike.

- After tandem.DDP is built (or ``tandem.init()``), each collective leaves a record: tandem.DDP's
  bucket all-reduces tagged ``DDP bucket k, step s`` (on the CPU its end-of-backward check rides
  in the last bucket: no record of its own when no rank missed gradients), and the user's own
  ``dist.all_reduce`` / ``dist.barrier`` with the line of this file that called them.
- Records are numbered per group from 1; every rank's sequence of (group, number, op, shapes,
  dtypes) is the same; a subgroup counts on its own.
- Blocking calls have ended when they return; an asynchronous one once its work is done, and
  the next collective lets go of a finished work (no record keeps its tensors alive).
- The ring keeps the newest ``CAPACITY`` records; ``uninstall`` gives torch its functions back.
- On Gloo a blocking collective, and ``records.wait`` on an asynchronous one, wait in slices: a
  failure set meanwhile (``records.fail``, what the doctor calls on a mismatch) is raised in the
  waiting thread within a second, while the peer has not even arrived.
"""

from __future__ import annotations

import inspect
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.doctor import mismatch, records
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def _train_and_talk() -> dict:
    torch.manual_seed(0)
    model = tandem.DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    dist.all_reduce(torch.ones(3, dtype=torch.float64))
    work = dist.all_reduce(torch.ones(2), async_op=True)
    work.wait()
    pair = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1), group=pair)
    dist.barrier()
    # Before anything polls the records: the barrier's own look must have let go of every
    # finished work (a Work keeps its tensors, the buckets' among them, alive).
    held = [r.as_dict() for r in records.recent() if r.work is not None]
    return {
        "held": held,
        "records": [r.as_dict() for r in records.recent()],
        "line": line,
        "open": len(records.open_records()),
    }


def test_every_collective_is_recorded_alike_on_every_rank():
    first, second = run_ranks(_train_and_talk, 2, init="gloo", timeout=60)
    for result in (first, second):
        recs = result["records"]
        contexts = [r["context"] for r in recs]
        assert "DDP bucket 0, step 1" in contexts and "DDP bucket 0, step 2" in contexts, contexts
        assert not any("end-of-backward" in (c or "") for c in contexts), contexts
        user = [r for r in recs if r["context"] is None and r["op"] == "all_reduce"]
        assert user[0]["site"] == f"test_records.py:{result['line']} in _train_and_talk", user
        assert user[0]["shapes"] == [[3]] and user[0]["dtypes"] == ["float64"], user[0]
        assert recs[-1]["op"] == "barrier", recs[-1]
        # Numbered per group from 1, without gaps.
        for group in {r["group"] for r in recs}:
            seqs = [r["seq"] for r in recs if r["group"] == group]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (group, seqs)
        sub = [r for r in recs if r["group"] == "ranks 0,1"]
        assert [r["seq"] for r in sub] == [1], sub
        assert all(r["end"] is not None and r["end"] >= r["start"] for r in recs), recs
        assert result["open"] == 0
        assert result["held"] == [], result["held"]
    keys = ("group", "seq", "op", "shapes", "dtypes", "context")
    assert [[r[k] for k in keys] for r in first["records"]] == [
        [r[k] for k in keys] for r in second["records"]
    ]


def _many() -> dict:
    records.install()
    for _ in range(records.CAPACITY + 10):
        dist.all_reduce(torch.ones(1))
    kept = records.recent()
    records.uninstall()
    restored = dist.all_reduce.__module__
    return {"kept": len(kept), "last": kept[-1].seq, "first": kept[0].seq, "module": restored}


def test_ring_keeps_the_newest_and_uninstall_restores_torch():
    (result,) = run_ranks(_many, 1, init="gloo", timeout=60)
    assert result["kept"] == records.CAPACITY
    assert result["last"] - result["first"] == records.CAPACITY - 1
    assert result["module"] == "torch.distributed.distributed_c10d", result


def _interrupted(how: str) -> dict:
    tandem.init(timeout=30)
    mismatch.before_raise = None  # no doctor to wait for: this test fails the rank by hand
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        time.sleep(4)  # arrives long after rank 0 was told
        dist.all_reduce(torch.ones(2))  # meets rank 0's, which still runs
        store.set("rank 1 done", "1")
        return {}
    threading.Timer(0.5, records.fail, args=("told while waiting",)).start()
    start = time.monotonic()
    try:
        if how == "blocking":
            dist.all_reduce(torch.ones(2))
        else:
            records.wait(dist.all_reduce(torch.ones(2), async_op=True))
    except records.CollectiveMismatchError as e:
        error = str(e)
    after = time.monotonic() - start
    blocked = dict(records.blocked)
    issued = len(records.recent())
    try:
        dist.barrier()
    except records.CollectiveMismatchError as e:
        entry = str(e)
    assert len(records.recent()) == issued  # refused at its entry: not even recorded
    store.wait(["rank 1 done"])  # leaving earlier would fail rank 1's all-reduce
    return {"error": error, "after": after, "blocked": len(blocked), "entry": entry}


@pytest.mark.parametrize("how", ["blocking", "records.wait"])
def test_a_failure_set_while_waiting_is_raised_in_the_waiting_thread(how):
    first, _ = run_ranks(_interrupted, 2, args=(how,), init=None, timeout=60)
    assert first["error"] == "told while waiting", first
    assert first["after"] < 2, first  # the peer comes after 4 s; the timeout is 30 s
    assert first["blocked"] == 0, first
    assert first["entry"] == "told while waiting", first  # and the next collective at its entry


def _a_replacement_before_its_training() -> dict:
    """Rank 1 plays a replacement just admitted; rank 0 a member."""
    rank = dist.get_rank()
    if rank == 1:
        records.replacement_admitted(1)
    seen: dict = {}
    try:
        torch.manual_seed(0)
        # In a constructor the members' admission meets (a Trainer's): allowed.
        records.members_sequence(lambda: tandem.DDP(nn.Linear(3, 2)) and None)()
        if rank == 1:
            for call in (
                lambda: dist.all_reduce(torch.ones(2)),
                lambda: dist.broadcast_object_list([None], src=0),  # through torch's helper
                lambda: tandem.DDP(nn.Linear(3, 2)),  # through tandem, outside: its broadcast
            ):
                try:
                    call()
                except records.ReplacementCollectiveError as e:
                    seen.setdefault("errors", []).append(str(e))
    finally:
        if rank == 1:
            records.training_started()
    total = torch.ones(2)
    dist.all_reduce(total)  # training started: the user's own collective is met, not mixed up
    seen["total"] = total.tolist()
    return seen


def test_a_replacement_s_collectives_before_its_training_raise_naming_the_line():
    records.training_started()  # nothing left over in this process
    member, newcomer = run_ranks(_a_replacement_before_its_training, 2, init="gloo", timeout=60)
    assert member == {"total": [2.0, 2.0]}
    assert newcomer["total"] == [2.0, 2.0]
    ops = ("all_reduce", "broadcast_object_list", "all_gather_object")  # tandem.DDP's check
    assert len(newcomer["errors"]) == len(ops), newcomer
    for text, op in zip(newcomer["errors"], ops, strict=True):
        assert text.startswith("rank 1 is a replacement that joined the running job"), text
        assert "test_records.py:" in text and "in <lambda>" in text, text
        assert f"leads to torch.distributed.{op} before its training started" in text, text
        assert "`if not tandem.recovery.replacing(): ...`" in text, text


def _object_hand_over() -> dict:
    """A hand-over (recovery's: torch's object collectives) that the member handing the run
    over meets only long after: a failure set meanwhile must end the newcomer's wait."""
    tandem.init(timeout=30)
    mismatch.before_raise = None  # no doctor to wait for: this test fails the rank by hand
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:  # hung: it sends the object's size only long after
        time.sleep(4)
        dist.broadcast(torch.zeros(1, dtype=torch.int64), src=1)  # meets rank 0's, still on
        store.set("rank 1 done", "1")
        return {}
    threading.Timer(0.5, records.fail, args=("rank 1 is lost",)).start()
    start = time.monotonic()
    box: list = [None]
    try:
        dist.broadcast_object_list(box, src=1)  # a newcomer waiting for the run
        error = None
    except records.CollectiveMismatchError as e:
        error = str(e)
    after = time.monotonic() - start
    store.wait(["rank 1 done"])
    return {"error": error, "after": after}


def test_torch_s_object_collectives_wait_in_slices_too():
    """The records replace torch's collectives in its own module too, so the ones that torch's
    object helpers make inside (recovery's hand-over: ``broadcast_object_list``,
    ``all_gather_object``) wait in slices on Gloo: a failure set while a peer has not arrived
    (recovery's heartbeat sets one for a member lost or hung) ends the wait within about a
    slice, not at the group's timeout."""
    newcomer, _ = run_ranks(_object_hand_over, 2, timeout=60)
    assert newcomer["error"] is not None and "rank 1 is lost" in newcomer["error"], newcomer
    assert newcomer["after"] < 2.5, newcomer  # told at 0.5 s; rank 1 arrives at 4 s
