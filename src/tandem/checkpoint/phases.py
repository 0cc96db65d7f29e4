"""The steps of a checkpoint save and load that every rank runs alike, for both checkpointers.

``tandem.checkpoint.save`` / ``load`` and the Trainer's
:class:`~tandem.checkpoint.checkpointer.Checkpointer` differ only in their main file (its layout,
its name, the run directory's ``latest`` and retention); the work on the objects is these steps,
over the entries of :mod:`tandem.checkpoint.entries`:

- saving: :func:`collect_entries`: every entry's state (FSDP and ShardedOptimizer gather
  here); then :func:`write_entries`: each rank's shard file written, every rank's per-rank
  state and shard digest gathered (in the caller, or in the background writer of
  :mod:`tandem.checkpoint.async_save` on a copy of what was collected);
- loading: :func:`check`: the keys, the types, the per-rank states, each rank's shard part
  (read, or cut anew from the saved ranks' files at another world size:
  :func:`read_shard_parts`), each entry's fit; then :func:`load_into`.

Each is either local or one small collective whose result is the same on every rank
(:func:`agree`, :func:`settle`): that is how a problem found on one rank (a value it cannot
save, a corrupt shard, an object refusing its state) becomes the same error on every rank
instead of a hang in the next collective.

Example::

    entries, problem = classify_state(state)
    agree(entries, problem, path, "load")        # ValueError everywhere if the ranks differ
    settle(local_error)                          # raise everywhere if any rank failed
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem import _dist
from tandem._dist import gather_objects
from tandem._profile import span
from tandem.checkpoint.entries import Entry, StatefulEntry, ValueEntry, classify
from tandem.checkpoint.run_dir import CheckpointError
from tandem.checkpoint.sealed import payload_kind, read_verified
from tandem.checkpoint.shards import cached_reader, read_shard, shard_path, write_shard
from tandem.parallel.adapters import listed
from tandem.parallel.engine import Kind

log = logging.getLogger(__name__)

#: The errors raised on every rank, by the name a rank's own error travels under.
ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "CheckpointError": CheckpointError,
    "OSError": OSError,
    "ImportError": ImportError,
    "RuntimeError": RuntimeError,
}


@dataclass(frozen=True)
class ShardFiles:
    """The ranks' shard files of the checkpoint ``directory/stem.pt``, and their layout.

    ``tandem.checkpoint`` files hold ``{key: part}``; a Trainer's hold its one sharded entry's
    part bare (``single`` names that entry), as they always have.
    """

    directory: Path
    stem: str
    single: str | None = None

    def write(self, parts: dict[str, Any], rank: int) -> str:
        """Write ``rank``'s file of ``parts`` (key -> part); its sha256."""
        content = parts[self.single] if self.single is not None else parts
        return write_shard(content, self.directory, self.stem, rank)

    def read(self, rank: int, sha256: str) -> dict[str, Any]:
        """``rank``'s parts (key -> part), checked against ``sha256``."""
        content = read_shard(self.directory, self.stem, rank, sha256)
        return {self.single: content} if self.single is not None else content


@dataclass
class Saved:
    """What :func:`write_entries` gathered for the main file (on every rank)."""

    states: dict[str, Any]  # key -> its part of the main file
    ranks: dict[str, list[Any]]  # key -> every rank's own part, for entries that have one
    digests: list[str] | None  # every rank's shard file's sha256; None: no shard files


def classify_state(state: Any) -> tuple[list[Entry], Exception | None]:
    """``state``'s entries, or this rank's reason to refuse it (raised by :func:`agree`)."""
    try:
        return classify(state), None
    except ValueError as e:
        return [], e


def agree(entries: list[Entry], problem: Exception | None, path: Path, verb: str) -> None:
    """Raise on every rank if a rank refused its state or the ranks' keys or types differ.

    One gather: the collectives that follow go value by value, so ranks with other values
    would wait in different ones.
    """
    if _dist.group_size() == 1:
        if problem is not None:
            raise problem
        return
    mine = {
        "problem": None if problem is None else str(problem),
        "values": [(e.key, e.tag) for e in entries],
        "path": str(path),
    }
    everyone = gather_objects(mine)
    problems = [(r, m["problem"]) for r, m in enumerate(everyone) if m["problem"]]
    if problems:
        raise ValueError(_one_text(problems)) from problem
    for field in ("values", "path"):
        if any(m[field] != everyone[0][field] for m in everyone):
            seen = "; ".join(f"rank {r}: {m[field]}" for r, m in enumerate(everyone))
            raise ValueError(
                f"tandem.checkpoint.{verb}: the ranks pass different {field} ({seen}); every "
                "rank passes the same keys, kinds of object and path"
            )


@dataclass
class Collected:
    """What :func:`collect_entries` took from the entries: nothing is written yet."""

    states: dict[str, Any]  # key -> its part of the main file
    parts: dict[str, Any]  # key -> this rank's shard part, for entries that left one
    mine: dict[str, Any]  # key -> this rank's own part, for entries that have one


def collect_entries(entries: list[Entry], kind: Kind) -> Collected:
    """Every entry's state, in the dict's order (a collective: FSDP and ShardedOptimizer
    gather here). The tensors are the live ones where an object hands them out so (a model's
    ``state_dict()``): write them before training goes on, or copy them."""
    saved = {entry.key: entry.save(kind) for entry in entries}
    return Collected(
        states={key: state for key, (state, _) in saved.items()},
        parts={key: part for key, (_, part) in saved.items() if part is not None},
        mine={e.key: e.rank_state() for e in entries if e.has_rank_state},
    )


def write_entries(
    collected: Collected,
    files: ShardFiles,
    rank: int,
    gather: Callable[[Any], list[Any]] = gather_objects,
) -> Saved:
    """This rank's shard file written, the ranks' parts and digests gathered (by ``gather``:
    every rank's object, in rank order; the background writer's travels over its own group).

    A collective. A rank that cannot write its shard fails the save on every rank, before
    anything is committed (the main file, which commits, is the caller's, written after).

    Raises:
        OSError: a rank could not write its shard file (on every rank, naming it).
    """
    # Each rank writes its own shard file; one rank's failure fails the save on all.
    report: tuple[str | None, str | None] = (None, None)
    if collected.parts:
        try:
            with span("tandem.train.checkpoint_write", f"{files.stem} shard {rank}"):
                report = (None, files.write(collected.parts, rank))
        except OSError as e:
            report = ("OSError", f"rank {rank} could not save its shard: {e}")
    everyone = gather({"ranks": collected.mine, "shard": report})
    failed = [r["shard"][1] for r in everyone if r["shard"][0] is not None]
    if failed:
        # Every rank has the same gathered list: the same error everywhere, nothing committed.
        raise OSError("; ".join(failed))
    return Saved(
        states=collected.states,
        ranks={key: [r["ranks"][key] for r in everyone] for key in collected.mine},
        digests=[r["shard"][1] for r in everyone] if collected.parts else None,
    )


def read_api_file(path: Path) -> dict[str, Any]:
    """The verified payload of a ``tandem.checkpoint.save`` file (CheckpointError otherwise)."""
    payload = read_verified(path)
    if payload_kind(path, payload) == "trainer":
        raise CheckpointError(
            f"{path} is a Trainer checkpoint (epoch {payload['epoch']}, step "
            f"{payload['step']}), not a tandem.checkpoint.save file: resume it with "
            f"Trainer(resume={str(path)!r}); `tandem export` takes its weights out"
        )
    return payload


def check(
    path: Path, payload: dict[str, Any], entries: list[Entry], files: ShardFiles, rank: int
) -> dict[str, Any] | None:
    """Everything that must hold before anything loads; this rank's shard parts.

    ``payload`` is ``{"objects": {key: {"type", "state", "ranks"}}, "shards"}`` (a
    ``tandem.checkpoint`` file's layout; the Trainer's checkpointer maps its own onto it).
    """
    objects = payload["objects"]
    keys = [e.key for e in entries]
    only_file = [k for k in objects if k not in keys]
    only_state = [k for k in keys if k not in objects]
    if only_file or only_state:
        differences = listed(
            [(only_file, "that the state lacks"), (only_state, "that the checkpoint lacks")]
        )
        raise ValueError(
            f"checkpoint {path} and the state differ in keys: {differences}; "
            f"the checkpoint holds {list(objects)}: pass a state with those keys"
        )
    world_size = _dist.group_size()
    for e in entries:
        saved_type = objects[e.key]["type"]
        if saved_type != e.tag:
            raise ValueError(
                f"checkpoint {path}: {e.what} is a {e.tag} ({type(e.obj).__name__}); "
                f"the checkpoint holds a {saved_type} there"
            )
        ranks = objects[e.key].get("ranks")
        if isinstance(e, StatefulEntry) and e.has_rank_state and ranks is not None:
            try:
                e.check_rank_states(ranks, world_size)
            except ValueError as error:
                raise ValueError(f"checkpoint {path}: {error}") from error
    shard = read_shard_parts(path, payload, entries, files, rank)
    for e in entries:
        try:
            e.check(objects[e.key]["state"], None if shard is None else shard.get(e.key))
        except ValueError as error:
            raise ValueError(f"checkpoint {path}: {error}") from error
    return shard


def read_shard_parts(
    path: Path, payload: dict[str, Any], entries: list[Entry], files: ShardFiles, rank: int
) -> dict[str, Any] | None:
    """This rank's shard parts (key -> part): its own file's at the world size and layout that
    saved them; at another, each sharded entry's cut anew (:meth:`Entry.reshard`) from the
    saved ranks' files that overlap this rank's share, each read once. None for a checkpoint
    without shards.

    Raises:
        CheckpointError: a file needed is missing or corrupt (at another world size the message
            says that every process must see the other ranks' files).
        ValueError: the files do not fit the entries.
    """
    if payload["shards"] is None:
        return None
    digests = payload["shards"]["sha256"]
    world_size = _dist.group_size()
    if len(digests) == world_size:
        own = files.read(rank, digests[rank])
        if all(e.cut_alike(own.get(e.key)) for e in entries):
            return own
        # As many files as processes, cut on another layout (hybrid and flat sharding of the
        # same ranks): each rank cuts its part anew, as at another world size.
        log.info("resharding %s: its shard files were cut on another layout", path)
    else:
        log.info("resharding %s: %d shard files for %d processes", path, len(digests), world_size)
    read = cached_reader(lambda q: files.read(q, digests[q]))
    objects = payload["objects"]
    parts: dict[str, Any] = {}
    try:
        for e in entries:
            if e.sharded_in(objects[e.key]["state"]):
                parts[e.key] = e.reshard(len(digests), functools.partial(_part_of, read, key=e.key))
    except CheckpointError as error:
        raise CheckpointError(
            f"{error}. Loading {len(digests)} ranks' shards with {world_size} process(es) "
            "reads other ranks' shard files: they must be visible to every process (a shared "
            "file system), or save a full checkpoint"
        ) from error
    return parts


def _part_of(read: Callable[[int], dict[str, Any]], rank: int, *, key: str) -> Any:
    parts = read(rank)
    if key not in parts:
        raise ValueError(f"saved rank {rank}'s shard file holds no part of {key!r}")
    return parts[key]


def load_into(
    state: MutableMapping[str, Any],
    path: Path,
    payload: dict[str, Any],
    entries: list[Entry],
    shard: dict[str, Any] | None,
    rank: int,
) -> None:
    """Load the checked ``payload`` (and this rank's ``shard``) into ``entries``, in place.

    Plain values are put back into ``state``; per-rank states go to each object last
    (:meth:`StatefulEntry.load_rank_states`: at another world size the object maps them).
    """
    objects = payload["objects"]
    stateful = [e for e in entries if isinstance(e, StatefulEntry)]
    # Stateful objects first, each able to refuse (a sampler over another data set): what
    # loaded before a refusal is put back, and the models are not yet touched.
    before = [copy.deepcopy(e.obj.state_dict()) for e in stateful]
    done: list[int] = []
    try:
        for i, e in enumerate(stateful):
            e.load(objects[e.key]["state"], None)
            done.append(i)
    except Exception as error:
        for i in reversed(done):
            stateful[i].load(before[i], None)
        if isinstance(error, ValueError):
            raise ValueError(f"checkpoint {path}: {error}") from error
        raise
    for entry in entries:
        if not isinstance(entry, StatefulEntry | ValueEntry):
            part = None if shard is None else shard.get(entry.key)
            entry.load(objects[entry.key]["state"], part)
    for entry in entries:
        if isinstance(entry, ValueEntry):
            state[entry.key] = entry.loaded(objects[entry.key]["state"])
    # Per-rank states last, the RNG's above all: nothing after this may draw a random number.
    for e in stateful:
        ranks = objects[e.key].get("ranks")
        if e.has_rank_state and ranks is not None:
            e.load_rank_states(ranks, rank)


def settle(error: Exception | None) -> None:
    """Raise on every rank if any rank's ``error`` is not None (a collective)."""
    if _dist.group_size() == 1:
        if error is not None:
            raise error
        return
    everyone = gather_objects(None if error is None else (kind_of(error), str(error)))
    failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
    if not failed:
        return
    text = _one_text([(r, message) for r, (_, message) in failed])
    raise ERRORS[failed[0][1][0]](text) from error


def _one_text(problems: list[tuple[int, str]]) -> str:
    """Every rank's problem, once when they all say the same (as checks of shared data do)."""
    if len({message for _, message in problems}) == 1:
        return problems[0][1]
    return "; ".join(f"rank {r}: {message}" for r, message in problems)


def kind_of(error: Exception) -> str:
    """The name of the error to raise on every rank for ``error`` (see ``ERRORS``)."""
    # CheckpointError before OSError's subclasses; a FileNotFoundError is raised as an OSError.
    for name, kind in ERRORS.items():
        if isinstance(error, kind):
            return name
    return "RuntimeError"


def tidy_shards(path: Path, rank: int) -> None:
    """After a full save over a sharded one: this rank's old shard file is garbage now."""
    stale = shard_path(path.parent, path.stem, rank)
    if stale.is_file():
        with contextlib.suppress(OSError):
            stale.unlink()
            stale.parent.rmdir()  # fails while other ranks' files remain: theirs to remove
