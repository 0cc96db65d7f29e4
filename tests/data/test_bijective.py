"""BijectiveSampler: a keyed permutation of [0, n) that is never stored, no processes.

Proves: every epoch is a permutation of [0, n) (hypothesis over n in 1..5000, seeds, epochs; the
scalar path, the vectorized path and iteration agree element for element); sharding is torch's
exactly (each rank's list is our permutation read at the positions torch's unshuffled
DistributedSampler gives that rank, for padding and drop_last alike), so shards are disjoint,
cover [0, n), and have equal lengths; (seed, epoch) fixes the permutation and changing either
changes it; ``sampler[i]`` equals the i-th element of iteration; n = 10^11 works; a resume from
``state_dict`` mid-epoch continues exactly as the uninterrupted run; bad arguments raise
ValueError naming the value. Two statistical tests, deterministic because their keys are a fixed
set: over 2000 seeds at n = 1000 each element's position is uniform (chi-square on a 1000 x 20
table), and outputs at adjacent positions, or positions one bit apart, are independent (their
joint law matches two draws without replacement; and over one permutation of 10^5, successive
outputs are uncorrelated). A 1-round network fails the first, a 2-round one the second: teeth.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch.utils.data import DistributedSampler

from tandem.data import bijective
from tandem.data.bijective import BijectiveSampler


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _perm(n: int, seed: int = 0, epoch: int = 0) -> list[int]:
    s = BijectiveSampler(n, num_replicas=1, rank=0, seed=seed)
    s.set_epoch(epoch)
    return list(s)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    seed=st.integers(0, 2**70),
    epoch=st.integers(-5, 10**6),
)
def test_every_epoch_is_a_permutation(n, seed, epoch):
    assert sorted(_perm(n, seed, epoch)) == list(range(n))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 600), seed=st.integers(0, 2**64), epoch=st.integers(0, 100))
def test_scalar_vectorized_and_iteration_agree(n, seed, epoch):
    s = BijectiveSampler(n, num_replicas=1, rank=0, seed=seed)
    s.set_epoch(epoch)
    scalar = [s.permute(j) for j in range(n)]
    assert sorted(scalar) == list(range(n))
    assert s.indices(0, n).tolist() == scalar == list(s) == [s[i] for i in range(n)]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "replicas"), [(1, 1), (1, 3), (10, 3), (12, 4), (1001, 8), (5, 7)])
def test_shards_are_torchs_positions_of_our_permutation(n, replicas, drop_last):
    perm = _perm(n, seed=11, epoch=2)
    seen = []
    for rank in range(replicas):
        ours = BijectiveSampler(n, replicas, rank, seed=11, drop_last=drop_last)
        ours.set_epoch(2)
        positions = DistributedSampler(Sized(n), replicas, rank, shuffle=False, drop_last=drop_last)
        assert len(ours) == len(positions)
        assert list(ours) == [perm[j] for j in positions]
        seen += list(ours)
    total = len(seen)
    if drop_last:  # disjoint: no index twice, and only the tail of the permutation is cut
        assert sorted(seen) == sorted(perm[:total])
    else:  # covering: every index, and the only repeats are the wrapped padding
        assert set(seen) == set(range(n)) and total - n < replicas


def test_dataset_argument_and_world_defaults():
    s = BijectiveSampler(Sized(37))  # one process: tandem.world() is rank 0 of 1
    assert (s.n, s.num_replicas, s.rank, len(s)) == (37, 1, 0, 37)


def test_seed_and_epoch_fix_the_permutation():
    n = 2000
    assert _perm(n, 5, 3) == _perm(n, 5, 3)
    others = [_perm(n, 5, 4), _perm(n, 6, 3), _perm(n, 0, 0), _perm(n, 2**64 + 5, 3)]
    base = _perm(n, 5, 3)
    assert all(p != base for p in others)
    assert len({tuple(p) for p in others}) == len(others)
    # not a rotation or a near-identity: a random permutation fixes about one point
    assert sum(a == b for a, b in zip(base, others[0], strict=True)) < 10


def test_huge_n():
    n = 10**11
    s = BijectiveSampler(n, num_replicas=8, rank=3, seed=99)
    s.set_epoch(7)
    assert len(s) == n // 8
    values = [s[i] for i in range(300)] + [s[-1], s[len(s) // 2]]
    assert all(0 <= v < n for v in values)
    assert len(set(values)) == len(values)
    it = iter(s)
    assert [next(it) for _ in range(20)] == values[:20] == s.indices(0, 20).tolist()
    # spread over the whole range, not clustered near the positions
    assert max(values) > n // 2 > min(values)
    assert BijectiveSampler(2**63, 1, 0)[2**63 - 1] < 2**63


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_mid_epoch_equals_uninterrupted(drop_last):
    n, replicas, rank = 10_007, 3, 2
    full = BijectiveSampler(n, replicas, rank, seed=4, drop_last=drop_last)
    full.set_epoch(1)
    epoch1 = list(full)
    full.set_epoch(2)
    epoch2 = list(full)

    run = BijectiveSampler(n, replicas, rank, seed=4, drop_last=drop_last)
    run.set_epoch(1)
    it = iter(run)
    head = [next(it) for _ in range(1234)]
    state = run.state_dict()
    assert (state["epoch"], state["position"]) == (1, 1234)

    resumed = BijectiveSampler(n, replicas, rank, seed=4, drop_last=drop_last)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # a training loop does this right after loading: must keep the point
    assert head + list(resumed) == epoch1
    resumed.set_epoch(2)
    assert list(resumed) == epoch2
    resumed.set_epoch(2)
    assert list(resumed) == epoch2  # the resume point was used once, not kept

    other = BijectiveSampler(n, replicas, rank, seed=4, drop_last=drop_last)
    other.load_state_dict(state)
    other.set_epoch(2)  # moving on to another epoch drops the stale resume point
    assert list(other) == epoch2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_or_dataset": 0}, "got 0"),
        ({"n_or_dataset": 2**63 + 1}, "got 9223372036854775809"),
        ({"n_or_dataset": Sized(0)}, "got 0"),
        ({"num_replicas": 0, "rank": 0}, "got 0"),
        ({"num_replicas": 4, "rank": 4}, r"rank 4 not in \[0, 4\)"),
        ({"num_replicas": 4, "rank": -1}, r"rank -1 not in \[0, 4\)"),
        ({"seed": -3}, "got -3"),
    ],
)
def test_bad_arguments_raise_with_values(kwargs, match):
    args = {"n_or_dataset": 10, "num_replicas": 1, "rank": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        BijectiveSampler(**args)


def test_bad_positions_and_states():
    s = BijectiveSampler(10, 2, 0, seed=1)
    with pytest.raises(IndexError, match=r"index 5 not in \[0, 5\)"):
        s[5]
    with pytest.raises(IndexError, match=r"position 10 not in \[0, 10\)"):
        s.permute(10)
    with pytest.raises(ValueError, match="seed=2 but this sampler has 1"):
        s.load_state_dict({"epoch": 0, "position": 0, "seed": 2})
    with pytest.raises(ValueError, match=r"position 6 not in \[0, 5\]"):
        s.load_state_dict({"epoch": 0, "position": 6})
    assert s[-1] == s[4]


# --- statistics: a fixed set of keys, so the p-values are fixed numbers, not flaky ---

N, KEYS = 1000, 2000


def _perms(rounds: int = bijective.ROUNDS) -> np.ndarray:
    """KEYS permutations of [0, N), one per seed, as a KEYS x N array (row: position -> element)."""
    j = np.arange(N, dtype=np.uint64)
    h = bijective._half_bits(N)
    rows = [
        bijective._permute_np(j, N, bijective.round_keys(seed, 0, rounds), h)
        for seed in range(KEYS)
    ]
    return np.array(rows, dtype=np.int64)


def _position_uniformity_p(perms: np.ndarray) -> float:
    # element k's position, binned into 20 bins of 50: a 1000 x 20 table whose rows should all
    # follow the same (uniform) law; both margins are fixed, so a contingency test is exact
    position = np.argsort(perms, axis=1)  # row s: element -> its position under seed s
    bins = position // (N // 20)
    table = np.stack([np.bincount(bins[:, k], minlength=20) for k in range(N)])
    return stats.chi2_contingency(table).pvalue


def _pair_p(perms: np.ndarray, partner) -> float:
    # (pi(j), pi(partner(j))) for 4 fixed j per seed (pairs disjoint), in 10 x 10 bins of 100
    # values; a random permutation makes the pair two draws without replacement, so a diagonal
    # cell expects 99/999 of its row, the others 100/999
    pairs = np.concatenate([perms[:, [j, partner(j)]] for j in (0, 3, 100, 400)])
    cells = (pairs[:, 0] // 100) * 10 + pairs[:, 1] // 100
    observed = np.bincount(cells, minlength=100)
    diagonal = np.eye(10, dtype=bool).ravel()
    expected = len(pairs) * 0.1 * np.where(diagonal, 99 / 999, 100 / 999)
    return stats.chisquare(observed, expected).pvalue


# adjacent positions, and positions one bit apart (any bit of [0, 1024)): the inputs a weak
# network leaves related (2 Feistel rounds pass a flipped high bit straight through)
PARTNERS = [lambda j: j + 1] + [lambda j, b=b: j ^ (1 << b) for b in range(10)]


@pytest.fixture(scope="module")
def perms() -> np.ndarray:
    return _perms()


def test_positions_are_uniform(perms):
    assert _position_uniformity_p(perms) > 1e-3


def test_adjacent_outputs_are_independent(perms):
    assert min(_pair_p(perms, partner) for partner in PARTNERS) > 1e-3
    # and within one long permutation, successive outputs are uncorrelated: r ~ N(0, 1/n)
    n = 100_000
    z2 = [stats.pearsonr(p[:-1], p[1:]).statistic ** 2 * n for p in map(np.array, _few(n))]
    assert stats.chi2(len(z2)).sf(sum(z2)) > 1e-3


def _few(n: int) -> list[list[int]]:
    return [_perm(n, seed, epoch) for seed, epoch in [(0, 0), (1, 0), (0, 1), (7, 3), (8, 8)]]


def test_statistics_have_teeth():
    assert _position_uniformity_p(_perms(rounds=1)) < 1e-6
    assert min(_pair_p(_perms(rounds=2), partner) for partner in PARTNERS) < 1e-6
