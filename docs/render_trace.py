"""Draw ``docs/trace.png``: the timeline that ``tandem run --trace`` records of a small job.

    python docs/render_trace.py        # runs the job (about 20 s on 2 cores), draws the PNG

The job: the Trainer on synthetic data, a 6-layer MLP in tandem.DDP (buckets of 0.05 MiB, so
that there are several), 2 ranks on the CPU with Gloo, a checkpoint after each of 2 epochs.
Rank 1's data set is slow (1 ms per sample, a slow disk): the picture shows rank 0 waiting for
it in the gradient all-reduce of every step. The window drawn is the last steps of the first
epoch and its checkpoint. The launcher's exit summary (steps per rank, the slowest named) is
printed as the job prints it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SLOW_PER_SAMPLE_S = 0.001


def job(run_dir: str) -> None:
    """What each rank runs (under ``tandem run``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import Dataset, TensorDataset

    import tandem

    class SlowOnRank1(Dataset):
        def __init__(self, data: TensorDataset, rank: int) -> None:
            self.data, self.rank = data, rank

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int):
            if self.rank == 1:
                time.sleep(SLOW_PER_SAMPLE_S)
            return self.data[i]

    rank = tandem.init().rank
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    y = (x[:, :8].sum(1) > 0).long()
    layers: list[nn.Module] = []
    for width_in, width_out in ((64, 128), (128, 128), (128, 128), (128, 128), (128, 128)):
        layers += [nn.Linear(width_in, width_out), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(128, 2))
    trainer = tandem.Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        SlowOnRank1(TensorDataset(x, y), rank),
        loss_fn=F.cross_entropy,
        max_epochs=2,
        save_every=1,
        batch_size=16,
        run_dir=run_dir,
        progress=False,
        ddp_kwargs={"bucket_cap_mb": 0.05},
    )
    trainer.train()


def window(trace_file: Path, steps_before: int = 3) -> tuple[float, float]:
    """From the start of the ``steps_before``-th last step before rank 0's first checkpoint to
    the end of that checkpoint, in ms."""
    events = json.loads(trace_file.read_text())["traceEvents"]
    checkpoint = min(
        (e for e in events if e["name"] == "tandem.train.checkpoint" and e["pid"] == 0),
        key=lambda e: e["ts"],
    )
    forwards = sorted(
        e["ts"]
        for e in events
        if e["name"] == "tandem.ddp.forward" and e["pid"] == 0 and e["ts"] < checkpoint["ts"]
    )
    begin = forwards[-steps_before] - 2_000  # a little before it: the data loading
    end = checkpoint["ts"] + checkpoint["dur"] + 2_000
    return begin / 1e3, end / 1e3


def main() -> None:
    from tandem.doctor import trace_png

    with tempfile.TemporaryDirectory(prefix="tandem-trace-") as tmp:
        traces = Path(tmp) / "traces"
        command = [
            sys.executable, "-m", "tandem.cli", "run", "--nproc-per-node", "2",
            "--trace", str(traces), __file__, "--job", str(Path(tmp) / "run"),
        ]  # fmt: skip
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        print(done.stderr, end="", file=sys.stderr)
        if done.returncode != 0:
            sys.exit(done.returncode)
        start_ms, end_ms = window(traces / "trace.json")
        png = trace_png.render(
            traces / "trace.json",
            HERE / "trace.png",
            start_ms=start_ms,
            end_ms=end_ms,
            title="tandem run --trace: 2 ranks, rank 1's data loading slow (3 steps + checkpoint)",
        )
    print(f"wrote {png}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        job(sys.argv[2])
    else:
        main()
