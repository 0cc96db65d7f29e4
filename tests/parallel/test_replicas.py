"""Replica checks without processes: parameter signatures, their comparison, broadcast chunks.

Proves: ``signature`` lists (name, shape, dtype, requires_grad) in registration order, frozen and
float64 parameters included. ``first_difference`` returns None exactly when every rank's
signature is the same, and otherwise describes the first differing parameter: its name and
index, rank 0's entry and the entry of every rank that differs from it (and no other rank),
for a different shape, name, dtype or requires_grad, and "no such parameter" with every rank's
parameter count when one rank has an extra parameter; on random signatures the reported index
and ranks are the first differing index and exactly the ranks that differ there. Buffers get the
same report in their own words: ``buffer_signature`` lists (name, shape, dtype), and
``first_difference(..., "buffer")`` names a buffer, "no such buffer" and the buffer counts.
``_chunks`` cuts chunks in input order, closes one exactly once it holds CHUNK_BYTES (checked
against a small CHUNK_BYTES), and places every tensor at an offset aligned to its element size,
since chunks mix dtypes as raw bytes.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tandem.parallel import replicas
from tandem.parallel.replicas import buffer_signature, first_difference, signature

F32 = "torch.float32"
W = ("w", (2, 3), F32, True)
B = ("b", (3,), F32, True)


def test_signature_in_registration_order():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1).double())
    model[0].bias.requires_grad_(False)
    assert signature(model.named_parameters()) == [
        ("0.weight", (3, 2), F32, True),
        ("0.bias", (3,), F32, False),
        ("1.weight", (1, 3), "torch.float64", True),
        ("1.bias", (1,), "torch.float64", True),
    ]


@pytest.mark.parametrize("ranks", [1, 3])
def test_identical_signatures_have_no_difference(ranks):
    assert first_difference([[W, B] for _ in range(ranks)]) is None


def test_no_parameters_anywhere_is_no_difference():
    assert first_difference([[], []]) is None


def test_shape_differs_on_one_rank_of_three():
    other = ("b", (4,), F32, True)
    message = first_difference([[W, B], [W, B], [W, other]])
    assert message == (
        "parameter 'b' (#1) differs: rank 0 has 'b' of shape (3,) torch.float32, "
        "rank 2 has 'b' of shape (4,) torch.float32"
    )
    assert "rank 1" not in message


def test_only_the_first_difference_is_reported():
    message = first_difference([[W, B], [("w", (9, 9), F32, True), ("b", (7,), F32, True)]])
    assert "'w' (#0)" in message and "(9, 9)" in message
    assert "(7,)" not in message


def test_name_differs():
    message = first_difference([[W, B], [W, ("bias", (3,), F32, True)]])
    assert message.startswith("parameter 'b' (#1) differs")
    assert "rank 0 has 'b' of shape (3,)" in message
    assert "rank 1 has 'bias' of shape (3,)" in message


def test_dtype_differs():
    message = first_difference([[W, B], [("w", (2, 3), "torch.float16", True), B]])
    assert "rank 0 has 'w' of shape (2, 3) torch.float32" in message
    assert "rank 1 has 'w' of shape (2, 3) torch.float16" in message


def test_requires_grad_differs():
    message = first_difference([[W, B], [W, B], [("w", (2, 3), F32, False), B]])
    assert "rank 0 has 'w' of shape (2, 3) torch.float32, " in message
    assert message.endswith("rank 2 has 'w' of shape (2, 3) torch.float32 (requires_grad=False)")
    assert "rank 1" not in message


def test_extra_parameter_on_another_rank():
    extra = ("head", (5,), F32, True)
    message = first_difference([[W, B], [W, B, extra]])
    assert message == (
        "parameter 'head' (#2) differs: rank 0 has no such parameter, "
        "rank 1 has 'head' of shape (5,) torch.float32 (parameter counts: rank 0: 2, rank 1: 3)"
    )


def test_extra_parameter_on_rank_0():
    extra = ("head", (5,), F32, True)
    message = first_difference([[W, B, extra], [W, B], [W, B, extra]])
    assert "parameter 'head' (#2)" in message
    assert "rank 1 has no such parameter" in message
    assert "rank 2 has" not in message
    assert "(parameter counts: rank 0: 3, rank 1: 2, rank 2: 3)" in message


def test_buffer_signature_and_wording():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    buffers = buffer_signature(model.named_buffers())
    assert buffers == [
        ("1.running_mean", (3,), F32),
        ("1.running_var", (3,), F32),
        ("1.num_batches_tracked", (), "torch.int64"),
    ]
    wider = buffer_signature(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(4)).named_buffers())
    assert first_difference([buffers, wider], "buffer") == (
        "buffer '1.running_mean' (#0) differs: rank 0 has '1.running_mean' of shape (3,) "
        "torch.float32, rank 1 has '1.running_mean' of shape (4,) torch.float32"
    )
    message = first_difference([buffers, buffers[:2]], "buffer")
    assert message.startswith("buffer '1.num_batches_tracked' (#2) differs")
    assert "rank 1 has no such buffer (buffer counts: rank 0: 3, rank 1: 2)" in message


ENTRIES = st.tuples(
    st.sampled_from(["w", "b", "head"]),
    st.sampled_from([(2,), (3,), (2, 3)]),
    st.sampled_from([F32, "torch.float16"]),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(ENTRIES, max_size=4), min_size=1, max_size=4))
def test_reports_the_first_differing_index_and_exactly_the_ranks_that_differ(signatures):
    message = first_difference(signatures)
    reference = signatures[0]
    if all(s == reference for s in signatures):
        assert message is None
        return

    def entry(s, j):
        return s[j] if j < len(s) else None

    length = max(len(s) for s in signatures)
    j = next(
        j for j in range(length) if any(entry(s, j) != entry(reference, j) for s in signatures)
    )
    differing = [r for r, s in enumerate(signatures) if r and entry(s, j) != entry(reference, j)]
    assert message is not None
    assert f"(#{j}) differs" in message, message
    named = [int(r) for r in re.findall(r"rank (\d+) has", message)]
    assert named == [0, *differing], message
    has_counts = "(parameter counts:" in message
    assert has_counts == any(len(s) != len(reference) for s in signatures), message


def _kinds(chunk: list[torch.Tensor]) -> set[tuple[torch.dtype, torch.device]]:
    return {(t.dtype, t.device) for t in chunk}


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_chunks_worked_example(monkeypatch):
    monkeypatch.setattr(replicas, "CHUNK_BYTES", 16)
    a, b, c, d, e = (
        torch.zeros(2),  # 8 bytes
        torch.zeros(1, dtype=torch.float64),  # 8 bytes: 16 with a, the chunk is full
        torch.zeros(2),  # 8 bytes
        torch.zeros(4),  # 16 bytes with c: full
        torch.zeros(1, dtype=torch.int16),
    )
    chunks = replicas._chunks([a, b, c, d, e])
    # dtypes share a chunk (they travel as bytes); the widest elements go first
    assert [[id(t) for t in chunk] for chunk in chunks] == [
        [id(b), id(a)],
        [id(c), id(d)],
        [id(e)],
    ]


DTYPES = [torch.float32, torch.float16, torch.float64, torch.int64, torch.bool, torch.uint8]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 30), st.sampled_from(DTYPES)), max_size=20),
    st.integers(1, 120),
)
def test_chunks_keep_every_tensor_aligned_and_respect_the_cap(specs, cap):
    tensors = [torch.zeros(n, dtype=dtype) for n, dtype in specs]
    # A fixture would be shared by all examples; this patch lasts for one example.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replicas, "CHUNK_BYTES", cap)
        chunks = replicas._chunks(tensors)

    assert sorted(id(t) for chunk in chunks for t in chunk) == sorted(id(t) for t in tensors)
    assert all(chunk for chunk in chunks), chunks
    # chunks are cut in input order...
    position = {id(t): i for i, t in enumerate(tensors)}
    spans = [sorted(position[id(t)] for t in chunk) for chunk in chunks]
    assert [i for span in spans for i in span] == list(range(len(tensors)))
    for n, chunk in enumerate(chunks):
        in_order = [tensors[i] for i in spans[n]]
        # ...take tensors while under the cap, so they can pass it by one tensor...
        assert _bytes(in_order[:-1]) < cap, (n, cap)
        # ...and close once they reach it, unless the tensors ran out first.
        if n < len(chunks) - 1:
            assert _bytes(in_order) >= cap, (n, cap)
        # every tensor starts at a multiple of its element size within the chunk's bytes
        offset = 0
        for t in chunk:
            assert offset % t.element_size() == 0, (offset, t.dtype)
            offset += t.numel() * t.element_size()


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
