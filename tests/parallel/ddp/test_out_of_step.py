"""The out-of-step check's record of this process's DDP models, without processes.

Each model gets the next index (the same on every rank, since every rank builds its models in
the same order), and a model that is gone is forgotten: a process that builds many models (a
sweep, a test suite) neither grows the record nor reports the steps of dead models to its peers.
"""

from __future__ import annotations

import gc

from tandem.parallel.ddp import out_of_step


def test_models_are_numbered_in_build_order_and_forgotten_when_gone():
    first = out_of_step.track(None)
    second = out_of_step.track(None)
    assert second.index == first.index + 1
    assert out_of_step._models[first.index] is first
    index = first.index
    del first
    gc.collect()
    assert index not in out_of_step._models
    assert out_of_step._models[second.index] is second
