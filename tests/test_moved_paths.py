"""Import paths that moved in the restructure keep working for one release, and say so.

Proves: each old path (the ones the README documented before tandem 0.1's packages) imports,
raises a DeprecationWarning that names the new path, and hands out the very objects of the new
module, so a script written against the old path behaves the same.
"""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = [
    ("tandem.train.checkpoint", "tandem.checkpoint.run_dir", "load_checkpoint"),
    ("tandem.parallel.comm_hooks", "tandem.parallel.ddp.comm_hooks", "allreduce_hook"),
    ("tandem.launch.meeting", "tandem.job.checkin", "meet"),
    ("tandem.doctor.steps", "tandem.doctor.step_clock", "clock"),
]


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_an_old_path_warns_and_gives_the_new_objects(old, new, name, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
