"""Checkpoints for hand-written loops, and plain weights out of any checkpoint.

:func:`save` and :func:`load` take a dict of the objects to keep, as
``torch.distributed.checkpoint`` does, and load in place: models (plain, tandem.DDP,
DataParallel, tandem.FullyShardedDataParallel), optimizers (plain, tandem.ShardedOptimizer, one
over an FSDP model's shards), engines (:func:`tandem.parallel.engine.make_engine`), anything
with ``state_dict()`` / ``load_state_dict()`` (schedulers, samplers, GradScaler, :class:`RNG`),
and plain values (numbers, strings, tensors, lists and dicts of them). They give the Trainer's
guarantees:

- **atomic**: a temporary file, fsynced and renamed, then its ``.sha256`` sidecar, which
  commits it; a crash leaves a file that refuses to load, never one that loads half-way;
- **checked**: the checksum is verified and every value checked against its object (keys,
  shapes, parameter groups, shards) on every rank before any object changes; unpickled
  with ``torch.load(weights_only=True)``, so no code in a file runs;
- **collective**: every rank calls them with the same keys; an error on any rank (a full disk,
  a corrupt shard, a mismatched key) is raised on every rank, never left as a hang;
- ``kind="full"`` (default) gathers what is sharded into rank 0's file: it loads at any world
  size, and into the unwrapped model; ``kind="sharded"`` gathers nothing: each rank writes its
  own shards. Both load at another world size: there each rank cuts its FSDP shards and its
  ShardedOptimizer or FSDP optimizer state anew from the saved ranks' shard files that overlap
  its share (the Trainer's resharding: :mod:`tandem.checkpoint.shards`), which must then be
  visible to every process (a shared file system);
- ``async_=True``: the call returns once the state is copied to host memory (one copy, reused
  between saves), and the files are written, fsynced, checksummed and committed in the
  background; :class:`AsyncSave` ``.wait()`` for the commit. At most one save is in flight;
  its error is raised on every rank (:mod:`tandem.checkpoint.async_save`).

At another world size the rest of an epoch continues where the saved ranks stood: a
:class:`tandem.data.DistributedSampler` (or a :class:`tandem.data.StatefulLoader` over one)
deals the samples not yet trained on to the new ranks, none repeated, none skipped (apart from
the padding that evens the ranks' shares). Per-rank states are mapped by their object's
``load_rank_state_dicts(states, rank)``; :class:`RNG`'s: ranks that existed continue their
saved generators, new ranks seed theirs deterministically. An object with only
``load_rank_state_dict`` loads at the same world size only (a ValueError otherwise). The run
goes on, but not bitwise as the uninterrupted one: the global batch and the order of the
gradient sums change with the number of processes.

:func:`export_weights` (and ``tandem export`` on the command line) writes the plain model's
weights as one safetensors file, from a Trainer run or checkpoint, a :func:`save` file, or a
live model.

What a Trainer checkpoint holds (``runs/x/checkpoints/ckpt-eEEEE-sSSSSSSSS.pt``, read with
``tandem.checkpoint.run_dir.load_checkpoint``)::

    {"format_version": 1, "epoch": E, "step": S, "state": {
        "model":     the plain module's state_dict() (no wrapper prefixes; FSDP's gathered);
                     None in FSDP's sharded kind
        "optimizer": a plain optimizer's state_dict() over the plain module's parameters
                     (ShardedOptimizer's and FSDP's gathered); None in the sharded kind
        "engine":    tandem.DDP's bucket order, or None
        "shards":    None, or in the sharded kind {"sha256": [rank r's shard file digest]}
        "scheduler", "scaler": their state_dict(), or None
        "trainer":   epoch, step, batch, sampler position, history; under "ranks" every
                     rank's RNG states and loss sums}}
    ckpt-....pt.sha256                  its checksum, written last
    shards/ckpt-.../rankNNNNN.pt        sharded kind: rank r's {"model": FSDP shards,
                                        "optimizer": its optimizer shard}

What a :func:`save` file holds (``path``, its ``path.sha256``, and in the sharded kind
``shards/<path's stem>/rankNNNNN.pt`` beside it)::

    {"format": "tandem.checkpoint/1", "kind": "full" | "sharded", "world_size": N,
     "shards": None | {"sha256": [rank r's shard file digest]},
     "objects": {key: {"type": "model" | "optimizer" | "engine" | "stateful" | "value",
                       "state": rank 0's part (below),
                       "ranks": [every rank's rank_state_dict()] or None}}}

    model      {"model": the plain module's state_dict(), "engine": tandem.DDP's bucket order}
    optimizer  {"optimizer": a plain optimizer's state_dict() over the plain module}
    engine     {"model", "optimizer", "engine"}, as Engine.state_dict gives them
    stateful   its state_dict(); RNG's per-rank generator states are under "ranks"
    value      the value
    rankNNNNN.pt: {key: {"model": FSDP shards} | {"optimizer": an optimizer shard}} for what
               is sharded (its place in "state" is then None)

Example::

    import tandem, tandem.checkpoint

    tandem.init()
    model = tandem.DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler,
             "rng": tandem.checkpoint.RNG(), "step": 0}
    if os.path.exists("ckpt/last.pt"):
        tandem.checkpoint.load(state, "ckpt/last.pt")      # state["step"] is the saved step
    for step in range(state["step"], 1000):
        ...
        if step % 100 == 99:
            state["step"] = step + 1
            tandem.checkpoint.save(state, "ckpt/last.pt")
    tandem.checkpoint.export_weights(model, "model.safetensors")
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, Literal, overload

from torch import nn

from tandem import _dist
from tandem._dist import from_rank0
from tandem.checkpoint.async_save import WRITER, AsyncSave, Meeting
from tandem.checkpoint.dcp import holds_dcp_files, is_dcp, load_dcp, write_dcp
from tandem.checkpoint.export import export_file as _export_file
from tandem.checkpoint.export import strip_wrapper_prefixes, write_safetensors
from tandem.checkpoint.phases import (
    ERRORS,
    Collected,
    ShardFiles,
    agree,
    check,
    classify_state,
    collect_entries,
    kind_of,
    load_into,
    read_api_file,
    settle,
    tidy_shards,
    write_entries,
)
from tandem.checkpoint.rng import (
    capture_rng_state,
    derived_seed,
    restore_rng_state,
    seed_rng,
    states_digest,
)
from tandem.checkpoint.run_dir import CheckpointError
from tandem.checkpoint.sealed import API_FORMAT, write_checkpoint_file
from tandem.parallel.adapters import model_state
from tandem.parallel.engine import Engine, Kind

__all__ = [
    "KINDS",
    "RNG",
    "AsyncSave",
    "CheckpointError",
    "Kind",
    "export_weights",
    "load",
    "save",
]

KINDS: tuple[Kind, ...] = ("full", "sharded")
#: The files :func:`save` writes: its own, or a directory of torch's distributed checkpoint.
Format = Literal["tandem", "dcp"]


class RNG:
    """Every rank's random number generators, as one object to put in a checkpoint's state.

    Saved: each rank's Python ``random``, NumPy global, torch CPU and (when initialized) CUDA
    generator states. Loaded at the same world size: each rank gets its own back, so dropout
    masks and shuffles go on as in the uninterrupted run. At another world size a rank that
    existed gets its own back too, and a new rank (one past the saved ones) seeds Python's,
    NumPy's and torch's generators from ``derived_seed("tandem.checkpoint.RNG", digest, rank)``,
    the digest being that of the saved states: loading the same checkpoint on as many
    processes gives the same draws every time, another checkpoint other ones.

    Example::

        state = {"model": model, "optimizer": opt, "rng": tandem.checkpoint.RNG()}
        tandem.checkpoint.save(state, "ckpt.pt")
        tandem.checkpoint.load(state, "ckpt.pt")   # every rank's generators as at the save
    """

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing shared: the states are per rank

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's generator states."""
        return capture_rng_state()

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's saved generator states."""
        restore_rng_state(state)

    def load_rank_state_dicts(self, states: list[dict[str, Any]], rank: int) -> None:
        """Restore saved rank ``rank``'s states, or derive a new rank's (see the class doc)."""
        if rank < len(states):
            restore_rng_state(states[rank])
        else:
            seed_rng(derived_seed("tandem.checkpoint.RNG", states_digest(states), rank))


@overload
def save(
    state: Mapping[str, Any],
    path: str | Path,
    *,
    kind: Kind = ...,
    async_: Literal[False] = ...,
    format: Format = ...,
) -> Path: ...
@overload
def save(
    state: Mapping[str, Any],
    path: str | Path,
    *,
    kind: Kind = ...,
    async_: Literal[True],
    format: Format = ...,
) -> AsyncSave: ...
@overload
def save(
    state: Mapping[str, Any],
    path: str | Path,
    *,
    kind: Kind = ...,
    async_: bool,
    format: Format = ...,
) -> Path | AsyncSave: ...


def save(
    state: Mapping[str, Any],
    path: str | Path,
    *,
    kind: Kind = "full",
    async_: bool = False,
    format: Format = "tandem",
) -> Path | AsyncSave:
    """Save every value of ``state`` to ``path`` (a collective: every rank calls it).

    Rank 0 writes ``path`` and its ``.sha256``; in the sharded kind every rank also writes its
    own shards to ``shards/<stem>/rankNNNNN.pt`` beside it. See the module doc for the layout.

    Args:
        state: key -> model, optimizer, engine, stateful object or plain value; the same keys
            and kinds of value on every rank (checked). Plain values are rank 0's.
        path: the checkpoint file; its directory is created. Saving over an existing
            checkpoint replaces it (a crash in between leaves neither loadable: save to a new
            name per step and keep the last few where that matters, as the Trainer does).
        kind: ``"full"`` or ``"sharded"`` (see the module doc).
        async_: return once the state is copied to host memory, and write the files in the
            background (:mod:`tandem.checkpoint.async_save`): the training may go on and
            change the live objects at once. At most one save is in flight: a save or load
            while one is being written waits for it first (and logs a warning). The errors of
            the writing (below) are then raised by ``wait()``, else by the next save or load
            (this call raises an earlier one's that nothing waited for).
        format: ``"tandem"`` (this module's files) or ``"dcp"``: a directory of torch's
            distributed checkpoint, laid out as torch's own tools write a model and its
            optimizer (:mod:`tandem.checkpoint.dcp`: an FSDP model and its optimizer written
            by every rank, its own slices, a ShardedOptimizer's state by each owner;
            ``async_`` as for the tandem format, the same writer; ``kind`` does not apply),
            which ``torch.distributed.checkpoint.load`` reads.

    Returns:
        ``path``, on every rank; with ``async_``: an :class:`AsyncSave` whose ``wait()``
        returns ``path`` once the checkpoint is committed.

    Raises:
        ValueError: a bad ``kind``, a value that cannot be saved, ranks that disagree on the
            keys, or a value ``weights_only`` loading would refuse (nothing is committed).
        OSError: a rank could not write (on every rank; nothing is committed).

    Example::

        tandem.checkpoint.save({"model": model, "optimizer": opt, "step": 100}, "ckpt/100.pt")
        handle = tandem.checkpoint.save(state, "ckpt/200.pt", async_=True)
        ...                                                  # training goes on
        handle.wait()
    """
    started = time.monotonic()
    path = Path(path)
    if not isinstance(async_, bool):
        raise ValueError(f"async_ must be True or False, not {async_!r}")
    if format not in ("tandem", "dcp"):
        raise ValueError(f"format must be 'tandem' or 'dcp', not {format!r}")
    WRITER.settle("tandem.checkpoint.save")
    if format == "dcp":
        # Refused on every rank with the ranks' own checks, before anything is written.
        refused = None
        if kind != "full":
            refused = ValueError(
                f"kind={kind!r} does not apply to format='dcp': DCP's layout is one (an FSDP "
                "model's and its optimizer's slices by each rank, a ShardedOptimizer's state "
                "by each owner, the rest by rank 0); leave kind='full', or save kind='sharded' "
                "in the tandem format"
            )
        return write_dcp(state, path, async_=async_, problem=refused, started=started)
    rank, world_size = _dist.group_rank(), _dist.group_size()
    # Phase 1: every rank sorts its values, and the ranks compare them before any collective.
    entries, problem = classify_state(state)
    if kind not in KINDS:
        problem = ValueError(f"kind must be one of {list(KINDS)}, not {kind!r}")
    agree(entries, problem, path, "save")
    # Phase 2: each value's state (FSDP and ShardedOptimizer gather here).
    collected = collect_entries(entries, kind)
    tags = {e.key: e.tag for e in entries}
    write = functools.partial(_write, path, kind, world_size, tags, rank)
    if not async_:
        return write(collected, Meeting())
    # Phases 3 and 4 in the background, from a copy: the caller may change the objects now.
    return WRITER.start(path, collected, write, rank, started)


def _write(
    path: Path,
    kind: Kind,
    world_size: int,
    tags: dict[str, str],
    rank: int,
    collected: Collected,
    meeting: Meeting,
) -> Path:
    """Phases 3 and 4 of :func:`save`: each rank's shard file; rank 0's file, which commits."""
    saved = write_entries(collected, ShardFiles(path.parent, path.stem), rank, meeting.gather)
    verdict: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        objects = {
            key: {"type": tag, "state": saved.states[key], "ranks": saved.ranks.get(key)}
            for key, tag in tags.items()
        }
        payload = {
            "format": API_FORMAT,
            "kind": kind,
            "world_size": world_size,
            "shards": None if saved.digests is None else {"sha256": saved.digests},
            "objects": objects,
        }
        try:
            with meeting.commit():
                write_checkpoint_file(payload, path)
        except (OSError, ValueError) as e:
            verdict = (kind_of(e), f"rank 0 could not save checkpoint {path}: {e}")
    error, message = meeting.gather(verdict)[0]
    if error is not None:
        raise ERRORS[error](message)
    if saved.digests is None:
        tidy_shards(path, rank)
    return path


def load(
    state: MutableMapping[str, Any], path: str | Path, *, format: Format | None = None
) -> None:
    """Load the checkpoint at ``path`` into the values of ``state``, in place (a collective).

    Models, optimizers, engines and stateful objects load their saved state; plain values are
    replaced in ``state`` (a tensor of the same shape and dtype is copied into). Rank 0 reads
    the file (the other ranks may not see its disk) and sends it to the others; in the
    sharded kind each rank reads its own shard file.

    Everything is checked on every rank before anything changes: the checksums, the keys (a key
    in the file that ``state`` lacks, or the reverse, is an error naming them), each value's
    type, the models' keys and shapes, the optimizers' parameter groups, the shards. Stateful
    objects load first, and are put back as they were if one of them refuses its state; the
    per-rank states (RNG) are restored last. At another world size than the save's, sharded
    state is cut anew and per-rank states mapped (see the module doc).

    Args:
        state: the same keys as the saved dict, with objects to load into and placeholders
            for plain values (``{"step": 0}``).
        path: a file written by :func:`save`, or a directory of torch's distributed
            checkpoint (DCP: it has a ``.metadata`` file), e.g. one torch saved from DDP or
            FSDP2 with ``get_state_dict`` (:mod:`tandem.checkpoint.dcp`), at any world size.
        format: ``"tandem"`` or ``"dcp"``; None (default): a DCP directory is recognised.

    Raises:
        CheckpointError: the file is missing, corrupt, truncated, not a tandem checkpoint (the
            message names what it is), or a shard file is missing or corrupt.
        ValueError: it does not fit ``state`` (the message names the key and what differs),
            e.g. FSDP shards for a model that is not FSDP, or per-rank state of another world
            size for an object without ``load_rank_state_dicts``.

    Example::

        state = {"model": model, "optimizer": opt, "rng": tandem.checkpoint.RNG(), "step": 0}
        tandem.checkpoint.load(state, "ckpt/100.pt")
        start = state["step"]
    """
    path = Path(path)
    WRITER.settle("tandem.checkpoint.load")
    if format not in (None, "tandem", "dcp"):
        raise ValueError(f"format must be 'tandem', 'dcp' or None, not {format!r}")
    # A DCP save that did not finish is recognised too, and refused as one.
    if format == "dcp" or (format is None and (is_dcp(path) or holds_dcp_files(path))):
        load_dcp(state, path)
        return
    rank = _dist.group_rank()
    # Phase 1: every rank sorts its values; the ranks compare them.
    entries, problem = classify_state(state)
    agree(entries, problem, path, "load")
    # Phase 2: rank 0 reads and verifies its file; every rank gets its content.
    verdict: tuple[str | None, Any] = (None, None)
    if rank == 0:
        try:
            verdict = (None, read_api_file(path))
        except CheckpointError as e:
            verdict = (str(e), None)
    error, payload = from_rank0(verdict)
    if error is not None:
        raise CheckpointError(error)
    # Phase 3: every check, and each rank's own shard read; all ranks hear every verdict.
    # (At another world size each rank reads the saved shard files that overlap its share.)
    shard: dict[str, Any] | None = None
    local: Exception | None = None
    try:
        shard = check(path, payload, entries, ShardFiles(path.parent, path.stem), rank)
    except (ValueError, CheckpointError) as e:
        local = e
    settle(local)
    # Phase 4: load; a failure here (an object's own refusal) is raised on every rank too.
    local = None
    try:
        load_into(state, path, payload, entries, shard, rank)
    except Exception as e:
        local = e
    settle(local)


def export_weights(
    source: str | Path | nn.Module | Engine, out: str | Path, *, key: str | None = None
) -> Path:
    """Write the plain model's weights to ``out`` as safetensors; ``out``.

    The keys are the unwrapped module's, so the file loads with ``safetensors.torch.load_file``
    into the plain model with ``load_state_dict(strict=True)``.

    Args:
        source: a checkpoint (a Trainer run directory, meaning its latest checkpoint; a Trainer
            checkpoint file; a :func:`save` file; full or sharded), read in this process alone;
            or a live model or engine (tandem.DDP, FSDP, plain), a collective: every rank
            calls it, rank 0 writes.
        out: the file to write, atomically: on any error it is left as it was.
        key: which model of a :func:`save` file that holds several.

    Raises:
        CheckpointError: no checkpoint at ``source``, or a corrupt, foreign or incomplete one.
        ValueError: ``key`` is needed or names no model; ``out`` is a directory.
        ImportError: safetensors is not installed: ``pip install "tandem[export]"``.

    Example::

        tandem.checkpoint.export_weights("runs/lm", "lm.safetensors")
        net.load_state_dict(safetensors.torch.load_file("lm.safetensors"), strict=True)
    """
    if not isinstance(source, nn.Module | Engine):
        return _export_file(source, out, key=key).out
    out = Path(out)
    # A collective: every rank joins the gather of a sharded model; rank 0 writes.
    state = source.model_state if isinstance(source, Engine) else model_state(source)
    weights = state.plain_weights(0)
    verdict: tuple[str | None, str | None] = (None, None)
    if weights is not None:
        try:
            write_safetensors(strip_wrapper_prefixes(weights), out, {"tandem.source": "model"})
        except (OSError, ValueError, ImportError) as e:
            verdict = (kind_of(e), f"rank 0 could not export to {out}: {e}")
    error, message = from_rank0(verdict)
    if error is not None:
        raise ERRORS[error](message)
    return out
