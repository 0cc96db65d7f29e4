"""Recovery in memory: a rank that dies costs the step in flight, not a restart from disk.

Under ``tandem run --recover in-memory`` the launcher keeps the other workers running when one
dies, hosts the job's store itself (so rank 0's death does not take it along) and marks the
dead rank there (``tandem/recover/dead/<rank>``). A hand-written loop written with :class:`Run`
then goes on by itself:

1. Every step ends with a **commit**, a vote that rides in the step's own gradient
   all-reduce. Right before a member reduces the last gradient bucket of its backward, it
   leaves its own state as the step leaves it (its generators; a Trainer's loss sums) in the
   store, in one of three keys of its own and only when it changed (:func:`slot_to_write`).
   Once every bucket's all-reduce has completed on a rank, every member contributed to the
   last one, so every member had left its state: that completion is the vote, and the step
   commits there and its optimizer steps, with no collective and no store round trip of its
   own. The replacements a member has seen queued ride in the same all-reduce, as counts that
   are zero while none is queued (:class:`tandem.parallel.ddp.end_of_backward.Vote`). A step
   that made no DDP backward (or one on NCCL, whose waits do not block the host) votes in a
   collective of its own instead: one small all-gather. Every wait is in slices
   (:func:`tandem.doctor.mismatch.wait_in_slices`, the reducer's alike), so a dead or hung
   member makes it raise within the heartbeat's notice.
2. A survivor learns of the loss from its collective's error (Gloo's connection to the dead
   peer breaks), or from the launcher's mark, or from a heartbeat (``hb/<rank>``, every 0.5 s)
   older than ``heartbeat_timeout`` (a hung rank): the heartbeat thread reads the last two and
   makes every sliced wait, the vote's included, raise.
3. The survivors **agree on the new membership** through the store: each joins generation
   ``g + 1`` with its last commit; once every member of ``g`` has joined or is known
   to be gone, the first to decide writes the members (``compare_set``: one decision, the same
   on every rank). A rank left out, or a side that does not hold a majority of the ranks not
   known dead, stops with a :class:`MembershipError`.
4. A collective can complete on some ranks and not on others (a member dies in the middle of
   Gloo's ring), so the survivors may disagree on the last commit. They **roll forward**:
   the newest commit any survivor made is the one all go on from. A survivor that did not
   make it entered its vote (it had left its state), but its last bucket may hold a partial
   sum: it takes the state the step left from a survivor that committed it
   (:meth:`Recoverer.reform`'s ``ahead``: the parameters and the optimizer's state).
   A commit is known by its **key, (step, generation)**: the step, and the generation whose
   members voted on it, compared in that order. A new generation's start commit (7.) commits
   again the step it starts from, among other members in other places, so one step can have
   two commits: a member that made only the older one is behind as well, and takes the newer
   key and member list alone (that commit moved no parameters; it says which members, in
   which places, hold the step's states). Each rank's own state is left in the store under
   the key it votes on, and the states of its last two commits stay readable until it votes
   again (:func:`slot_to_write`): a member still reading the states of the commit a generation
   starts from finds them even after the others left theirs for that generation's start.
5. They build a **new process group** over a fresh key prefix of the same store (the old one
   is destroyed off the path: :func:`_abandon_group`), wrap the module in a new tandem.DDP,
   and **redo the next step** at the smaller
   world size from the state they hold: the sampler deals the samples of the epoch not yet
   trained on to the new world, as a resume at another world size does, and each rank starts
   the redo from the random generators of the rank whose place it takes (as of the last
   commit). So the run ends where "train to the failed step, save, resume at the
   new size" ends, bitwise.

**Growing back, and a loss during an admission.** A replacement queued in the store
(:mod:`tandem.job.join`) is admitted after a step whose vote says every member has seen it
queued (its counts ride in the same all-reduce). Every generation is decided once, the same
way whatever brought the members to it:

6. Each member goes to generation ``g + 1`` through one decision (:meth:`Membership.reform`):
   it joins with its last commit's key and, after a commit that admits, the queue place the
   vote admitted up to. The first member that sees every member of ``g`` joined or gone
   writes ``g + 1``'s members by ``compare_set``, so a member whose vote passed (it admits)
   and one whose vote failed (it re-forms) read one membership, and the same join values,
   whichever wrote first. The decision admits the replacements only when no member of ``g``
   was lost and none is behind; else it is a re-form, and the replacements stay queued for the
   next commit's vote. Every member writes each newcomer's admission, the same text.
7. Before anyone forms the group, every member says it is here (:func:`tandem.job.join.meet`):
   a member lost since the decision is noticed there, in store calls that return, and the
   survivors decide ``g + 2``. Then the group forms, within :func:`formation_timeout` (one
   lost in between stops it there: the survivors decide ``g + 2``, whose record counts the
   losses of ``g + 1``), a member behind rolls forward (4.), the
   first member that holds the run hands it to the newcomers (:meth:`Recoverer.hand_over`),
   every rank starts its generators where a resume at the new size from the last commit starts
   them (new rank r continues rank r's of that commit; a rank beyond them is seeded by
   :func:`newcomer_seed`), and with newcomers the new generation's start is committed.
8. A loss anywhere in this (the hand-over, the start commit; a newcomer's own included) is a
   loss like any: the survivors decide ``g + 2``. A newcomer that has not got the run yet
   joins that decision as a *fresh* member (it is behind nobody, and the next generation hands
   it the run again), one that has it as any member; a newcomer whose generation lost a member
   before its group formed joins the re-form from its wait to be admitted. One left out stops
   with a :class:`MembershipError` (the launcher kills and counts it), as any member left out.

So a run with losses during admissions ends where the chain of saves and resumes at each
generation's size, at each step where a group was formed, ends.

A rank cut off from the store (a partition, or the store's node down: its heartbeat's store
calls go unanswered for ``heartbeat_timeout``; a watchdog thread notices, since such a call
waits rather than fails) stops with a :class:`MembershipError` that says so
(:func:`cut_off_message`), and exits one heartbeat timeout later if it is blocked where the
error cannot reach it. The old group of a re-form is taken down without waiting for it: its
Gloo connections are shut down from this side (a wait blocked on a peer that only silence tells
gone then fails at once) and the group is freed on a thread of its own
(:mod:`tandem._groups_reaper`).

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

from tandem.job.join import formation_timeout, replacing
from tandem.recovery.commits import OWN_SLOTS, CommitKey, commit_key, newest_slot, slot_to_write
from tandem.recovery.heartbeat import cut_off_message
from tandem.recovery.membership import Membership, MembershipError, Recovery
from tandem.recovery.recoverer import Recoverer
from tandem.recovery.run import Run
from tandem.recovery.state import RngText, decode, encode, newcomer_seed
from tandem.recovery.store import (
    ABLE,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    HEARTBEAT_TIMEOUT_VARIABLE,
    MODE_VARIABLE,
    PREFIX,
    declare_unable,
    enabled,
)
from tandem.recovery.vote import OFF_PATH_VARIABLE, StateAfterVoteError, commit_off_path

__all__ = [
    "ABLE",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "HEARTBEAT_TIMEOUT_VARIABLE",
    "MODE_VARIABLE",
    "OFF_PATH_VARIABLE",
    "OWN_SLOTS",
    "PREFIX",
    "CommitKey",
    "Membership",
    "MembershipError",
    "Recoverer",
    "Recovery",
    "RngText",
    "Run",
    "StateAfterVoteError",
    "commit_key",
    "commit_off_path",
    "cut_off_message",
    "declare_unable",
    "decode",
    "enabled",
    "encode",
    "formation_timeout",
    "newcomer_seed",
    "newest_slot",
    "replacing",
    "slot_to_write",
]
