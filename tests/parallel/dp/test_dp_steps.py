"""The four steps of DataParallel one by one: scatter, replicate, parallel_apply, gather.

Proves: ``split_sizes`` covers the batch exactly with slices that differ by at most one, larger
first, never empty, on min(replicas, batch) replicas (one empty slice for an empty batch), for
batches up to 200 on up to 9 replicas (hypothesis). ``scatter`` gives each replica the rows
``split_sizes`` assigns, keeps container types (named tuples too) and passes non-tensors as the
same object; it is differentiable (the slices' gradients land in the input's rows); inputs with
no tensor make one slice; a 0-dim tensor is a ``ValueError``. ``replicate`` returns the module
itself as replica 0; other CPU replicas share the parameter tensors but hold copies of the
buffers; tied weights and a submodule used twice stay shared inside a replica; a ``None`` bias
stays ``None``. ``gather`` concatenates tensors, stacks scalars, recurses into containers,
passes equal non-tensors, and rejects differing ones, differing structures, and shapes that
differ outside ``dim``; one output is returned as it is. ``parallel_apply`` returns results in
replica order, raises the lowest-numbered failure as a ``ReplicaError`` that survives pickling,
and rejects mismatched lengths.
"""

from __future__ import annotations

import pickle
from collections import namedtuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tandem.parallel.dp.steps import (
    ReplicaError,
    Slice,
    gather,
    parallel_apply,
    replicate,
    scatter,
    split_sizes,
)

CPU = torch.device("cpu")


@given(batch=st.integers(0, 200), replicas=st.integers(1, 9))
def test_split_sizes_cover_the_batch_as_evenly_as_possible(batch, replicas):
    sizes = split_sizes(batch, replicas)
    assert sum(sizes) == batch
    assert len(sizes) == max(1, min(replicas, batch))
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert batch == 0 or min(sizes) >= 1


def test_split_sizes_rejects_no_replicas():
    with pytest.raises(ValueError, match="replicas=0"):
        split_sizes(4, 0)


Point = namedtuple("Point", ["x", "y"])


def test_scatter_slices_every_tensor_and_keeps_structure():
    x = torch.arange(7.0).reshape(7, 1)
    marker = object()
    slices = scatter(
        (x, Point(x * 10, [x * 100])), {"d": {"z": x}, "obj": marker}, [CPU] * 3, target=x + 1
    )
    assert [s.size for s in slices] == [3, 2, 2]
    starts = [0, 3, 5]
    for s, start in zip(slices, starts, strict=True):
        rows = x[start : start + s.size]
        a, point = s.args
        assert isinstance(point, Point) and isinstance(point.y, list)
        assert torch.equal(a, rows) and torch.equal(point.x, rows * 10)
        assert torch.equal(point.y[0], rows * 100) and torch.equal(s.kwargs["d"]["z"], rows)
        assert s.kwargs["obj"] is marker and torch.equal(s.target, rows + 1)


def test_scatter_is_differentiable():
    x = torch.randn(5, 3, requires_grad=True)
    slices = scatter((x,), {}, [CPU] * 2)
    sum((i + 1) * s.args[0].sum() for i, s in enumerate(slices)).backward()
    assert torch.equal(x.grad, torch.tensor([1.0] * 3 + [2.0] * 2).unsqueeze(1).expand(5, 3))


def test_scatter_without_tensors_is_one_slice_and_rejects_scalars():
    assert scatter((1, "a"), {"k": None}, [CPU] * 2) == [Slice((1, "a"), {"k": None}, None, None)]
    with pytest.raises(ValueError, match=r"kwargs\['t'\] is a 0-dim tensor"):
        scatter((torch.zeros(2),), {"t": torch.tensor(1.0)}, [CPU] * 2)


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        self.b = nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight
        self.block = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        self.again = self.block  # one submodule reachable under two names


def test_replicate_shares_parameters_and_copies_buffers():
    model = Shared()
    r0, r1, r2 = replicate(model, [CPU] * 3)
    assert r0 is model
    for r in (r1, r2):
        assert r is not model and r.a is not model.a
        assert r.a.weight is model.a.weight and r.b.weight is r.a.weight
        assert r.a.bias is None
        assert r.again is r.block
        bn, original = r.block[1], model.block[1]
        assert bn.running_mean is not original.running_mean
        assert torch.equal(bn.running_mean, original.running_mean)
    assert r1.block[1].running_mean is not r2.block[1].running_mean
    r1.block[1].running_mean.add_(1.0)  # a replica's update never reaches the module
    assert torch.equal(model.block[1].running_mean, torch.zeros(2))


def test_gather_concatenates_stacks_and_recurses():
    outs = [
        {"y": torch.ones(2, 3), "s": torch.tensor(1.0), "p": Point(torch.zeros(2), "k"), "n": None},
        {"y": torch.zeros(1, 3), "s": torch.tensor(2.0), "p": Point(torch.ones(1), "k"), "n": None},
    ]
    got = gather(outs, CPU)
    assert torch.equal(got["y"], torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    assert torch.equal(got["s"], torch.tensor([1.0, 2.0]))
    assert isinstance(got["p"], Point) and got["p"].y == "k" and got["n"] is None
    assert torch.equal(got["p"].x, torch.tensor([0.0, 0.0, 1.0]))
    assert torch.equal(gather([torch.ones(3, 2), torch.ones(3, 1)], CPU, dim=1), torch.ones(3, 3))

    only = torch.tensor(3.0)
    assert gather([only], CPU) is only  # one replica: the module's own output

    with pytest.raises(ValueError, match=r"output\[1\] is 'a' on replica 0 but \['a', 'b'\]"):
        gather([(torch.ones(1), "a"), (torch.ones(1), "b")], CPU)
    with pytest.raises(ValueError, match=r"output: the replicas returned different structures"):
        gather([(torch.ones(1),), (torch.ones(1), torch.ones(1))], CPU)
    with pytest.raises(
        ValueError, match=r"output\[0\]: the replicas' outputs have shapes \[\(1, 3\), \(1, 2\)\]"
    ):
        gather(
            [(torch.ones(1, 3),), (torch.ones(1, 2),)], CPU
        )  # e.g. an LSTM's h_n, batch in dim 1
    with pytest.raises(ValueError, match=r"output: the replicas returned different keys"):
        gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}], CPU)


def _fail_on_negative(x):
    if (x < 0).any():
        raise ArithmeticError(f"negative input {x.tolist()}")
    return x * 2


def test_parallel_apply_orders_results_and_raises_the_first_failure():
    inputs = [Slice((torch.tensor([float(v)]),), {}, None, 1) for v in (1, -2, -3, 4)]
    fns = [_fail_on_negative] * 4
    ok = parallel_apply(fns[:1] * 2, [inputs[0], inputs[3]], [CPU] * 2)
    assert [o.item() for o in ok] == [2.0, 8.0]

    with pytest.raises(ReplicaError, match=r"replica 1 on cpu raised ArithmeticError") as info:
        parallel_apply(fns, inputs, [CPU] * 4)
    assert "negative input [-2.0]" in str(info.value)
    assert "_fail_on_negative" in info.value.traceback_text

    copied = pickle.loads(pickle.dumps(info.value))
    assert str(copied) == str(info.value) and copied.replica == 1

    with pytest.raises(ValueError, match=r"2 replicas, 1 slices and 2 devices"):
        parallel_apply(fns[:2], inputs[:1], [CPU] * 2)
