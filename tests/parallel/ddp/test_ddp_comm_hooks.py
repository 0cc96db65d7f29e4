"""torch's communication hooks run in tandem.DDP and give torch's DDP's bits.

Oracle: torch.nn.parallel.DistributedDataParallel with the same hook, seeds and data. After 30
SGD steps the parameters of both engines are ``torch.equal`` on every rank, for torch's
``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, the fp16/bf16 wrappers around
``allreduce_hook`` (which need ``GradBucket.set_buffer`` to replace the buffer), ``noop_hook`` and
``post_localSGD_hook`` with torch's ``PeriodicModelAverager``, each with the default buckets and
with many small ones; and ``powerSGD_hook`` with the default buckets, three runs, alone and
inside torch's ``fp16_compress_wrapper`` and ``bf16_compress_wrapper`` (PowerSGD then works on
``bucket.gradients()`` of the float16 / bfloat16 buffer the wrapper set, which must be views of
that buffer, as torch's are; the wrapped runs differ from the unwrapped one, so the low dtype was
used). tandem's own fp16 and bf16 hooks give torch's hooks' bits at world size 1 too (nothing is
sent, but both round the gradients through the low dtype). In one process: after
``set_buffer``, ``gradients()`` are views of the new buffer, in its dtype and shapes.

Where torch's DDP cannot run on Gloo (PowerSGD over several buckets issues collectives from two
threads), tandem must: it runs, every rank ends with the same parameters, and the result is as
close to exact averaging as the single-bucket run. ``batched_powerSGD_hook`` fails inside torch's
own code in any engine (torch 2.13): its error reaches every rank, with no hang.

A hook that issues a second collective from its future's callback, with that callback delayed on
rank 0 and run inline on rank 1, makes the ordering race deterministic: the collectives still
match across ranks.

A hook's future is waited on in slices: a failure declared while rank 0 waits on it (a member
gone, as ``--recover in-memory``'s heartbeat declares one) ends rank 0's backward within a slice,
with its peer stalled before its own backward.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import (
    debugging_hooks,
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.parallel.ddp import comm_hooks
from tests import models
from tests.harness import run_ranks

STEPS = 30
SMALL_BUCKETS = 0.0005  # MiB: the MLP's 6 gradients land in 4 buckets


def _bf16(state, bucket):
    # torch refuses its bf16 hook by name off CUDA+NCCL; through this wrapper it runs on Gloo.
    return default_hooks.bf16_compress_hook(state, bucket)


def _hook(name: str):
    """(hook, state factory, needs a model averager) for a hook name."""
    if name == "allreduce":
        return default_hooks.allreduce_hook, lambda: None, False
    if name == "fp16":
        return default_hooks.fp16_compress_hook, lambda: None, False
    if name == "bf16":
        return _bf16, lambda: None, False
    if name == "fp16_wrapper":
        wrapped = default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
        return wrapped, lambda: None, False
    if name == "bf16_wrapper":
        wrapped = default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)
        return (lambda state, bucket: wrapped(state, bucket)), lambda: None, False
    if name == "noop":
        return debugging_hooks.noop_hook, lambda: None, False
    if name == "post_localsgd":
        subgroup, _ = dist.new_subgroups(group_size=1)

        def state():
            return post_localSGD_hook.PostLocalSGDState(
                process_group=None, subgroup=subgroup, start_localSGD_iter=10
            )

        return post_localSGD_hook.post_localSGD_hook, state, True
    if name in ("powersgd", "batched_powersgd", "powersgd_fp16_wrapper", "powersgd_bf16_wrapper"):
        hook = powerSGD_hook.powerSGD_hook
        if name == "batched_powersgd":
            hook = powerSGD_hook.batched_powerSGD_hook
        if name.endswith("_wrapper"):
            wrap = getattr(default_hooks, f"{name[9:13]}_compress_wrapper")(hook)

            # torch's DDP refuses bf16 wrappers by name off CUDA+NCCL: called through this
            # function they run on Gloo (both engines get the same function).
            def hook(state, bucket):
                return wrap(state, bucket)

        def state():
            return powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3
            )

        return hook, state, False
    raise ValueError(name)


def _train(engine: str, hook_name: str, bucket_cap_mb: float | None) -> torch.nn.Module:
    rank = dist.get_rank()
    if hook_name.startswith("tandem_"):  # tandem's own hook in tandem.DDP, torch's in torch's
        ours = getattr(comm_hooks, f"{hook_name[7:]}_compress_hook")
        hook_name = hook_name[7:] if engine == "torch" else hook_name
    hook, make_state, averaged = (
        (ours, lambda: None, False) if hook_name.startswith("tandem_") else _hook(hook_name)
    )
    wrapper = tandem.DDP if engine == "tandem" else TorchDDP
    model = wrapper(models.mlp(seed=rank, dtype=torch.float32), bucket_cap_mb=bucket_cap_mb)
    model.register_comm_hook(make_state(), hook)
    averager = PeriodicModelAverager(period=4, warmup_steps=10) if averaged else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = models.batch(step, rank, 6, (10,), torch.float32)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if averager is not None:
            averager.average_parameters(model.parameters())
    return model.module


def _parity(hook_name: str, bucket_cap_mb: float | None) -> dict:
    ours = _train("tandem", hook_name, bucket_cap_mb)
    theirs = _train("torch", hook_name, bucket_cap_mb)
    return {
        "equal": all(
            torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
        ),
        "diff": models.max_diff(ours, theirs),
        "params": [p.detach().clone() for p in ours.parameters()],
    }


HOOKS = ["allreduce", "fp16", "bf16", "fp16_wrapper", "bf16_wrapper", "noop", "post_localsgd"]


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_cap_mb", [None, SMALL_BUCKETS], ids=["default", "small"])
@pytest.mark.parametrize("hook_name", HOOKS)
def test_torch_hooks_equal_torch_ddp(hook_name, bucket_cap_mb):
    results = run_ranks(_parity, 2, args=(hook_name, bucket_cap_mb), timeout=120)
    for rank, result in enumerate(results):
        assert result["equal"], (rank, result["diff"])
    if hook_name in ("noop", "post_localsgd"):
        # No (or only periodic) averaging: the replicas drift apart, in both engines alike.
        assert not torch.equal(results[0]["params"][0], results[1]["params"][0])
    else:
        for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.distributed
@pytest.mark.parametrize("hook_name", ["tandem_fp16", "tandem_bf16"])
def test_own_compress_hooks_round_as_torchs_at_world_size_1(hook_name):
    (result,) = run_ranks(_parity, 1, args=(hook_name, None), timeout=120)
    assert result["equal"], result["diff"]


@pytest.mark.distributed
@pytest.mark.parametrize("run", range(3))
def test_powersgd_equals_torch_ddp(run):
    results = run_ranks(_parity, 2, args=("powersgd", None), timeout=120)
    for rank, result in enumerate(results):
        assert result["equal"], (rank, result["diff"])


def _wrapped_powersgd(hook_name: str) -> dict:
    result = _parity(hook_name, None)
    plain = _train("tandem", "powersgd", None)
    result["differs_from_unwrapped"] = not all(
        torch.equal(a, b) for a, b in zip(result["params"], plain.parameters(), strict=True)
    )
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("hook_name", ["powersgd_fp16_wrapper", "powersgd_bf16_wrapper"])
def test_powersgd_in_compress_wrappers_equals_torch_ddp(hook_name):
    # The wrapper sets a float16 (bfloat16) buffer; PowerSGD computes on bucket.gradients().
    # Views of the float32 buffer there failed in tandem ("expected scalar type Float but
    # found Half"); torch's are views of the buffer set.
    results = run_ranks(_wrapped_powersgd, 2, args=(hook_name,), timeout=120)
    for rank, result in enumerate(results):
        assert result["equal"], (rank, result["diff"])
        assert result["differs_from_unwrapped"], rank
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


def test_gradients_are_views_of_the_buffer_set():
    flat = torch.arange(10.0)
    views = [flat[:6].view(2, 3), flat[6:].view(4)]
    bucket = comm_hooks.GradBucket(0, flat, [torch.zeros(2, 3), torch.zeros(4)], views, True)
    assert bucket.gradients()[0] is views[0]  # unchanged buffer: the bucket's own views
    half = flat.half()
    bucket.set_buffer(half)
    grads = bucket.gradients()
    assert [g.dtype for g in grads] == [torch.float16] * 2
    assert [g.shape for g in grads] == [(2, 3), (4,)]
    grads[1].fill_(-1)  # written through into the buffer set
    assert torch.equal(half[6:], torch.full((4,), -1.0, dtype=torch.float16))
    assert torch.equal(grads[0], flat[:6].view(2, 3).half())


def _powersgd_beyond_torch(hook_name: str) -> dict:
    several = _train("tandem", hook_name, SMALL_BUCKETS)
    one = _train("tandem", "powersgd", None)
    exact = _train("tandem", "allreduce", None)
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (several, one)]
    ref = torch.cat([p.detach().reshape(-1) for p in exact.parameters()])
    return {
        "params": flat[0],
        "to_one_bucket": ((flat[0] - flat[1]).norm() / flat[1].norm()).item(),
        "one_bucket_to_exact": ((flat[1] - ref).norm() / ref.norm()).item(),
    }


@pytest.mark.distributed
def test_powersgd_over_several_buckets_where_torch_fails():
    results = run_ranks(_powersgd_beyond_torch, 2, args=("powersgd",), timeout=120)
    assert torch.equal(results[0]["params"], results[1]["params"])  # replicas stay equal
    for r in results:
        # Low-rank compression drifts from exact averaging; several buckets drift no more
        # than the single-bucket run does (different random projections, same algorithm).
        assert r["to_one_bucket"] <= 2 * r["one_bucket_to_exact"] + 1e-3, r


def _batched_powersgd() -> str:
    with pytest.raises(AssertionError) as info:
        _train("tandem", "batched_powersgd", None)
    return "".join(traceback.format_tb(info.tb))


@pytest.mark.distributed
def test_batched_powersgd_fails_in_torchs_own_code_on_every_rank():
    # torch 2.13's batched_powerSGD_hook hands _orthogonalize a 2-D matrix where it asserts a
    # batch of them: no engine can run it. tandem's part is to let the hook's error out on every
    # rank at the same step, never a hang.
    for where in run_ranks(_batched_powersgd, 2, timeout=60):
        assert "batched_powerSGD_hook" in where and "_orthogonalize" in where


def _two_phase_hook(state, bucket):
    """Mean, then a second collective from the future's callback (as PowerSGD does).

    Rank 0's callback is delayed, so its next bucket is ready long before; rank 1 runs the
    whole chain inline, before the hook returns. An engine that launched the next bucket
    without waiting would issue the collectives in different orders on the two ranks.
    """
    rank = dist.get_rank()
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    first = dist.all_reduce(buf, async_op=True).get_future()

    def second(fut):
        if rank == 0:
            time.sleep(0.05)
        count = torch.tensor([float(bucket.index() + 1)])
        dist.all_reduce(count, async_op=True).get_future().wait()
        state.append(count.item())
        return fut.value()[0]

    chained = first.then(second)
    if rank == 1:
        chained.wait()
    return chained


def _race() -> dict:
    rank = dist.get_rank()
    seen: list[float] = []
    hooked = tandem.DDP(models.mlp(seed=rank), bucket_cap_mb=SMALL_BUCKETS)
    hooked.register_comm_hook(seen, _two_phase_hook)
    plain = tandem.DDP(models.mlp(seed=rank), bucket_cap_mb=SMALL_BUCKETS)
    for step in range(3):
        x, y = models.batch(step, rank, 6, (10,))
        for model in (hooked, plain):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
    return {
        "seen": seen,
        "buckets": len(hooked.reducer.layout),
        "equal": all(
            torch.equal(a.grad, b.grad)
            for a, b in zip(hooked.parameters(), plain.parameters(), strict=True)
        ),
    }


@pytest.mark.distributed
def test_collectives_issued_from_hook_callbacks_stay_in_order():
    results = run_ranks(_race, 2, timeout=60)
    assert results[0]["buckets"] >= 3
    for r in results:
        assert r["equal"]  # the means are right
        # every second-phase all-reduce met its own bucket's on the other rank: 2 * (k + 1)
        assert all(v % 2 == 0 for v in r["seen"]), r["seen"]
        assert r["seen"] == results[0]["seen"]
    assert functools.reduce(max, results[0]["seen"]) == 2 * results[0]["buckets"]


def _stalled_peer() -> float | str:
    # Rank 1 never starts its backward (a hung member, as SIGSTOP leaves it): rank 0 waits in
    # its hook's future until another thread declares the failure, as --recover in-memory's
    # heartbeat does when a member falls silent.
    from tandem.doctor import mismatch

    model = tandem.DDP(models.mlp(), comm_hook=default_hooks.allreduce_hook)
    if dist.get_rank() == 1:
        time.sleep(3)  # busy, not in a collective: the out-of-step survey lets the wait go on
        return 0.0
    loss = model(torch.randn(8, 10, dtype=torch.float64)).sum()
    timer = threading.Timer(1.0, mismatch.fail, ("rank 1 is gone",), {"wait_for_others": False})
    timer.start()
    started = time.monotonic()
    try:
        loss.backward()
    except mismatch.CollectiveMismatchError as error:
        return time.monotonic() - started if "rank 1 is gone" in str(error) else str(error)
    finally:
        timer.join()
    return "the backward returned"


@pytest.mark.distributed
def test_a_failure_declared_while_a_hook_future_waits_ends_the_backward_at_once():
    waited, _ = run_ranks(_stalled_peer, 2, timeout=40)
    assert isinstance(waited, float), waited
    assert waited < 1.0 + 1.5  # a slice after the failure, not Gloo's 30-minute timeout
