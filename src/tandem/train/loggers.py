"""Where the step log goes: CSV, JSON lines, TensorBoard, or any object with ``log_metrics``.

The Trainer's ``loggers=[...]`` takes names and objects:

- ``"csv"``: ``run_dir/steps.csv``, one row per logged step, a column per metric (a metric
  that appears later, such as the first evaluation's, widens the file);
- ``"jsonl"``: ``run_dir/steps.jsonl``, one JSON object per logged step;
- ``"tensorboard"``: event files in ``run_dir/tensorboard`` written by
  ``torch.utils.tensorboard.SummaryWriter`` (``pip install "tandem[tensorboard]"``);
- any object with ``log_metrics(metrics: dict, step: int)`` (and, if it likes, ``flush()``):
  Weights & Biases, MLflow or a dashboard of your own, wrapped in a few lines.

Only rank 0 logs. A resumed run appends, and never logs a step twice or loses one: the files
are first cut back to the checkpoint's step (the records after it are written again by the
resumed run, with the same values), and TensorBoard is told to purge the events after it
(``SummaryWriter(purge_step=...)``). A fresh run in a used run directory starts the files anew.
An object of yours gets the records from the checkpoint's step on: steps that an earlier
session logged after that step come again (with equal values), for its backend to replace.

Example::

    loggers = open_loggers(["csv", "jsonl", my_logger], Path("runs/lm"), start_step=0)
    log_all(loggers, {"epoch": 0.5, "loss": 2.31, "lr": 3e-4}, step=10)
    flush_all(loggers)
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tandem._optional import require
from tandem.files import write_atomic

CSV_FILE = "steps.csv"
JSONL_FILE = "steps.jsonl"
TENSORBOARD_DIR = "tensorboard"
NAMES = ("csv", "jsonl", "tensorboard")
DEFAULT = ("csv", "jsonl")


class MetricsLogger(Protocol):
    """What the Trainer logs to: ``log_metrics(metrics, step)``, called on rank 0 only.

    ``metrics`` maps names to numbers (``epoch``, ``loss``, ``lr``, ``eval_loss``, ...);
    ``step`` is the optimizer step. ``flush()``, if the object has one, is called when
    ``train()`` returns.

    Example::

        class PrintLogger:
            def log_metrics(self, metrics: dict, step: int) -> None:
                print(step, metrics)
    """

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None: ...


LoggerArg = str | MetricsLogger


def check_loggers(loggers: Sequence[LoggerArg] | None) -> list[LoggerArg]:
    """The ``loggers`` argument checked (on every rank); None is the default, csv and jsonl.

    Raises:
        ValueError: an unknown name, an object without ``log_metrics``, or not a list.
        ImportError: ``"tensorboard"`` without tensorboard installed (names the extra).

    Example::

        >>> check_loggers(None)
        ['csv', 'jsonl']
    """
    if loggers is None:
        return list(DEFAULT)
    if isinstance(loggers, (str, bytes)) or not isinstance(loggers, Sequence):
        raise ValueError(
            f"loggers must be a list of names and objects, e.g. ['csv', 'tensorboard'], got "
            f"{loggers!r}"
        )
    for item in loggers:
        if isinstance(item, str):
            if item not in NAMES:
                listed = ", ".join(repr(n) for n in NAMES)
                raise ValueError(
                    f"unknown logger {item!r}: the names are {listed}; or pass an object with "
                    "log_metrics(metrics: dict, step: int)"
                )
        elif not callable(getattr(item, "log_metrics", None)):
            raise ValueError(
                f"logger {item!r} ({type(item).__name__}) has no log_metrics(metrics, step) "
                f"method; the names are {', '.join(repr(n) for n in NAMES)}"
            )
    if "tensorboard" in loggers:
        require("tensorboard", extra="tensorboard")  # every rank: the same error everywhere
    return list(loggers)


def open_loggers(
    loggers: Sequence[LoggerArg], run_dir: Path, *, start_step: int
) -> list[MetricsLogger]:
    """The loggers of a run going on from ``start_step`` (0: a fresh run), on rank 0.

    Files of the run directory keep their records up to ``start_step`` only (see the module
    doc). Objects are taken as they are.

    Raises:
        ImportError: ``"tensorboard"`` without tensorboard (``pip install "tandem[tensorboard]"``).
    """
    opened: list[MetricsLogger] = []
    for item in loggers:
        if item == "csv":
            opened.append(CsvLogger(run_dir / CSV_FILE, start_step=start_step))
        elif item == "jsonl":
            opened.append(JsonlLogger(run_dir / JSONL_FILE, start_step=start_step))
        elif item == "tensorboard":
            opened.append(TensorBoardLogger(run_dir / TENSORBOARD_DIR, start_step=start_step))
        else:
            assert not isinstance(item, str), "check_loggers refuses unknown names"
            opened.append(item)
    return opened


def log_all(loggers: Sequence[MetricsLogger], metrics: dict[str, Any], step: int) -> None:
    """``metrics`` of optimizer step ``step`` to every logger; entries that are None left out."""
    present = {k: v for k, v in metrics.items() if v is not None}
    for logger in loggers:
        logger.log_metrics(present, step)


def flush_all(loggers: Sequence[MetricsLogger]) -> None:
    """Flush the loggers that can be (``train()`` returns: nothing may wait in a buffer)."""
    for logger in loggers:
        flush = getattr(logger, "flush", None)
        if callable(flush):
            flush()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a ``steps.jsonl`` (none if it does not exist).

    Example::

        losses = [(r["step"], r["loss"]) for r in read_jsonl(run_dir / "steps.jsonl")
                  if "loss" in r]
    """
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


class JsonlLogger:
    """``{"step": step, **metrics}`` per line, appended and flushed at once.

    Args:
        path: the file (created).
        start_step: records after this step are dropped first (a resumed run writes them
            again); 0 empties the file.
    """

    def __init__(self, path: Path, *, start_step: int) -> None:
        self.path = path
        kept = [r for r in read_jsonl(path) if r["step"] <= start_step]
        # Whole or absent, as the metrics file: a dashboard tailing it never sees half of it.
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode())

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


class CsvLogger:
    """A row per logged step under a header of every metric seen so far (``step`` first).

    A record with a metric the header lacks rewrites the file once with the wider header, the
    earlier rows' new cells empty; other records are appended.

    Args:
        path: the file (created).
        start_step: rows after this step are dropped first; 0 empties the file.
    """

    def __init__(self, path: Path, *, start_step: int) -> None:
        self.path = path
        self.columns: list[str] = ["step"]
        rows: list[dict[str, str]] = []
        if path.exists():
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or ["step"])
                rows = [r for r in reader if int(r["step"]) <= start_step]
        self._rewrite(rows)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, **metrics}
        new = [k for k in row if k not in self.columns]
        if new:
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
            self.columns += new
            self._rewrite(rows)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(row)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, self.columns)
        writer.writeheader()
        writer.writerows(rows)
        write_atomic(self.path, text.getvalue().encode())


class TensorBoardLogger:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter``, one tag per metric.

    Args:
        log_dir: the event files' directory (``tensorboard --logdir`` it).
        start_step: events after this step, from earlier sessions, are purged (TensorBoard
            hides them): a resumed run writes them again.
    """

    def __init__(self, log_dir: Path, *, start_step: int) -> None:
        require("tensorboard", extra="tensorboard")  # torch's module needs it
        writer_cls = require("torch.utils.tensorboard", extra="tensorboard").SummaryWriter
        # purge_step: TensorBoard drops every event at this step or later from the files it
        # read before this writer's (a START event at purge_step marks the restart).
        self.writer = writer_cls(log_dir=str(log_dir), purge_step=start_step + 1)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()
