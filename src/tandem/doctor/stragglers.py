"""Stragglers: which rank the others wait for, from the step files every rank wrote at exit.

In synchronous data parallelism a step takes as long on every rank as on the slowest one: the
others wait for it in the collectives. So step times alone name nobody. What a rank did itself
in a step, its *work* (the step's time less the time it was blocked in collectives), does: the
straggler has the most work and waits least. The summary lists, per rank, the median step time
and time spent waiting, and names the rank whose median work is more than :data:`THRESHOLD`
above the median over ranks.

Then the bytes each process group was handed per step (:mod:`tandem.doctor.records` defines
them: the sizes of the tensors a rank gives each collective), a line per group: each rank's
median step (the lower median: a step that really happened, exact to the byte), the same on
every rank of the group in data parallelism, so one number; where ranks differ (a broadcast
counts on its source only) the values with their ranks. Rank 0 alone would not do: it is not in
every group.

The step files come from :mod:`tandem.doctor.step_clock`; ``tandem run`` prints :func:`summary` at
the end of every run (its workers write into its report directory).

Example::

    text = stragglers.summary(Path("logs"))    # None when no rank wrote its steps
    if text is not None:
        print(text)
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.doctor import step_clock

#: A rank is named when its median work per step is this much above the median rank's.
THRESHOLD = 0.10


@dataclass(frozen=True)
class RankSteps:
    """One rank's steps: ``(seconds, seconds waited in collectives)`` each, and the bytes it
    handed to collectives per group in each (``handed``, the same steps; empty if unknown)."""

    rank: int
    steps: Sequence[tuple[float, float]]
    handed: Sequence[Mapping[str, int]] = field(default=())

    def median_handed(self, group: str) -> int | None:
        """The lower median over steps of the bytes handed to ``group``; None if it never was.

        Example::

            >>> steps = RankSteps(0, [(0.1, 0.0)] * 3, [{"world": 8}, {"world": 8}, {}])
            >>> steps.median_handed("world"), steps.median_handed("ranks 0,1")
            (8, None)
        """
        if not any(group in step for step in self.handed):
            return None
        return statistics.median_low(step.get(group, 0) for step in self.handed)

    @property
    def median_step(self) -> float:
        return statistics.median(s for s, _ in self.steps)

    @property
    def median_wait(self) -> float:
        return statistics.median(w for _, w in self.steps)

    @property
    def waited(self) -> float:
        """Seconds waited in all over these steps."""
        return sum(w for _, w in self.steps)

    @property
    def median_work(self) -> float:
        """Median over steps of the step's time less its waiting: what the rank did itself."""
        return statistics.median(s - w for s, w in self.steps)


def slowest(ranks: Sequence[RankSteps], threshold: float = THRESHOLD) -> RankSteps | None:
    """The rank with the most work per step, if that is more than ``threshold`` above the
    median rank's; else None (and always None for one rank).

    Example::

        >>> even = RankSteps(0, [(0.1, 0.05)] * 5)
        >>> slow = RankSteps(1, [(0.1, 0.0)] * 5)
        >>> slowest([even, slow]).rank
        1
        >>> print(slowest([even, RankSteps(1, [(0.1, 0.048)] * 5)]))
        None
    """
    measured = [r for r in ranks if r.steps]
    if len(measured) < 2:
        return None
    worst = max(measured, key=lambda r: r.median_work)
    middle = statistics.median(r.median_work for r in measured)
    return worst if worst.median_work > (1 + threshold) * middle and middle > 0 else None


def describe(ranks: Sequence[RankSteps], threshold: float = THRESHOLD) -> str:
    """The summary's text: a line per rank, and the straggler's if there is one.

    Example::

        >>> fast = RankSteps(0, [(0.060, 0.045)] * 40)
        >>> slow = RankSteps(1, [(0.061, 0.001)] * 40)
        >>> print(describe([fast, slow]))
        steps per rank (median step time; of it, median time waiting in collectives):
          rank 0: 40 steps, 60.0 ms; waiting 45.0 ms (1.80 s in all)
          rank 1: 40 steps, 61.0 ms; waiting 1.0 ms (0.04 s in all)
          rank 1 is the slowest: 60.0 ms of work per step, 60% more than the median rank's 37.5 ms
    """
    lines = ["steps per rank (median step time; of it, median time waiting in collectives):"]
    for r in sorted(ranks, key=lambda r: r.rank):
        if not r.steps:
            lines.append(f"  rank {r.rank}: no steps")
            continue
        lines.append(
            f"  rank {r.rank}: {len(r.steps)} steps, {_ms(r.median_step)}; waiting "
            f"{_ms(r.median_wait)} ({r.waited:.2f} s in all)"
        )
    worst = slowest(ranks, threshold)
    if worst is not None:
        middle = statistics.median(r.median_work for r in ranks if r.steps)
        more = worst.median_work / middle - 1
        lines.append(
            f"  rank {worst.rank} is the slowest: {_ms(worst.median_work)} of work per step, "
            f"{more:.0%} more than the median rank's {_ms(middle)}"
        )
    lines += handed_lines(ranks)
    return "\n".join(lines)


def handed_lines(ranks: Sequence[RankSteps]) -> list[str]:
    """The summary's lines on bytes handed to collectives per step, a line per group (none if
    no rank handed any): each rank's median step, one number where the group's ranks agree.

    Example::

        >>> even = [{"world": 1_180_160, "ranks 0,1": 64}] * 3
        >>> ranks = [RankSteps(0, [(0.1, 0.0)] * 3, even), RankSteps(1, [(0.1, 0.0)] * 3, even),
        ...          RankSteps(2, [(0.1, 0.0)] * 3, [{"world": 4}] * 3)]
        >>> print("\\n".join(handed_lines(ranks)))
        bytes handed to collectives per step, per group (median step of each rank):
          world: 1,180,160 B (1.18 MB) on ranks 0,1; 4 B on rank 2
          ranks 0,1: 64 B on each of its ranks
    """
    groups: dict[str, None] = {}  # in the order they first appear
    for r in sorted(ranks, key=lambda r: r.rank):
        for step in r.handed:
            groups.update(dict.fromkeys(step))
    if not groups:
        return []
    lines = ["bytes handed to collectives per step, per group (median step of each rank):"]
    for group in sorted(groups, key=lambda g: (g != "world", _group_order(g))):
        by_value: dict[int, list[int]] = {}
        for r in sorted(ranks, key=lambda r: r.rank):
            median = r.median_handed(group)
            if median is not None:
                by_value.setdefault(median, []).append(r.rank)
        if len(by_value) == 1:
            lines.append(f"  {group}: {_bytes(next(iter(by_value)))} on each of its ranks")
            continue
        parts = [
            f"{_bytes(n)} on rank{'s' if len(who) > 1 else ''} {','.join(map(str, who))}"
            for n, who in sorted(by_value.items(), key=lambda item: -item[0])
        ]
        lines.append(f"  {group}: {'; '.join(parts)}")
    return lines


def read(directory: Path, run_id: str | None = None) -> list[RankSteps]:
    """The step files in ``directory`` (of run ``run_id``, if given), newest attempt only."""
    found: list[dict] = []
    for path in sorted(directory.glob(step_clock.file_name(run_id, "*"))):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    if not found:
        return []
    latest = max(int(d.get("attempt", 0)) for d in found)
    ranks = {}
    for d in found:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            if int(d.get("attempt", 0)) == latest:
                pairs = [(float(s), float(w)) for s, w in d["steps"]]
                handed = [{str(g): int(n) for g, n in step.items()} for step in d.get("handed", [])]
                if len(handed) != len(pairs):  # a file of an older tandem, or a broken one
                    handed = []
                ranks[int(d["rank"])] = RankSteps(int(d["rank"]), pairs, handed)
    return [ranks[r] for r in sorted(ranks)]


def summary(directory: Path, run_id: str | None = None) -> str | None:
    """:func:`describe` of the step files in ``directory``; None if there are none.

    Example::

        if (text := summary(Path("logs"), run_id="3f2a9c01be77")) is not None:
            print(text)
    """
    ranks = read(directory, run_id)
    return describe(ranks) if ranks else None


def _group_order(name: str) -> tuple[int, str]:
    # Groups by their first rank ("ranks 0,1" before "ranks 2,3"), then by name.
    head = name.removeprefix("ranks ").split(",")[0].split(" ")[0]
    return (int(head) if head.isdigit() else 1 << 30, name)


def _bytes(n: int) -> str:
    """Exact, and readable where it is large: ``1,180,160 B (1.18 MB)``, ``64 B``."""
    if n < 1000:
        return f"{n} B"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n:,} B ({n / size:.2f} {unit})"
    raise AssertionError(n)  # unreachable: n >= 1000 above


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"
