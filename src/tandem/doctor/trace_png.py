"""A Chrome trace drawn as a PNG: a row per rank and thread, spans coloured by category.

What ``docs/trace.png`` is made with; for the trace itself see :mod:`tandem.doctor.trace`.
Needs matplotlib (``pip install "tandem[plots]"``).

Example::

    from tandem.doctor import trace_png

    trace_png.render("traces/trace.json", "trace.png", start_ms=500, end_ms=800)
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem._optional import require
from tandem.doctor.trace import COLLECTIVE_TID

# Colours of the categories in render(): one hue per kind of work.
COLOURS = {
    "forward": "#4c78a8",
    "backward": "#f58518",
    "reduce": "#e45756",
    "wait": "#bab0ac",
    "all_gather": "#72b7b2",
    "collective": "#54a24b",
    "optimizer": "#b279a2",
    "data": "#eeca3b",
    "checkpoint": "#9d755d",
    "other": "#d0d0d0",
}


def render(
    trace_file: str | Path,
    png: str | Path,
    *,
    start_ms: float | None = None,
    end_ms: float | None = None,
    title: str | None = None,
) -> Path:
    """Draw a trace (merged or one rank's) as a PNG: a row per rank and thread, nested spans
    stacked, coloured by category. ``start_ms``/``end_ms`` pick a window. Needs matplotlib.

    Example::

        trace_png.render("traces/trace.json", "trace.png", start_ms=500, end_ms=800)
    """
    figure_module = require("matplotlib.figure", extra="plots")
    patches = require("matplotlib.patches", extra="plots")
    document = json.loads(Path(trace_file).read_text())
    all_events = document["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in all_events
             if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    # A track per thread, and one for a rank's collectives (its lanes drawn as thin sub-rows).
    by_track: dict[tuple[int, int], list[tuple[float, float, str, int]]] = {}
    lo = start_ms * 1e3 if start_ms is not None else float("-inf")
    hi = end_ms * 1e3 if end_ms is not None else float("inf")
    for e in all_events:
        if e["ph"] == "X" and e["ts"] + e["dur"] >= lo and e["ts"] <= hi:
            tid, lane = e["tid"], 0
            if tid >= COLLECTIVE_TID:
                tid, lane = COLLECTIVE_TID, tid - COLLECTIVE_TID
            by_track.setdefault((e["pid"], tid), []).append(
                (e["ts"] / 1e3, e["dur"] / 1e3, e.get("cat", "other"), lane)
            )
    if not by_track:
        raise ValueError(f"{trace_file} has no complete events between {start_ms} and {end_ms} ms")
    bars: dict[str, tuple[list[float], list[float], list[float]]] = {}  # category: y, left, width
    heights: dict[str, list[float]] = {}
    ticks, labels, y, last_pid = [], [], 0.0, None
    for pid, tid in sorted(by_track):
        if last_pid is not None and pid != last_pid:
            y += 0.5  # a gap between ranks
        last_pid = pid
        track = sorted(by_track[(pid, tid)], key=lambda s: (s[0], -s[1]))  # outer spans first
        if tid == COLLECTIVE_TID:
            placed, pitch = [(b, d, c, lane) for b, d, c, lane in track], 0.2
        else:
            placed, pitch = _stack([(b, d, c) for b, d, c, _ in track]), 0.5
        for begin, duration, cat, depth in placed:
            ys, lefts, widths = bars.setdefault(cat, ([], [], []))
            ys.append(y + (depth + 0.5) * pitch)
            lefts.append(begin)
            widths.append(duration)
            heights.setdefault(cat, []).append(pitch * 0.9)
        rows = 1 + max(depth for *_, depth in placed)
        ticks.append(y + min(rows * pitch, 0.5) / 2)
        # One row holds the collectives of every group (each group's lanes its sub-rows).
        label = "collectives" if tid == COLLECTIVE_TID else names.get((pid, tid), tid)
        labels.append(f"rank {pid} · {label}")
        y += max(rows * pitch, 0.5) + 0.25
    figure = figure_module.Figure(figsize=(12, 1.2 + 0.45 * y), layout="constrained")
    ax = figure.add_subplot()
    shown = [c for c in COLOURS if c in bars] + sorted(set(bars) - set(COLOURS))
    for cat in shown:
        ys, lefts, widths = bars[cat]
        colour = COLOURS.get(cat, COLOURS["other"])
        ax.barh(ys, widths, left=lefts, height=heights[cat], color=colour, edgecolor="none")
    ax.set_yticks(ticks, labels)
    ax.set_ylim(y, -0.25)  # the first track on top
    if start_ms is not None or end_ms is not None:
        ax.set_xlim(start_ms, end_ms)
    ax.set_xlabel("ms")
    ax.grid(axis="x", alpha=0.3)
    handles = [patches.Patch(color=COLOURS.get(c, COLOURS["other"]), label=c) for c in shown]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18),
              ncols=len(handles), frameon=False)  # fmt: skip
    if title:
        ax.set_title(title)
    out = Path(png)
    figure.savefig(out, format="png", dpi=110)
    return out


def _stack(ordered: list[tuple[float, float, str]]) -> list[tuple[float, float, str, int]]:
    """Each span of a track (sorted by start) with its nesting depth."""
    ends: list[float] = []
    placed = []
    for begin, duration, cat in ordered:
        while ends and ends[-1] <= begin:
            ends.pop()
        placed.append((begin, duration, cat, len(ends)))
        ends.append(begin + duration)
    return placed
