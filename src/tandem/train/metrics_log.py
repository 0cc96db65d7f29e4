"""The run's record: ``metrics.jsonl`` (one line per epoch), ``metrics.png``, the Summary.

(The step log, a record every ``log_every`` optimizer steps, goes to the loggers of
:mod:`tandem.train.loggers`; ``metrics.png`` is drawn from it when the run keeps one.)

The history itself lives in the checkpoint, so a resumed run rewrites both files from it: an
epoch run again after a resume from an earlier checkpoint replaces its old line instead of
appearing twice. Both files are written to a temporary name and renamed, so a reader (or a
crash) never sees half a file. Only the main rank calls these.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem._optional import require
from tandem.files import rename_into_place, write_temp

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


@dataclass(frozen=True)
class Summary:
    """What :meth:`Trainer.train` returns (the same on every rank).

    Attributes:
        epochs: epochs completed.
        steps: optimizer steps taken.
        train_loss: the last completed epoch's training loss, mean over all ranks' samples.
        eval_loss: its evaluation loss (None without ``eval_data``).
        eval_accuracy: its evaluation accuracy (None without ``eval_data`` or for outputs that
            are not class scores).
        stopped_by: ``"SIGTERM"`` or ``"request_stop()"`` when the run stopped early, else None.
        checkpoint: the last checkpoint written or resumed from, if any.
        history: one record per completed epoch, as in ``metrics.jsonl``.

    Example::

        summary = trainer.train()
        if summary.stopped_by is None:
            print(f"final test accuracy {summary.eval_accuracy:.3f}")
    """

    epochs: int
    steps: int
    train_loss: float | None
    eval_loss: float | None
    eval_accuracy: float | None
    stopped_by: str | None
    checkpoint: Path | None
    history: list[dict[str, Any]]


def _replace(path: Path, write: Any) -> None:
    # Whole or absent: a reader (a dashboard tailing the run) never sees half a file.
    rename_into_place(write_temp(path.parent, path.name, write), path)


def epoch_line(record: dict[str, Any]) -> str:
    """Rank 0's printed line for an epoch record: ``epoch   E  loss L  test accuracy A``.

    Example::

        epoch_line({"epoch": 3, "train_loss": 0.12, "eval_accuracy": 0.98})
    """
    line = f"epoch {record['epoch']:3d}  loss {record['train_loss']:.4f}"
    if record.get("eval_accuracy") is not None:
        line += f"  test accuracy {record['eval_accuracy']:.3f}"
    elif record.get("eval_loss") is not None:
        line += f"  test loss {record['eval_loss']:.4f}"
    return line


def write_metrics(run_dir: Path, history: Sequence[dict[str, Any]]) -> Path:
    """Write ``history`` (one dict per epoch) as ``run_dir/metrics.jsonl``; return its path.

    Example::

        write_metrics(Path("runs/wine"), [{"epoch": 1, "train_loss": 0.7}])
    """
    path = run_dir / METRICS_FILE
    text = "".join(json.dumps(record) + "\n" for record in history)
    _replace(path, lambda f: f.write(text.encode()))
    return path


def _series(records: Sequence[dict[str, Any]], x: str, y: str) -> tuple[list, list]:
    points = [(r[x], r[y]) for r in records if r.get(y) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_metrics(
    run_dir: Path, history: Sequence[dict[str, Any]], steps: Sequence[dict[str, Any]] = ()
) -> Path:
    """Draw the run's curves to ``run_dir/metrics.png``; return its path.

    From the step log's records (``steps``, as ``steps.jsonl`` holds them) when there are any:
    the training loss and the evaluation loss by optimizer step, the evaluation accuracy and
    the learning rate where logged. Otherwise from the epoch records (``history``): the losses
    and the accuracy by epoch.

    Raises:
        ImportError: matplotlib is missing (``pip install "tandem[plots]"``).

    Example::

        plot_metrics(Path("runs/wine"), history, read_jsonl(Path("runs/wine/steps.jsonl")))
    """
    # Imported here: matplotlib is the optional "plots" extra, it takes a noticeable part of a
    # second to import, and only the main rank plots. A bare Figure renders with Agg and
    # touches no pyplot global state, so it works without a display and inside any application.
    Figure = require("matplotlib.figure", extra="plots").Figure

    by_step = any(r.get("loss") is not None for r in steps)
    records, x, train = (steps, "step", "loss") if by_step else (history, "epoch", "train_loss")
    panels = [("loss", "loss (mean over all ranks)")]
    if any(r.get("eval_accuracy") is not None for r in records):
        panels.append(("accuracy", "eval accuracy"))
    if by_step and any(r.get("lr") is not None for r in records):
        panels.append(("lr", "learning rate"))
    fig = Figure(figsize=(5 * len(panels), 4), layout="constrained")
    row = fig.subplots(1, len(panels), squeeze=False)[0]
    axes = {name: ax for (name, _), ax in zip(panels, row, strict=True)}
    for (name, title), ax in zip(panels, row, strict=True):
        ax.set(xlabel=x, ylabel=name, title=title)
        ax.grid(alpha=0.3)
    # Many step records make a line; a few epochs read better as points.
    marker = "" if by_step and len(records) > 50 else "."
    axes["loss"].plot(*_series(records, x, train), marker=marker, label="train loss")
    if any(r.get("eval_loss") is not None for r in records):
        axes["loss"].plot(*_series(records, x, "eval_loss"), marker=".", label="eval loss")
    axes["loss"].legend()
    if "accuracy" in axes:
        axes["accuracy"].plot(*_series(records, x, "eval_accuracy"), marker=".", color="tab:green")
        axes["accuracy"].set(ylim=(0, 1.02))
    if "lr" in axes:
        axes["lr"].plot(*_series(records, x, "lr"), color="tab:orange")
    path = run_dir / PLOT_FILE
    _replace(path, lambda f: fig.savefig(f, format="png", dpi=100))
    return path
