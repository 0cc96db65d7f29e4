"""The Trainer's part of recovery in memory (``tandem run --recover in-memory``).

A Trainer needs no change to its script to survive a lost rank: under the launcher's
``--recover in-memory`` it commits every optimizer step through :class:`tandem.recovery.Recoverer`
and, when a member is lost, goes on among the survivors as if it had resumed, at the smaller
world size, from a checkpoint written at the last committed step. Nothing is read from disk:

- **What a survivor keeps**: right after each optimizer step, the run's shared state (the
  checkpoint's ``"trainer"`` entry: epoch, step, the sampler's place, history; the scheduler's
  and the grad scaler's state), the same on every rank, kept in memory
  (:meth:`InMemory.keep`). The model and the optimizer need no copy: the commit comes before
  the optimizer steps, so a step that does not commit leaves them as they were.
- **What a lost rank leaves behind**: its own part of the run, its generators and its loss
  sums, left in the store right before the step's vote, which rides in the gradient
  all-reduce (:meth:`tandem.recovery.Recoverer.attach`): the sums as the step will leave them,
  from the loss its forward computed (:meth:`InMemory.own`; the commit checks that the step
  left them so). So the survivors find every member's part of the last committed step.
- **The recovery** (:meth:`InMemory.recover`): the survivors re-form the group. The vote may
  have completed on some of them and not on others (a member lost in the middle of it): those
  behind take the state of one that committed the step (its parameters, optimizer state and
  kept shared state: a broadcast over the new group, only then), so every survivor goes on
  from the newest step any of them committed. Then the Trainer
  builds what depends on the world anew (tandem.DDP over the new group, the loaders and the
  sampler, the run state), loads the kept shared state and every old member's own part with
  the same code a resume from a checkpoint at another world size runs
  (:class:`tandem.train.step_log.SavedRun`: the rest of the epoch dealt to the survivors, the
  loss sums added up on rank 0, new rank r taking old rank r's generators), and the loop goes
  on from that step's boundary: its log record, evaluation and checkpoint (where the plan
  has them) are done again at the new size, since the failure may have cut them short.

So a run that loses a rank at step k ends bitwise where "train to step k, save, resume at the
new size" ends.

**Growing back** (``--max-restarts N``, one node): the Trainer admits replacements. The launcher
starts one for a lost rank; its ``tandem.init()`` queues it in the store
(:mod:`tandem.job.join`), and the commit whose vote names it (the fewest queued replacements
any member has seen, counted in the vote: the same count everywhere) makes every
member admit it after that step's boundary (its log record, evaluation and checkpoint, done at
the old size; :meth:`InMemory.admit`). The group grows with it
(:meth:`tandem.recovery.Recoverer.grow`), the members build anew what depends on the world,
and the newcomer's own Trainer (made by the user's unchanged script, skipping its ``resume``)
makes the same collectives in its constructor, then takes the run from rank 0 over the new
group (:meth:`tandem.recovery.Recoverer.hand_over`, nothing from disk): the parameters (the
wrapper's broadcast), the optimizer's state, the shared state of a checkpoint written at that
boundary, and every member's own part. Every rank loads these with the code a resume at the
larger world size runs (the newcomer's generators are seeded as such a resume seeds a rank the
checkpoint had not), and the new generation's start is committed. So the run ends bitwise where
the chain of saves and resumes with the same membership schedule ends.

A member lost during an admission makes it a re-form, as any loss does. A newcomer that has not
taken the run yet joins it as a member that holds nothing (its take-over failing, or its
admitting generation failing to form): after the re-form the members build anew what depends
on the world, and rank 0 hands the newcomers what a checkpoint of the last committed step holds
(the kept shared state, the optimizer's, every old member's own part from the store). The
generation's start is committed, and where the members do that step's boundary again, the
newcomers do it with them (:meth:`InMemory.start` tells ``train()``).

A set-up whose state is sharded across ranks (tandem.FullyShardedDataParallel, a
ShardedOptimizer) or that the Trainer did not wrap itself is not recovered in memory: the
Trainer says so at its start, and a lost rank then ends the job as under ``--recover restart``.

Example::

    recovery = InMemory(trainer)          # inactive outside --recover in-memory
    recovery.attach(trainer)              # the votes ride in the engine's all-reduce
    recovery.keep(trainer)                # after every optimizer step
    recovery.commit(trainer, step)        # before it
    recovery.admit(trainer)               # at a step boundary: replacements the commit named
"""

from __future__ import annotations

import copy
import json
import logging
import pickle
from functools import partial
from typing import Any, Protocol, cast

import torch

from tandem.checkpoint.rng import expand_rng_state
from tandem.job import join
from tandem.parallel.adapters import model_state, optimizer_state
from tandem.parallel.engine import Engine
from tandem.recovery import (
    MembershipError,
    Recoverer,
    RngText,
    StateAfterVoteError,
    declare_unable,
    decode,
    enabled,
)
from tandem.recovery.membership import _Lost
from tandem.train.precision import ScalerState
from tandem.train.run_state import RunState
from tandem.train.step import StepOutput, Update
from tandem.train.step_log import RunLog, SavedRun
from tandem.world import World

log = logging.getLogger(__name__)


class Trainer(Protocol):
    """What of a :class:`tandem.Trainer` its recovery reads and rebuilds."""

    engine: Engine
    world: World
    state: RunState
    log: RunLog
    scheduler: Any
    _scaler_state: ScalerState | None
    _wraps_itself: bool
    _update: Update

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def _release_world(self) -> None: ...

    def _build_world(self, log_from: int) -> None: ...


def why_not(trainer: Trainer) -> str | None:
    """Why this Trainer's set-up cannot be recovered in memory, or None if it can."""
    engine = trainer.engine
    if engine.model_state.sharded or model_state(engine.model).sharded:
        return "the model is sharded across ranks (FullyShardedDataParallel)"
    if engine.optimizer_state.sharded or optimizer_state(engine.optimizer).sharded:
        return (
            f"the optimizer's state is sharded across ranks ({type(engine.optimizer).__name__}): "
            "a lost rank takes its shard along"
        )
    if not trainer._wraps_itself:
        return "the model came wrapped (pass the plain module: the Trainer wraps it anew)"
    return None


class InMemory:
    """One rank's recovery in memory for a Trainer (see the module doc).

    Args:
        trainer: the Trainer, built (engine, loaders, run state). A replacement's takes the
            run's state from the members here.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.recoverer: Recoverer | None = None
        self.kept: dict[str, Any] | None = None
        self.after_step = False  # the state kept is a step's (not train()'s start)
        self.refused: str | None = None
        self.growing = 0  # replacements the last commit's vote admits (queued up to)
        self._reformed = False  # an admission became a re-form: recover() finds it made
        # A newcomer handed the run within a re-form: train() first redoes the boundary of the
        # step the members go back to, as they do (their recover() says so).
        self._redo = False
        self.rng = RngText()  # this rank's generators as the commit leaves them in the store
        # The step's micro-batch whose backward carries the vote: its loss, count and tokens;
        # and the loss sums own() left in the store at the vote.
        self._micro: tuple[float, int, int | None] | None = None
        self._sums: list[Any] | None = None
        if not enabled() or trainer.world.world_size == 1:
            return
        self.refused = why_not(trainer)
        if self.refused is not None and join.replacing():
            # The members admit none with such a set-up: a script that differs between them.
            raise RuntimeError(
                f"a replacement whose Trainer cannot be recovered in memory ({self.refused}), "
                "while the members' could: every process must run the same script"
            )
        if self.refused is not None:
            declare_unable(self.refused)
            if trainer.world.is_main:
                log.warning(
                    "--recover in-memory: this Trainer is not recovered in memory (%s); a "
                    "lost rank makes tandem run restart every worker (--max-restarts), which "
                    "resume from the last checkpoint",
                    self.refused,
                )
            return
        self.recoverer = Recoverer(admits=True)
        self.attach(trainer)
        if self.recoverer.joined:
            self._take_over(trainer)

    @property
    def active(self) -> bool:
        return self.recoverer is not None

    def start(self, trainer: Trainer) -> bool:
        """``train()`` starts (or a generation with newcomers does): the state it starts from
        is the first one kept and committed (a member lost in the first step goes back to
        it). Whether the boundary of the last step is to be done (again) first: True only
        where the run was handed over within a re-form that redoes it."""
        if self.recoverer is None:
            return False
        redo, self._redo = self._redo, False
        self.keep(trainer)
        self.after_step = redo
        self.commit(trainer, trainer.state.step)
        return redo

    def begin(self, trainer: Trainer) -> bool:
        """``train()`` starts: :meth:`start`, and a member lost before its commit completed
        (a replacement's start, say) recovers (:meth:`recover`). Whether the boundary of the
        last step is to be done (again) first."""
        try:
            return self.start(trainer)
        except MembershipError:
            raise
        except Exception as error:
            if not self.lost(error):
                raise
        # Outside the except block: the failed collective's frames are gone first.
        return self.recover(trainer)

    def attach(self, trainer: Trainer) -> None:
        """Let the commit's vote ride in the engine's gradient all-reduce (again after the
        engine was built anew): the engine's wrapper carries it, and the Trainer's backward
        tells :meth:`own` the loss of the micro-batch before it runs."""
        if self.recoverer is None:
            return
        self.recoverer.attach(trainer.engine.model, partial(self.own, trainer))
        update = trainer._update
        backward = type(update).backward.__get__(update)
        update.backward = partial(self._backward, backward)  # type: ignore[method-assign]

    def _backward(self, backward: Any, out: StepOutput, weight: float) -> float:
        # The loss as Update.backward reads it after the backward (the same bits: the forward
        # computed it), read before, for own() at the vote inside it.
        self._micro = (out.loss.item(), out.count, out.tokens)
        return cast(float, backward(out, weight))

    def own(self, trainer: Trainer) -> str:
        """This rank's own part of the run as the step in progress will leave it, taken for the
        vote (on the vote's own thread as the backward of its last micro-batch starts, again
        before its last bucket if the generators moved meanwhile; either way before the Trainer
        adds that one's loss to the sums, which nothing changes during the backward): what
        :meth:`commit` passes once the step is done."""
        run, window = trainer.state, trainer.log.window
        if self._micro is not None:
            # The two sums the Trainer adds each micro-batch's loss to (Trainer._run_batch),
            # added to copies here, in the same order: the same bits.
            loss, count, tokens = self._micro
            run, window = copy.copy(run), copy.copy(window)
            run.epoch_loss = list(run.epoch_loss)
            run.epoch_loss[0] += loss * count
            run.epoch_loss[1] += count
            window.add(loss, count, tokens)
        saved = SavedRun(run, window, world_size=trainer.world.world_size)
        self._sums = _loss_sums(run, window)
        return _own_text(self.rng.value(), saved.rank_state_dict(dict))

    def commit(self, trainer: Trainer, step: int) -> None:
        """Commit optimizer step ``step`` (its number once taken) on every member or none,
        with this rank's own part of the run as the step left it (:meth:`own` left it in the
        store at the vote; a step without a DDP backward leaves it here)."""
        if self.recoverer is None:
            return
        self._micro = None
        sums, self._sums = self._sums, None
        if self.recoverer.passed(step):
            # The state was taken at the vote; between the backward and here the Trainer draws
            # nothing, and only its loss sums move (by the micro-batch's loss, added as own()
            # added it): checked on the numbers alone, cheaply, not on the whole text again.
            if repr(sums) != repr(_loss_sums(trainer)):  # repr: a NaN loss equals itself
                raise RuntimeError(
                    f"the loss sums of step {step} are {_loss_sums(trainer)}, not {sums} as "
                    "left in the store at its vote"
                )
            self.growing = self.recoverer.commit(step, partial(self._own_now, trainer))
            return
        self.growing = self.recoverer.commit(step, self._own_now(trainer))

    def _own_now(self, trainer: Trainer) -> str:
        return _own_text(self.rng.value(), _saved_run(trainer).rank_state_dict(dict))

    def keep(self, trainer: Trainer) -> None:
        """The shared state right after an optimizer step, the point a recovery goes back to."""
        if self.recoverer is None:
            return
        self.kept = _shared_state(trainer, self.kept)
        self.after_step = True

    def lost(self, error: BaseException) -> bool:
        if self.recoverer is None or isinstance(error, StateAfterVoteError):
            return False  # the latter is raised on every member alike: nothing to recover
        # The state of the failed step may still be on its way to the store (taken off the
        # step's path): done before the recovery sets the generators anew.
        self.recoverer.settle()
        return self.recoverer.lost(error)

    def recover(self, trainer: Trainer) -> bool:
        """Go on among the survivors from the last committed step (see the module doc), and
        hand the run to the newcomers the new generation holds (replacements whose admission
        a loss cut short, before they had the run: this rank may be one); whether that step's
        boundary is to be done (again): False at ``train()``'s start. A member lost meanwhile
        re-forms again.

        Raises:
            MembershipError: this rank cannot go on (:mod:`tandem.recovery`).
        """
        assert self.recoverer is not None and self.recoverer.members is not None
        self.growing = 0  # the queue stays: the new generation's next commit names it again
        while True:
            try:
                return self._recover(trainer)
            except MembershipError:
                raise
            except Exception as error:  # a member lost before the new generation committed
                if not self.lost(error):
                    raise
            # Outside the except block (the failed collective's frames are gone): again.
            self._reformed = False

    def _recover(self, trainer: Trainer) -> bool:
        recoverer = self.recoverer
        assert recoverer is not None
        if not self._reformed:
            # The step it goes back to: an admission cut short has built the run state anew.
            step = trainer.state.step if self.kept is None else self.kept["trainer"]["step"]
            self._reform(trainer, step, partial(self._ahead, trainer))
            self._reformed = True
        members = recoverer.members
        assert members is not None
        if members.me in members.newcomers:  # one that holds nothing yet: it is handed the run
            self._take_over(trainer, reformed=True)
            # Its generators as the members start theirs (train() did so at its start, but the
            # new generation may put it in another old rank's place).
            trainer.state.restore_rng()
            self.rng.forget()
            self._reformed = False
            return self.start(trainer)
        if recoverer.behind:  # its vote completed on others, not here: the step is theirs
            caught_up = recoverer.caught_up
            trainer.engine.module.load_state_dict(caught_up["model"])
            trainer.optimizer.load_state_dict(caught_up["optimizer"])
            self.kept, self.after_step = caught_up["kept"], caught_up["after_step"]
        texts = recoverer.committed_states()
        kept = self.kept
        assert kept is not None
        step = kept["trainer"]["step"]
        # The step's log record is written again where its boundary is done again. Its
        # collectives are a newcomer's constructor's, which the newcomers within it meet.
        trainer._build_world(log_from=max(step - 1, 0) if self.after_step else step)
        self.attach(trainer)
        if members.newcomers:
            # The checkpoint a resume here would read: the kept shared state, the optimizer's,
            # every old member's own part, and whether the boundary is done again.
            handed = {
                **kept,
                "optimizer": trainer.optimizer.state_dict(),
                "owns": texts,
                "after_step": self.after_step,
            }
            recoverer.hand_over(handed)
        _load(trainer, kept, _own_states(texts))
        trainer.state.restore_rng()
        self.rng.forget()
        self._reformed = False
        if not members.newcomers:
            return self.after_step
        # With newcomers, the new generation's start is committed, as an admission's is (they
        # commit it as their train() starts); a loss before it goes back to the same commit.
        self._redo = self.after_step
        return self.start(trainer)

    def _ahead(self, trainer: Trainer) -> dict[str, Any]:
        """What a member behind the step this one committed needs of it: the state that step
        left (the gradients it holds are the same, so this is what its own optimizer step
        would make, and the Trainer's shared state after it)."""
        return {
            "model": trainer.engine.module.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "kept": self.kept,
            "after_step": self.after_step,
        }

    def admit(self, trainer: Trainer) -> None:
        """Admit the replacements the last commit's vote named (every member at the same
        step boundary, once that step's boundary is done; see the module doc): grow the group,
        build anew what depends on the world, hand the newcomers the run, and go on from what
        a checkpoint written here would hold, as a resume at the larger world size does. The
        new generation's start is committed, and may name more replacements: admitted in turn.

        Raises:
            MembershipError: this rank cannot go on (:mod:`tandem.recovery`).
        """
        while self.growing:
            assert self.recoverer is not None
            step = trainer.state.step
            # Taken before the group changes: nothing the rebuilding draws or adds counts.
            shared = {
                **_shared_state(trainer),
                "optimizer": trainer.optimizer.state_dict(),
                "owns": None,  # every member's, as the hand-over gathers them
                "after_step": False,  # this boundary is done
            }
            own = _saved_run(trainer).rank_state_dict()
            recoverer, members = self.recoverer, self.recoverer.members
            assert members is not None
            recoverer.grow(
                step, self.growing, trainer._release_world, partial(self._ahead, trainer)
            )
            if members.lost or members.behind:
                # A member lost, or one that did not commit the step (a split vote): the members
                # decided a re-form instead, and this rank is in it; train() goes on from here
                # as after any loss (recover(), which finds the group re-formed).
                self.growing, self._reformed = 0, True
                raise _Lost(
                    f"rank(s) {members.lost or members.behind} lost or behind during the "
                    f"admission after step {step}: re-formed instead"
                )
            # The same collectives, in the same order, as a newcomer's Trainer constructor:
            # tandem.DDP's (its broadcast gives the newcomers the parameters), the run
            # directory's check, the loggers' opening (no record is dropped).
            trainer._build_world(log_from=step)
            self.attach(trainer)
            shared, owns = self.recoverer.hand_over(shared, own)
            _load(trainer, shared, [state for state in owns if state is not None])
            trainer.state.restore_rng()
            self.rng.forget()
            self.start(trainer)  # sets growing anew

    def _take_over(self, trainer: Trainer, reformed: bool = False) -> None:
        """A replacement, admitted (its constructor made the members' collectives; or
        ``reformed``: the group was re-formed with it still holding nothing): take the run from
        them. A member lost meanwhile makes it join the members' re-form as one that holds
        nothing, and take the run there. Its generators are restored where a resumed run's
        are, as ``train()`` starts: a rank the members' run had not is seeded as a resume
        seeds it.

        Raises:
            MembershipError: this rank cannot go on (:mod:`tandem.recovery`).
        """
        recoverer = self.recoverer
        assert recoverer is not None and recoverer.members is not None
        while True:
            try:
                if reformed:
                    # The members' collectives after their re-form (_recover), in their order.
                    trainer._build_world(log_from=trainer.state.step)
                    self.attach(trainer)
                handed, owns = recoverer.hand_over(None)
                break
            except MembershipError:
                raise
            except Exception as error:
                if not recoverer.lost(error):
                    raise
            # Outside the except block: the failed collective's frames are gone first.
            self._reform(trainer, trainer.state.step)
            reformed = True
        trainer.optimizer.load_state_dict(handed["optimizer"])
        if handed["owns"] is None:  # an admission: every member's part, gathered
            states = [state for state in owns if state is not None]
        else:  # within a re-form: the parts of the last commit's members
            states = _own_states(handed["owns"])
        _load(trainer, handed, states)
        self._redo = handed["after_step"]

    def _reform(self, trainer: Trainer, step: int, ahead: Any = None) -> None:
        """Re-form the group (:meth:`tandem.recovery.Recoverer.reform`), again while a member is
        lost before it formed; a newcomer whose take-over a loss cut short joins the members'
        re-form so, holding nothing (``ahead`` None)."""
        recoverer = self.recoverer
        assert recoverer is not None
        while True:
            try:
                recoverer.reform(step, trainer._release_world, ahead)
                return
            except MembershipError:
                raise
            except Exception as error:  # a member lost before the new group formed: again
                if not recoverer.lost(error):
                    raise

    def committed(self) -> None:
        if self.recoverer is not None:
            self.recoverer.committed()

    def close(self) -> None:
        if self.recoverer is not None:
            self.recoverer.close()


def _saved_run(trainer: Trainer) -> SavedRun:
    return SavedRun(trainer.state, trainer.log.window, world_size=trainer.world.world_size)


def _shared_state(trainer: Trainer, last: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's state that every rank shares, as a checkpoint's entries hold it, with
    tandem.DDP's bucket order: at 3 ranks and more Gloo's sums round otherwise in buckets laid
    out otherwise, so a wrapper made anew takes the old one's, as a resume does. Copied (through
    pickle), since the reducer appends to its own until it has rebuilt; once rebuilt it never
    changes, so the copy in ``last`` (the state kept before) serves again, off the step's path."""
    scheduler, scaler = trainer.scheduler, trainer._scaler_state
    buckets = None if last is None else last["engine"]
    if buckets is None or not buckets["rebuilt"]:
        buckets = trainer.engine.model_state.engine_state()
        buckets = None if buckets is None else pickle.loads(pickle.dumps(buckets))
    return {
        "trainer": _saved_run(trainer).state_dict(),
        "engine": buckets,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
    }


def _load(trainer: Trainer, shared: dict[str, Any], states: list[dict[str, Any]]) -> None:
    """Load the shared state and every saved rank's own part (in rank order) with the code a
    resume from a checkpoint at any world size runs; the generators wait for
    ``trainer.state.restore_rng()``."""
    trainer.engine.model_state.load_engine_state(shared["engine"])
    saved = _saved_run(trainer)
    saved.load_state_dict(shared["trainer"])
    saved.load_rank_state_dicts(states, trainer.world.rank)
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(shared["scheduler"])
    if trainer._scaler_state is not None:
        trainer._scaler_state.load_state_dict(shared["scaler"])
    trainer.optimizer.zero_grad()  # what a failed step's backward left


def _own_states(texts: list[str]) -> list[dict[str, Any]]:
    """The last commit's own parts as the store holds them (:func:`_own_text`), loaded."""
    states = []
    for value in texts:
        rng, _, rest = value.partition("\n")
        state = json.loads(rest)
        state["rng"] = expand_rng_state(decode(rng))
        states.append(state)
    return states


def _loss_sums(trainer_or_run: Any, window: Any = None) -> list[Any]:
    """The loss sums of a rank's own part (the run state's and the step log window's)."""
    if window is None:
        trainer_or_run, window = trainer_or_run.state, trainer_or_run.log.window
    return [*trainer_or_run.epoch_loss, *window.sums()]


def _own_text(rng: str, state: dict[str, Any]) -> str:
    """A rank's own part as the store holds it: its generators' text (:class:`RngText`, taken
    anew only when they changed) and the rest as JSON (floats come back bitwise)."""
    rest = {k: v for k, v in state.items() if k != "rng"}
    return f"{rng}\n{json.dumps(rest, separators=(',', ':'))}"
