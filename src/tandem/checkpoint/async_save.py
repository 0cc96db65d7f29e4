"""Checkpoints written in the background: the training waits only for a copy of the state.

A save with ``async_=True`` (:func:`tandem.checkpoint.save`, the Trainer's
``checkpoint_async``) runs in two parts:

1. in the caller, on every rank, as a synchronous save begins: the ranks agree on the keys, each
   value's state is taken (FSDP and ShardedOptimizer gather here), then every tensor this rank
   will write is copied into host memory (:class:`Staging`). The caller goes on from there,
   and may change the live tensors at once;
2. in a thread of this process (``tandem-checkpoint-writer``), from that copy: the files a
   synchronous save writes, with its fsyncs, checksums and order (each rank's shard file, then
   rank 0's file and the sidecar that commits it, then a Trainer run's ``latest``). The ranks'
   reports and rank 0's verdict travel over a Gloo group of the writers' own, so that they
   never interleave with the training's collectives.

The writer thread yields the CPU to the training (:func:`yield_cpu`): on Linux it puts itself,
and only itself, in the idle scheduling class (``SCHED_IDLE``), so the write's copies, hashing
and fsyncs run when a core would otherwise idle (the ranks' waits in collectives, data loading)
rather than taking time slices from the training's threads. The price is the write's length
while every core is busy: it still progresses (the kernel gives an idle-class thread a small
share, never none), and once the training waits for it (the next save, ``wait()``, the end of
``train()``, the interpreter's exit) the time the waiting thread leaves on its core is the
writer's, unless other programs keep every core busy too: then the write, and the wait, last
as long as they do (an unprivileged thread cannot leave the idle class: a wait cannot raise the
writer's priority back).

At most one save is in flight in a process: a save (or a load) that finds one still being
written waits for it first, and logs a warning that it did (saves closer together than a write
takes). A save's failure is raised, on every rank alike (the ranks share the verdict as a
synchronous save does), at the first of: its handle's :meth:`AsyncSave.wait`, the next save or
load, the end of ``Trainer.train()``; one that nothing waited for is waited for when the
interpreter exits, and a failure then is printed on stderr. Call ``wait()`` before
``tandem.shutdown()``: the writer's group goes with the process group.

Staging memory: one copy of the tensors this rank writes, kept between saves and reused while
their shapes and dtypes stay the same (no allocation per save). That is the whole gathered state
(model and optimizer) on rank 0 in the full kind, and on every rank its shard file's part in the
sharded kind, plus the per-rank states (RNG). Tensors on a GPU are copied into pinned memory.

The write makes one pass over the staged bytes: each file of the tandem format is hashed as it
is written, chunk by chunk (``tandem.files.write_temp_digested``), rather than read back
afterwards to hash it, a second pass over memory, which the idle class does not keep from the
training: the cores share the memory bus. ``WRITER.bytes_per_s`` (None by default) bounds the
background write's rate as well: its chunks then come with pauses between them, so that it
takes longer and leaves the memory bus to the training in between.

A process killed at any moment of the background write (one rank, or the whole job) leaves what
a synchronous save killed there leaves: each rank's files are fsynced, with their sha256 taken
of the bytes as they were written, before it reports, rank 0 commits only once every rank
reported, and ``latest`` moves last; a checkpoint whose save did not finish never loads as
complete.

Example::

    handle = tandem.checkpoint.save(state, "ckpt/step100.pt", async_=True)
    ...                                   # training goes on while the file is written
    handle.wait()                         # committed (or its error, on every rank)
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import enum
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem import _dist
from tandem._dist import gather_objects
from tandem.checkpoint.phases import ERRORS, Collected, kind_of
from tandem.doctor import records
from tandem.files import paced

log = logging.getLogger(__name__)

THREAD_NAME = "tandem-checkpoint-writer"

Gather = Callable[[Any], list[Any]]

# Values a state holds that nothing can change in place: kept as they are, never copied.
_IMMUTABLE = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
    torch.memory_format, enum.Enum,
)  # fmt: skip

# One commit at a time in a process: an abandoned save's late commit never crosses a new one's.
_COMMIT = threading.Lock()

#: The niceness asked for where the idle class is not available (the lowest priority).
LOWEST_NICE = 19


def yield_cpu() -> str:
    """Lower the calling thread's CPU priority below the training's; what it got, in words.

    Linux schedules each thread on its own: ``SCHED_IDLE`` for this thread alone (the rest of
    the process keeps its class), else niceness :data:`LOWEST_NICE` for it; elsewhere (macOS,
    Windows) the thread is left as it is, ``"unchanged"``. Lowering needs no privilege; an
    unprivileged thread cannot raise itself back, so call it only in a thread of its own.

    Example::

        threading.Thread(target=lambda: (yield_cpu(), write_the_files())).start()
    """
    tid = threading.get_native_id()
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return "SCHED_IDLE"
        except OSError as e:  # a kernel or a sandbox without the idle class
            log.debug("SCHED_IDLE refused for the checkpoint writer (%s); trying nice", e)
    if hasattr(os, "setpriority") and sys.platform.startswith("linux"):
        # Linux only: elsewhere PRIO_PROCESS with a thread id would renice the whole process.
        try:
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST_NICE)
            return f"nice {LOWEST_NICE}"
        except OSError as e:
            log.debug("nice %d refused for the checkpoint writer (%s)", LOWEST_NICE, e)
    return "unchanged"


@dataclass
class Meeting:
    """How the ranks of one save meet while its files are written.

    ``gather``: every rank's object in rank order, the way the ranks' reports and rank 0's
    verdict travel (a synchronous save's: the default group's; the writer's: its own group's).
    :meth:`commit` holds rank 0's commit; it refuses a save given up (:meth:`Writer.abandon`).
    """

    gather: Gather = gather_objects
    abandoned: bool = field(default=False)

    @contextlib.contextmanager
    def commit(self) -> Iterator[None]:
        with _COMMIT:
            if self.abandoned:
                raise RuntimeError(
                    "the save was given up (its process group was re-formed) before its commit"
                )
            yield


class Staging:
    """Host memory that a state's tensors are copied into, kept and reused between saves.

    A tensor's buffer is found by its place in the state (its path of keys): the next copy whose
    tensor there has the same shape and dtype writes into the same memory. A buffer no longer
    used is let go at the end of the copy, so the memory held is one copy of the last state
    copied (two, for a moment, of the tensors whose shapes changed). Tensors that share memory
    (tied weights) are copied once, and share their copy.

    Example::

        staging = Staging()
        copy = staging.copy({"model": model.state_dict(), "step": 3})
        model.weight.data.add_(1)              # the copy keeps the values at the call
        staging.nbytes                         # the bytes held
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """The bytes of host memory held."""
        return sum(b.nbytes for b in self._buffers.values())

    def copy(self, tree: Any) -> Any:
        """``tree`` with its containers rebuilt and every tensor copied into this memory.

        Dicts (an ``OrderedDict``'s attributes, like a ``state_dict()``'s ``_metadata``,
        included), lists and tuples are rebuilt with their types; tensors become CPU tensors of
        the same dtype, shape and values (a Parameter stays a Parameter); immutable values are
        kept; anything else is deep-copied.
        """
        old, self._buffers = self._buffers, {}
        seen: dict[tuple[Any, ...], torch.Tensor] = {}
        devices: set[torch.device] = set()
        copied = self._copy(tree, (), old, seen, devices)
        for device in devices:  # the copies from a GPU were issued without waiting
            torch.cuda.synchronize(device)
        return copied

    def _copy(
        self,
        value: Any,
        path: tuple[Any, ...],
        old: dict[tuple[Any, ...], torch.Tensor],
        seen: dict[tuple[Any, ...], torch.Tensor],
        devices: set[torch.device],
    ) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, old, seen, devices)
        if isinstance(value, dict):
            out = copy.copy(value)  # its type and attributes; the values are replaced below
            if hasattr(out, "__dict__"):
                out.__dict__ = copy.deepcopy(value.__dict__)
            for key, item in value.items():
                out[key] = self._copy(item, (*path, key), old, seen, devices)
            return out
        if isinstance(value, list | tuple):
            items = [self._copy(v, (*path, i), old, seen, devices) for i, v in enumerate(value)]
            if isinstance(value, list):
                return type(value)(items)
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if isinstance(value, _IMMUTABLE):
            return value
        return copy.deepcopy(value)

    def _tensor(
        self,
        value: torch.Tensor,
        path: tuple[Any, ...],
        old: dict[tuple[Any, ...], torch.Tensor],
        seen: dict[tuple[Any, ...], torch.Tensor],
        devices: set[torch.device],
    ) -> torch.Tensor:
        if type(value) not in (torch.Tensor, nn.Parameter) or value.layout != torch.strided:
            return value.detach().to("cpu", copy=True)  # sparse, subclasses: a copy of its own
        same = (
            value.device,
            value.dtype,
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            value.stride(),
        )
        if same in seen:  # the same memory under another key (tied weights)
            return seen[same]
        pin = value.device.type == "cuda"
        place = (*path, pin)  # a GPU tensor's buffer is pinned, a CPU tensor's not
        buffer = old.pop(place, None)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
        with torch.no_grad():
            buffer.copy_(value, non_blocking=pin)
        if pin:
            devices.add(value.device)
        self._buffers[place] = buffer
        staged = buffer.detach()
        if isinstance(value, nn.Parameter):
            staged = nn.Parameter(staged, requires_grad=value.requires_grad)
        elif value.requires_grad:
            staged.requires_grad_(True)
        seen[same] = staged
        return staged


class AsyncSave:
    """A checkpoint being written in the background (``tandem.checkpoint.save(...,
    async_=True)``); every rank holds one.

    Example::

        handle = tandem.checkpoint.save(state, "ckpt/step100.pt", async_=True)
        handle.done()          # False while the file is being written
        handle.wait()          # Path('ckpt/step100.pt'), once committed
    """

    def __init__(self, path: Path, writer: Writer, started: float, meeting: Meeting) -> None:
        self.path = path
        self.started = started  # time.monotonic() when the save was called
        self.blocked_s = 0.0  # how long the caller was held: the checks and the copy
        self.written_s: float | None = None  # how long the background write took, once done
        self._writer = writer
        self._meeting = meeting
        self._finished = threading.Event()
        self._error: Exception | None = None
        self._thread: threading.Thread | None = None  # the writer, once started

    def done(self) -> bool:
        """Whether the background write has finished (committed or failed)."""
        return self._finished.is_set()

    def wait(self) -> Path:
        """Block until the checkpoint is committed; its path (every rank calls it).

        Raises:
            OSError, ValueError, CheckpointError, RuntimeError: the save failed; the message
                names the checkpoint and what went wrong (on every rank the same, unless
                the ranks lost touch: a rank died while it was written).
        """
        self._finished.wait()
        # The thread itself too, not only its result: a writer thread still winding down (its
        # copy being freed) when the interpreter finalizes is stopped inside torch's C++ code,
        # which aborts the process ("terminate called without an active exception").
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._writer.forget(self)
        if self._error is not None:
            raise self._error
        return self.path

    def _write(
        self,
        write: Callable[[Any, Meeting], Path],
        staged: Any,
        idle: bool,
        bytes_per_s: float | None,
    ) -> None:
        begun = time.monotonic()
        try:
            if idle:
                # The write competes with the training for the same cores (on a machine the
                # ranks fill, a writer at their priority slowed each step by 14-16%): it runs
                # in their gaps instead. Its own thread, so the training's keeps its class.
                log.debug("checkpoint writer for %s: %s", self.path, yield_cpu())
            with paced(bytes_per_s):
                write(staged, self._meeting)
        except Exception as e:
            self._error = _not_committed(self.path, e)
        finally:
            self.written_s = time.monotonic() - begun
            self._finished.set()


def _not_committed(path: Path, error: Exception) -> Exception:
    """The error a background save's failure is raised as: its kind, naming the checkpoint."""
    if kind_of(error) != "RuntimeError":
        what = f"was not committed: {error}"
    elif isinstance(error, RuntimeError):  # a collective of the writers' group failed
        # This rank cannot tell whether rank 0 committed before the others were lost.
        what = (
            "is not known to be committed: the ranks lost touch while it was written (a rank "
            f"died or left?): {error}"
        )
    else:
        what = f"was not committed: {type(error).__name__}: {error}"
    raised = ERRORS[kind_of(error)](f"checkpoint {path}, written in the background, {what}")
    raised.__cause__ = error
    return raised


class Writer:
    """The one background writer of a process: its staging memory, its group, its save."""

    def __init__(self) -> None:
        self.staging = Staging()
        self.in_flight: AsyncSave | None = None
        # Whether the writer thread yields the CPU (yield_cpu); False writes at the caller's
        # priority, as benchmarks/checkpoint.py does to measure what yielding buys.
        self.idle = True
        # The bound on the background write's rate (bytes/s; None: none): see the module doc.
        self.bytes_per_s: float | None = None
        self._group: dist.ProcessGroup | None = None
        self._for: Any = None  # the default group the writers' group was made in

    def settle(self, before: str) -> None:
        """Wait for the save in flight, if any, and raise its error (once); every save and
        load calls this first, on every rank, before any collective of its own."""
        handle = self.in_flight
        if handle is None:
            return
        if not handle.done():
            began = time.monotonic()
            handle._finished.wait()
            log.warning(
                "%s waited %.2f s for checkpoint %s, still being written in the background "
                "(at most one save is in flight): saves come closer together than a write takes",
                before, time.monotonic() - began, handle.path,
            )  # fmt: skip
        handle.wait()

    def forget(self, handle: AsyncSave) -> None:
        if self.in_flight is handle:
            self.in_flight = None

    def start(
        self,
        path: Path,
        collected: Collected,
        write: Callable[[Any, Meeting], Path],
        rank: int,
        started: float,
    ) -> AsyncSave:
        """Copy ``collected`` into the staging memory, then ``write(copy, meeting)`` in the
        background; its handle. Called on every rank alike, once :meth:`settle` returned."""
        assert self.in_flight is None, "settle() the save in flight first"
        gather = self._gather()
        # Only rank 0 writes the main file: the other ranks keep no copy of its part.
        states = collected.states if rank == 0 else dict.fromkeys(collected.states)
        staged = Collected(*self.staging.copy((states, collected.parts, collected.mine)))
        handle = AsyncSave(path, self, started, Meeting(gather))
        handle.blocked_s = time.monotonic() - started
        self.in_flight = handle
        thread = threading.Thread(
            target=handle._write,
            args=(write, staged, self.idle, self.bytes_per_s),
            name=THREAD_NAME,
            daemon=True,
        )
        handle._thread = thread
        thread.start()
        return handle

    def abandon(self) -> None:
        """Give up the save in flight: its group lost a member (recovery in memory re-forms
        the world). It never commits after this; its thread may go on reading its copy, so the
        next save copies into new memory."""
        handle, self.in_flight = self.in_flight, None
        if handle is None:
            return
        with _COMMIT:
            handle._meeting.abandoned = True
        if not handle.done():
            self.staging = Staging()
        self._group = self._for = None
        log.warning("checkpoint %s, being written in the background, was given up", handle.path)

    def _gather(self) -> Gather:
        """How the background write's ranks meet: over the writers' own Gloo group, made the
        first time (a collective: every rank's first async save) and again in a new world."""
        if _dist.group_size() == 1:
            return lambda obj: [obj]
        world = dist.group.WORLD
        if self._group is None or self._for is not world:
            self._group = dist.new_group(backend="gloo", group_desc="tandem checkpoint writer")
            self._for = world
        group = self._group
        return lambda obj: _gather_in_background(obj, group)


def _gather_in_background(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``obj`` over ``group``, in rank order (pickled: small objects).

    Issued as asynchronous work and waited for by this thread: the doctor records it (hang
    reports see it) but does not count its wait as the training step's, as it counts a
    blocking collective's.
    """
    size = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    records.wait(dist.all_gather(lengths, torch.tensor([data.numel()]), group=group, async_op=True))
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    records.wait(dist.all_gather(out, padded, group=group, async_op=True))
    return [pickle.loads(o[: int(n)].numpy().tobytes()) for o, n in zip(out, lengths, strict=True)]


#: The process's writer (``tandem.checkpoint.save`` and the Trainer's checkpointer share it).
WRITER = Writer()


def _at_exit() -> None:
    """The interpreter exits: a save in flight that nothing waited for is finished now."""
    handle = WRITER.in_flight
    if handle is None:
        return
    try:
        handle.wait()
    except Exception as e:
        print(f"tandem.checkpoint: {e}", file=sys.stderr, flush=True)


atexit.register(_at_exit)
