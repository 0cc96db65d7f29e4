"""Mistakes made when building an engine are a clear error at construction, never a hang.

Proven with real processes (Gloo, 30 s timeout), each error on every rank and naming the value:

- no process group: a process launched with WORLD_SIZE=2 that builds tandem.DDP,
  FullyShardedDataParallel or ShardedOptimizer without ``tandem.init()`` gets a RuntimeError
  naming the wrapper, its rank, WORLD_SIZE=2 and ``tandem.init()`` (instead of training alone
  and exiting 0); with WORLD_SIZE unset or 1 the same constructions work without a group and
  take a step;
- buffers that differ across ranks (BatchNorm1d(4) on rank 0, BatchNorm1d(5) on rank 1, or one
  buffer more on rank 1), with identical parameters: ``verify_same_model``, tandem.DDP and
  FullyShardedDataParallel raise ValueError on both ranks naming the
  buffer, both ranks' shapes (or "no such buffer" with both counts); a differing parameter is
  still reported before any buffer; without the check FSDP's buffer broadcast has ranks send
  different sizes;
- FSDP units that differ across ranks (auto_wrap={nn.Linear} on rank 0, None or another
  predicate on rank 1, or an auto_wrap refused on rank 1 only) raise ValueError on both ranks
  naming the first differing unit and saying to pass the same auto_wrap on every rank; the rank
  whose auto_wrap was refused raises its own error; without the check the ranks' first
  broadcasts have different sizes;
- after each of these errors the ranks still work together (an all-reduce gives the world size).

Without processes, ``check_device_ids`` accepts and refuses exactly what torch's DDP constructor
does for a CPU module (checked against torch's own DDP in a one-rank group; tandem.DDP calls it
at construction): None and [] pass,
[0], ["cpu"], [torch.device("cpu")], output_device=1 and two devices raise, and (torch tests
truthiness) output_device=0 alone passes. torch rejects even
``device_ids=["cpu"]`` (the argument names a GPU or nothing), so we do too, pointing to
device_ids=None. Beyond torch, a module on several devices with device_ids given, and
device_ids[0] other than the module's device, raise naming both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tandem
from tandem.parallel.replicas import check_device_ids, verify_same_model
from tests.harness import run_ranks

FSDP = tandem.FullyShardedDataParallel


def _error(fn, *args, **kwargs) -> tuple[str, str] | None:
    """(type name, message) of what ``fn`` raises, or None."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _still_together() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


# -- no process group -----------------------------------------------------------------------------


def _build(kind: str) -> None:
    """Build the engine and take one step."""
    if kind in ("fsdp", "ddp"):
        model: nn.Module = (FSDP if kind == "fsdp" else tandem.DDP)(nn.Linear(3, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model = nn.Linear(3, 2)
        opt = tandem.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()


WRAPPERS = {
    "ddp": "tandem.DDP",
    "fsdp": "tandem.FullyShardedDataParallel",
    "zero": "tandem.ShardedOptimizer",
}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", WRAPPERS)
def test_launched_without_process_group_raises_on_every_rank(kind):
    results = run_ranks(_error, 2, args=(_build, kind), init=None, timeout=30)
    for rank, result in enumerate(results):
        assert result is not None, rank
        name, message = result
        assert name == "RuntimeError", (rank, message)
        assert message.startswith(WRAPPERS[kind]), (rank, message)
        assert f"rank {rank} of WORLD_SIZE=2" in message, (rank, message)
        assert "tandem.init()" in message, (rank, message)


@pytest.mark.parametrize("world_size", [None, "1"])
@pytest.mark.parametrize("kind", WRAPPERS)
def test_one_process_needs_no_group(kind, world_size, monkeypatch):
    assert not dist.is_initialized()
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    _build(kind)


# -- buffers --------------------------------------------------------------------------------------


class Normed(nn.Module):
    """The same parameters on every rank; ``features`` and ``extra`` change only buffers."""

    def __init__(self, features: int = 4, extra: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(features, affine=False)
        if extra:  # registered last: the first difference is the extra buffer itself
            self.extra = nn.Module()
            self.extra.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def _buffers_differ(case: str, via: str) -> dict:
    rank = dist.get_rank()
    if case == "features":
        model = Normed(features=4 if rank == 0 else 5)
    elif case == "extra":
        model = Normed(extra=rank == 1)
    else:  # a parameter differs too (an affine BatchNorm): it is reported first
        model = nn.Sequential()
        model.add_module("bn", nn.BatchNorm1d(4 if rank == 0 else 5))
    if via == "ddp":
        error = _error(tandem.DDP, model)
    elif via == "model":
        error = _error(verify_same_model, model, None, "W")
    else:
        error = _error(FSDP, model)
    return {"error": error, "after": _still_together()}


@pytest.mark.distributed
@pytest.mark.parametrize("via", ["model", "ddp", "fsdp"])
@pytest.mark.parametrize("case", ["features", "extra"])
def test_buffers_that_differ_raise_on_every_rank(case, via):
    results = run_ranks(_buffers_differ, 2, args=(case, via), timeout=30)
    wrapper = {"fsdp": "tandem.FullyShardedDataParallel", "ddp": "tandem.DDP"}.get(via, "W")
    for rank, r in enumerate(results):
        assert r["error"] is not None, rank
        name, message = r["error"]
        assert name == "ValueError", (rank, message)
        assert message.startswith(f"{wrapper}: the model differs across ranks: buffer "), message
        if case == "features":
            assert "buffer 'bn.running_mean' (#0) differs" in message, message
            assert "rank 0 has 'bn.running_mean' of shape (4,) torch.float32" in message, message
            assert "rank 1 has 'bn.running_mean' of shape (5,) torch.float32" in message, message
        else:
            assert "buffer 'extra.scale' (#3) differs: rank 0 has no such buffer" in message
            assert "rank 1 has 'extra.scale' of shape (2,) torch.float32" in message, message
            assert "(buffer counts: rank 0: 3, rank 1: 4)" in message, message
        assert r["after"] == 2.0


@pytest.mark.distributed
def test_a_differing_parameter_is_reported_before_the_buffers():
    results = run_ranks(_buffers_differ, 2, args=("parameter", "model"), timeout=30)
    for r in results:
        _, message = r["error"]
        assert "parameter 'bn.weight' (#0) differs" in message, message
        assert "buffer" not in message, message


# -- FSDP units -----------------------------------------------------------------------------------


def _first_linear_only(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) and m.out_features == 4


def _units_differ(other: str) -> dict:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    if dist.get_rank() == 0:
        auto_wrap = {nn.Linear}
    else:
        auto_wrap = {"none": None, "predicate": _first_linear_only, "refused": "Linear"}[other]
    return {"error": _error(FSDP, model, auto_wrap=auto_wrap), "after": _still_together()}


@pytest.mark.distributed
@pytest.mark.parametrize("other", ["none", "predicate", "refused"])
def test_units_that_differ_raise_on_every_rank(other):
    results = run_ranks(_units_differ, 2, args=(other,), timeout=30)
    for rank, r in enumerate(results):
        assert r["error"] is not None, rank
        name, message = r["error"]
        assert name == "ValueError", (rank, message)
        assert r["after"] == 2.0
        if other == "refused" and rank == 1:  # its own mistake, as in one process
            assert message.startswith("auto_wrap='Linear'"), message
            continue
        assert message.startswith("tandem.FullyShardedDataParallel: the unit layout differs"), (
            message
        )
        assert message.endswith(
            "Pass the same auto_wrap and mixed_precision on every rank (they decide the "
            "collectives)"
        ), message
        if other == "none":
            assert (
                "unit #0 differs: rank 0 has '0' (0.weight: 12, 0.bias: 4), rank 1 has the root "
                "(0.weight: 12, 0.bias: 4, 2.weight: 8, 2.bias: 2) (unit counts: rank 0: 2, "
                "rank 1: 1)"
            ) in message, message
        elif other == "predicate":
            assert (
                "unit #1 differs: rank 0 has '2' (2.weight: 8, 2.bias: 2), rank 1 has the root "
                "(2.weight: 8, 2.bias: 2) (unit counts: rank 0: 2, rank 1: 2)"
            ) in message, message
        else:
            assert "rank(s) [1] refused their auto_wrap" in message, message


# -- device_ids -----------------------------------------------------------------------------------

# (device_ids, output_device) for a CPU module: torch's DDP constructor is the oracle.
CPU_CASES = [
    (None, None),
    ([], None),
    ([0], None),
    (["cpu"], None),
    ([torch.device("cpu")], None),
    (None, 0),
    (None, 1),
    ([0, 1], None),
]


def _torch_and_ours() -> list[tuple[bool, bool]]:
    verdicts = []
    for device_ids, output_device in CPU_CASES:
        theirs = _error(
            torch.nn.parallel.DistributedDataParallel,
            nn.Linear(2, 2),
            device_ids=device_ids,
            output_device=output_device,
        )
        ours = _error(
            check_device_ids, nn.Linear(2, 2), device_ids, "W", output_device=output_device
        )
        assert theirs is None or theirs[0] == "ValueError", theirs
        verdicts.append((theirs is None, ours is None))
    return verdicts


@pytest.mark.distributed
def test_cpu_module_accepts_and_refuses_what_torch_does():
    (verdicts,) = run_ranks(_torch_and_ours, 1, timeout=30)
    for (device_ids, output_device), (torch_ok, ours_ok) in zip(CPU_CASES, verdicts, strict=True):
        assert torch_ok == ours_ok, (device_ids, output_device, torch_ok, ours_ok)
    assert [ok for ok, _ in verdicts] == [True, True, False, False, False, True, False, False]


@pytest.mark.parametrize("through", ["check", "ddp"])
def test_cpu_module_with_a_gpu_index_says_to_move_it(through):
    with pytest.raises(ValueError) as info:
        if through == "ddp":
            tandem.DDP(nn.Linear(2, 2), device_ids=[0])
        else:
            check_device_ids(nn.Linear(2, 2), [0], "tandem.DDP")
    message = str(info.value)
    assert message.startswith("tandem.DDP: device_ids=[0], but the module's parameters are on cpu")
    assert "Move the module to cuda:0 first (module.to('cuda:0'))" in message
    assert "or pass device_ids=None for a CPU module" in message


@pytest.mark.parametrize("cpu", ["cpu", torch.device("cpu")])
def test_cpu_module_with_device_ids_cpu_is_refused_as_torch_does(cpu):
    with pytest.raises(ValueError) as info:
        check_device_ids(nn.Linear(2, 2), [cpu], "tandem.DDP")
    message = str(info.value)
    assert f"device_ids=[{cpu!r}]" in message and "are on cpu" in message
    assert message.endswith("Pass device_ids=None for a CPU module")


def test_output_device_alone_is_refused_for_a_cpu_module():
    with pytest.raises(ValueError, match=r"output_device=1.*None and output_device=None"):
        check_device_ids(nn.Linear(2, 2), None, "tandem.DDP", output_device=1)


def test_module_on_several_devices_with_device_ids_is_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta"))
    with pytest.raises(ValueError) as info:
        check_device_ids(model, [0], "tandem.DDP")
    message = str(info.value)
    assert "device_ids=[0]" in message and "on several devices (cpu, meta)" in message
    assert "pass device_ids=None" in message
    check_device_ids(model, None, "tandem.DDP")  # the module places its own tensors


def test_device_ids_other_than_the_module_device_is_refused():
    # meta stands in for an accelerator: the check is the same for cuda:1 against cuda:0.
    model = nn.Linear(2, 2).to("meta")
    with pytest.raises(ValueError) as info:
        check_device_ids(model, ["cpu"], "tandem.DDP")
    message = str(info.value)
    assert "device_ids=['cpu'], but the module's parameters are on meta" in message
    assert "Move the module to cpu first" in message and "device_ids=['meta']" in message
    check_device_ids(model, ["meta"], "tandem.DDP")
    check_device_ids(model, [torch.device("meta")], "tandem.DDP")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_module_with_another_gpu_index_is_refused():
    model = nn.Linear(2, 2).to("cuda:0")
    check_device_ids(model, [0], "tandem.DDP")
    with pytest.raises(ValueError, match=r"device_ids=\[1\].*on cuda:0.*device_ids=\[0\]"):
        check_device_ids(model, [1], "tandem.DDP")


def test_several_device_ids_are_refused():
    with pytest.raises(ValueError, match=r"device_ids=\[0, 1\] names 2 devices"):
        check_device_ids(nn.Linear(2, 2), [0, 1], "tandem.DDP")
