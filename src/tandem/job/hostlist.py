"""SLURM hostlists: ``gpu[01-04,07],cpu3`` -> ``gpu01 gpu02 gpu03 gpu04 gpu07 cpu3``.

SLURM hands every task the job's nodes in this compressed form (SLURM_JOB_NODELIST); the first
host is where rank 0 runs, so it is the rendezvous address when nothing else names one.
"""

from __future__ import annotations

import itertools
import math
import re

# A typo such as ``node[0-9999999999]`` should fail with a message, not exhaust memory.
MAX_HOSTS = 1_000_000

_NUMBER = re.compile(r"[0-9]+")
_BRACKETS = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist into host names, in order, duplicates kept.

    Hosts are separated by commas outside brackets. A bracket holds numbers and ``lo-hi`` ranges
    separated by commas; a range is zero-padded to the width of ``lo`` as written. Several
    bracket groups in one name expand to every combination, the last group varying fastest.

    Args:
        hostlist: the compressed list, e.g. the value of ``SLURM_JOB_NODELIST``.

    Returns:
        The host names; an empty list for an empty string.

    Raises:
        ValueError: the hostlist is malformed (unbalanced or nested brackets, an empty host or
            bracket item, a non-numeric or descending range), naming the hostlist and the fault.

    Example::

        >>> expand_hostlist("gpu[01-03,07],cpu3")
        ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu3']
        >>> expand_hostlist("rack[1-2]-n[01-02]")
        ['rack1-n01', 'rack1-n02', 'rack2-n01', 'rack2-n02']
    """
    if any(c.isspace() for c in hostlist.strip()):
        raise ValueError(f"hostlist {hostlist!r} contains whitespace; host names cannot")
    hostlist = hostlist.strip()
    if not hostlist:
        return []
    hosts: list[str] = []
    for name in _split_names(hostlist):
        # re.split with one capture group alternates literal text and bracket contents.
        pieces = _BRACKETS.split(name)
        choices = [
            [p] if i % 2 == 0 else _expand_brackets(p, hostlist) for i, p in enumerate(pieces)
        ]
        if len(hosts) + math.prod(len(c) for c in choices) > MAX_HOSTS:
            raise ValueError(f"hostlist {hostlist!r} expands to more than {MAX_HOSTS} hosts")
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _split_names(hostlist: str) -> list[str]:
    """Split at the commas outside brackets, checking the brackets pair up without nesting."""
    names, start, inside = [], 0, False
    for i, c in enumerate(hostlist):
        if c == "[":
            if inside:
                raise ValueError(f"hostlist {hostlist!r} has a nested '[' at position {i}")
            inside = True
        elif c == "]":
            if not inside:
                raise ValueError(f"hostlist {hostlist!r} has an unmatched ']' at position {i}")
            inside = False
        elif c == "," and not inside:
            names.append(hostlist[start:i])
            start = i + 1
    if inside:
        raise ValueError(f"hostlist {hostlist!r} has an unclosed '['")
    names.append(hostlist[start:])
    if "" in names:
        raise ValueError(f"hostlist {hostlist!r} has an empty host name (two commas in a row?)")
    return names


def _expand_brackets(body: str, hostlist: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']``."""
    numbers: list[str] = []
    for item in body.split(","):
        if not item:
            raise ValueError(f"hostlist {hostlist!r} has an empty item in [{body}]")
        lo, dash, hi = item.partition("-")
        if not _NUMBER.fullmatch(lo) or (dash and not _NUMBER.fullmatch(hi)):
            raise ValueError(
                f"hostlist {hostlist!r}: {item!r} in [{body}] is not a number or a lo-hi range"
            )
        if not dash:
            numbers.append(lo)
            continue
        if int(lo) > int(hi):
            raise ValueError(f"hostlist {hostlist!r}: range {item!r} in [{body}] runs backwards")
        if len(numbers) + int(hi) - int(lo) >= MAX_HOSTS:
            raise ValueError(f"hostlist {hostlist!r}: range {item!r} is over {MAX_HOSTS} hosts")
        numbers.extend(f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1))
    return numbers
