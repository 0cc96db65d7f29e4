"""tandem.DDP where scripts written for torch's DDP meet it: torch's methods, arguments and edge
cases, each against torch's DDP on the same seeds (issue 25).

Oracle: torch.nn.parallel.DistributedDataParallel, run in the same processes on the same seeds
and data, compared with ``torch.equal`` (bit for bit), and the assertions of the torch test each
scenario is taken from (``torch/testing/_internal/distributed/distributed_test.py``, named in
each test). Real processes, Gloo, world size 2 (3 where the division's bits depend on it).

- ``model.join(...)``: torch's method (uneven inputs with the mean over the ranks still training
  or over the initial world size, equivalence with local training, an exception inside the
  context, ``enable=False``).
- The constructor: torch 2.13's signature (names, order, defaults; the DDP guide's too);
  ``forward_sync_buffers`` (buffers still broadcast at construction, not before forwards, not at
  the end of a join), the ``broadcast_buffers`` deprecation warnings, ``init_sync=False``,
  ``skip_all_reduce_unused_params`` (one all-reduce fewer per step, same parameters),
  ``bucket_cap_mb_list`` (torch's buckets, torch's bits), ``batched_grad_copy`` (torch's
  division, at world size 3), ``device_mesh``, ``check_reduction``, and the arguments refused
  with an error naming them; ``_get_ddp_logging_data()``'s fields, torch's values.
- find_unused_parameters with outputs the loss leaves out (tuple and dict outputs): no error,
  ``.grad`` None where local training leaves it None, torch's bits every step.
- A buffer reassigned by the module (not updated in place) is the one broadcast.
- A module with nothing to train: torch's RuntimeError, on every rank.
- ``torch.func.functional_call(ddp_model, ...)``: the given tensors get their local gradients,
  the module's parameters none; training goes on normally after it.
- ``torch._C._functions.UndefinedGrad`` with find_unused_parameters: ``.grad`` stays None.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import tandem
from tandem.parallel.ddp.buckets import assign_buckets
from tests.harness import run_ranks

ENGINES = {"tandem": tandem.DDP, "torch": TorchDDP}


def _both(body: Any, *args: Any) -> dict[str, Any]:
    """``body(wrapper, *args)`` for each engine, on the same seeds."""
    return {name: body(wrapper, *args) for name, wrapper in ENGINES.items()}


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested results (tensors with torch.equal, None only with None)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def _assert_parity(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert _same(result["tandem"], result["torch"]), (rank, result)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.detach().contiguous())
    return out


# -- 1. model.join(): torch's method ---------------------------------------------------------


def _grad_div(wrapper: type) -> dict:
    # test_ddp_grad_div_uneven_inputs
    dim, grad_scale, rank = 5, 50, dist.get_rank()
    torch.manual_seed(0)
    net = wrapper(nn.Linear(dim, dim, bias=False), bucket_cap_mb=1)
    inp = torch.ones(1, dim) * grad_scale
    n_iters = 3 + (2 if rank > 0 else 0)
    grads: dict[str, list] = {"effective": [], "initial": []}
    for key, divide_initial in (("effective", False), ("initial", True)):
        with net.join(divide_by_initial_world_size=divide_initial):
            for _ in range(n_iters):
                net(inp).sum().backward()
                grads[key].append(net.module.weight.grad.clone())
                net.zero_grad()
    return grads


@pytest.mark.distributed
def test_join_method_divides_by_the_ranks_still_training_or_the_initial_world_size():
    results = run_ranks(_both, 2, args=(_grad_div,))
    _assert_parity(results)
    world = 2
    for rank, result in enumerate(results):
        got = result["tandem"]
        assert len(got["effective"]) == (3 if rank == 0 else 5)
        for g in got["effective"]:  # always the full gradient: divided by the ranks training
            assert torch.equal(g, torch.ones(5, 5) * 50)
        for i, g in enumerate(got["initial"]):
            effective = world - (1 if i >= 3 else 0)
            assert torch.equal(g, torch.ones(5, 5) * 50 * effective / world), (rank, i)


def _join_equivalence(wrapper: type) -> dict:
    # test_ddp_join_model_equivalence
    rank, world, lr = dist.get_rank(), dist.get_world_size(), 0.03
    torch.manual_seed(0)
    model = nn.Linear(10, 10, bias=False).double()
    inp = torch.rand(3, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    local = copy.deepcopy(model)
    iters = {r: 2 * (r + 1) for r in range(world)}
    local_opt = torch.optim.SGD(local.parameters(), lr=lr)
    for _ in range(sum(iters.values())):
        local_opt.zero_grad()
        local(inp).sum().backward()
        local_opt.step()
    net = wrapper(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr * world)
    with net.join():
        for _ in range(iters[rank]):
            opt.zero_grad()
            net(inp).sum().backward()
            opt.step()
    return {"ddp": net.module.weight.detach().clone(), "local": local.weight.detach().clone()}


@pytest.mark.distributed
def test_join_method_equals_local_training():
    results = run_ranks(_both, 2, args=(_join_equivalence,))
    _assert_parity(results)
    for result in results:
        got = result["tandem"]
        torch.testing.assert_close(got["ddp"], got["local"])
    assert torch.equal(results[0]["tandem"]["ddp"], results[1]["tandem"]["ddp"])


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.ones(1))

    def forward(self, _: torch.Tensor) -> torch.Tensor:
        raise ValueError("Intentional error")


def _exception_in_join(wrapper: type) -> str:
    # test_ddp_uneven_input_exception
    net = wrapper(_Raises())
    try:
        with net.join():
            net(torch.ones(1)).sum().backward()
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_join_method_lets_an_exception_out_on_every_rank():
    results = run_ranks(_both, 2, args=(_exception_in_join,))
    assert all(r == {"tandem": "Intentional error", "torch": "Intentional error"} for r in results)


def _join_disabled(wrapper: type) -> dict:
    # test_ddp_uneven_input_join_disable
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    net = wrapper(nn.Linear(1, 1))
    grads = []
    with net.join(enable=False):
        for _ in range(5):
            if net.module.weight.grad is not None:
                net.module.weight.grad.zero_()
            net(torch.ones(1) * rank).sum().backward()
            grads.append(net.module.weight.grad.item())
    expected = sum(range(world)) / world
    return {
        "grads_as_expected": all(g == expected for g in grads),
        "enabled": net._join_config.enable,
        "params": [p.detach().clone() for p in net.parameters()],
    }


@pytest.mark.distributed
def test_join_method_disabled_divides_by_the_world_size():
    results = run_ranks(_both, 2, args=(_join_disabled,))
    _assert_parity(results)
    for result in results:
        assert result["tandem"]["grads_as_expected"] is True
        assert result["tandem"]["enabled"] is False
    assert _same(results[0]["tandem"]["params"], results[1]["tandem"]["params"])


# -- 2. The constructor: torch 2.13's arguments ---------------------------------------------

TANDEM_ONLY = (
    "comm_hook",
    "comm_state",
    "first_bucket_cap_mb",
    "hybrid",
    "shard_group",
    "replicate_group",
)


def _parameters(cls: type) -> list[tuple[str, Any, Any]]:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params]


def test_signature_is_torchs_with_tandems_own_arguments_keyword_only_at_the_end():
    ours, theirs = _parameters(tandem.DDP), _parameters(TorchDDP)
    assert ours[: len(theirs)] == theirs
    assert [(n, k) for n, k, _ in ours[len(theirs) :]] == [
        (n, inspect.Parameter.KEYWORD_ONLY) for n in TANDEM_ONLY
    ]


def test_guide_signature_is_torchs():
    guide = (Path(__file__).parents[3] / "docs" / "guides" / "ddp.md").read_text()
    section = guide.split("# `tandem.DistributedDataParallel`", 1)[1]
    block = section.split("```python", 1)[1].split("```", 1)[0]
    call = " ".join(block.split())
    names = re.findall(r"(\w+)=", call)
    defaults = dict(re.findall(r"(\w+)=([^,()]+)", call.replace(")", ",")))
    expected = [n for n, _, _ in _parameters(tandem.DDP)][1:]  # module is positional
    assert names == expected, (names, expected)
    for name, _, default in _parameters(tandem.DDP)[1:]:
        assert defaults[name].strip() == repr(default), (name, defaults[name], default)


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.register_buffer("coeff", torch.randn(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.coeff


def _forward_sync_false(wrapper: type) -> dict:
    # test_ddp_init_sync_buffers_with_forward_sync_buffers_false
    rank = dist.get_rank()
    torch.manual_seed(rank)
    ddp = wrapper(_WithBuffer(), forward_sync_buffers=False)
    at_init = _gather(ddp.module.coeff)
    if rank == 0:
        with torch.no_grad():
            ddp.module.coeff += 1
    ddp(torch.randn(2, 10)).sum().backward()
    after = _gather(ddp.module.coeff)
    return {
        "flag": ddp.forward_sync_buffers,
        "alias": ddp.broadcast_buffers,
        "same_at_init": torch.equal(at_init[0], at_init[1]),
        "same_after_forward": torch.equal(after[0], after[1]),
        "grads": [p.grad for p in ddp.parameters()],
    }


@pytest.mark.distributed
def test_forward_sync_buffers_false_still_broadcasts_at_construction():
    results = run_ranks(_both, 2, args=(_forward_sync_false,))
    _assert_parity(results)
    got = results[0]["tandem"]
    assert got["flag"] is False and got["alias"] is False
    assert got["same_at_init"] is True and got["same_after_forward"] is False


def _join_keeps_rank_buffers(wrapper: type) -> dict:
    # test_ddp_join_respects_forward_sync_buffers_false
    rank = dist.get_rank()
    torch.manual_seed(rank + 42)
    ddp = wrapper(_WithBuffer(), forward_sync_buffers=False)
    with torch.no_grad():
        ddp.module.coeff.copy_(torch.randn(10))  # rank-local again, after the init broadcast
    before = ddp.module.coeff.clone()
    with ddp.join():
        for _ in range(rank + 1):
            ddp(torch.randn(2, 10)).sum().backward()
    return {
        "kept": torch.equal(before, ddp.module.coeff),
        "buffer": ddp.module.coeff.clone(),
        "weight": ddp.module.a.weight.detach().clone(),
    }


@pytest.mark.distributed
def test_join_end_keeps_rank_local_buffers_without_forward_sync():
    results = run_ranks(_both, 2, args=(_join_keeps_rank_buffers,))
    _assert_parity(results)
    assert all(r["tandem"]["kept"] for r in results)
    assert not torch.equal(results[0]["tandem"]["buffer"], results[1]["tandem"]["buffer"])
    assert torch.equal(results[0]["tandem"]["weight"], results[1]["tandem"]["weight"])


BUFFER_KWARGS = [
    {"broadcast_buffers": True},
    {"broadcast_buffers": False},
    {"broadcast_buffers": False, "forward_sync_buffers": True},
    {"broadcast_buffers": True, "forward_sync_buffers": False},
    {},
    {"forward_sync_buffers": False},
    {"check_reduction": True},
]


def _buffer_flags(wrapper: type) -> list[dict]:
    # test_ddp_broadcast_buffers_deprecation_warning, and what each flag does
    rank = dist.get_rank()
    out = []
    for kwargs in BUFFER_KWARGS:
        torch.manual_seed(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = wrapper(_WithBuffer(), **kwargs)
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        ddp(torch.ones(2, 10)).sum().backward()
        out.append(
            {
                "about_broadcast_buffers": sum("broadcast_buffers" in m for m in future),
                "about_check_reduction": sum("check_reduction" in m for m in future),
                "forward_sync_buffers": ddp.forward_sync_buffers,
                "buffer": ddp.module.coeff.clone(),
                "weight": ddp.module.a.weight.detach().clone(),
            }
        )
    return out


@pytest.mark.distributed
def test_buffer_flags_warn_and_act_as_torchs():
    results = run_ranks(_both, 2, args=(_buffer_flags,))
    _assert_parity(results)
    got = results[0]["tandem"]
    assert [g["about_broadcast_buffers"] > 0 for g in got] == [1, 1, 1, 1, 0, 0, 0]
    assert got[-1]["about_check_reduction"] == 1
    assert [g["forward_sync_buffers"] for g in got] == [True, False, True, False, True, False, True]
    # broadcast_buffers=False: rank-local buffers, not even broadcast at construction.
    other = results[1]["tandem"]
    assert not torch.equal(got[1]["buffer"], other[1]["buffer"])
    assert torch.equal(got[5]["buffer"], other[5]["buffer"])


def _no_init_sync(wrapper: type) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    ddp = wrapper(_WithBuffer(), init_sync=False)
    state = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    torch.manual_seed(rank)
    return {"kept_own_values": _same(state, _WithBuffer().state_dict()), "state": state}


@pytest.mark.distributed
def test_init_sync_false_broadcasts_nothing_at_construction():
    results = run_ranks(_both, 2, args=(_no_init_sync,))
    _assert_parity(results)
    assert all(r["tandem"]["kept_own_values"] for r in results)


class _LargeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(100, 5000, bias=False)
        self.fc2 = nn.Linear(100, 100, bias=False)  # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(x)


def _skip_unused(wrapper: type, skip: bool, mode: str) -> dict:
    # test_skip_all_reduce_unused_parameters (and the same with static_graph)
    torch.manual_seed(31415)
    model = wrapper(
        _LargeNet(),
        find_unused_parameters=mode == "find_unused",
        static_graph=mode == "static_graph",
        bucket_cap_mb=1.5,
        skip_all_reduce_unused_params=skip,
    )
    x = torch.randn(20, 100, generator=torch.Generator().manual_seed(dist.get_rank()))
    calls = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        for _ in range(10):
            model(x).sum().backward()
    finally:
        dist.all_reduce = real
    ours = not isinstance(model, TorchDDP)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        # tandem's all-reduces of a bucket's size; torch's reducer calls the backend directly,
        # and its log counts the buckets reduced in the last backward
        "buckets_reduced": sum(n in (100 * 5000, 100 * 100) for n in calls) if ours else None,
        "last_step_buckets_reduced": (
            None if ours else model._get_ddp_logging_data().get("num_buckets_reduced")
        ),
    }


def _skip_cases(mode: str) -> dict:
    return {
        "tandem": _skip_unused(tandem.DDP, True, mode),
        "tandem_base": _skip_unused(tandem.DDP, False, mode),
        "torch": _skip_unused(TorchDDP, True, mode),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["find_unused", "static_graph"])
def test_skip_all_reduce_unused_params_reduces_one_bucket_fewer_with_the_same_result(mode):
    results = run_ranks(_skip_cases, 2, args=(mode,))
    for result in results:
        ours, base, theirs = result["tandem"], result["tandem_base"], result["torch"]
        assert _same(ours["params"], theirs["params"]) and _same(ours["grads"], theirs["grads"])
        assert _same(ours["params"], base["params"]) and _same(ours["grads"], base["grads"])
        assert ours["grads"][1] is None  # fc2: never used, never touched
        # torch's test: 2 buckets reduced per step without the flag, 1 with it. (static_graph:
        # one bucket of both parameters until the rebuild after the second backward, so 8
        # steps of 2 buckets are counted.)
        steps = 10 if mode == "find_unused" else 8
        assert base["buckets_reduced"] == 2 * steps, result
        assert ours["buckets_reduced"] == steps, result
        assert theirs["last_step_buckets_reduced"] == 1, result


def _torch_layout(ddp: TorchDDP) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
    return [
        [index[id(p)] for p in bucket.parameters()]
        for bucket in ddp.reducer._get_zeros_like_grad_buckets()
    ]


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 3))


def _cap_list(wrapper: type, cap_list: list[float], extra: dict) -> dict:
    rank = dist.get_rank()
    model = wrapper(_mlp(rank), bucket_cap_mb_list=cap_list, **extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layouts = []
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        ours = isinstance(model, tandem.DDP)
        layouts.append(model.reducer.layout if ours else _torch_layout(model))
    return {
        "layouts": layouts,
        "params": [p.detach().clone() for p in model.parameters()],
        "attributes": (model.bucket_bytes_cap, model.bucket_bytes_cap_list),
    }


@pytest.mark.distributed
@pytest.mark.parametrize(
    "extra", [{}, {"find_unused_parameters": True}, {"static_graph": True}], ids=str
)
def test_bucket_cap_mb_list_gives_torchs_buckets_and_bits(extra):
    # 64x64 float32 is 16 KiB a weight: caps of 0.01 and 0.02 MiB cut several buckets.
    results = run_ranks(_both, 2, args=(_cap_list, [0.01, 0.02], extra))
    _assert_parity(results)
    assert len(results[0]["tandem"]["layouts"][-1]) > 2


@pytest.mark.parametrize("seed", range(30))
def test_assign_buckets_with_a_cap_list_equals_torch(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 14, (1,), generator=gen))
    dtypes = [torch.float32, torch.float16, torch.float64]
    tensors = [
        torch.empty(int(torch.randint(0, 40, (1,), generator=gen)), dtype=dtypes[k])
        for k in torch.randint(0, 3, (n,), generator=gen).tolist()
    ]
    caps = torch.randint(1, 200, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)
    order = torch.randperm(n, generator=gen).tolist()
    sizes = [t.numel() * t.element_size() for t in tensors]
    ours = assign_buckets(sizes, [t.dtype for t in tensors], order, 1, 1, caps=caps.tolist())
    theirs, _ = torch._C._distributed_c10d._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], caps.tolist(), [False] * n, order
    )
    assert sorted(ours) == sorted(theirs)


def _batched(wrapper: type, batched: bool) -> list[torch.Tensor]:
    rank = dist.get_rank()
    model = wrapper(_mlp(rank), batched_grad_copy=batched)
    grads = []
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad()
        model(x).square().mean().backward()
        grads += [p.grad.clone() for p in model.parameters()]
    return grads


def _batched_cases() -> dict:
    return {
        "tandem": _batched(tandem.DDP, True),
        "torch": _batched(TorchDDP, True),
        "torch_default": _batched(TorchDDP, False),
    }


@pytest.mark.distributed
def test_batched_grad_copy_divides_as_torch_does():
    # At world size 3, dividing by 3 and multiplying by 1/3 give other bits: the option's bits
    # are torch's own for it, which differ from the default's (checked, so that this test
    # cannot pass with the default's arithmetic).
    results = run_ranks(_batched_cases, 3)
    for result in results:
        assert _same(result["tandem"], result["torch"])
        assert not _same(result["torch"], result["torch_default"])


def _mesh(wrapper: type) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = wrapper(_mlp(rank), device_mesh=mesh)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    errors = []
    for kwargs in (
        {"device_mesh": mesh, "process_group": dist.group.WORLD},
        {"device_mesh": init_device_mesh("cpu", (dist.get_world_size(), 1))},
    ):
        try:
            wrapper(_mlp(rank), **kwargs)
            errors.append(None)
        except RuntimeError as exc:
            errors.append(str(exc).split(",")[0])
    return {
        "mesh_kept": model.device_mesh is mesh,
        "grads": [p.grad for p in model.parameters()],
        "errors": errors,
    }


@pytest.mark.distributed
def test_device_mesh_averages_over_its_group():
    results = run_ranks(_both, 2, args=(_mesh,))
    _assert_parity(results)
    got = results[0]["tandem"]
    assert got["mesh_kept"] is True
    assert got["errors"] == [
        "Cannot specify both process_group and device_mesh arguments.",
        "Only 1D device mesh is supported",
    ]


def _refusals() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Linear(2, 2)
    sliced = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))
    cases = [
        {"delay_all_reduce_named_params": list(model.named_parameters())},
        {
            "delay_all_reduce_named_params": list(model.named_parameters()),
            "param_to_hook_all_reduce": model.weight,
        },
        {"mixed_precision": object()},
        {"device_mesh": sliced["dp"]},
    ]
    out = []
    for kwargs in cases:
        try:
            tandem.DDP(model, **kwargs)
            out.append("accepted")
        except (ValueError, NotImplementedError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


@pytest.mark.distributed
def test_arguments_tandem_does_not_implement_are_refused_by_name():
    for got in run_ranks(_refusals, 2):
        pairing, delay, mixed, sliced = got
        assert pairing.startswith("ValueError") and "at the same time" in pairing
        assert delay.startswith("NotImplementedError") and "delay_all_reduce_named_params" in delay
        assert mixed.startswith("NotImplementedError") and "mixed_precision" in mixed
        assert sliced.startswith("NotImplementedError") and "device_mesh" in sliced


LOGGING_CASES = [
    {},
    {"find_unused_parameters": True},
    {"static_graph": True},
    {"bucket_cap_mb": 0.0005},
    {"bucket_cap_mb_list": [0.0005, 0.001]},
]


def _logging_data() -> list[dict]:
    out = []
    for kwargs in LOGGING_CASES:
        logs = {}
        for name, wrapper in ENGINES.items():
            model = wrapper(_NetWithBuffers(), **kwargs)
            for step in range(4):
                x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step))
                model(x).sum().backward()
            logs[name] = model._get_ddp_logging_data()
        out.append(logs)
    return out


@pytest.mark.distributed
def test_logging_data_has_torchs_values_for_the_fields_tandem_keeps():
    # torch's tests read _get_ddp_logging_data() (num_buckets_reduced, bucket sizes, rebuilt
    # order): every field tandem.DDP gives has torch's value.
    for per_case in run_ranks(_logging_data, 2):
        for kwargs, logs in zip(LOGGING_CASES, per_case, strict=True):
            ours, theirs = logs["tandem"], logs["torch"]
            assert {k: theirs.get(k) for k in ours} == ours, kwargs
            assert "num_buckets_reduced" in ours and "bucket_sizes" in ours


# -- 3. find_unused_parameters, outputs the loss leaves out ---------------------------------


class _TwoOutputs(nn.Module):
    # torch's UnusedParamTwoLinLayerNet
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 10, bias=False)
        self.c = nn.Linear(5, 5, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class _DictOutput(nn.Module):
    # torch's DictOutputModule
    def __init__(self) -> None:
        super().__init__()
        self.module = _TwoOutputs()

    def forward(self, x: torch.Tensor) -> dict:
        predictions = self.module(x)
        return {"predictions": predictions, "loss": (predictions[0] + predictions[1]).sum()}


def _outputs_left_out(wrapper: type, kind: str, as_view: bool) -> dict:
    # test_output_unused_in_loss_tuple_module / _dict_module
    torch.manual_seed(0)
    model = _DictOutput() if kind == "dict" else _TwoOutputs()
    local = copy.deepcopy(model)
    net = wrapper(
        copy.deepcopy(model), find_unused_parameters=True, gradient_as_bucket_view=as_view
    )
    inp = torch.randn(10, 10, generator=torch.Generator().manual_seed(dist.get_rank()))

    def outputs(m: nn.Module) -> tuple:
        out = m(inp)
        return out["predictions"] if kind == "dict" else out

    _, b = outputs(net)
    b.sum().backward()
    _, b_local = outputs(local)
    b_local.sum().backward()
    first = [p.grad for p in net.parameters()]
    first_local = [p.grad for p in local.parameters()]
    net.zero_grad()
    local.zero_grad()
    steps = []
    rank = dist.get_rank()
    for i in range(8):
        # steps 0-1: both outputs in the loss; 2-5: a left out; 6-7: left out on rank 0 only
        uses_a = i < 2 or (i >= 6 and rank == 1)
        for m in (net, local):
            a, b = outputs(m)
            (a @ b if uses_a else b).sum().backward()
        steps.append(
            {
                "ddp": [None if p.grad is None else p.grad.clone() for p in net.parameters()],
                "local_none": [p.grad is None for p in local.parameters()],
                "ddp_none": [p.grad is None for p in net.parameters()],
            }
        )
    return {"first": first, "first_none_as_local": [g is None for g in first_local], "steps": steps}


@pytest.mark.distributed
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket_view"])
@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_outputs_the_loss_leaves_out_are_torchs(kind, as_view):
    results = run_ranks(_both, 2, args=(_outputs_left_out, kind, as_view))
    _assert_parity(results)
    for result in results:
        got = result["tandem"]
        # a.weight: used in forward, left out of the loss: .grad None, as in local training
        assert (
            [g is None for g in got["first"]]
            == got["first_none_as_local"]
            == [
                True,
                False,
                True,
            ]
        )
        for step in got["steps"]:
            assert step["ddp_none"] == step["local_none"]
        # In steps 2-5 a's output is left out: its gradient stays what steps 0-1 left.
        assert all(torch.equal(s["ddp"][0], got["steps"][1]["ddp"][0]) for s in got["steps"][2:6])
    # Steps 6-7: used on rank 1 only, so a's mean reaches both ranks, the same.
    for step in (6, 7):
        assert torch.equal(
            results[0]["tandem"]["steps"][step]["ddp"][0],
            results[1]["tandem"]["steps"][step]["ddp"][0],
        )
        assert not torch.equal(
            results[0]["tandem"]["steps"][step]["ddp"][0],
            results[0]["tandem"]["steps"][5]["ddp"][0],
        )


# -- 4. A buffer the module reassigns ------------------------------------------------------


class _NetWithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10, bias=False)
        self.b = nn.Linear(10, 1, bias=False)
        self.register_buffer("buffer", torch.randn(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _reassigned_buffer(wrapper: type) -> dict:
    # test_ddp_broadcast_buffer
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = wrapper(_NetWithBuffers())
    inp = torch.randn(2, 10)
    seen = []
    for _ in range(2):
        if rank == 0:
            model.module.buffer = model.module.buffer + 1  # a new tensor, not in place
        model(inp).sum().backward()
        everyone = _gather(model.module.buffer)
        seen.append({"same": torch.equal(everyone[0], everyone[1]), "buffer": everyone[0]})
    return {"seen": seen}


@pytest.mark.distributed
def test_a_reassigned_buffer_is_the_one_broadcast():
    results = run_ranks(_both, 2, args=(_reassigned_buffer,))
    _assert_parity(results)
    assert all(s["same"] for r in results for s in r["tandem"]["seen"])


# -- 5. Nothing to train --------------------------------------------------------------------


def _nothing_to_train(wrapper: type) -> list[str]:
    # test_DistributedDataParallel_requires_grad
    frozen = nn.Linear(2, 2).requires_grad_(False)
    out = []
    for module in (nn.Module(), frozen):
        try:
            wrapper(module)
            out.append("accepted")
        except RuntimeError as exc:
            out.append(str(exc))
    return out


@pytest.mark.distributed
def test_a_module_with_nothing_to_train_is_torchs_runtime_error_on_every_rank():
    for result in run_ranks(_both, 2, args=(_nothing_to_train,)):
        for ours, theirs in zip(result["tandem"], result["torch"], strict=True):
            assert theirs.startswith("DistributedDataParallel is not needed")
            assert ours.startswith("tandem.DDP:") and theirs.rstrip(".") in ours


# -- 6. torch.func.functional_call -----------------------------------------------------------


class _Mock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(1, 1)
        self.register_buffer("buffer", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(x) + self.buffer


def _functional_call(wrapper: type, find_unused: bool) -> dict:
    # test_stateless_api_with_ddp, then normal training steps
    rank = dist.get_rank()
    torch.manual_seed(rank)
    module = wrapper(_Mock(), find_unused_parameters=find_unused)
    x = torch.rand((1, 1))
    weight = torch.tensor([[1.0]], requires_grad=True)
    bias = torch.tensor([0.0], requires_grad=True)
    swapped = {"module.l1.weight": weight, "module.l1.bias": bias, "module.buffer": torch.zeros(1)}
    before = [t.clone() for t in (module.module.l1.weight, module.module.buffer)]
    out = {}
    for step in range(2):
        res = torch.func.functional_call(module, swapped, x)
        res.backward()
        out[f"call{step}"] = {
            "res_is_x": torch.equal(res, x),
            "given_grads": [weight.grad.clone(), bias.grad.clone()],
            "module_grads_none": [p.grad is None for p in module.parameters()],
            "unchanged": _same(before, [module.module.l1.weight, module.module.buffer]),
        }
    for step in range(2):
        module(torch.rand((3, 1))).sum().backward()
        out[f"train{step}"] = [p.grad.clone() for p in module.parameters()]
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("find_unused", [False, True], ids=["default", "find_unused"])
def test_functional_call_on_the_wrapper_is_torchs(find_unused):
    results = run_ranks(_both, 2, args=(_functional_call, find_unused))
    _assert_parity(results)
    for result in results:
        for step in ("call0", "call1"):
            got = result["tandem"][step]
            assert got["res_is_x"] and got["unchanged"]
            assert got["module_grads_none"] == [True, True]
    # the given tensors' gradients are local (not averaged): they differ across ranks
    assert not _same(results[0]["tandem"]["call0"], results[1]["tandem"]["call0"])
    # and the training steps after it are averaged as usual
    assert _same(results[0]["tandem"]["train1"], results[1]["tandem"]["train1"])


# -- 7. Undefined gradients -----------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.no_grad_param = nn.Parameter(torch.tensor([2, 2]).long(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return torch.softmax(self.fc3(x), dim=1)


def _undefined_grad(wrapper: type) -> dict:
    # test_undefined_grad_parity_unused_parameters
    torch.manual_seed(0)
    net = _Net()
    local = copy.deepcopy(net)
    ddp = wrapper(net, find_unused_parameters=True)
    x = torch.ones(1, 2)
    torch._C._functions.UndefinedGrad()(ddp(x).sum()).backward()
    torch._C._functions.UndefinedGrad()(local(x).sum()).backward()
    return {
        "ddp": [p.grad for p in ddp.module.parameters()],
        "local": [p.grad for p in local.parameters()],
    }


@pytest.mark.distributed
def test_an_undefined_gradient_leaves_grad_none():
    results = run_ranks(_both, 2, args=(_undefined_grad,))
    _assert_parity(results)
    for result in results:
        assert result["tandem"]["ddp"] == [None] * 4 == result["tandem"]["local"]
