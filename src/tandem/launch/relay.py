"""Relaying a worker's output to the launcher's console: prefixed lines, and a live bar.

Each worker's stdout and stderr are pipes to the launcher, read by one thread each, and passed
on line by line, prefixed ``[rank N]`` (kept in the rank's log file, the end of stderr kept for
the failure report).

A progress bar is not lines: it redraws one line with carriage returns. When the launcher's
own stderr is a terminal it says so to its workers (``TANDEM_CONSOLE_TTY=1``, and the columns
left after the prefix in ``TANDEM_CONSOLE_COLUMNS``: a pipe has no width to ask), so that rank
0 draws its bar (:mod:`tandem.train.progress`), and it relays rank 0's stderr in chunks as they
come instead of waiting for a newline: the text after a carriage return is the bar's new state,
shown at once as ``[rank 0] <bar>`` on the terminal's last line (:class:`Console`). Every
worker's lines, rank 0's too, are then printed above the bar, which is redrawn below them, so
lines and bar never tear each other, whichever relay thread writes first. Without a terminal
(CI, SLURM's files, ``| tee``) nothing changes: lines, as before, and no bar is drawn.
"""

from __future__ import annotations

import codecs
import os
import re
import sys
import threading
from collections import deque
from pathlib import Path
from typing import IO

from tandem.launch.logfiles import FilteredLog

CONSOLE_TTY = "TANDEM_CONSOLE_TTY"
CONSOLE_COLUMNS = "TANDEM_CONSOLE_COLUMNS"
_CLEAR = "\r\x1b[K"  # to the line's start, and erase it (ANSI "erase in line")
_BREAKS = re.compile(r"(\r\n|\r|\n)")


class Console:
    """The launcher's terminal while rank 0 draws a bar: the bar on the last line, lines above.

    Args:
        terminal: the launcher's stderr (a terminal), where the bar is drawn.

    Example::

        console = Console(sys.stderr)
        console.show("[rank 0] epoch 1/3:  40%|####      | 8/20 steps")
        console.line(sys.stdout, "[rank 1] a line")     # printed above the bar
    """

    def __init__(self, terminal: IO[str]) -> None:
        self.terminal = terminal
        self.status = ""
        self._lock = threading.Lock()

    def show(self, status: str) -> None:
        """Make ``status`` the bar's line ("" takes it away)."""
        with self._lock:
            self.status = status
            self.terminal.write(_CLEAR + status)
            self.terminal.flush()

    def line(self, out: IO[str], text: str) -> None:
        """Write ``text`` and a newline to ``out``; above the bar when ``out`` is a terminal."""
        with self._lock:
            above = bool(self.status) and out.isatty()
            if above:
                self.terminal.write(_CLEAR)
                self.terminal.flush()
            out.write(text + "\n")
            out.flush()
            if above:
                self.terminal.write(self.status)
                self.terminal.flush()


def console_env(prefix_width: int) -> tuple[Console | None, dict[str, str]]:
    """The launcher's console and the variables that tell workers about it.

    A Console and ``{TANDEM_CONSOLE_TTY: "1", TANDEM_CONSOLE_COLUMNS: width}`` when stderr is a
    terminal (the width is what the ``prefix_width`` characters of ``[rank 0] `` leave), else
    ``(None, {})``.

    Example::

        console, extra = console_env(len("[rank 0] "))
    """
    if not sys.stderr.isatty():
        return None, {}
    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        columns = 80
    # One column short: a bar that fills the last column makes some terminals wrap.
    width = max(columns - prefix_width - 1, 20)
    return Console(sys.stderr), {CONSOLE_TTY: "1", CONSOLE_COLUMNS: str(width)}


class _Sink:
    """Where one stream's complete lines go: the tail, the log file, the console."""

    def __init__(
        self,
        out: IO[str],
        prefix: str | None,
        log: IO[str] | None,
        tail: deque[str] | None,
        console: Console | None,
        duplicate: FilteredLog | None = None,
    ) -> None:
        self.out, self.prefix, self.log, self.tail, self.console = out, prefix, log, tail, console
        self.echo = prefix is not None
        self.duplicate = duplicate if prefix is not None else None  # the console's lines only

    def line(self, line: str) -> None:
        if self.tail is not None:
            self.tail.append(line)
        if self.log is not None:
            self.log.write(line + "\n")
            self.log.flush()
        if self.duplicate is not None:
            self.duplicate.offer(f"{self.prefix}{line}")
        if self.echo:
            try:
                if self.console is not None:
                    self.console.line(self.out, f"{self.prefix}{line}")
                else:
                    self.out.write(f"{self.prefix}{line}\n")
                    self.out.flush()
            except (OSError, ValueError):
                # Our own output is gone (a closed pipe): keep draining the worker's, or it
                # blocks on a full pipe and the job hangs.
                self.echo = False

    def show(self, status: str) -> None:
        if self.echo and self.console is not None:
            try:
                self.console.show(f"{self.prefix}{status}" if status else "")
            except (OSError, ValueError):
                self.echo = False


def relay(
    pipe: IO[bytes] | None,
    out: IO[str],
    prefix: str | None,
    log_dir: Path | None,
    name: str,
    tail: deque[str] | None,
    console: Console | None = None,
    live: bool = False,
    duplicate: FilteredLog | None = None,
) -> threading.Thread:
    """Start the thread passing ``pipe`` (a worker's ``name`` stream) to ``out``.

    Args:
        pipe: the worker's stream.
        out: the launcher's stream it goes to.
        prefix: each line's prefix (``"[rank 3] "``); None: not echoed (logged and kept only).
        log_dir: where ``NAME.log`` gets every line, or None.
        name: ``"stdout"`` or ``"stderr"``.
        tail: keeps the last lines, for the failure report.
        console: the launcher's terminal while a bar is drawn (see the module doc).
        live: relay in chunks as they come, carriage returns redrawing the bar (rank 0's
            stderr, with a console).
        duplicate: offered every line shown on the console, prefixed (torchrun's
            ``--duplicate-*-filters`` file).

    Example::

        thread = relay(proc.stderr, sys.stderr, "[rank 0] ", None, "stderr", deque(maxlen=30))
    """

    def pump() -> None:
        assert pipe is not None
        log = open(log_dir / f"{name}.log", "w") if log_dir is not None else None  # noqa: SIM115
        sink = _Sink(out, prefix, log, tail, console, duplicate)
        try:
            if live and console is not None:
                _pump_chunks(pipe, sink)
            else:
                for raw in iter(pipe.readline, b""):
                    sink.line(raw.decode("utf-8", errors="replace").rstrip("\n"))
        finally:
            if log is not None:
                log.close()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _pump_chunks(pipe: IO[bytes], sink: _Sink) -> None:
    """Lines to ``sink.line``; what follows a carriage return to ``sink.show`` at once."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    current, live, shown = "", False, ""
    fd = pipe.fileno()
    while True:
        chunk = os.read(fd, 1 << 16)
        for piece in _BREAKS.split(decoder.decode(chunk, final=not chunk)):
            if piece in ("\n", "\r\n"):
                if live and shown:  # a bar that ends with a newline stays, as a line
                    sink.show(shown := "")
                sink.line(current)
                current, live = "", False
            elif piece == "\r":
                current, live = "", True  # the line starts over: a bar's redraw
            else:
                current += piece
        status = current.rstrip() if live else ""
        if live and status != shown:
            sink.show(shown := status)
        if not chunk:
            break
    if current and not live:
        sink.line(current)
    if shown:
        sink.show("")
