"""How a worker ended, said the way a user can act on: signal names, the likely cause, the tail.

Example::

    >>> describe_exit(-9)
    "killed by SIGKILL (often the out-of-memory killer: check `dmesg` or the job's memory limit)"
    >>> describe_exit(1)
    'exit code 1'
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

# Why a worker might have received a signal it did not send itself.
_LIKELY = {
    "SIGKILL": "often the out-of-memory killer: check `dmesg` or the job's memory limit",
    "SIGSEGV": "a crash in native code (a CUDA or C++ extension, or a corrupt install)",
    "SIGABRT": "an abort in native code, e.g. a failed assertion or NCCL/Gloo error",
    "SIGBUS": "often shared memory (/dev/shm) too small for DataLoader workers",
    "SIGTERM": "stopped from outside: the scheduler's time limit or a user",
}


def describe_exit(returncode: int) -> str:
    """'exit code N' or 'killed by SIGNAME (likely cause)' for a Popen returncode."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"killed by signal {-returncode}"
    cause = _LIKELY.get(name)
    return f"killed by {name}" + (f" ({cause})" if cause else "")


@dataclass(frozen=True)
class Failure:
    """The first worker failure of an attempt, as the launcher reports it."""

    rank: int
    local_rank: int
    host: str
    returncode: int
    tail: tuple[str, ...]
    #: Set where no worker of ours failed but a whole node was lost (its launcher stopped
    #: beating): what the summary says instead of a worker's exit.
    cause: str = ""

    def summary(self) -> str:
        """A few lines: who failed, how, and the end of what it wrote to stderr."""
        if self.cause:
            return f"tandem run: {self.cause}"
        lines = [
            f"tandem run: rank {self.rank} (local rank {self.local_rank} on {self.host}) "
            f"failed first: {describe_exit(self.returncode)}"
        ]
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
