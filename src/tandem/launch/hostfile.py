"""``tandem run --hostfile``: one ``tandem run`` per host of a host file, started over ``ssh``.

This module reads the host file and decides what every host runs; starting, relaying and
stopping the hosts is :mod:`tandem.launch.ssh_launcher`'s, the far end
:mod:`tandem.launch.ssh_agent`'s.

The host file is DeepSpeed's: one ``hostname slots=N`` per line, ``#`` comments, blank lines.
Node ranks follow the file's order; node 0's address is the first host's name, as the file
spells it (every host must resolve it); every host runs ``slots`` workers, the same number on
each (or ``--nproc-per-node`` when given). Each host's command is ``tandem run --nnodes N
--node-rank i --master-addr HOST0 --master-port P`` (29500 unless given), every other flag of
this command line as given, and the script; it runs in the same directory, with the same
Python, and with these variables: ``TANDEM_JOB_SECRET`` (one made for the job when unset, so
node 0's store keys are scoped to it), ``PYTHONPATH``, and the names ``TANDEM_SSH_ENV`` lists.

Example::

    tandem run --hostfile hosts.txt --master-port 29600 train.py --lr 0.1
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tandem.job.secret import SECRET_VARIABLE
from tandem.launch.rendezvous import LaunchError

#: Comma-separated names of further variables to pass to every host (``NCCL_DEBUG,WANDB_MODE``).
FORWARD_VARIABLE = "TANDEM_SSH_ENV"
DEFAULT_PORT = 29500
# The flags --hostfile sets for each host itself; given by the user, they are an error.
_PLACEMENT = ("nnodes", "node_rank", "master_addr", "rdzv_endpoint", "standalone")
_NOT_FORWARDED = {"help", "hostfile", "nproc_per_node", "master_port", *_PLACEMENT}
_LINE = re.compile(r"^(\S+)\s+slots\s*=\s*(\S+)$")


@dataclass(frozen=True)
class Host:
    """One line of a host file: the host's name, its worker count, where it was written."""

    name: str
    slots: int
    line: int


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """The hosts of a host file's ``text``, in order; ``LaunchError`` names a bad line.

    Example::

        >>> parse_hostfile("# two nodes\\nnode1 slots=4\\n\\nnode2 slots=4  # spare\\n")
        [Host(name='node1', slots=4, line=2), Host(name='node2', slots=4, line=4)]
    """
    hosts: dict[str, Host] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise LaunchError(
                f"{source}, line {number}: {raw.strip()!r} is not `hostname slots=N` "
                "(e.g. `node1 slots=4`; `#` starts a comment)"
            )
        name, slots = match.groups()
        if not slots.isdigit() or int(slots) <= 0:
            raise LaunchError(
                f"{source}, line {number}: slots={slots} for host {name!r} must be a whole "
                "number >= 1 (the workers to start there)"
            )
        if name in hosts:
            raise LaunchError(
                f"{source}, line {number}: host {name!r} is listed again (first on line "
                f"{hosts[name].line}); list each host once, with all its slots"
            )
        hosts[name] = Host(name, int(slots), number)
    if not hosts:
        raise LaunchError(f"{source} lists no host: write one `hostname slots=N` per line")
    return list(hosts.values())


def read_hostfile(path: Path) -> list[Host]:
    """:func:`parse_hostfile` of the file at ``path``; a missing file is a ``LaunchError``.

    Example::

        hosts = read_hostfile(Path("hosts.txt"))
    """
    try:
        text = path.read_text()
    except OSError as error:
        raise LaunchError(f"--hostfile {str(path)!r} cannot be read: {error.strerror}") from None
    return parse_hostfile(text, source=f"host file {str(path)!r}")


def workers_per_host(hosts: list[Host], nproc_per_node: str) -> int:
    """Every host's worker count: ``--nproc-per-node`` when it is not torchrun's default 1,
    else the slots, which must then be the same on every host (tandem's ranks assume it).

    Example::

        >>> workers_per_host([Host("a", 2, 1), Host("b", 2, 2)], "1")
        2
        >>> workers_per_host([Host("a", 2, 1), Host("b", 4, 2)], "3")
        3
    """
    if str(nproc_per_node) != "1":
        try:
            given = int(nproc_per_node)
        except ValueError:
            raise LaunchError(
                f"--nproc-per-node {nproc_per_node!r} with --hostfile must be a number (or "
                "left out: the hosts' slots)"
            ) from None
        if given < 1:
            raise LaunchError(f"--nproc-per-node {given} must be >= 1")
        return given
    slots = {host.slots for host in hosts}
    if len(slots) > 1:
        listed = ", ".join(f"{h.name} slots={h.slots}" for h in hosts)
        raise LaunchError(
            f"the hosts' slots differ ({listed}): every node runs the same number of workers; "
            "make them equal, or give --nproc-per-node N to run N on every host"
        )
    return slots.pop()


def forwarded_flags(args: argparse.Namespace, actions: Iterable[argparse.Action]) -> list[str]:
    """``tandem run``'s options in ``args``, as a command line every host's launcher parses the
    same way: each value explicit (a host has none of this shell's ``PET_*`` defaults), but the
    placement, which :class:`HostfileLauncher` gives per host.

    Example::

        flags = forwarded_flags(args, run_parser._actions)   # ['--max-restarts=0', ...]
    """
    flags = []
    for action in actions:
        if not action.option_strings or action.dest in _NOT_FORWARDED:
            continue
        value = getattr(args, action.dest, None)
        name = action.option_strings[-1]
        if action.nargs == 0:  # a switch
            if value:
                flags.append(name)
        elif isinstance(value, list):  # a repeated option
            flags.extend(f"{name}={item}" for item in value)
        elif value is not None:  # "=": a value starting with "-" is not read as an option
            flags.append(f"{name}={value}")
    return flags


def check_placement(args: argparse.Namespace) -> None:
    """``LaunchError`` for a flag that ``--hostfile`` sets itself, naming it."""
    for dest in _PLACEMENT:
        if getattr(args, dest, None) not in (None, "", False):
            name = "--" + dest.replace("_", "-")
            raise LaunchError(
                f"{name} {getattr(args, dest)!r} with --hostfile: the host file sets the nodes "
                "(its order is the node ranks, its first host is node 0); leave it out"
            )
    if args.rdzv_backend != "static":
        raise LaunchError(
            f"--rdzv-backend {args.rdzv_backend!r} with --hostfile: hosts of a host file meet "
            "by the static rendezvous at the first host; leave it out"
        )


def forwarded_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables every host's launcher gets: the job's secret (made here when unset),
    ``PYTHONPATH`` and the names ``TANDEM_SSH_ENV`` lists, where set.

    Example::

        >>> sorted(forwarded_env({"PYTHONPATH": "/src", "TANDEM_JOB_SECRET": "s"}).items())
        [('PYTHONPATH', '/src'), ('TANDEM_JOB_SECRET', 's')]
    """
    names = ["PYTHONPATH", *filter(None, environ.get(FORWARD_VARIABLE, "").split(","))]
    env = {name.strip(): environ[name.strip()] for name in names if name.strip() in environ}
    env[SECRET_VARIABLE] = environ.get(SECRET_VARIABLE) or secrets.token_hex(16)
    return env
