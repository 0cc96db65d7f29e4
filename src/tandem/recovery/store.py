"""The job's store as recovery in memory meets it: what the launcher that hosts it sets in
every worker (the mode, the heartbeat timeout), a new client of it, the prefix under which every
key of the protocol lives there, and the ``able/<rank>`` key by which a rank tells the launcher
whether it recovers in memory.

Every other module of :mod:`tandem.recovery` talks to the store through these; none of them is
imported here (this is the bottom of the package).

Example::

    if enabled():
        store = _job_store()
        store.set(f"{PREFIX}able/3", ABLE)
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from tandem._dist import group_rank, group_size
from tandem.job import join
from tandem.job.secret import key_scope

#: The environment variable ``tandem run --recover in-memory`` sets in every worker.
MODE_VARIABLE = "TANDEM_RECOVER"
#: Seconds without a heartbeat after which a rank counts as hung, unless the launcher says.
HEARTBEAT_TIMEOUT_VARIABLE = join.HEARTBEAT_TIMEOUT_VARIABLE  # a replacement reads it there too
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
#: Every key of the protocol lives under this prefix of the job's store (in the job secret's
#: scope, as the launcher writes its keys: a client without the secret can forge none).
PREFIX = f"tandem/{key_scope()}recover/"
#: The value of ``able/<rank>`` from a rank that recovers in memory (else ``no: <reason>``).
ABLE = "1"


def _job_store(timeout: float = 60.0) -> dist.Store:
    """A new client of the job's store (the launcher's, at MASTER_ADDR:MASTER_PORT) whose
    calls give up after ``timeout`` seconds (a cut link makes a call wait, not fail)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
        use_libuv=True,
    )


def declare_unable(reason: str) -> None:
    """Tell the launcher that this rank will not recover in memory (``reason`` says why): a lost
    rank then makes it restart every worker (``--recover in-memory`` falls back to
    ``restart``). A no-op outside ``--recover in-memory``.

    Example::

        declare_unable("the model is sharded across ranks (FullyShardedDataParallel)")
    """
    if enabled() and group_size() > 1:
        _job_store().set(f"{PREFIX}able/{group_rank()}", f"no: {reason}")


def enabled() -> bool:
    """Whether this process runs under ``tandem run --recover in-memory``."""
    return os.environ.get(MODE_VARIABLE) == "in-memory"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
