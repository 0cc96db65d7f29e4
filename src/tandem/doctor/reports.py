"""What the doctor tells, built from every rank's answer: pure text and data, no communication.

An answer is one rank's state as ``hang.Reporter.state()`` gives it (its newest collective per
group, its open ones, what its main thread is blocked in, its line and stacks). From them:

- :func:`hang_report`: a rank blocked in a collective, and which ranks never arrived;
- :func:`mismatched`: every rank's side of a collective that differs across ranks, if it does;
- :func:`deadlock_report`: no rank has issued a collective for a while, and where each one is.
"""

from __future__ import annotations

import time
from typing import Any

from tandem.doctor import mismatch

ANSWER_WITHIN_S = 5.0


def hang_report(
    rank: int,
    stuck: dict[str, Any],
    answers: dict[int, dict[str, Any]],
    world: int,
    within_s: float = ANSWER_WITHIN_S,
) -> dict[str, Any]:
    """The report of ``rank``, blocked in ``stuck`` (a record's ``as_dict()``), from every
    rank's answer (asked for ``within_s`` seconds): laggards first. ``laggard_ranks``: the
    ranks that never entered it or exited before it."""
    waited = time.time() - stuck["start"]
    lines = [
        f"tandem: rank {rank} has waited {waited:.0f} s in {_describe(stuck)} of {stuck['group']}"
    ]
    laggards, waiting, silent, differ = [], [], [], []
    late: list[int] = []
    for r in range(world):
        answer = answers.get(r)
        if r == rank:
            continue
        if answer is None:
            silent.append(r)
            continue
        theirs = at(answer, stuck["group"], stuck["seq"])
        newest = answer["newest"].get(stuck["group"])
        if answer.get("exited") and theirs is None:
            late.append(r)
            laggards.append(f"  rank {r} exited before {stuck['op']} #{stuck['seq']}")
        elif theirs is None and (newest is None or newest["seq"] < stuck["seq"]):
            late.append(r)
            had = f"{_describe(newest)}" if newest is not None else "none in this group"
            laggards.append(
                f"  rank {r} never entered {stuck['op']} #{stuck['seq']}: its newest is {had}; "
                f"it is at {answer['where']}"
            )
        elif theirs is not None and mismatch.fingerprint(theirs) != mismatch.fingerprint(stuck):
            differ.append(
                f"  rank {r} issued {_side(theirs)} where rank {rank} issued {_side(stuck)}: "
                "the ranks' collectives differ"
            )
        elif answer["blocked"] is not None:
            waiting.append(f"  rank {r} waits in {_describe(answer['blocked'])} too")
        else:
            waiting.append(f"  rank {r} has passed it; it is at {answer['where']}")
    lines += differ
    lines += laggards
    lines += [f"  rank {r} did not answer within {within_s:g} s" for r in silent]
    lines += waiting
    if laggards:
        lines.append(
            "The laggards' stacks follow; the job goes on until the collective's timeout stops it."
        )
    for r in range(world):
        answer = answers.get(r)
        if answer is not None and any(f"rank {r} never" in line for line in laggards):
            lines += _stacks(r, answer)
    return {
        "rank": rank,
        "waited_s": waited,
        "collective": stuck,
        "laggards": [line.strip() for line in laggards],
        "laggard_ranks": late,
        "mismatched": [line.strip() for line in differ],
        "silent": silent,
        "ranks": answers,
        "text": "\n".join(lines),
    }


def mismatched(
    mine: dict[str, Any], answers: dict[int, dict[str, Any]]
) -> dict[int, dict[str, Any]] | None:
    """Every rank's collective at ``mine``'s group and number, if they differ (None if not)."""
    sides = {}
    for r, answer in answers.items():
        theirs = at(answer, mine["group"], mine["seq"])
        if theirs is not None:
            sides[r] = theirs
    if len({mismatch.fingerprint(d) for d in [mine, *sides.values()]}) > 1:
        return sides
    return None


def at(answer: dict[str, Any], group: str, seq: int) -> dict[str, Any] | None:
    """A rank's collective ``seq`` of ``group``, if its answer holds it (newest or open)."""
    for record in [answer["newest"].get(group), *answer.get("open", ())]:
        if record is not None and record["group"] == group and record["seq"] == seq:
            return record
    return None


def deadlock_report(answers: dict[int, dict[str, Any]], world: int) -> dict[str, Any]:
    """No rank is in a collective, and none has issued one for a while: where each one is."""
    quiet = min(answers[r]["quiet_s"] for r in range(world))
    lines = [
        f"tandem: no rank has issued a collective for {quiet:.0f} s, and none is in one: the "
        "ranks wait on something else (each other, through another channel?) or work long "
        "without communicating"
    ]
    for r in range(world):
        last = answers[r]["last"]
        lines.append(
            f"  rank {r} is at {answers[r]['where']} (its last collective: {_describe(last)} of "
            f"{last['group']}, ended {answers[r]['quiet_s']:.0f} s ago)"
        )
    lines.append("Every rank's stacks follow; the job goes on.")
    for r in range(world):
        lines += _stacks(r, answers[r])
    return {
        "kind": "deadlock",
        "quiet_s": quiet,
        "where": {r: answers[r]["where"] for r in range(world)},
        "ranks": answers,
        "text": "\n".join(lines),
    }


def _stacks(rank: int, answer: dict[str, Any]) -> list[str]:
    return [
        f"--- rank {rank} thread {name}:\n{stack.rstrip()}"
        for name, stack in answer["stacks"].items()
    ]


def _describe(record: dict[str, Any]) -> str:
    where = f" ({record['context']})" if record.get("context") else ""
    return f"{record['op']} #{record['seq']}{where}"


def _side(record: dict[str, Any]) -> str:
    return mismatch.side(record).replace(" of ", f" #{record['seq']} of ", 1)
