"""Where each worker's stdout and stderr go: the console, a log file in torchrun's layout, both.

torchrun's layout (``torch.distributed.elastic.multiprocessing.api.DefaultLogsSpecs``)::

    LOG_DIR/<rdzv-id>_<random>/attempt_<restart>/<local rank>/stdout.log
                                                              stderr.log

The run's directory is made once per launch (``mkdtemp``, so two runs with the same id never
share one) and each attempt's directory is made fresh. Which streams are written follows
torchrun's ``--redirects`` (file only) and ``--tee`` (file and console) bits per local rank;
with neither, tandem writes both streams of every rank once a log directory is given (torchrun
would write only ``error.json`` then: a log directory that stays empty surprises people).
``--local-ranks-filter`` takes ranks off the console only, never out of the files (the
supervisor's ``show_ranks``). ``--duplicate-stdout-filters``/``--duplicate-stderr-filters``
copy the console's lines of that stream that contain any of the filters (as shown, with their
``[rank N]`` prefix) to ``attempt_<restart>/filtered_stdout.log``/``filtered_stderr.log``, as
torchrun does for the streams it tees (:class:`FilteredLog`).

Example::

    logs = LogPlan(Path("logs"), run_id="456", redirects={0: 0, 1: 3}, tee={0: 0, 1: 0})
    logs.begin(attempt=0)
    logs.stream(local_rank=1, name="stdout")   # (Path('logs/456_x1y2/attempt_0/1'), False)
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tandem.launch.torchrun_flags import STD_ERR, STD_OUT

_BITS = {"stdout": STD_OUT, "stderr": STD_ERR}


def parse_filters(text: str) -> list[str]:
    """torchrun's comma-separated filter list: ``,,`` stands for a comma; empty: no filter.

    Example::

        >>> parse_filters("loss,,acc,NaN")
        ['loss,acc', 'NaN']
        >>> parse_filters("")
        []
    """
    if not text:
        return []
    marker = "\0"
    return [item.replace(marker, ",") for item in text.replace(",,", marker).split(",")]


class FilteredLog:
    """One attempt's ``filtered_<stream>.log``: the lines that contain any of ``needles``.

    Every rank's relay thread writes to it: one lock keeps lines whole.

    Example::

        log = FilteredLog(Path("attempt_0/filtered_stdout.log"), ["loss"])
        log.offer("[rank 1] step 10 loss 0.25")     # written
        log.offer("[rank 1] step 10 lr 0.1")        # not
        log.close()
    """

    def __init__(self, path: Path, needles: list[str]) -> None:
        self.path, self.needles = path, needles
        self._file: IO[str] = open(path, "w", errors="replace", buffering=1)  # noqa: SIM115
        self._lock = threading.Lock()

    def offer(self, line: str) -> None:
        """Write ``line`` (a newline added) if it contains any needle."""
        if any(needle in line for needle in self.needles):
            with self._lock:
                if not self._file.closed:
                    self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class LogPlan:
    """The log-file decisions of one launch.

    Args:
        root: LOG_DIR (made if missing), or None: no files, or a temporary ``torchelastic_*``
            directory when --redirects/--tee ask for files (as torchrun does).
        run_id: the rendezvous id, the run directory's prefix.
        redirects: local rank -> stream bits written to the file and not shown.
        tee: local rank -> stream bits written to the file and shown.
        duplicate_filters: stream name -> the filters of ``--duplicate-<stream>-filters``.
    """

    root: Path | None
    run_id: str
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    duplicate_filters: dict[str, list[str]] = field(default_factory=dict)
    run_dir: Path | None = None
    attempt_dir: Path | None = None
    filtered: dict[str, FilteredLog] = field(default_factory=dict)  # this attempt's

    def __post_init__(self) -> None:
        chosen = any(self.redirects.values()) or any(self.tee.values())
        wanted = chosen or any(self.duplicate_filters.values())
        if self.root is None and wanted:
            self.root = Path(tempfile.mkdtemp(prefix="torchelastic_"))
        if self.root is not None:
            if self.root.is_file():
                raise ValueError(f"--log-dir {self.root} is a file, not a directory")
            self.root.mkdir(parents=True, exist_ok=True)
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"{self.run_id}_", dir=self.root))
        # Neither flag: every stream of every rank is kept, and shown (tandem's default).
        self._all = not chosen

    def begin(self, attempt: int) -> None:
        """Make the attempt's directory, empty (a restart of a resumed run overwrites)."""
        if self.run_dir is None:
            return
        self.close()
        self.attempt_dir = self.run_dir / f"attempt_{attempt}"
        shutil.rmtree(self.attempt_dir, ignore_errors=True)
        self.attempt_dir.mkdir(parents=True)
        for name, needles in self.duplicate_filters.items():
            if needles:
                path = self.attempt_dir / f"filtered_{name}.log"
                self.filtered[name] = FilteredLog(path, needles)

    def close(self) -> None:
        """Close the attempt's filtered logs (the relays have ended)."""
        for log in self.filtered.values():
            log.close()
        self.filtered = {}

    def rank_dir(self, local_rank: int) -> Path | None:
        """The local rank's directory of this attempt (made), or None without log files."""
        if self.attempt_dir is None:
            return None
        path = self.attempt_dir / str(local_rank)
        path.mkdir(exist_ok=True)
        return path

    def stream(self, local_rank: int, name: str) -> tuple[Path | None, bool]:
        """``(directory whose NAME.log gets the stream or None, shown on the console)``."""
        bit = _BITS[name]
        redirected = bool(self.redirects.get(local_rank, 0) & bit)
        teed = bool(self.tee.get(local_rank, 0) & bit)
        filed = self._all or redirected or teed
        shown = teed or not redirected  # as torch: a tee wins over a redirect of the stream
        return (self.rank_dir(local_rank) if filed else None), shown
