"""tandem.checkpoint in one process: round trips, the checks made before loading, files, export.

Proven (one process, no process group; the collective paths are in
tests/checkpoint/test_checkpoint_api.py):

- a hand-written loop (dropout, AdamW, a scheduler, a GradScaler, tandem's sampler, ``RNG()``
  drawn from through torch, Python and NumPy, plain values) saved mid-epoch and loaded into
  fresh objects continues bitwise as the uninterrupted loop: parameters, batches, draws;
- loading checks before it changes anything: keys missing or extra, a value of another type,
  another model's keys or shapes, other optimizer groups are ValueErrors naming them, and the
  model and optimizer stay bitwise as they were; a stateful object refusing its state puts back
  the ones loaded before it;
- a corrupt file, one without its sidecar, foreign files (a torch.save state dict, safetensors,
  an empty file, a Trainer checkpoint) and a pickle that would run code are CheckpointErrors
  naming the path and what the file is, with nothing changed;
- a save that fails (a value ``weights_only`` would refuse) leaves the checkpoint already at
  that path loadable and no temporary file;
- engines (``make_engine``) and wrapped models (``nn.DataParallel``) round-trip, the latter
  into the unwrapped model;
- export: the model of a save file (one of several, by key; tied weights) written as
  safetensors loads with ``strict=True`` and equals the model (``torch.equal``); wrapper
  prefixes are dropped; ``tandem export`` exits 0, and 2 for a missing path, a directory
  without checkpoints, a corrupt or foreign file, leaving OUT as it was; a missing safetensors
  names the extra to install.
"""

from __future__ import annotations

import itertools
import random
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import tandem.checkpoint as ckpt
from tandem.checkpoint.export import strip_wrapper_prefixes
from tandem.checkpoint.run_dir import CheckpointError, save_checkpoint
from tandem.cli import main as cli
from tandem.data import DistributedSampler
from tandem.parallel.engine import make_engine

X = torch.randn(22, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0.3).long()
BATCH = 4


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _state(seed: int = 0) -> dict:
    net = _net(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    return {
        "model": net,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        "scaler": torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2),
        "sampler": DistributedSampler(range(len(X)), num_replicas=1, rank=0, seed=3),
        "rng": ckpt.RNG(),
        "step": 0,
        "epoch": 0,
        "losses": [],
    }


def _run(state: dict, until: int, save_at: int | None = None, path=None) -> list[list[int]]:
    """Train to global step ``until``; save after step ``save_at``; the batches drawn."""
    net, opt, scaler, sampler = (
        state["model"],
        state["optimizer"],
        state["scaler"],
        state["sampler"],
    )
    drawn = []
    while state["step"] < until:
        sampler.set_epoch(state["epoch"])  # keeps a loaded position of the same epoch
        indices = iter(sampler)
        while batch := list(itertools.islice(indices, BATCH)):
            drawn.append(batch)
            # Every generator matters: torch (dropout), Python and NumPy (a jitter).
            jitter = 1 + 0.01 * random.random() + 0.01 * float(np.random.rand())
            loss = F.cross_entropy(net(X[batch]), Y[batch]) * jitter
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            state["scheduler"].step()
            state["losses"].append(loss.item())
            state["step"] += 1
            if state["step"] == save_at:
                ckpt.save(state, path)
            if state["step"] == until:
                return drawn
        state["epoch"] += 1
    return drawn


def _params(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def saved(tmp_path):
    """A loop saved after step 3 (mid-epoch), and where the uninterrupted loop ended at 12."""
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    state = _state()
    drawn = _run(state, 12, save_at=3, path=tmp_path / "ck.pt")
    return {"path": tmp_path / "ck.pt", "state": state, "drawn": drawn}


def test_resumed_loop_continues_bitwise(saved):
    fresh = _state(seed=7)  # other weights, a fresh sampler, other generators
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    ckpt.load(fresh, saved["path"])
    assert fresh["step"] == 3 and fresh["losses"] == saved["state"]["losses"][:3]
    drawn = _run(fresh, 12)
    assert drawn == saved["drawn"][3:]
    assert fresh["losses"] == saved["state"]["losses"]
    assert _same(_params(fresh["model"]), _params(saved["state"]["model"]))
    assert fresh["scaler"].get_scale() == saved["state"]["scaler"].get_scale()


def test_engines_and_wrapped_models_round_trip(tmp_path):
    net, other = _net(seed=1), _net(seed=2)
    engine = make_engine(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    net(X).sum().backward()
    engine.optimizer.step()
    wrapped = nn.DataParallel(other)  # no devices: its module runs as it is
    ckpt.save({"engine": engine, "dp": wrapped}, tmp_path / "e.pt")
    net2, other2 = _net(seed=3), _net(seed=4)
    engine2 = make_engine(net2, torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9))
    ckpt.load({"engine": engine2, "dp": other2}, tmp_path / "e.pt")  # into the unwrapped one
    assert _same(_params(net2), _params(net)) and _same(_params(other2), _params(other))
    assert repr(engine2.optimizer.state_dict()) == repr(engine.optimizer.state_dict())
    ckpt.export_weights(tmp_path / "e.pt", tmp_path / "dp.safetensors", key="dp")
    assert sorted(load_file(tmp_path / "dp.safetensors")) == sorted(other.state_dict())


def test_a_tensor_value_is_loaded_into_the_tensor_there(tmp_path):
    counts = torch.arange(4.0)
    ckpt.save({"counts": counts}, tmp_path / "c.pt")
    mine = torch.zeros(4)
    state = {"counts": mine}
    ckpt.load(state, tmp_path / "c.pt")
    assert state["counts"] is mine and torch.equal(mine, counts)


def _unchanged(state: dict):
    """A check that the model and optimizer of ``state`` are as they are now."""
    params = _params(state["model"])
    optim = repr(state["optimizer"].state_dict())

    def check():
        assert _same(_params(state["model"]), params)
        assert repr(state["optimizer"].state_dict()) == optim

    return check


def test_keys_that_differ_are_named_and_nothing_changes(saved):
    state = _state(seed=5)
    unchanged = _unchanged(state)
    extra = {**state, "ema": 0.5}
    with pytest.raises(ValueError, match=r"\['ema'\] that the checkpoint lacks"):
        ckpt.load(extra, saved["path"])
    fewer = {k: v for k, v in state.items() if k != "scheduler"}
    with pytest.raises(ValueError, match=r"\['scheduler'\] that the state lacks"):
        ckpt.load(fewer, saved["path"])
    with pytest.raises(ValueError, match=r"state\['step'\] is a model .* holds a value there"):
        ckpt.load({**state, "step": nn.Linear(1, 1)}, saved["path"])
    unchanged()


def test_another_model_or_optimizer_is_refused_before_anything_loads(saved):
    state = _state(seed=5)
    unchanged = _unchanged(state)
    wider = {
        **state,
        "model": nn.Sequential(nn.Linear(6, 17), nn.ReLU(), nn.Dropout(), nn.Linear(17, 3)),
    }
    wider_before = _params(wider["model"])
    with pytest.raises(ValueError, match=r"0.weight: checkpoint \(16, 6\), here \(17, 6\)"):
        ckpt.load(wider, saved["path"])
    assert _same(_params(wider["model"]), wider_before)
    other = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))  # no Dropout: 2. keys
    with pytest.raises(ValueError, match=r"keys \['2.weight', '2.bias'\] that the checkpoint"):
        ckpt.load({**state, "model": other}, saved["path"])
    net = state["model"]
    params = list(net.parameters())
    groups = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    with pytest.raises(ValueError, match=r"param groups of \[4\] parameters, this one \[2, 2\]"):
        ckpt.load({**state, "optimizer": groups}, saved["path"])
    unchanged()


def test_a_refusing_object_puts_back_the_ones_loaded_before_it(saved):
    state = _state(seed=5)
    unchanged = _unchanged(state)
    scheduler_before = state["scheduler"].state_dict()
    # A sampler over another data set: its own load_state_dict refuses the saved position.
    state["sampler"] = DistributedSampler(range(30), num_replicas=1, rank=0, seed=3)
    with pytest.raises(ValueError, match="dataset_len"):
        ckpt.load(state, saved["path"])
    assert state["scheduler"].state_dict() == scheduler_before
    assert state["step"] == 0
    unchanged()


def _flip_byte(path, where: int = -200) -> None:
    data = bytearray(path.read_bytes())
    data[where] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_truncated_and_unfinished_files_refuse_to_load(saved, tmp_path):
    state = _state(seed=5)
    unchanged = _unchanged(state)
    path = saved["path"]
    good = path.read_bytes()
    _flip_byte(path)
    with pytest.raises(CheckpointError, match=r"ck.pt is corrupt or truncated"):
        ckpt.load(state, path)
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=r"corrupt or truncated"):
        ckpt.load(state, path)
    path.write_bytes(good)
    path.with_name("ck.pt.sha256").unlink()
    with pytest.raises(CheckpointError, match=r"is a torch.save file, not a committed tandem"):
        ckpt.load(state, path)
    with pytest.raises(CheckpointError, match=r"missing.pt does not exist"):
        ckpt.load(state, tmp_path / "missing.pt")
    unchanged()


def test_foreign_files_are_named(tmp_path):
    state = {"model": _net()}
    torch.save(state["model"].state_dict(), tmp_path / "plain.pt")
    save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    (tmp_path / "empty.pt").write_bytes(b"")
    weights = {"model": state["model"].state_dict()}
    trainer_ckpt = save_checkpoint(weights, tmp_path / "run", epoch=1, step=5)
    cases = {
        tmp_path / "plain.pt": "is a torch.save file",
        tmp_path / "w.safetensors": "is a safetensors file",
        tmp_path / "empty.pt": "is an empty file",
        trainer_ckpt: r"is a Trainer checkpoint \(epoch 1, step 5\)",
        tmp_path / "run" / "checkpoints" / "latest": "is a Trainer's latest pointer",
        tmp_path / "run": "is a directory, not a checkpoint file; it holds Trainer checkpoints",
    }
    for path, what in cases.items():
        with pytest.raises(CheckpointError, match=what):
            ckpt.load(state, path)


class _Gadget:
    pass


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    # A file whose checksum is right but whose pickle names a class: weights_only refuses it.
    path = tmp_path / "evil.pt"
    torch.save({"format": "tandem.checkpoint/1", "objects": _Gadget()}, path)
    from tandem.files import file_digest

    path.with_name("evil.pt.sha256").write_text(f"{file_digest(path, 'sha256')}  evil.pt\n")
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        ckpt.load({}, path)


def test_a_failed_save_leaves_the_checkpoint_there(saved):
    path = saved["path"]
    before = path.read_bytes()

    class Odd:
        def state_dict(self):
            return {"gadget": _Gadget()}

        def load_state_dict(self, state):
            pass

    with pytest.raises(ValueError, match="weights_only"):
        ckpt.save({"odd": Odd()}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["ck.pt", "ck.pt.sha256"]
    with pytest.raises(ValueError, match=r"state\['x'\] is of type object"):
        ckpt.save({"x": object()}, path)
    with pytest.raises(ValueError, match="kind must be one of"):
        ckpt.save({"x": 1}, path, kind="half")  # type: ignore[arg-type]


# -- export --------------------------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(2.0))


def test_export_of_a_save_file_loads_strictly_and_equals_the_model(saved, tmp_path):
    out = tmp_path / "w.safetensors"
    assert ckpt.export_weights(saved["path"], out) == out
    net = _net(seed=5)
    net.load_state_dict(load_file(out), strict=True)
    # The file holds the weights at the save (step 3): the resumed state's model has them.
    fresh = _state(seed=7)
    ckpt.load(fresh, saved["path"])
    assert _same(_params(net), _params(fresh["model"]))

    tied, other = Tied(), _net(seed=2)
    ckpt.save({"a": tied, "b": other, "step": 1}, tmp_path / "two.pt")
    with pytest.raises(ValueError, match=r"holds 2 models \(\['a', 'b'\]\)"):
        ckpt.export_weights(tmp_path / "two.pt", out)
    with pytest.raises(ValueError, match=r"no model under 'step'"):
        ckpt.export_weights(tmp_path / "two.pt", out, key="step")
    ckpt.export_weights(tmp_path / "two.pt", out, key="a")
    loaded = load_file(out)
    assert sorted(loaded) == ["emb.weight", "head.weight", "scale"]
    back = Tied()
    back.load_state_dict(loaded, strict=True)
    for key, value in tied.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)


def test_wrapper_prefixes_are_dropped():
    assert list(strip_wrapper_prefixes({"module.a.weight": 1, "module.b": 2})) == ["a.weight", "b"]
    fsdp = {"_fsdp_wrapped_module.layer._checkpoint_wrapped_module.w": 1, "_orig_mod.x": 2}
    assert list(strip_wrapper_prefixes(fsdp)) == ["layer.w", "x"]
    # A model whose own child is "module" keeps it when other keys lack the prefix.
    assert list(strip_wrapper_prefixes({"module.w": 1, "head.w": 2})) == ["module.w", "head.w"]


def test_cli_export_and_its_errors(saved, tmp_path, capsys):
    out = tmp_path / "out" / "w.safetensors"
    assert cli(["export", str(saved["path"]), str(out)]) == 0
    assert "tandem export: wrote" in capsys.readouterr().out
    before = out.read_bytes()
    (tmp_path / "empty").mkdir()
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(saved["path"].read_bytes())
    (tmp_path / "corrupt.pt.sha256").write_text(saved["path"].with_name("ck.pt.sha256").read_text())
    _flip_byte(corrupt)
    torch.save({"w": torch.ones(1)}, tmp_path / "foreign.pt")
    cases = {
        str(tmp_path / "nothing"): "nothing does not exist",
        str(tmp_path / "empty"): "no checkpoints in",
        str(corrupt): "corrupt or truncated",
        str(tmp_path / "foreign.pt"): "is a torch.save file",
    }
    for source, what in cases.items():
        assert cli(["export", source, str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tandem export: error:") and what in err, err
        assert out.read_bytes() == before
    fresh = tmp_path / "fresh.safetensors"
    assert cli(["export", str(tmp_path / "empty"), str(fresh)]) == 2
    assert not fresh.exists() and not list(tmp_path.glob(".fresh*"))


def test_missing_safetensors_names_the_extra(saved, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r'pip install "tandem\[export\]"'):
        ckpt.export_weights(saved["path"], tmp_path / "w.safetensors")
    assert not (tmp_path / "w.safetensors").exists()
