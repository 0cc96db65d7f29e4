"""The recovery tests' oracles, chains of saves and resumes: each distinct one run once a session,
the missing ones of a batch in one launch.

A recovered run's oracle is the chain of saves and resumes with the membership schedule the run
went through: train at N ranks to step K, save; resume at M ranks to step L, save; ...; resume
to the end. Many tests need the same chain, or chains that begin alike, and every launch costs
an interpreter and torch's import in every process. So:

- a chain is named by its whole description (:class:`Chain`: the worker, the arguments every
  segment takes, each segment's world size, the step it saves after and its own arguments).
  :class:`Chains` keeps each segment's result under the description of the chain up to it:
  a chain that begins as one already run starts from where that one's prefix ended, and a
  description that differs in anything (a size, a step, a seed, an argument) names other
  files: nothing is shared that was not run alike;
- one launch (``tandem run -m tests.recovery.chains SPEC``, :func:`main`) runs every missing
  segment of a batch, in order: a process per rank of the largest segment imports the worker
  once and forks a child for each segment it takes part in, which starts as a fresh launch at
  that size would (its ``WORLD_SIZE``, a rendezvous of its own over a file store, or none at
  one rank; the worker's ``main()`` with the segment's arguments), so that nothing a segment
  does to its process (a generator drawn, a function patched) reaches the next.

Two workers are known: ``tests.recovery.recovery_worker`` (a segment's result is the record
file it writes; ``--stop-after K``, ``--resume FILE``) and ``tests.recovery.trainer_worker`` (a
run directory: a copy of the previous segment's, resumed from its latest checkpoint; ``--max-steps
K``, ``--resume``).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib
import json
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.launching import run_job

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies

RECORD_WORKER = "tests.recovery.recovery_worker"
TRAINER_WORKER = "tests.recovery.trainer_worker"
# How each worker saves after a step and resumes: the flags, and whether a segment's result is
# a file (the previous one's is named) or a run directory (a copy of the previous one's).
STYLES = {
    RECORD_WORKER: ("--stop-after", ("--resume", "{previous}"), "file"),
    TRAINER_WORKER: ("--max-steps", ("--resume",), "directory"),
}


@dataclass(frozen=True)
class Segment:
    """One link: ``size`` ranks train to the end, or save after step ``stop``."""

    size: int
    stop: int | None = None
    args: tuple[str, ...] = ()  # this segment's own further arguments


@dataclass(frozen=True)
class Chain:
    """A chain of saves and resumes: the first segment starts afresh, each next one resumes
    from the previous one's save.

    Example::

        >>> c = Chain(RECORD_WORKER, (Segment(4, 3), Segment(3)), ("--epochs", "2"))
        >>> c.prefix(1).segments
        (Segment(size=4, stop=3, args=()),)
        >>> c.key() == Chain(RECORD_WORKER, (Segment(4, 3), Segment(2))).key()
        False
    """

    worker: str
    segments: tuple[Segment, ...]
    args: tuple[str, ...] = ()  # every segment's

    def __post_init__(self) -> None:
        if self.worker not in STYLES:
            raise ValueError(f"worker {self.worker!r}: chains know {', '.join(STYLES)}")
        if not self.segments:
            raise ValueError("a chain needs at least one segment")
        for i, segment in enumerate(self.segments[:-1]):
            if segment.stop is None:
                raise ValueError(f"segment {i} of {self.segments} runs to the end: none can follow")
        if any(s.size < 1 for s in self.segments):
            raise ValueError(f"a segment's size must be >= 1: {self.segments}")

    def prefix(self, n: int) -> Chain:
        """The chain of the first ``n`` segments."""
        return Chain(self.worker, self.segments[:n], self.args)

    def key(self) -> str:
        """A name for everything that makes this chain's result (a digest of its description)."""
        described = [
            self.worker,
            list(self.args),
            [list(map(repr, (s.size, s.stop, s.args))) for s in self.segments],
        ]
        return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:24]


def resumes(
    nproc: int,
    steps: Sequence[tuple[int, int]],
    args: Sequence[str] = (),
    worker: str = RECORD_WORKER,
) -> Chain:
    """The chain "``nproc`` ranks to the first step of ``steps`` (pairs of a step and the world
    size from it on), saved; resumed at that size to the next step, saved; ...; to the end".

    Example::

        >>> [(s.size, s.stop) for s in resumes(4, [(2, 3), (3, 2)]).segments]
        [(4, 2), (3, 3), (2, None)]
    """
    sizes = [nproc, *(size for _, size in steps)]
    stops: list[int | None] = [step for step, _ in steps]
    links = (Segment(n, stop) for n, stop in zip(sizes, [*stops, None], strict=True))
    return Chain(worker, tuple(links), tuple(args))


class Chains:
    """The session's oracle chains, kept in ``directory`` (one per pytest worker)."""

    def __init__(self, directory: Path, timeout: float = 400) -> None:
        self.directory, self.timeout = directory, timeout
        self.launches = 0  # how many launches ran chains (for the tests of this module)

    def result(self, chain: Chain) -> Path:
        """Where ``chain``'s result is (or will be): its record file or its run directory."""
        suffix = ".pt" if STYLES[chain.worker][2] == "file" else ""
        return self.directory / f"{chain.key()}{suffix}"

    def get(self, *chains: Chain) -> list[Path]:
        """The results of ``chains``, running the segments of them not run before in one launch
        per worker."""
        by_worker: dict[str, list[Chain]] = {}
        for chain in chains:
            by_worker.setdefault(chain.worker, []).append(chain)
        for worker, group in by_worker.items():
            self._run(worker, group)
        return [self.result(chain) for chain in chains]

    def _run(self, worker: str, chains: list[Chain]) -> None:
        stop_flag, resume_flags, style = STYLES[worker]
        segments: list[dict] = []
        planned: set[Path] = set()
        for chain in chains:
            for n in range(1, len(chain.segments) + 1):
                out = self.result(chain.prefix(n))
                if out in planned or out.exists():
                    continue  # run earlier in this session, or earlier in this batch
                segment = chain.segments[n - 1]
                previous = self.result(chain.prefix(n - 1)) if n > 1 else None
                argv = [str(out), *chain.args, *segment.args]
                if segment.stop is not None:
                    argv += [stop_flag, str(segment.stop)]
                if previous is not None:
                    argv += [flag.format(previous=previous) for flag in resume_flags]
                copy = (
                    [str(previous), str(out)]
                    if previous is not None and style == "directory"
                    else None
                )
                store = self.directory / f"{out.name}.store"
                segments.append(
                    {"size": segment.size, "argv": argv, "copy": copy, "store": str(store)}
                )
                planned.add(out)
        if not segments:
            return
        spec = self.directory / f"batch{self.launches}.json"
        spec.write_text(json.dumps({"worker": worker, "segments": segments}))
        self.launches += 1
        nproc = max(s["size"] for s in segments)
        result = run_job(
            nproc, [], "tests.recovery.chains", str(spec), timeout=self.timeout, check=False
        )
        if result.returncode != 0:
            for out in planned:  # a segment cut short leaves no result to be taken for one
                if out.is_dir():
                    shutil.rmtree(out)
                out.unlink(missing_ok=True)
                out.with_name(f"{out.name}.store").unlink(missing_ok=True)
            raise AssertionError(
                f"the oracle chains' launch failed ({spec}):\n{result.stderr[-4000:]}"
            )


def _segment(worker: str, segment: dict, rank: int) -> None:
    """In a forked child: run ``worker``'s main() as a fresh launch of the segment's size would."""
    import tandem

    size = segment["size"]
    os.environ.update(WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
    if segment["copy"] is not None and rank == 0:
        # Before the rendezvous: no rank of the segment starts (reads the copy) before rank 0
        # has joined it, so after the copy.
        shutil.copytree(*segment["copy"])
    if size > 1:  # one process alone makes no group, as a launch of one would not
        meet = tandem.init

        def init(*args: object, **kwargs: object) -> object:
            kwargs.setdefault("init_method", f"file://{segment['store']}")
            return meet(*args, **kwargs)  # type: ignore[arg-type]

        tandem.init = init  # type: ignore[assignment]
    sys.argv = [worker, *segment["argv"]]
    importlib.import_module(worker).main()
    tandem.shutdown()  # the Trainer script leaves its group to the process's end


def main() -> None:
    """``python -m tests.recovery.chains SPEC`` under ``tandem run``: every segment of SPEC, in
    order, each in a child forked from this process (torch and the worker imported once)."""
    import torch

    torch.set_num_threads(1)  # before any fork: no thread pool to inherit
    # What every segment would import on its own, once here: an optimizer's construction
    # imports torch._dynamo (seconds of CPU a process).
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    worker = spec["worker"]
    importlib.import_module(worker)
    rank = int(os.environ["RANK"])
    for j, segment in enumerate(spec["segments"]):
        if rank >= segment["size"]:
            continue  # this segment's ranks start without this process
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        child = os.fork()
        if child == 0:
            # The segment dies with this process (the launcher stops its workers, not what they
            # forked): nothing of a job cut short is left behind.
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)  # it died before the line above
            code = 0
            try:
                _segment(worker, segment, rank)
            except BaseException:  # reported here; the exit status tells the parent
                traceback.print_exc()
                code = 1
            # As a process's end would (its loggers flushed, its files closed), then no further:
            # the parent's own end is the parent's.
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(child, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"rank {rank}: segment {j} ({segment['argv']}) failed: {status}")


if __name__ == "__main__":
    main()
