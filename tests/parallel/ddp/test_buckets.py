"""Bucket layout (assign_buckets) and bucket buffers (build_buckets), no processes.

Proves, for assign_buckets: over random byte sizes, 1-3 keys, a random ready order and random
caps, the layout satisfies every rule that defines it, together enough to pin it down uniquely:
each index in exactly one bucket; one key per bucket; a key's buckets, read in list order, are
consecutive runs of that key's indices in ready order; buckets sorted by when their first index
is ready; a bucket closes exactly when it reaches its cap (the first bucket of a key uses
first_cap_bytes, later ones cap_bytes), so every bucket but a key's last is at or over its cap and
every bucket is under its cap without its last tensor (a tensor larger than the cap closes the
bucket it joins, and is never split). It also forms the same buckets as torch's own
``_compute_bucket_assignment_by_size`` on tensors of those byte sizes. Worked examples pin the
docstring's layout; a non-permutation order or a non-positive cap raises ValueError naming it.

For build_buckets: each view has its parameter's shape, lies inside the bucket's flat buffer at
the running offset (writing a view changes exactly that slice of flat, and the reverse), flat
starts zeroed with the dtype of its parameters.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.parallel.ddp.buckets import assign_buckets, build_buckets

KEYS = ("f32", "f16", "bf16")


@st.composite
def layouts_input(draw: st.DrawFn) -> tuple[list[int], list[str], list[int], int, int]:
    n = draw(st.integers(0, 16))
    sizes = draw(st.lists(st.integers(0, 120), min_size=n, max_size=n))
    distinct = draw(st.integers(1, 3))
    keys = draw(st.lists(st.sampled_from(KEYS[:distinct]), min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))
    cap = draw(st.integers(1, 400))
    first_cap = draw(st.integers(1, 400))
    return sizes, keys, order, cap, first_cap


@settings(max_examples=400, deadline=None)
@given(layouts_input())
def test_layout_follows_the_bucketing_rules(case):
    sizes, keys, order, cap, first_cap = case
    layout = assign_buckets(sizes, keys, order, cap_bytes=cap, first_cap_bytes=first_cap)
    position = {index: pos for pos, index in enumerate(order)}

    assert sorted(i for bucket in layout for i in bucket) == list(range(len(sizes)))
    assert all(bucket for bucket in layout), layout
    firsts = [position[bucket[0]] for bucket in layout]
    assert firsts == sorted(firsts), layout
    for bucket in layout:
        assert len({keys[i] for i in bucket}) == 1, (bucket, keys)
        assert [position[i] for i in bucket] == sorted(position[i] for i in bucket), bucket

    for key in set(keys):
        of_key = [bucket for bucket in layout if keys[bucket[0]] == key]
        assert [i for bucket in of_key for i in bucket] == [i for i in order if keys[i] == key]
        for n, bucket in enumerate(of_key):
            limit = first_cap if n == 0 else cap
            held = sum(sizes[i] for i in bucket)
            # Still open when its last tensor arrived...
            assert held - sizes[bucket[-1]] < limit, (key, n, bucket, held, limit)
            # ...and closed by it, unless the key ran out of tensors first.
            if n < len(of_key) - 1:
                assert held >= limit, (key, n, bucket, held, limit)


_DTYPES = {"f32": torch.float32, "f16": torch.float16, "f64": torch.float64}
# Caps that are multiples of the element sizes, so that buckets often land exactly on a cap.
_CAPS = st.one_of(st.integers(1, 300), st.integers(1, 40).map(lambda k: 8 * k))
_torch_assign = getattr(torch._C._distributed_c10d, "_compute_bucket_assignment_by_size", None)


@pytest.mark.skipif(_torch_assign is None, reason="this torch has no bucket assignment to match")
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.sampled_from(sorted(_DTYPES))), min_size=1, max_size=14
    ),
    st.data(),
    _CAPS,
    _CAPS,
)
def test_same_buckets_as_torch(specs, data, cap, first_cap):
    tensors = [torch.empty(numel, dtype=_DTYPES[name]) for numel, name in specs]
    order = data.draw(st.permutations(range(len(tensors))))
    sizes = [t.numel() * t.element_size() for t in tensors]
    ours = assign_buckets(sizes, [t.dtype for t in tensors], order, cap, first_cap)
    # Torch takes the tensors already in ready order, with their indices beside them (as its
    # DDP passes them when it rebuilds buckets).
    ready = [tensors[i] for i in order]
    theirs, _ = _torch_assign(ready, [first_cap, cap], [False] * len(tensors), order)
    # Torch lists the buckets in the order they closed; tandem sorts them by first ready
    # gradient (checked above), so compare the buckets themselves.
    assert sorted(ours) == sorted(theirs)


def test_docstring_example():
    layout = assign_buckets(
        sizes=[400, 400, 400, 400],
        keys=["f32"] * 4,
        order=[3, 2, 1, 0],
        cap_bytes=1000,
        first_cap_bytes=500,
    )
    # 3+2 reach the small first cap (800 >= 500); 1+0 stay under 1000 and form the last bucket.
    assert layout == [[3, 2], [1, 0]]


def test_each_key_starts_with_its_own_small_bucket():
    keys = ["f32", "f16", "f32", "f16", "f32", "f16"]
    layout = assign_buckets([100] * 6, keys, range(6), cap_bytes=1000, first_cap_bytes=100)
    assert layout == [[0], [1], [2, 4], [3, 5]]


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        # The big tensor closes the bucket it joins: it is never split, never shares with later.
        ([0, 1, 2, 3], [[0, 1], [2, 3]]),
        # Arriving first, it is alone in its bucket.
        ([1, 0, 2, 3], [[1], [0, 2, 3]]),
    ],
)
def test_tensor_larger_than_the_cap(order, expected):
    assert assign_buckets([10, 5000, 10, 10], ["f32"] * 4, order, 100, 100) == expected


def test_a_bucket_closes_exactly_at_the_cap():
    assert assign_buckets([50, 50, 50, 49, 1], ["f32"] * 5, range(5), 100, 100) == [
        [0, 1],
        [2, 3, 4],
    ]


def test_no_tensors_no_buckets():
    assert assign_buckets([], [], [], 100, 100) == []


@pytest.mark.parametrize(
    ("order", "keys"),
    [
        ([0, 0, 1], ["f32"] * 3),  # a repeated index
        ([0, 1], ["f32"] * 3),  # too short
        ([0, 1, 2, 3], ["f32"] * 3),  # too long
        ([0, 1, 3], ["f32"] * 3),  # out of range
        ([0, 1, 2], ["f32"] * 2),  # keys too short
    ],
)
def test_bad_order_or_keys_raise(order, keys):
    with pytest.raises(ValueError, match=r"permutation of range\(3\)") as info:
        assign_buckets([4, 4, 4], keys, order, 100, 100)
    assert f"order of length {len(order)}, {len(keys)} keys" in str(info.value)


def test_bad_order_error_shows_the_order():
    with pytest.raises(ValueError) as info:
        assign_buckets([4, 4, 4], ["f32"] * 3, [0, 0, 1], 100, 100)
    assert "[0, 0, 1]" in str(info.value)


@pytest.mark.parametrize(("cap", "first_cap"), [(0, 100), (-5, 100), (100, 0), (100, -1)])
def test_non_positive_caps_raise_with_their_values(cap, first_cap):
    with pytest.raises(ValueError, match="positive") as info:
        assign_buckets([4], ["f32"], [0], cap_bytes=cap, first_cap_bytes=first_cap)
    message = str(info.value)
    assert f" cap_bytes={cap}," in message
    assert f"first_cap_bytes={first_cap}" in message


def _params() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(2, 3),
        torch.randn(4),
        torch.randn(()),
        torch.randn(5, 1, 2, dtype=torch.float64),
        torch.randn(3, 2),
    ]


LAYOUT = [[2, 0], [3], [1, 4]]


def test_views_have_the_shapes_and_offsets_of_their_parameters():
    params = _params()
    buckets = build_buckets(LAYOUT, params)
    assert [b.index for b in buckets] == [0, 1, 2]
    assert [b.params for b in buckets] == LAYOUT
    for bucket, indices in zip(buckets, LAYOUT, strict=True):
        assert bucket.flat.numel() == sum(params[i].numel() for i in indices)
        assert bucket.flat.dtype == params[indices[0]].dtype
        assert not bucket.flat.any(), "a new bucket must start zeroed"
        assert [tuple(v.shape) for v in bucket.views] == [tuple(params[i].shape) for i in indices]
        assert all(v.is_contiguous() for v in bucket.views)

        # Writing view j must change exactly its own slice of flat: right offset, no overlap.
        for j, view in enumerate(bucket.views):
            view.fill_(j + 1)
        expected = torch.cat(
            [torch.full((params[i].numel(),), j + 1.0) for j, i in enumerate(indices)]
        ).to(bucket.flat.dtype)
        assert torch.equal(bucket.flat, expected)

        # And the reverse: the views read what is written into flat.
        bucket.flat.copy_(torch.arange(bucket.flat.numel(), dtype=bucket.flat.dtype))
        offset = 0
        for view, i in zip(bucket.views, indices, strict=True):
            n = params[i].numel()
            assert torch.equal(view.reshape(-1), torch.arange(offset, offset + n).to(view.dtype))
            offset += n


def test_parameters_are_not_copied_or_touched():
    params = _params()
    before = [p.clone() for p in params]
    build_buckets(LAYOUT, params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
