"""The values of ``tandem slurm``'s options, checked before they become ``#SBATCH`` lines.

sbatch reports a bad directive only when the job is submitted, and some (a misspelt signal)
not at all: the job then runs without the checkpoint warning. These checks fail at once, naming
the value. Nothing here imports torch.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass

# Slurm's limit for the @ of --signal (sbatch(1): "sig_time must be an integer between 0 and
# 65535").
MAX_SIGNAL_LEAD_S = 65535
# Whole number and an optional unit, as Slurm's --mem takes it (megabytes without a unit; 0
# asks for all of a node's memory).
_MEM = re.compile(r"[0-9]+[KMGT]?", re.IGNORECASE)
_SIGNAL = re.compile(r"(?:B:)?(?P<sig>[A-Za-z0-9]+)@(?P<lead>[0-9]+)")

# Directives the script writes itself, by every spelling sbatch takes, with tandem slurm's
# option for each: given twice, sbatch keeps whichever comes last, silently.
_OWN_DIRECTIVES = {
    "--job-name": "--job-name",
    "-J": "--job-name",
    "--nodes": "--nodes",
    "-N": "--nodes",
    "--ntasks-per-node": "(one task per node is how the script works)",
    "--gpus-per-node": "--gpus-per-node",
    "--cpus-per-task": "--cpus-per-task",
    "-c": "--cpus-per-task",
    "--time": "--time",
    "-t": "--time",
    "--partition": "--partition",
    "-p": "--partition",
    "--output": "--output",
    "-o": "--output",
    "--open-mode": "(append keeps every attempt's log)",
    "--signal": "--signal",
    "--requeue": "--requeue",
    "--no-requeue": "--no-requeue",
    "--account": "--account",
    "-A": "--account",
    "--qos": "--qos",
    "-q": "--qos",
    "--mem": "--mem",
    "--constraint": "--constraint",
    "-C": "--constraint",
    "--exclusive": "--exclusive",
}


@dataclass(frozen=True)
class SignalSpec:
    """A ``--signal`` value: which signal, and how many seconds before the time limit.

    Example::

        >>> parse_signal("USR1@90")
        SignalSpec(name='USR1', lead_s=90)
    """

    name: str  # without "SIG": what both #SBATCH --signal and bash's trap and kill take
    lead_s: int


def parse_signal(spec: str) -> SignalSpec:
    """``SIG@SECONDS`` (``USR1@90``, ``SIGUSR1@90``, ``10@90``; a leading ``B:`` is allowed).

    The script always has Slurm signal the batch shell (``B:``), which passes the signal on, so
    ``B:`` changes nothing.

    Raises:
        ValueError: another form, an unknown signal, one that cannot be caught (KILL, STOP: the
            workers would die without a checkpoint), or a lead past 65535 s; naming the value.

    Example::

        >>> parse_signal("B:SIGTERM@120")
        SignalSpec(name='TERM', lead_s=120)
    """
    match = _SIGNAL.fullmatch(spec.strip())
    if match is None:
        raise ValueError(
            f"signal={spec!r} is not SIG@SECONDS: write the signal and the seconds before the "
            "time limit when Slurm sends it, e.g. USR1@90"
        )
    raw, lead = match["sig"], int(match["lead"])
    try:
        sig = signal.Signals(int(raw)) if raw.isdigit() else signal.Signals[_sig_name(raw)]
    except (KeyError, ValueError):
        raise ValueError(
            f"signal={spec!r}: {raw!r} is not a signal (USR1, USR2, TERM, INT, HUP, or a number)"
        ) from None
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(
            f"signal={spec!r}: {sig.name} cannot be caught, so no worker could checkpoint on "
            "it; USR1 makes the Trainer save and carry on, TERM save and stop"
        )
    if not 1 <= lead <= MAX_SIGNAL_LEAD_S:
        raise ValueError(
            f"signal={spec!r}: {lead} s before the time limit is outside Slurm's 1..65535"
        )
    return SignalSpec(sig.name.removeprefix("SIG"), lead)


def _sig_name(raw: str) -> str:
    upper = raw.upper()
    return upper if upper.startswith("SIG") else f"SIG{upper}"


def check_mem(mem: str) -> str:
    """A ``--mem`` value as sbatch takes it: whole number, optional K/M/G/T (megabytes without).

    Raises:
        ValueError: anything else (``16 GB``, ``1.5G``, ``16GiB``), naming it.

    Example::

        >>> check_mem("64G"), check_mem("0")
        ('64G', '0')
    """
    text = mem.strip()
    if not _MEM.fullmatch(text):
        raise ValueError(
            f"mem={mem!r} is not a SLURM memory size: a whole number with an optional unit "
            "K, M, G or T (64G, 16000M; megabytes without one; 0 for all of a node's memory)"
        )
    return text


def check_word(name: str, value: str | None) -> None:
    """A value written on an #SBATCH line as one word: non-empty, no whitespace.

    Raises:
        ValueError: empty or with whitespace, naming the option and the value.
    """
    # sbatch splits #SBATCH lines at whitespace and has no quoting to rely on.
    if value is not None and (not value or any(c.isspace() for c in value)):
        raise ValueError(f"{name}={value!r} is empty or contains whitespace; sbatch cannot read it")


def extra_directives(lines: Sequence[str]) -> list[str]:
    """The ``--sbatch`` lines as #SBATCH options: ``--mail-type=END``, ``#SBATCH -x node3``.

    A line without a leading dash gets ``--``: ``tandem slurm --sbatch mail-type=END`` is
    easier to type than ``--sbatch=--mail-type=END`` (argparse takes a separate
    ``--mail-type=END`` for an option of its own).

    Raises:
        ValueError: an empty line, one with a newline, or one that sets a directive the script
            writes itself (naming tandem slurm's option for it).

    Example::

        >>> extra_directives(["--mail-type=END,FAIL", "#SBATCH --gres=gpu:a100:4", "nice=10"])
        ['--mail-type=END,FAIL', '--gres=gpu:a100:4', '--nice=10']
    """
    out = []
    for line in lines:
        text = line.strip().removeprefix("#SBATCH").strip()
        if not text.lstrip("-") or "\n" in text or "\r" in text:
            raise ValueError(
                f"sbatch={line!r} is not one sbatch option: give one like --mail-type=END "
                "(one --sbatch per directive)"
            )
        if not text.startswith("-"):
            text = f"--{text}"
        word = text.split()[0].split("=")[0]
        # Short options may carry their value attached (-t1:00:00).
        own = _OWN_DIRECTIVES.get(word) or (
            _OWN_DIRECTIVES.get(word[:2]) if not word.startswith("--") else None
        )
        if own is not None:
            raise ValueError(
                f"sbatch={line!r} sets {word}, which tandem slurm writes itself: use {own}"
                if own.startswith("--")
                else f"sbatch={line!r} sets {word}, which tandem slurm fixes {own}"
            )
        out.append(text)
    return out
