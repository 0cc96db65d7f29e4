"""tandem.checkpoint.rng: restoring a captured state repeats every generator's draws exactly.

Proves: after capture, draws from Python's ``random`` (including ``gauss``'s cached value),
NumPy's global generator (including its cached Gaussian) and torch's CPU generator, a restore
(even after reseeding all of them) makes the same calls return the same numbers; the same holds
after the state goes through ``save_checkpoint``/``load_checkpoint`` (weights_only loading) in a
fresh process-like state; a state without CUDA entries leaves CUDA alone, one with more CUDA
generators than the process has warns; a state missing a generator is a ValueError naming it;
the compact form recovery in memory publishes (through JSON) is the same state.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.checkpoint.rng import (
    capture_rng_state,
    compact_rng_state,
    expand_rng_state,
    restore_rng_state,
)
from tandem.checkpoint.run_dir import load_checkpoint, save_checkpoint


def draw() -> dict[str, Any]:
    return {
        "random": [random.random() for _ in range(5)] + [random.gauss(0, 1) for _ in range(3)],
        "getrandbits": random.getrandbits(200),
        "numpy": np.random.standard_normal(5).tolist() + np.random.randint(0, 1 << 30, 4).tolist(),
        "torch": torch.rand(5).tolist() + torch.randint(0, 1 << 30, (4,)).tolist(),
        "dropout": torch.nn.functional.dropout(torch.ones(64), 0.5).tolist(),
    }


def advance_odd() -> None:
    # An odd number of Gaussians leaves a cached second value in both Python and NumPy.
    random.gauss(0, 1)
    np.random.standard_normal()
    torch.randn(3)


def reseed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_restore_repeats_every_generator() -> None:
    reseed_everything(1)
    advance_odd()
    state = capture_rng_state()
    first = draw()
    reseed_everything(2)  # something else entirely happened in between
    assert draw() != first
    restore_rng_state(state)
    assert draw() == first


def test_restore_after_a_checkpoint_round_trip(tmp_path) -> None:
    reseed_everything(3)
    advance_odd()
    path = save_checkpoint({"rng": [capture_rng_state()]}, tmp_path, epoch=0, step=7)
    first = draw()
    reseed_everything(4)
    restore_rng_state(load_checkpoint(path)["state"]["rng"][0])
    assert draw() == first


def test_state_is_plain_data_and_does_not_alias_the_generator() -> None:
    state = capture_rng_state()
    before = state["torch"].clone()
    torch.rand(10)
    assert torch.equal(state["torch"], before)
    assert state["numpy"]["keys"].dtype == torch.int64 and state["numpy"]["keys"].shape == (624,)
    assert state["python"]["internal"].shape == (625,)


def test_cuda_states_only_when_cuda_was_used() -> None:
    state = capture_rng_state()
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert state["cuda"] == []
    else:
        assert len(state["cuda"]) == torch.cuda.device_count()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generators_repeat() -> None:
    torch.cuda.manual_seed_all(5)
    torch.rand(1, device="cuda")  # initializes CUDA, so the capture includes it
    state = capture_rng_state()
    first = torch.rand(8, device="cuda").tolist()
    torch.cuda.manual_seed_all(6)
    restore_rng_state(state)
    assert torch.rand(8, device="cuda").tolist() == first


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only process")
def test_more_cuda_states_than_devices_warns_and_still_restores_cpu() -> None:
    state = capture_rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    first = draw()
    with pytest.warns(UserWarning, match="1 CUDA generator.*sees 0"):
        restore_rng_state(state)
    assert draw() == first


def test_missing_generator_is_named() -> None:
    state = capture_rng_state()
    del state["numpy"]
    with pytest.raises(ValueError, match=r"lacks \['numpy'\]"):
        restore_rng_state(state)


@settings(max_examples=25, deadline=None)
@given(draws=st.integers(0, 700), gauss=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_compact_state_through_json_restores_every_generator(draws, gauss, seed):
    """compact_rng_state -> JSON text -> expand_rng_state is capture_rng_state's state, and
    restoring it repeats every generator's draws (Python's, NumPy's with a cached Gaussian or
    not, torch's), wherever the Mersenne twisters stand in their 624-word blocks."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    for _ in range(draws):
        random.random()
        np.random.rand()
    torch.rand(draws + 1)
    if gauss:
        np.random.randn()  # leaves a cached Gaussian behind
    compact = json.loads(json.dumps(compact_rng_state()))
    expanded = expand_rng_state(compact)
    full = capture_rng_state()
    assert expanded["python"]["version"] == full["python"]["version"]
    assert torch.equal(expanded["python"]["internal"], full["python"]["internal"])
    assert torch.equal(expanded["numpy"]["keys"], full["numpy"]["keys"])
    for key in ("pos", "has_gauss", "cached_gaussian", "bit_generator"):
        assert expanded["numpy"][key] == full["numpy"][key], key
    assert torch.equal(expanded["torch"], full["torch"])
    ahead = (random.random(), np.random.randn(), torch.rand(3))
    restore_rng_state(expanded)
    again = (random.random(), np.random.randn(), torch.rand(3))
    assert ahead[:2] == again[:2] and torch.equal(ahead[2], again[2])
