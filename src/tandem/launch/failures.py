"""How a worker ended, said the way a user can act on: signal names, the likely cause, the tail.

Example::

    >>> describe_exit(-9)
    "killed by SIGKILL (often the out-of-memory killer: check `dmesg` or the job's memory limit)"
    >>> describe_exit(1)
    'exit code 1'
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

# Why a worker might have received a signal it did not send itself.
_LIKELY = {
    "SIGKILL": "often the out-of-memory killer: check `dmesg` or the job's memory limit",
    "SIGSEGV": "a crash in native code (a CUDA or C++ extension, or a corrupt install)",
    "SIGABRT": "an abort in native code, e.g. a failed assertion or NCCL/Gloo error",
    "SIGBUS": "often shared memory (/dev/shm) too small for DataLoader workers",
    "SIGTERM": "stopped from outside: the scheduler's time limit or a user",
}


def describe_exit(returncode: int, likely: bool = True) -> str:
    """'exit code N' or 'killed by SIGNAME (likely cause)' for a Popen returncode; without the
    likely cause when ``likely`` is false (a one-line summary: ``killed by SIGKILL``).

    Example::

        >>> describe_exit(-9, likely=False)
        'killed by SIGKILL'
    """
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"killed by signal {-returncode}"
    cause = _LIKELY.get(name) if likely else None
    return f"killed by {name}" + (f" ({cause})" if cause else "")


@dataclass(frozen=True)
class Failure:
    """A worker's failure as the launcher reports it: the first of an attempt, or under
    ``--recover in-memory`` each rank lost (:mod:`tandem.launch.in_memory`)."""

    rank: int
    local_rank: int
    host: str
    returncode: int
    tail: tuple[str, ...]
    #: Set where no worker of ours failed but a whole node was lost (its launcher stopped
    #: beating): what the summary says instead of a worker's exit.
    cause: str = ""
    #: When the launcher saw the exit (``time.time()``, within its 20 ms poll); 0 if unknown.
    at: float = 0.0

    def summary(
        self, laggards: Sequence[int] = (), collective: str = "", details: Sequence[str] = ()
    ) -> str:
        """A few lines: who failed, how, and the end of what it wrote to stderr.

        ``laggards``: the ranks this one waited for in ``collective`` until it failed (its hang
        report named them, with ``details``): they head the summary, since they held the job up
        and this rank only timed out waiting for them.

        Example::

            >>> print(Failure(0, 0, "vm", 1, ()).summary([1], "all_reduce #1 of world"))
            tandem run: rank 1 held the job up; rank 0 (local rank 0 on vm) failed first (exit code 1) while waiting for it in all_reduce #1 of world
            (rank 0 wrote nothing to stderr)
        """  # noqa: E501
        if self.cause:
            return f"tandem run: {self.cause}"
        me = f"rank {self.rank} (local rank {self.local_rank} on {self.host})"
        if laggards:
            who = _ranks(laggards)
            them = "it" if len(laggards) == 1 else "them"
            lines = [
                f"tandem run: {who} held the job up; {me} failed first "
                f"({describe_exit(self.returncode)}) while waiting for {them} in {collective}",
                *(f"  {line}" for line in details),
            ]
        else:
            lines = [f"tandem run: {me} failed first: {describe_exit(self.returncode)}"]
        if self.tail:
            lines.append(f"--- last {len(self.tail)} lines of rank {self.rank}'s stderr ---")
            lines.extend(self.tail)
            lines.append("---")
        else:
            lines.append(f"(rank {self.rank} wrote nothing to stderr)")
        return "\n".join(lines)

    def exit_code(self) -> int:
        """The launcher's own exit status: the worker's code, or 128 + its signal."""
        return self.returncode if self.returncode > 0 else 128 + (-self.returncode or 1)


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 1, 3``."""
    listed = ", ".join(str(r) for r in ranks)
    return f"rank {listed}" if len(ranks) == 1 else f"ranks {listed}"
