"""The Trainer on CUDA: its precisions equal a hand-written loop bitwise, and a GPU checkpoint
resumes bitwise and loads in a process without CUDA.

Where the ranks go: two ranks, over NCCL with a GPU each when there are two GPUs, else both on
``cuda:0`` over Gloo, which takes CUDA tensors (NCCL refuses two ranks on one device). Each
such rank is then told it is alone on its node (``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``), as
on two one-GPU machines: ``tandem.init`` places a rank on ``cuda:LOCAL_RANK`` and refuses a
local rank past the visible GPUs. Two ranks, not one, because only then does the Trainer wrap
the model in tandem.DDP, whose CUDA path (buckets on the GPU, the end-of-backward check copied
to pinned memory and read at the next forward) is what differs from the CPU; at one rank the
model stays plain and there is nothing of the engine to check. The fp16 skip count runs at one
rank, as on the CPU.

Proves (mirroring tests/train/test_trainer_precision.py and test_trainer_resume.py):

- ``precision="bf16-mixed"``, ``"fp16-mixed"`` (its ``GradScaler("cuda")`` made by the Trainer)
  and ``"bf16-true"``, with gradient accumulation (2 micro-batches) and a binding
  ``clip_grad_norm``: the parameters are ``torch.equal`` to a hand-written loop over torch's own
  DistributedDataParallel with CUDA autocast, its GradScaler (``scale`` -> ``unscale_`` ->
  ``clip_grad_norm_`` -> ``step`` -> ``update``), bfloat16 conversion, seeds and data order;
  every epoch's train and eval loss are ``==``, and so are the last gradient norm and the
  scaler's scale. Bitwise for the CPU test's reasons: the same kernels on the same operands in
  each rank, and each gradient element the sum of two addends (which commute) halved (exact);
- fp16 with a scaler starting too high (``init_scale=2**24``) at one rank: ``skipped_steps``
  equals the steps in which the hand-written loop's parameters did not change (more than 0,
  fewer than all), and a run stopped after its first epoch and resumed ends ``torch.equal`` to
  the uninterrupted one with the same count and scale;
- resume: a run with dropout on the GPU, each rank its own CUDA generator (seeded 100 + rank,
  so each rank must get its own state back), SGD with momentum, StepLR, accumulation, a
  shuffled sampler and tandem.DDP in 3 or more buckets, stopped in the middle of its second
  epoch (``max_steps=6`` of 8) and resumed in fresh processes ends ``torch.equal`` to the
  uninterrupted run on every rank, with the same history.
  The oracle can fail: the same resume with the CUDA generators left unrestored ends elsewhere
  on a GPU (on the CPU, where dropout draws from the restored CPU generator, it cannot);
- the uninterrupted run's last checkpoint, written from the GPU with every rank's CUDA
  generator states, loads in a process that sees no GPU (``CUDA_VISIBLE_DEVICES=""``):
  ``load_checkpoint`` gives CPU tensors and ``tandem export`` writes a safetensors file; both
  hold weights ``torch.equal`` to the GPU's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from tandem.train.trainer import Trainer
from tests.cuda import gpu
from tests.harness import run_ranks

# The CPU test's data, model, optimizer and Trainer: the same run, on the GPU here.
from tests.train.test_trainer_precision import (
    ACCUM,
    BATCH,
    EPOCHS,
    _hand_loop,
    _trainer,
)

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]

WORLD = 2
PRECISIONS = ("bf16-mixed", "fp16-mixed", "bf16-true")


# The precisions: the Trainer against a hand-written torch loop.


def _parity(run_dir: str) -> dict:
    gpu.deterministic()
    dev = gpu.device()
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for precision in PRECISIONS:
        trainer = _trainer(str(Path(run_dir, precision)), precision)
        summary = trainer.train()
        scaler = torch.amp.GradScaler(dev.type) if precision == "fp16-mixed" else None
        model, losses, norm, _ = _hand_loop(precision, scaler, world, rank, dev)
        results[precision] = {
            "same_params": all(
                torch.equal(a, b)
                for a, b in zip(trainer.module.parameters(), model.parameters(), strict=True)
            ),
            "devices": {str(p.device) for p in trainer.module.parameters()},
            "dtypes": {str(p.dtype) for p in trainer.module.parameters()},
            "losses": ([(r["train_loss"], r["eval_loss"]) for r in summary.history], losses),
            "norms": (trainer.last_grad_norm, norm),
            "scales": (
                trainer.scaler.get_scale() if trainer.scaler is not None else None,
                scaler.get_scale() if scaler is not None else None,
            ),
            "made_scaler": type(trainer.scaler).__name__,
            "engine": type(trainer.model).__name__,
        }
    return results


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> list[dict]:
    """One pair of ranks trains every precision (a CUDA context per rank is paid once)."""
    run_dir = str(tmp_path_factory.mktemp("precision"))
    return run_ranks(
        _parity, WORLD, args=(run_dir,), init=gpu.backend(WORLD), env=gpu.env(WORLD), timeout=180
    )


@pytest.mark.xdist_group("trainer_cuda_precision")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_trainer_equals_a_hand_written_ddp_loop_bitwise(parity, precision):
    for rank, ranks_results in enumerate(parity):
        result = ranks_results[precision]
        assert result["engine"] == "DistributedDataParallel", result  # tandem.DDP
        assert result["devices"] == {gpu.expected_device(rank, WORLD)}, result
        assert result["same_params"], result
        got, want = result["losses"]
        assert got == want, result
        assert result["norms"][0] == result["norms"][1], result
        assert result["scales"][0] == result["scales"][1], result
        want_scaler = "GradScaler" if precision == "fp16-mixed" else "NoneType"
        assert result["made_scaler"] == want_scaler, result
        want_dtype = "torch.bfloat16" if precision == "bf16-true" else "torch.float32"
        assert result["dtypes"] == {want_dtype}, result


# fp16's skipped steps, at one rank.


def _high_scaler() -> torch.amp.GradScaler:
    # float16 overflows in backward until the scale has halved below about 2**19.
    return torch.amp.GradScaler(gpu.device().type, init_scale=2.0**24)


def _skips(run_dir: str) -> dict:
    gpu.deterministic()
    whole = _trainer(str(Path(run_dir, "whole")), None, scaler=_high_scaler())
    whole.train()
    model, _, _, unchanged = _hand_loop("fp16-mixed", _high_scaler(), 1, 0, gpu.device())
    same = all(
        torch.equal(a, b)
        for a, b in zip(whole.module.parameters(), model.parameters(), strict=True)
    )

    _trainer(str(Path(run_dir, "resumed")), None, epochs=1, scaler=_high_scaler()).train()
    resumed = _trainer(str(Path(run_dir, "resumed")), None, scaler=_high_scaler(), resume="latest")
    loaded = resumed.skipped_steps
    resumed_step = resumed.step
    resumed.train()
    return {
        "precision": whole.precision,
        "device": str(next(whole.module.parameters()).device),
        "same": same,
        "skipped": whole.skipped_steps,
        "unchanged": unchanged,
        "steps": whole.step,
        "loaded": (loaded, resumed_step),
        "resumed_skipped": resumed.skipped_steps,
        "scales": (resumed.scaler.get_scale(), whole.scaler.get_scale()),
        "resumed_same": all(
            torch.equal(a, b)
            for a, b in zip(resumed.module.parameters(), whole.module.parameters(), strict=True)
        ),
    }


def test_fp16_skipped_steps_are_counted_and_resume_with_the_checkpoint(tmp_path):
    (r,) = run_ranks(_skips, 1, args=(str(tmp_path),), init=None, env=gpu.env(), timeout=120)
    assert r["precision"] == "fp16-mixed" and r["device"] == gpu.expected_device(0, 1), r
    assert r["same"], r
    assert 0 < r["skipped"] == r["unchanged"] < r["steps"], r
    loaded, resumed_step = r["loaded"]
    assert loaded == min(r["unchanged"], resumed_step), r  # loaded with the checkpoint
    assert r["resumed_skipped"] == r["skipped"], r
    assert r["scales"][0] == r["scales"][1], r
    assert r["resumed_same"], r


# Resume from a GPU checkpoint, and read it without a GPU.

SAMPLES_PER_RANK = 25
BATCHES_PER_EPOCH = 7  # 25 samples per rank in batches of 4: steps of 2, 2, 2, 1
STOP_AT = 6  # of 8 steps: batch 4 of epoch 2
# Small enough that the 6 parameters (12 to 3072 bytes) fall into 3 or more buckets.
BUCKET_CAP_MB = 256 / 2**20


def _resume_data(world: int) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    n = SAMPLES_PER_RANK * world
    x = torch.randn(n + 11, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:])


def _dropout_run(run_dir: str, max_steps: int | None, resume: str | None) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, test_set = _resume_data(world)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 3)
    )
    # Each rank its own dropout masks, drawn on the GPU from its CUDA generator (seeded here
    # with the CPU one): restoring the wrong state, or none, would show.
    torch.manual_seed(100 + rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(
        model,
        optimizer,
        train_set,
        loss_fn=F.cross_entropy,
        eval_data=test_set,
        max_epochs=EPOCHS,
        max_steps=max_steps,
        save_every=1,
        batch_size=BATCH,
        run_dir=run_dir,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7),
        grad_accum_steps=ACCUM,
        resume=resume,
        keep_checkpoints=10,
        progress=False,
        ddp_kwargs={"bucket_cap_mb": BUCKET_CAP_MB},
    )
    assert len(trainer.train_loader) == BATCHES_PER_EPOCH
    summary = trainer.train()
    return {
        "buckets": trainer.model.reducer.layout,
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "device": str(next(model.parameters()).device),
        "history": [
            (r["epoch"], r["step"], r["train_loss"], r["eval_loss"], r["eval_accuracy"])
            for r in summary.history
        ],
        "steps": summary.steps,
    }


def _run_phase(run_dir: str, max_steps: int | None) -> dict:
    gpu.deterministic()
    gpu.device()
    return _dropout_run(run_dir, max_steps, None)


def _resume_phase(run_dir: str, checkpoint: str, elsewhere: str) -> dict:
    """Resume ``checkpoint`` twice in these processes: first with the CUDA generators left as
    they are (the control, written to ``elsewhere``), then as the Trainer does, from
    ``run_dir``'s latest: every generator is restored, so what ran before cannot matter."""
    gpu.deterministic()
    gpu.device()
    import tandem.checkpoint.rng as rng

    restore_cuda = rng._restore_cuda
    rng._restore_cuda = lambda saved: None
    try:
        control = _dropout_run(elsewhere, None, checkpoint)
    finally:
        rng._restore_cuda = restore_cuda
    return {"control": control, "resumed": _dropout_run(run_dir, None, "latest")}


def _phase(fn, *args) -> list[dict]:
    return run_ranks(fn, WORLD, args=args, init=gpu.backend(WORLD), env=gpu.env(WORLD), timeout=120)


def _same_states(got: list[dict], want: list[dict]) -> bool:
    return all(
        torch.equal(g["state"][k], w["state"][k])
        for g, w in zip(got, want, strict=True)
        for k in w["state"]
    )


_CPU_READER = """
import sys
import torch
from tandem.cli import main
from tandem.checkpoint.run_dir import load_checkpoint

run_dir, out, summary = sys.argv[1:]
status = main(["export", run_dir, out])
ckpt = load_checkpoint(run_dir)
state = ckpt["state"]
torch.save(
    {
        "cuda": torch.cuda.is_available(),
        "status": status,
        "step": ckpt["step"],
        "model": state["model"],
        "devices": sorted({str(t.device) for t in state["model"].values()}),
        "cuda_rng": [len(r["rng"]["cuda"]) for r in state["trainer"]["ranks"]],
    },
    summary,
)
"""


def test_gpu_checkpoint_resumes_bitwise_and_loads_without_a_gpu(tmp_path):
    whole = _phase(_run_phase, str(tmp_path / "whole"), None)
    assert [r["device"] for r in whole] == [gpu.expected_device(r, WORLD) for r in range(WORLD)]
    assert whole[0]["history"][-1][1] == EPOCHS * 4  # 4 optimizer steps per epoch
    assert len(whole[0]["buckets"]) >= 3, whole[0]["buckets"]
    assert all(r["buckets"] == whole[0]["buckets"] for r in whole)

    stopped = _phase(_run_phase, str(tmp_path / "run"), STOP_AT)
    assert [r["steps"] for r in stopped] == [STOP_AT] * WORLD
    checkpoint = tmp_path / "run" / "checkpoints" / f"ckpt-e0001-s{STOP_AT:08d}.pt"
    assert checkpoint.is_file(), sorted(p.name for p in (tmp_path / "run").rglob("*.pt"))

    both = _phase(_resume_phase, str(tmp_path / "run"), str(checkpoint), str(tmp_path / "control"))
    resumed = [r["resumed"] for r in both]
    for rank in range(WORLD):
        assert resumed[rank]["history"] == whole[rank]["history"], (rank, resumed[rank])
        for key, want in whole[rank]["state"].items():
            got = resumed[rank]["state"][key]
            assert torch.equal(got, want), (
                f"rank {rank} {key}: differs by {(got - want).abs().max()}"
            )
    # Without its CUDA generators the resumed run draws other masks on the GPU.
    control = [r["control"] for r in both]
    assert _same_states(control, whole) == (gpu.gpus() == 0), "the control resume"

    # The last checkpoint of the uninterrupted run, read where no GPU is visible.
    out, summary = tmp_path / "whole.safetensors", tmp_path / "summary.pt"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TANDEM_CUDA_ON_CPU", None)
    read = subprocess.run(
        [sys.executable, "-c", _CPU_READER, str(tmp_path / "whole"), str(out), str(summary)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert read.returncode == 0, read.stdout + read.stderr
    seen = torch.load(summary, weights_only=True)
    assert seen["cuda"] is False and seen["status"] == 0, (seen, read.stderr)
    assert seen["step"] == EPOCHS * 4 and seen["devices"] == ["cpu"], seen
    # Written from the GPU: every rank's CUDA generator states are in it.
    visible = torch.cuda.device_count() if gpu.gpus() else 0
    assert seen["cuda_rng"] == [visible] * WORLD, seen["cuda_rng"]
    from safetensors.torch import load_file

    exported = load_file(str(out))
    want = whole[0]["state"]
    assert exported.keys() == want.keys() == seen["model"].keys()
    for key in want:
        assert torch.equal(exported[key], want[key]), key
        assert torch.equal(seen["model"][key], want[key]), key
