"""tandem.DataParallel on CUDA equals the plain module on the same GPU, run in this process.

The oracle is the module itself, a deep copy of the wrapped one, called on the whole batch on
``cuda:0``. Three layouts of the replicas:

- ``one``: ``device_ids=[0]``. DataParallel then calls the module in the caller's thread on the
  whole batch (scatter and gather only move, and the batch already is where it goes), so the
  same kernels see the same operands: outputs, every parameter's gradient, the input's gradient
  and the parameters after three SGD steps with momentum are ``torch.equal`` to the plain
  module's, in float64, for an MLP and a small conv net (cuDNN, deterministic algorithms). So
  are the balanced mode's loss and gradients against the full-batch ``F.cross_entropy``: with
  one replica its single weight is 1.0 exactly;
- ``shared``: ``device_ids=[0, 0]``, two replicas on the one GPU, one thread each on the
  caller's current stream: the layout a one-GPU machine can run with several threads;
- ``every``: ``device_ids=list(range(torch.cuda.device_count()))``, one replica per GPU, the
  parameters copied to each by differentiable ``.to``, the gradients summed on ``cuda:0``
  (skipped, saying so, with a single GPU).

With several replicas the batch is cut into slices (7 samples: 4 + 3, or fewer per GPU), so
each weight gradient is a sum of per-slice products, rounded in another order than the whole
batch's, and cuBLAS may pick other kernels for the smaller shapes: there the values agree within
1e-12 in float64, the tolerance of tests/parallel/dp/test_dp.py (which is never bitwise), while
``last_replicas`` is min(replicas, batch) and the balanced mode gathers one float64 per replica
(``last_gathered_bytes``) where the plain forward gathers the whole output. The input comes from
the CPU, as a DataLoader gives it; its gradient comes back there. Replicas run under the caller's
CUDA autocast: bfloat16 outputs, within bfloat16's rounding of the plain module's.

Rehearsed on the CPU (``TANDEM_CUDA_ON_CPU=1``) with ``"cpu"`` replicas: ``["cpu"]``,
``["cpu"] * 2`` and ``["cpu"] * 3``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.parallel.dp.wrapper import DataParallel
from tests.cuda import gpu
from tests.parallel.dp.test_dp import mlp  # the CPU test's model

pytestmark = pytest.mark.cuda

EXACT = {"atol": 0.0, "rtol": 0.0}
TOL = {"atol": 1e-12, "rtol": 0.0}  # tests/parallel/dp/test_dp.py's, float64
LAYOUTS = ("one", "shared", "every")


def _device_ids(layout: str) -> list:
    if gpu.gpus() == 0:  # rehearsing on the CPU
        return {"one": ["cpu"], "shared": ["cpu"] * 2, "every": ["cpu"] * 3}[layout]
    return {"one": [0], "shared": [0, 0], "every": list(range(gpu.gpus()))}[layout]


def _tolerance(layout: str) -> dict:
    return EXACT if layout == "one" else TOL


def _needs_gpus(layout: str) -> None:
    if layout == "every" and gpu.gpus() == 1:
        pytest.skip("one replica per GPU needs 2 or more CUDA devices; this process sees 1")


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    """``gpu.deterministic()`` for this test, then the worker's settings back as they were."""
    monkeypatch.setenv(
        "CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    )
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    gpu.deterministic()
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2:4]
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[4:6]


def convnet() -> nn.Module:
    # Convolutions only (cuDNN): CUDA's pooling backward kernels have no deterministic mode.
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 4),
    )


MODELS = {"mlp": (mlp, (6,)), "convnet": (convnet, (3, 8, 8))}


def _pair(factory, layout: str, dtype=torch.float64, **kwargs):
    """The plain module on the device, and a DataParallel over a deep copy of it."""
    dev = gpu.device()
    torch.manual_seed(0)
    plain = factory().to(dev, dtype)
    wrapped = DataParallel(copy.deepcopy(plain), device_ids=_device_ids(layout), **kwargs)
    return plain, wrapped


def _assert_grads_equal(plain: nn.Module, wrapped: DataParallel, tol: dict) -> None:
    for (name, p), q in zip(plain.named_parameters(), wrapped.module.parameters(), strict=True):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, **tol, msg=name)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_outputs_and_gradients_equal_the_plain_module(layout, name):
    _needs_gpus(layout)
    factory, shape = MODELS[name]
    plain, wrapped = _pair(factory, layout)
    dev, tol = gpu.device(), _tolerance(layout)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, *shape, dtype=torch.float64, generator=g)  # on the CPU, as loaded
    weight = torch.randn(7, 4, dtype=torch.float64, generator=g).to(dev)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()

    expected = plain(x1.to(dev))
    got = wrapped(x2)
    assert got.device == expected.device == dev
    torch.testing.assert_close(got, expected, **tol)
    (expected * weight).sum().backward()
    (got * weight).sum().backward()

    assert wrapped.last_replicas == min(len(_device_ids(layout)), 7)
    _assert_grads_equal(plain, wrapped, tol)
    assert x2.grad is not None and x2.grad.device == torch.device("cpu")
    torch.testing.assert_close(x2.grad, x1.grad, **tol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sgd_steps_equal_the_plain_module(layout):
    _needs_gpus(layout)
    plain, wrapped = _pair(mlp, layout)
    dev, tol = gpu.device(), _tolerance(layout)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, wrapped)]
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(11, 6, dtype=torch.float64, generator=g)
        y = torch.randint(0, 4, (11,), generator=g)
        for model, opt in zip((plain, wrapped), opts, strict=True):
            opt.zero_grad()
            inputs = x.to(dev) if model is plain else x
            F.cross_entropy(model(inputs), y.to(dev)).backward()
            opt.step()
    for p, q in zip(plain.parameters(), wrapped.module.parameters(), strict=True):
        assert q.device == dev
        torch.testing.assert_close(q, p, **tol)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_balanced_loss_equals_full_batch_cross_entropy(layout):
    _needs_gpus(layout)
    plain, wrapped = _pair(mlp, layout, loss_fn=F.cross_entropy)
    dev, tol = gpu.device(), _tolerance(layout)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 6, dtype=torch.float64, generator=g)
    y = torch.randint(0, 4, (7,), generator=g)

    expected = F.cross_entropy(plain(x.to(dev)), y.to(dev))
    got = wrapped.loss(x, target=y)
    assert got.device == dev and got.dim() == 0
    torch.testing.assert_close(got, expected, **tol)
    expected.backward()
    got.backward()
    _assert_grads_equal(plain, wrapped, tol)
    used = min(len(_device_ids(layout)), 7)
    assert wrapped.last_replicas == used
    assert wrapped.last_gathered_bytes == used * 8  # one float64 per replica

    wrapped(x)  # the plain forward gathers the whole output
    assert wrapped.last_gathered_bytes == 7 * 4 * 8


@pytest.mark.parametrize("layout", ["shared", "every"])
def test_replicas_run_under_the_callers_autocast(layout):
    _needs_gpus(layout)
    plain, wrapped = _pair(mlp, layout, dtype=torch.float32)
    dev = gpu.device()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        got = wrapped(x)
        expected = plain(x.to(dev))
    assert got.dtype == expected.dtype == torch.bfloat16
    # Not bitwise: each slice's products may take other kernels, and a bfloat16 rounding that
    # differs by one unit (2**-8 relative) in a hidden layer moves the outputs by about that.
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    assert wrapped(x).dtype == torch.float32  # and not outside it
