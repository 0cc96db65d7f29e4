"""A replacement worker asks to join a job that recovers in memory, and waits to be admitted.

Under ``tandem run --recover in-memory --max-restarts N`` the launcher starts a replacement for
a lost worker with ``TANDEM_RECOVER_JOIN=<its launch rank>`` (a number no worker of the job had).
Its ``tandem.init()`` does not form a group of its own: it takes a place in the store's queue
of joiners (``joiners``, a counter; ``joiner/<n>``, its launch rank), then waits for
``admit/<launch rank>``, which the members write at the step boundary where they let it in
(:mod:`tandem.recovery`): the generation, its members (launch ranks, in rank order), this
process's rank and world size there, and the key prefix of the group they form with it. Every
key lives under ``tandem/<job secret's scope>recover/``, as the rest of the protocol's.

Imports no torch at import time (the store is the caller's).

Example::

    me = joining()                       # None: an ordinary worker
    if me is not None:
        admitted = ask_to_join(store, me, timeout_s=600)
        dist.init_process_group("gloo", store=dist.PrefixStore(admitted["prefix"], store),
                                rank=admitted["rank"], world_size=admitted["world_size"])
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from tandem.job.secret import key_scope

#: The launch rank of a replacement worker, set by ``tandem run`` (absent for the others).
JOIN_VARIABLE = "TANDEM_RECOVER_JOIN"

#: What this process was admitted with (``ask_to_join``'s answer), once it was.
admitted: dict[str, Any] | None = None


def prefix(environ: Mapping[str, str] = os.environ) -> str:
    """The prefix of every key of recovery in memory, in the job secret's scope.

    Example::

        >>> prefix({})
        'tandem/recover/'
    """
    return f"tandem/{key_scope(environ)}recover/"


def joining(environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's launch rank if it is a replacement that joins a running job, else None.

    Raises:
        ValueError: ``TANDEM_RECOVER_JOIN`` is not a number.

    Example::

        >>> joining({"TANDEM_RECOVER_JOIN": "4"})
        4
    """
    value = environ.get(JOIN_VARIABLE)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{JOIN_VARIABLE}={value!r} is not a launch rank: tandem run sets it for a "
            "replacement worker; unset it to start an ordinary one"
        ) from None


def replacing() -> bool:
    """Whether this process is a replacement admitted into a running job (``tandem run
    --recover in-memory --max-restarts``): its run comes from the members, not from the start
    of the script. Collectives the script makes itself before training (an evaluation before
    ``train()``, a barrier after a download) must be skipped on it: the members are past them.

    Example::

        tandem.init()
        if not tandem.recovery.replacing():
            evaluate(model)          # its all_reduce would be met by no other rank
        trainer.train()
    """
    return admitted is not None


def ask_to_join(store: Any, me: int, timeout_s: float) -> dict[str, Any]:
    """Queue launch rank ``me`` to join and wait (up to ``timeout_s``) until the members admit
    it; what they admitted it with (also kept in :data:`admitted`).

    Raises:
        TimeoutError: no admission within ``timeout_s`` (the job ended, or every member is
            stuck).
    """
    global admitted
    keys = prefix()
    place = int(store.add(keys + "joiners", 1))
    store.set(f"{keys}joiner/{place}", str(me))
    answer = f"{keys}admit/{me}"
    try:
        store.wait([answer], timedelta(seconds=timeout_s))
    except Exception as error:  # the store's timeout: its type differs between torch versions
        raise TimeoutError(
            f"replacement rank {me}: not admitted into the job within {timeout_s:g} s (the job "
            "may have ended before its next step boundary)"
        ) from error
    admitted = json.loads(store.get(answer))
    return admitted
