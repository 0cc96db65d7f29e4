"""tandem.DataParallel against the plain module on the whole batch, with CPU replicas in threads.

Proves, in float64 within 1e-12: for an MLP and a conv net on 1, 2 and 3 CPU replicas and batch
sizes that split unevenly (7 on 2 or 3) or are smaller than the replica count (1 and 2 on 3), the
outputs, the parameters' gradients and the input's gradient equal the plain module's, and
``last_replicas`` is min(replicas, batch); three SGD steps with momentum leave the same
parameters (so replicate re-reads the parameters every step). Nested inputs (tuples, lists,
dicts, a named tuple) and keyword arguments are split, non-tensor arguments reach every replica,
and nested outputs are gathered to the plain module's; ``dim=1`` splits and gathers along the
second dimension; tied weights stay tied. BatchNorm follows torch's rule: in training the
output is each slice normalized by its own statistics and the running statistics are those of
slice 0 alone (``num_batches_tracked`` counts one step); in eval the outputs equal the plain
module's and the statistics stay. The balanced mode's ``loss`` equals the full-batch
``F.cross_entropy`` and ``F.mse_loss`` with the same gradients, and gathers one float64 per
replica (``last_gathered_bytes``) where the plain forward gathers the whole output. Every replica
runs in its own thread, under the caller's grad mode and CPU autocast; one replica runs in the
caller's thread. Mistakes are ``ValueError`` naming the values.
"""

from __future__ import annotations

import copy
import threading
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.parallel.dp.steps import ReplicaError
from tandem.parallel.dp.wrapper import DataParallel

CPU = torch.device("cpu")
TOL = {"atol": 1e-12, "rtol": 0.0}


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 4),
    )


MODELS = {"mlp": (mlp, (6,)), "convnet": (convnet, (3, 8, 8))}


def _pair(factory, replicas: int, **kwargs):
    torch.manual_seed(0)
    plain = factory().double()
    wrapped = DataParallel(copy.deepcopy(plain), device_ids=["cpu"] * replicas, **kwargs)
    return plain, wrapped


def _assert_grads_equal(plain: nn.Module, wrapped: DataParallel) -> None:
    for (name, p), q in zip(plain.named_parameters(), wrapped.module.parameters(), strict=True):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=name)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 2, 7])
def test_outputs_and_gradients_equal_plain_module(name, replicas, batch):
    factory, shape = MODELS[name]
    plain, wrapped = _pair(factory, replicas)
    x = torch.randn(batch, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    weight = torch.randn(batch, 4, dtype=torch.float64)

    expected = plain(x1)
    got = wrapped(x2)
    torch.testing.assert_close(got, expected, **TOL)
    (expected * weight).sum().backward()
    (got * weight).sum().backward()

    assert wrapped.last_replicas == min(replicas, batch)
    _assert_grads_equal(plain, wrapped)
    torch.testing.assert_close(x2.grad, x1.grad, **TOL)


def test_training_steps_equal_plain_module():
    plain, wrapped = _pair(mlp, 3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, wrapped)]
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(11, 6, dtype=torch.float64, generator=g)
        y = torch.randint(0, 4, (11,), generator=g)
        for model, opt in zip((plain, wrapped), opts, strict=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    for p, q in zip(plain.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(q, p, **TOL)


Pair = namedtuple("Pair", ["left", "right"])


class Nested(nn.Module):
    """Nested inputs and outputs; non-tensor arguments change the result."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, pair, parts, *, extra=None, scale=1.0, mode="tanh", names=()):
        a, (b,) = pair.left, pair.right
        h = self.lin(x) * parts["c"] + a - b + (0 if extra is None else extra["e"][0])
        h = (torch.tanh if mode == "tanh" else torch.relu)(h) * scale
        assert names == ("u", "v")  # a non-tensor tuple arrives whole, not split
        return {"h": h, "both": (h.sum(1), [h * 2]), "mode": mode, "none": None}


@pytest.mark.parametrize("replicas", [2, 3])
def test_nested_inputs_and_keyword_arguments(replicas):
    plain, wrapped = _pair(Nested, replicas)
    g = torch.Generator().manual_seed(3)
    t = [torch.randn(5, 3, dtype=torch.float64, generator=g) for _ in range(5)]
    args = (t[0], Pair(t[1], [t[2]]), {"c": t[3]})
    kwargs = {"extra": {"e": [t[4]]}, "scale": 0.5, "mode": "relu", "names": ("u", "v")}

    expected = plain(*args, **kwargs)
    got = wrapped(*args, **kwargs)
    assert got["mode"] == "relu" and got["none"] is None
    for a, b in [(got["h"], expected["h"]), (got["both"][0], expected["both"][0])]:
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(got["both"][1][0], expected["both"][1][0], **TOL)
    expected["h"].sum().backward()
    got["h"].sum().backward()
    _assert_grads_equal(plain, wrapped)


class SeqFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):  # (time, batch, features): the batch is dim 1
        return self.lin(x).cumsum(0)


def test_dim_one_splits_and_gathers_the_second_dimension():
    plain, wrapped = _pair(SeqFirst, 2, dim=1)
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    got = wrapped(x)
    torch.testing.assert_close(got, plain(x), **TOL)
    assert wrapped.last_replicas == 2


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def test_tied_weights_get_the_plain_gradient():
    plain, wrapped = _pair(Tied, 2)
    x = torch.randn(5, 4, dtype=torch.float64)
    plain(x).square().sum().backward()
    wrapped(x).square().sum().backward()
    _assert_grads_equal(plain, wrapped)


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())


def test_batchnorm_training_keeps_replica_zero_statistics():
    plain, wrapped = _pair(_bn_model, 2)
    x = torch.randn(7, 3, dtype=torch.float64)
    got = wrapped(x)
    # Each slice is normalized by its own batch statistics...
    expected = torch.cat([copy.deepcopy(plain)(x[:4]), copy.deepcopy(plain)(x[4:])])
    torch.testing.assert_close(got, expected, **TOL)
    # ...and only replica 0's (slice 0's) update reaches the module.
    plain(x[:4])
    for name, b in plain.named_buffers():
        torch.testing.assert_close(dict(wrapped.module.named_buffers())[name], b, **TOL, msg=name)
    assert wrapped.module[1].num_batches_tracked.item() == 1


def test_batchnorm_eval_equals_plain_module_and_keeps_statistics():
    plain, wrapped = _pair(_bn_model, 3)
    plain[1].running_mean.uniform_()
    wrapped.module.load_state_dict(plain.state_dict())
    plain.eval()
    wrapped.eval()
    x = torch.randn(8, 3, dtype=torch.float64)
    torch.testing.assert_close(wrapped(x), plain(x), **TOL)
    torch.testing.assert_close(wrapped.module[1].running_mean, plain[1].running_mean, **TOL)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("batch", [2, 7, 10])
def test_balanced_loss_equals_full_batch_cross_entropy(replicas, batch):
    plain, wrapped = _pair(mlp, replicas, loss_fn=F.cross_entropy)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(batch, 6, dtype=torch.float64, generator=g)
    y = torch.randint(0, 4, (batch,), generator=g)

    expected = F.cross_entropy(plain(x), y)
    got = wrapped.loss(x, target=y)
    torch.testing.assert_close(got, expected, **TOL)
    expected.backward()
    got.backward()
    _assert_grads_equal(plain, wrapped)
    used = min(replicas, batch)
    assert wrapped.last_replicas == used
    assert wrapped.last_gathered_bytes == used * 8  # one float64 per replica

    wrapped(x)  # the plain forward gathers the whole output
    assert wrapped.last_gathered_bytes == batch * 4 * 8


def test_balanced_loss_equals_full_batch_mse_with_keyword_arguments():
    plain, wrapped = _pair(Nested, 3, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(5)
    t = [torch.randn(8, 3, dtype=torch.float64, generator=g) for _ in range(5)]
    args = (t[0], Pair(t[1], [t[2]]), {"c": t[3]})
    kwargs = {"names": ("u", "v")}

    def mse(out, target):
        return F.mse_loss(out["h"], target)

    wrapped.loss_fn = mse
    expected = mse(plain(*args, **kwargs), t[4])
    got = wrapped.loss(*args, target=t[4], **kwargs)
    torch.testing.assert_close(got, expected, **TOL)
    expected.backward()
    got.backward()
    _assert_grads_equal(plain, wrapped)


class Probe(nn.Module):
    """Records, per call, the thread, grad mode and slice size it ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.calls: list[tuple[str, bool, int]] = []
        self.lock = threading.Lock()

    def forward(self, x):
        with self.lock:
            self.calls.append((threading.current_thread().name, torch.is_grad_enabled(), len(x)))
        return self.lin(x)


def test_each_replica_runs_in_its_own_thread_under_the_callers_grad_mode():
    probe = Probe()
    model = DataParallel(probe, device_ids=["cpu"] * 3)
    with torch.no_grad():
        y = model(torch.randn(8, 2))
    threads = {c[0] for c in probe.calls}
    assert threads == {"replica 0 on cpu", "replica 1 on cpu", "replica 2 on cpu"}
    assert sorted(c[2] for c in probe.calls) == [2, 3, 3]
    assert not any(c[1] for c in probe.calls) and not y.requires_grad

    probe.calls.clear()
    assert model(torch.randn(8, 2)).requires_grad
    assert all(c[1] for c in probe.calls)

    probe.calls.clear()
    DataParallel(probe, device_ids=["cpu"])(torch.randn(8, 2))
    assert probe.calls == [
        (threading.current_thread().name, True, 8)
    ]  # one replica: the caller's thread


def test_replicas_run_under_the_callers_autocast():
    model = DataParallel(nn.Linear(4, 4), device_ids=["cpu"] * 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(torch.randn(6, 4))
    assert y.dtype == torch.bfloat16
    assert model(torch.randn(6, 4)).dtype == torch.float32


def test_mistakes_are_value_errors_with_the_values():
    with pytest.raises(ValueError, match=r"device_ids=\[\]"):
        DataParallel(nn.Linear(2, 2), device_ids=[])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device 0: this machine has 0 CUDA device"):
            DataParallel(nn.Linear(2, 2), device_ids=[0])
    with pytest.raises(ValueError, match=r"device_ids\[0\]=cpu, but 'weight' is on meta"):
        DataParallel(nn.Linear(2, 2).to("meta"), device_ids=["cpu"])

    model = DataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 2)
    with pytest.raises(ValueError, match=r"args\[0\] has 4, kwargs\['y'\] has 3"):
        model(torch.randn(4, 2), y=torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"loss\(\) needs a loss function"):
        model.loss(torch.randn(4, 2), target=torch.randn(4, 2))
    model.loss_fn = lambda out, target: (out - target).square()  # forgot the mean
    with pytest.raises(ValueError, match=r"loss_fn returned \(2, 2\) on replica 0"):
        model.loss(torch.randn(4, 2), target=torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"target has 3"):
        model.loss(torch.randn(4, 2), target=torch.randn(3, 2))


class FailsOnNan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        if torch.isnan(x).any():
            raise KeyError(f"nan in a slice of {len(x)}")
        return self.lin(x)


def test_an_exception_in_one_replica_names_its_device_with_the_traceback():
    model = DataParallel(FailsOnNan(), device_ids=["cpu"] * 3)
    x = torch.zeros(7, 2)
    x[5, 0] = float("nan")  # slices 0:3, 3:5, 5:7: replica 2 fails, the others succeed
    with pytest.raises(
        ReplicaError, match=r"^replica 2 on cpu raised KeyError: 'nan in a slice of 2'"
    ) as info:
        model(x)
    error = info.value
    assert (error.replica, error.device) == (2, CPU)
    assert isinstance(error.__cause__, KeyError) and error.original is error.__cause__
    assert "Traceback (most recent call last)" in str(error)
    assert 'raise KeyError(f"nan in a slice of {len(x)}")' in str(error)  # the failing line
    assert "in forward" in error.traceback_text

    # One replica runs in the caller's thread: the module's own exception, unwrapped.
    with pytest.raises(KeyError, match="nan in a slice of 7"):
        DataParallel(FailsOnNan(), device_ids=["cpu"])(x)
