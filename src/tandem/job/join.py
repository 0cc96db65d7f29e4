"""A replacement worker asks to join a job that recovers in memory, and waits to be admitted.

Under ``tandem run --recover in-memory --max-restarts N`` the launcher starts a replacement for
a lost worker with ``TANDEM_RECOVER_JOIN=<its launch rank>`` (a number no worker of the job had).
Its ``tandem.init()`` does not form a group of its own: it takes a place in the store's queue
of joiners (``joiners``, a counter; ``joiner/<n>``, its launch rank), then waits for
``admit/<launch rank>``, which the members write at the step boundary where they let it in
(:mod:`tandem.recovery`): the generation, its members (launch ranks, in rank order), this
process's rank and world size there, and the key prefix of the group they form with it. Every
key lives under ``tandem/<job secret's scope>recover/``, as the rest of the protocol's.

Before anyone forms a generation's group, every member of it says it is here (:func:`meet`):
a member lost before (the launcher's dead mark, or its heartbeat silent) is seen there, in
store calls that each return, instead of inside the group's formation, which would wait for it
to the group's timeout. A replacement whose admitting generation loses a member so, before its
group was ever formed, joins that generation's re-form as a member holding no state yet
(``fresh``): the survivors decide the next generation with it and hand it the run there; one
they leave out stops with a message that says so.

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
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

from tandem.job.secret import key_scope

#: The launch rank of a replacement worker, set by ``tandem run`` (absent for the others).
JOIN_VARIABLE = "TANDEM_RECOVER_JOIN"

#: What this process was admitted with (``ask_to_join``'s answer), once it was.
admitted: dict[str, Any] | None = None
#: Seconds without a heartbeat after which a member counts as gone (the launcher's setting).
HEARTBEAT_TIMEOUT_VARIABLE = "TANDEM_HEARTBEAT_TIMEOUT"
_POLL_S = 0.005


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


def formation_timeout(heartbeat_timeout: float) -> float:
    """Seconds a generation's group may take to form (every member's address and connections)
    before its members re-form: twice the heartbeat timeout, 5 s at least. The group's
    collectives wait longer (six heartbeat timeouts, 60 s at least: a slow step is no loss).

    Example::

        >>> formation_timeout(2.0), formation_timeout(10.0)
        (5.0, 20.0)
    """
    return max(5.0, 2 * heartbeat_timeout)


def ask_to_join(
    store: Any,
    me: int,
    timeout_s: float,
    form: Callable[[dict[str, Any], float], bool] | None = None,
) -> dict[str, Any]:
    """Queue launch rank ``me`` to join and wait (up to ``timeout_s``) until the members admit
    it; what they admitted it with (also kept in :data:`admitted`). ``form(admission,
    seconds)``, once every member said it is here, forms the group within that many seconds
    and says whether it did: a member lost before its part of the formation makes it fail,
    and this rank joins the survivors' re-form (as it does when a member is lost before it
    said it is here).

    Raises:
        TimeoutError: no admission within ``timeout_s`` (the job ended, or every member is
            stuck).

    Example::

        admission = ask_to_join(store, 4, timeout_s=600, form=lambda a, s: form_group(a, s))
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
    admission = json.loads(store.get(answer))
    # Admitted, it is a member the others may go on with in memory if one of them is lost
    # while it forms the group with them (it joins their re-form from here), and one that
    # admits replacements as they do: said now, for the launcher, before its Recoverer says
    # it again (or refuses a script that differs from theirs).
    store.set(f"{keys}able/{me}", "1")
    store.set(f"{keys}admits/{me}", "1")
    beat_s = float(os.environ.get(HEARTBEAT_TIMEOUT_VARIABLE) or 10.0)
    while True:
        g, members = int(admission["generation"]), [int(r) for r in admission["members"]]
        gone = meet(
            store, f"{keys}gen{g}/", me, members, partial(silent_or_dead, store, members, me),
            timeout_s=max(60.0, 6 * beat_s),
        )  # fmt: skip
        if not gone and (form is None or form(admission, formation_timeout(beat_s))):
            break
        why = f"rank(s) {sorted(gone)}" if gone else "a member (its group did not form in time)"
        # A member of the generation that admitted this rank was lost before its group was
        # formed: the survivors re-form it, with this rank as a member that holds nothing yet.
        store.set(
            f"{keys}gen{g + 1}/join/{me}",
            json.dumps({"committed": None, "admit": 0, "fresh": True}),
        )
        decided = f"{keys}gen{g + 1}/members"
        store.wait([decided], timedelta(seconds=max(60.0, 6 * beat_s)))
        members = [int(r) for r in json.loads(store.get(decided))]
        if me not in members:
            raise RuntimeError(
                f"replacement rank {me}: {why} of the generation that admitted "
                f"it were lost before it started, and the others went on without it (members "
                f"{members}); it stops here"
            )
        admission = {
            **admission,
            "generation": g + 1,
            "members": members,
            "rank": members.index(me),
            "world_size": len(members),
            "prefix": f"{keys}gen{g + 1}/pg/",
            # Those the members hand the run to: the ones that hold none (as this rank).
            "newcomers": [
                r for r in members if r not in admission["members"] or r in admission["newcomers"]
            ],
        }
    admitted = admission
    return admitted


def meet(
    store: Any,
    generation: str,
    me: int,
    members: Sequence[int],
    gone: Callable[[], set[int]],
    timeout_s: float,
) -> set[int]:
    """Say that launch rank ``me`` is here to form the group of the generation whose keys
    start with ``generation``, and wait until every one of ``members`` said so; the members
    ``gone()`` names meanwhile (empty: every member is here). A member lost before it got
    here is noticed so within a poll, rather than by the group's formation, which waits for
    its address to the group's timeout.

    Raises:
        TimeoutError: neither within ``timeout_s`` (a member alive and not coming).

    Example::

        gone = meet(store, prefix() + "gen3/", 2, [0, 2, 5], lambda: set(), timeout_s=60)
    """
    store.set(f"{generation}here/{me}", "1")
    keys = [f"{generation}here/{r}" for r in members]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        lost = gone() & set(members)
        if lost:
            return lost
        if time.monotonic() > deadline:
            missing = [r for r, key in zip(members, keys, strict=True) if not store.check([key])]
            raise TimeoutError(
                f"rank {me}: members {missing} of {list(members)} did not come to form the "
                f"group ({generation}) within {timeout_s:g} s"
            )
        time.sleep(_POLL_S)
    return set()


def silent_or_dead(store: Any, members: Sequence[int], me: int) -> set[int]:
    """Of ``members`` (launch ranks), those the launcher marked dead or whose heartbeat is
    older than ``TANDEM_HEARTBEAT_TIMEOUT`` (what a member's own check counts as gone).

    Example::

        silent_or_dead(store, [0, 2, 5], me=5)   # {2}: marked dead by the launcher
    """
    keys, now = prefix(), time.time()
    timeout = float(os.environ.get(HEARTBEAT_TIMEOUT_VARIABLE) or 10.0)
    found = set()
    for r in members:
        if r == me:
            continue
        if store.check([f"{keys}dead/{r}"]):
            found.add(r)
            continue
        beat = f"{keys}hb/{r}"
        if store.check([beat]) and now - float(store.get(beat)) > timeout:
            found.add(r)
    return found
