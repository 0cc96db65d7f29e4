"""Recovery in memory: a rank that dies costs the step in flight, not a restart from disk.

Under ``tandem run --recover in-memory`` the launcher keeps the other workers running when one
dies, hosts the job's store itself (so rank 0's death does not take it along) and marks the
dead rank there (``tandem/recover/dead/<rank>``). A hand-written loop written with :class:`Run`
then goes on by itself:

1. Every step ends with a **commit**: each member sets ``gen<g>/commit/<step>/<rank>`` in the
   store once its backward (and so its gradient all-reduce) is done, and waits for every
   member's key before its optimizer steps. A step therefore commits on every member or on
   none: a rank that died before its key was set makes every survivor leave the step with its
   parameters and optimizer state as they were.
2. A survivor learns of the loss from its collective's error (Gloo's connection to the dead
   peer breaks), or from the launcher's mark while it waits for the commit, or from a
   heartbeat (``hb/<rank>``, every 0.5 s) older than ``heartbeat_timeout`` (a hung rank).
3. The survivors **agree on the new membership** through the store: each joins generation
   ``g + 1``; once every member of ``g`` has joined or is known to be gone, the first to
   decide writes the members (``compare_set``: one decision, the same on every rank). A rank
   left out, or a side that does not hold a majority of the ranks not known dead, stops with a
   :class:`MembershipError`.
4. They build a **new process group** over a fresh key prefix of the same store (the old one
   is destroyed), wrap the module in a new tandem.DDP, and **redo the step** at the smaller
   world size from the state they hold: the sampler deals the samples of the epoch not yet
   trained on to the new world, as a resume at another world size does, and each rank starts
   the redo from the random generators of the rank whose place it takes (published in the
   store at every commit). So the run ends where "train to the failed step, save, resume at the
   new size" ends, bitwise.

Without ``--recover in-memory`` (or with one process) :class:`Run` is a plain DDP loop: the
same steps, no store traffic.

Example::

    tandem.init()
    run = tandem.recovery.Run(net, torch.optim.SGD(net.parameters(), lr=0.1), train_set,
                              batch_size=32, epochs=3)

    def train_step(model, batch):            # may be run again after a failure
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.item()

    while not run.finished:
        loss = run.step(train_step)
"""

from __future__ import annotations

import base64
import gc
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from tandem._dist import group_rank, group_size, initialized
from tandem.checkpoint.rng import capture_rng_state, derived_seed, restore_rng_state, seed_rng
from tandem.data.sampler import DistributedSampler
from tandem.doctor import mismatch, records
from tandem.files import write_atomic
from tandem.job.secret import key_scope
from tandem.parallel.adapters import model_state, optimizer_state
from tandem.parallel.ddp import out_of_step
from tandem.parallel.ddp.wrapper import DistributedDataParallel
from tandem.world import reformed

log = logging.getLogger(__name__)

#: The environment variable ``tandem run --recover in-memory`` sets in every worker.
MODE_VARIABLE = "TANDEM_RECOVER"
#: Seconds without a heartbeat after which a rank counts as hung, unless the launcher says.
HEARTBEAT_TIMEOUT_VARIABLE = "TANDEM_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
#: Every key of the protocol lives under this prefix of the job's store (in the job secret's
#: scope, as the launcher writes its keys: a client without the secret can forge none).
PREFIX = f"tandem/{key_scope()}recover/"
_BEAT_S = 0.5
_POLL_S = 0.005
_COMMIT_SLICE = timedelta(seconds=0.05)


class MembershipError(RuntimeError):
    """This rank cannot go on: it was left out of the new membership, or its side of the job
    holds no majority (a partition), or the survivors could not agree in time."""


@dataclass
class Recovery:
    """One recovery, as the exit summary lists it."""

    generation: int
    lost: list[int]  # launch ranks (RANK as started)
    members: list[int]  # launch ranks of the new generation, in new rank order
    step: int  # the step redone
    detected_s: float | None  # from the launcher's record of the death to this rank noticing
    recovered_s: float | None = None  # from noticing to the next committed step
    started: float = field(default=0.0, repr=False)  # monotonic, when noticed

    def record(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "lost": self.lost,
            "members": self.members,
            "step": self.step,
            "detected_s": self.detected_s,
            "recovered_s": self.recovered_s,
        }


class _Lost(RuntimeError):
    """A member is gone (internal: the step is left and the group re-formed)."""


class Membership:
    """The job's members and this rank's place among them, agreed through the store.

    Members are named by their launch rank (``RANK`` as the launcher started them), which never
    changes; a generation's group ranks are their positions in its member list.

    Example::

        members = Membership(store, me=2, members=[0, 1, 2, 3], heartbeat_timeout=10.0)
        members.gone()              # {1}: the launcher marked rank 1 dead, or it went silent
        members.reform()            # generation 1: [0, 2, 3]; this rank is now rank 1 of 3
    """

    def __init__(
        self, store: dist.Store, me: int, members: list[int], heartbeat_timeout: float
    ) -> None:
        self.store = store
        self.me = me
        self.members = list(members)
        self.generation = 0
        self.heartbeat_timeout = heartbeat_timeout

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def key(self, *parts: object) -> str:
        return PREFIX + "/".join(str(p) for p in parts)

    def dead(self, store: dist.Store | None = None) -> dict[int, dict[str, Any]]:
        """Members the launcher marked dead: launch rank -> its record (``how``, ``at``).

        ``store``: another client of the job's store (a store client serves one thread)."""
        store = store or self.store
        found = {}
        for r in self.members:
            key = self.key("dead", r)
            if r != self.me and store.check([key]):
                found[r] = json.loads(store.get(key))
        return found

    def last_beats(self, store: dist.Store | None = None) -> dict[int, float]:
        """The time of each other member's last heartbeat (those that beat at all)."""
        store = store or self.store
        beats = {}
        for r in self.members:
            key = self.key("hb", r)
            if r != self.me and store.check([key]):
                beats[r] = float(store.get(key))
        return beats

    def silent(self, store: dist.Store | None = None) -> set[int]:
        """Members whose heartbeat is older than the timeout (hung, or cut off)."""
        now = time.time()
        beats = self.last_beats(store)
        return {r for r, at in beats.items() if now - at > self.heartbeat_timeout}

    def gone(self, store: dist.Store | None = None) -> set[int]:
        return set(self.dead(store)) | self.silent(store)

    def wait_commit(self, step: int) -> None:
        """Return once every member committed ``step``; :class:`_Lost` if one is gone first."""
        keys = [self.key(f"gen{self.generation}", "commit", step, r) for r in self.members]
        self.store.set(keys[self.rank], "1")
        next_gen = self.key(f"gen{self.generation + 1}", "join")
        while True:
            try:
                # Returns the moment the last key is set; a slice that runs out looks for a
                # member gone (a few store calls) before waiting again.
                self.store.wait(keys, _COMMIT_SLICE)
                break
            except dist.DistStoreError:
                if self.gone() or _any_key(self.store, next_gen, self.members):
                    raise _Lost(f"a member left during the commit of step {step}") from None
        if step >= 2:  # every member is past the commit before the last one: tidy it
            self.store.delete_key(self.key(f"gen{self.generation}", "commit", step - 2, self.me))

    def reform(self) -> list[int]:
        """Agree on the next generation's members; returns the launch ranks that left.

        Raises:
            MembershipError: this rank was left out, or holds no majority, or no agreement
                came within three heartbeat timeouts.
        """
        old, g = self.members, self.generation + 1
        self.store.set(self.key(f"gen{g}", "join", self.me), "1")
        deadline = time.monotonic() + 3 * self.heartbeat_timeout
        decided_key = self.key(f"gen{g}", "members")
        while not self.store.check([decided_key]):
            joined = {r for r in old if self.store.check([self.key(f"gen{g}", "join", r)])}
            dead = set(self.dead())
            if joined | dead | self.silent() >= set(old):
                proposal = sorted(joined - dead)
                self.store.compare_set(decided_key, "", json.dumps(proposal))
                break
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"rank {self.me}: the members of generation {g} did not agree within "
                    f"{3 * self.heartbeat_timeout:.0f} s (joined: {sorted(joined)}, of "
                    f"{old})"
                )
            time.sleep(_POLL_S)
        members = json.loads(self.store.get(decided_key))
        if self.me not in members:
            raise MembershipError(
                f"rank {self.me} was left out of generation {g} (members {members}): the "
                "others counted it as gone; it stops here"
            )
        confirmed = set(self.dead())
        counted = [r for r in old if r not in confirmed]
        if 2 * len(members) <= len(counted):
            raise MembershipError(
                f"rank {self.me}: only {len(members)} of the {len(counted)} ranks not known "
                f"dead ({counted}) are reachable: without a majority this side of a partition "
                "stops rather than train on its own"
            )
        lost = [r for r in old if r not in members]
        self.members, self.generation = members, g
        return lost


class _Heartbeat(threading.Thread):
    """Every 0.5 s, on its own store connection: sets ``hb/<me>`` to the time, and looks for a
    member gone (the launcher's mark, or silence). Finding one, it makes this process's waits
    on collectives raise :class:`_Lost` within half a second (``tandem.doctor.mismatch``'s
    sliced waits), so that a survivor blocked in a collective with a dead or hung peer leaves
    it at once instead of at the collective's timeout."""

    def __init__(self, members: Membership) -> None:
        super().__init__(name="tandem-heartbeat", daemon=True)
        self.members = members
        self.store = _job_store()
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # held by a re-form: no stale verdict lands after it

    def run(self) -> None:
        key = self.members.key("hb", self.members.me)
        while not self.stopped.is_set():
            try:
                self.store.set(key, repr(time.time()))
                with self.lock:
                    gone = self.members.gone(self.store)
                    if gone and mismatch.failed is None:
                        mismatch.fail(
                            f"rank(s) {sorted(gone)} of the job left", _Lost, wait_for_others=False
                        )
            except Exception:  # the store is gone: the job is ending
                return
            self.stopped.wait(_BEAT_S)


class Run:
    """A hand-written DDP training loop that survives the loss of a rank (see the module doc).

    Args:
        module: the model, on its device; it is wrapped in tandem.DDP (anew after a recovery).
        optimizer: an optimizer over ``module``'s parameters.
        dataset: the training set (indexed), dealt by :class:`tandem.data.DistributedSampler`.
        batch_size: samples per rank and step (the global batch shrinks with the world).
        epochs: passes over the data set; :attr:`finished` after the last.
        seed, shuffle: the sampler's.
        collate_fn: turns a list of samples into a batch (torch's default collate).
        ddp_kwargs: more arguments for tandem.DDP.
        heartbeat_timeout: seconds of silence after which a rank counts as hung (default
            ``TANDEM_HEARTBEAT_TIMEOUT``, else 10).

    Example::

        run = Run(net, opt, train_set, batch_size=8)
        while not run.finished:
            run.step(lambda model, batch: loss_fn(model(batch[0]), batch[1]).backward())
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset,
        *,
        batch_size: int,
        epochs: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        ddp_kwargs: dict[str, Any] | None = None,
        heartbeat_timeout: float | None = None,
    ) -> None:
        if batch_size < 1 or epochs < 1:
            raise ValueError(f"batch_size ({batch_size}) and epochs ({epochs}) must be >= 1")
        wrapped = model_state(module)
        if wrapped.sharded or wrapped.reducer is not None or wrapped.target is not module:
            raise ValueError(
                f"tandem.recovery.Run takes the plain module and wraps it in tandem.DDP itself "
                f"(anew after a recovery); this one is a {type(module).__name__}: pass the "
                "module inside it (a sharded model is not recovered in memory yet: use "
                "--recover restart with checkpoints)"
            )
        if optimizer_state(optimizer).sharded:
            raise ValueError(
                f"tandem.recovery.Run with a {type(optimizer).__name__}: its state is sharded "
                "across ranks, so a lost rank would take its shard along and the survivors "
                "would step without it. Use a plain optimizer (each rank holds the whole "
                "state), or --recover restart with checkpoints"
            )
        self.module, self.optimizer, self.dataset = module, optimizer, dataset
        self.batch_size, self.epochs = batch_size, epochs
        self.seed, self.shuffle, self.collate_fn = seed, shuffle, collate_fn
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.step_count = 0
        self.epoch = 0
        self.recoveries: list[Recovery] = []
        self._pending: Recovery | None = None
        self.members: Membership | None = None
        self._heartbeat: _Heartbeat | None = None
        size = group_size()
        if size > 1 and os.environ.get(MODE_VARIABLE) == "in-memory":
            timeout = heartbeat_timeout or float(
                os.environ.get(HEARTBEAT_TIMEOUT_VARIABLE, DEFAULT_HEARTBEAT_TIMEOUT_S)
            )
            me = group_rank()
            self.members = Membership(_job_store(), me, list(range(size)), timeout)
            self._heartbeat = _Heartbeat(self.members)
            self._heartbeat.start()
            # A peer that left is a member lost: no survey of where the others are.
            out_of_step.survey_lost_peers = False
        self.model: nn.Module = self._wrap()
        self._committed: dict[str, Any] | None = None  # the sampler after the last commit
        self._start_sampler()
        self._keep_rng()

    # -- what a loop reads ----------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Every epoch has been trained."""
        return self.epoch >= self.epochs

    @property
    def rank(self) -> int:
        return self.members.rank if self.members is not None else group_rank()

    @property
    def world_size(self) -> int:
        return self.members.world_size if self.members is not None else group_size()

    # -- the step -----------------------------------------------------------------------------

    def step(self, fn: Callable[[nn.Module, Any], Any]) -> Any:
        """Run ``fn(model, batch)`` (forward and backward), commit, and step the optimizer.

        ``fn`` may run more than once for one step: after a rank is lost it runs again, on the
        survivors, with the new model wrapper and this rank's share of the step's samples at
        the new world size. Its result (of the run that committed) is returned.

        Raises:
            MembershipError: this rank cannot go on (see :class:`MembershipError`).
        """
        if self.finished:
            raise RuntimeError(f"the run has trained its {self.epochs} epoch(s)")
        while True:
            batch = self._next_batch()
            self.optimizer.zero_grad(set_to_none=True)
            lost = False
            try:
                result = fn(self.model, batch)
                if self.members is not None:
                    self.members.wait_commit(self.step_count)
            except MembershipError:
                raise
            except Exception as error:
                if self.members is None or not self._lost_member(error):
                    raise
                lost = True
            if lost:
                # Outside the except block: its traceback (the frames of the failed step, which
                # hold the old group's work) is gone before the old group is taken down.
                self._recover()
                continue
            break
        self.optimizer.step()
        self.step_count += 1
        self._committed = self.sampler.state_dict()
        self._keep_rng()
        self._after_commit()
        return result

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run's position (step, epoch, sampler): with the model's and the optimizer's
        state, what a resume at any world size needs."""
        return {"step": self.step_count, "epoch": self.epoch, "sampler": self._committed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count, self.epoch = int(state["step"]), int(state["epoch"])
        self._committed = state["sampler"]
        self._start_sampler()

    def close(self) -> None:
        """Stop the heartbeat (the loop is done)."""
        if self._heartbeat is not None:
            self._heartbeat.stopped.set()

    # -- inside --------------------------------------------------------------------------------

    def _wrap(self) -> nn.Module:
        """The module as the step calls it: in a new tandem.DDP over the current group (the
        previous wrapper's gradient hooks are released first)."""
        previous: DistributedDataParallel | None = getattr(self, "_ddp", None)
        if previous is not None:
            previous.reducer.release()
        self._ddp = None
        if self.world_size == 1 and not initialized():
            return self.module
        self._ddp = DistributedDataParallel(self.module, **self.ddp_kwargs)
        return self._ddp

    def _start_sampler(self) -> None:
        self.sampler = DistributedSampler(
            cast(Sized, self.dataset),
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=self.shuffle,
            seed=self.seed,
        )
        if self._committed is not None:
            self.sampler.load_state_dict(self._committed)
        self.sampler.set_epoch(self.epoch)
        self._indices: Iterator[int] = iter(self.sampler)
        self._peeked: list[int] | None = None

    def _next_batch(self) -> Any:
        """This step's batch: taken once per step, kept for a re-run of the same step."""
        if self._peeked is None:
            left = self.sampler.current_len() - self.sampler.state_dict()["position"]
            # Never drawn past the share: an exhausted iterator would reset its position.
            self._peeked = [next(self._indices) for _ in range(min(self.batch_size, left))]
        return self.collate_fn([self.dataset[i] for i in self._peeked])

    def _after_commit(self) -> None:
        self._peeked = None
        if self._pending is not None:
            self._pending.recovered_s = time.monotonic() - self._pending.started
            self.recoveries.append(self._pending)
            self._report(self._pending)
            self._pending = None
        # An epoch ends at a step boundary: the next step starts the next epoch.
        if self._committed is not None and (
            self._committed["position"] >= self.sampler.current_len()
        ):
            self.epoch += 1
            self._committed = None
            if not self.finished:
                self._start_sampler()

    def _keep_rng(self) -> None:
        """In recovery mode: this rank's generators as the next step starts (after a commit),
        kept and published in the store: a redo of that step starts from them again, on
        whichever rank takes this rank's place (itself, or a survivor renumbered into it)."""
        if self.members is None:
            return  # nothing is redone without recovery: no need to keep them
        self._rng = capture_rng_state()
        buffer = io.BytesIO()
        torch.save(self._rng, buffer)
        text = base64.b64encode(buffer.getvalue()).decode()  # the store's values are text
        self.members.store.set(self.members.key("rng", self.members.me), text)

    def _restore_rng(self, old_members: list[int]) -> None:
        """Take the generators of the rank whose place this one takes: its own where it keeps its
        number, else the published ones of the old member at this new rank (as a resume at
        another world size maps them: new rank r continues saved rank r's generators)."""
        assert self.members is not None
        source = old_members[self.members.rank]
        if source == self.members.me:
            restore_rng_state(self._rng)
            return
        key = self.members.key("rng", source)
        if not self.members.store.check([key]):
            seed_rng(derived_seed("tandem.recovery", self.seed, self.members.rank))
            log.warning("no generator state of rank %d: seeded rank %d's anew", source, self.rank)
            return
        saved = base64.b64decode(self.members.store.get(key))
        state = torch.load(io.BytesIO(saved), weights_only=True)
        restore_rng_state(state)

    def _lost_member(self, error: BaseException) -> bool:
        """Whether ``error`` came from a member being gone (waiting up to a heartbeat timeout
        for the launcher's mark or the silence to show)."""
        assert self.members is not None
        if isinstance(error, _Lost):
            return True
        deadline = time.monotonic() + self.members.heartbeat_timeout + 2 * _BEAT_S
        while time.monotonic() < deadline:
            if self.members.gone() or _any_key(
                self.members.store,
                self.members.key(f"gen{self.members.generation + 1}", "join"),
                self.members.members,
            ):
                return True
            time.sleep(0.02)
        log.error("step %d failed and no member is gone: %s", self.step_count, error)
        return False

    def _recover(self) -> None:
        assert self.members is not None
        noticed, now = time.monotonic(), time.time()
        assert self._heartbeat is not None
        with self._heartbeat.lock:
            dead, beats = self.members.dead(), self.members.last_beats()
            old_members = list(self.members.members)
            lost = self.members.reform()
            mismatch.reset()  # the new group starts with no failure
        # Detection time: from the launcher's record of the death, else from the last beat.
        since = [float(dead[r]["at"]) if r in dead else beats.get(r) for r in lost]
        known = [s for s in since if s is not None]
        detected = now - max(known) if known else None
        backend = dist.get_backend()
        # Nothing of the old group may outlive it: its sockets close only when its last
        # reference goes, and a survivor still blocked in the failed step's collective (on a
        # live peer that left it) is released only by that peer's sockets closing.
        if self._ddp is not None:
            self._ddp.reducer.release()
        self._ddp, self.model = None, self.module
        records.clear()
        _abandon_group()
        gc.collect()
        g = self.members.generation
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(self.members.key(f"gen{g}", "pg") + "/", _job_store()),
            rank=self.members.rank,
            world_size=self.members.world_size,
            timeout=timedelta(seconds=max(60.0, 6 * self.members.heartbeat_timeout)),
        )
        reformed(self.members.rank, self.members.world_size)
        self.model = self._wrap()
        self._start_sampler()
        self._restore_rng(old_members)
        self._pending = Recovery(
            generation=g,
            lost=lost,
            members=list(self.members.members),
            step=self.step_count,
            detected_s=detected,
            started=noticed,
        )
        log.warning(
            "lost rank(s) %s at step %d: going on as rank %d of %d",
            lost,
            self.step_count,
            self.members.rank,
            self.members.world_size,
        )

    def _report(self, recovery: Recovery) -> None:
        """The new rank 0 writes the recovery's record for the launcher's exit summary."""
        if self.rank != 0:
            return
        directory = os.environ.get("TANDEM_REPORT_DIR")
        if not directory:
            return
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "job")
        path = Path(directory) / f"tandem-recovery-{run_id}-gen{recovery.generation}.json"
        try:
            write_atomic(path, json.dumps(recovery.record()).encode())
        except OSError as error:
            log.warning("could not write the recovery record %s: %s", path, error)


def _abandon_group() -> None:
    """Take down the default group without waiting for its collectives: one may be blocked on
    a hung peer, and a plain ``destroy_process_group`` would wait for it forever. The backend
    is aborted (its blocked work fails), then torch forgets the group."""
    from torch.distributed import distributed_c10d as c10d

    try:
        c10d._abort_process_group()
    except Exception as error:  # an abort the backend refuses: tear down the plain way
        log.warning("aborting the old process group: %s", error)
        dist.destroy_process_group()


def _job_store() -> dist.Store:
    """A new client of the job's store (the launcher's, at MASTER_ADDR:MASTER_PORT)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
        use_libuv=True,
    )


def _any_key(store: dist.Store, prefix: str, ranks: list[int]) -> bool:
    return any(store.check([f"{prefix}/{r}"]) for r in ranks)
