"""SLURM: the batch script ``tandem slurm`` prints; ``tandem run`` under srun finds its node.

The batch script runs one ``tandem run`` per node (``--ntasks-per-node=1``) through srun, and each
starts one worker per GPU. Under srun every node's ``tandem run`` learns the node count, its node
rank and the rendezvous host from SLURM's variables (``slurm_node.py``), so the script passes
none of them. The options' values are checked in ``slurm_options.py``; the command line is
:mod:`tandem.cli.slurm`. Nothing here imports torch: ``tandem slurm`` should print at once.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from tandem.launch.slurm_options import (
    SignalSpec,
    check_mem,
    check_word,
    extra_directives,
    parse_signal,
)

# Slurm warns the job this long before the time limit: time for the workers to write a
# checkpoint and for the requeue, without giving up much of the allocation.
SIGNAL_LEAD_S = 90
DEFAULT_SIGNAL = f"USR1@{SIGNAL_LEAD_S}"
# "Due to the resolution of event handling by Slurm, the signal may be sent up to 60 seconds
# earlier than specified" (sbatch(1)): a job shorter than its lead plus this would be warned,
# and requeued, at its start, and again at every restart.
SIGNAL_EARLY_S = 60
MIN_TIME_S = SIGNAL_LEAD_S + SIGNAL_EARLY_S
# Signals on which the Trainer saves and carries on (a user's script may handle USR2 so): the
# requeue then waits half the lead, so that the checkpoint commits before the requeue's SIGTERM.
# On any other signal the workers stop, and the requeue comes at once.
_CARRY_ON_SIGNALS = ("USR1", "USR2")

# Minutes ("90") or [D-]HH:MM:SS ("1-12:00:00", "01:30:00"): the forms of --time that scripts
# use; Slurm's rarer ones (MM:SS, D-HH, D-HH:MM) are refused rather than misread.
_DIGITS = re.compile(r"[0-9]+")
_CLOCK = re.compile(r"(?:(?P<d>[0-9]+)-)?(?P<h>[0-9]{1,3}):(?P<m>[0-9]{2}):(?P<s>[0-9]{2})")


def parse_time(time: str) -> int:
    """Seconds in a SLURM time limit written as minutes or ``[D-]HH:MM:SS``.

    Raises:
        ValueError: another form, minutes or seconds past 59, hours past 23 after a day count,
            or a limit of zero (which Slurm reads as "no limit", not as zero).

    Example::

        >>> parse_time("90"), parse_time("01:30:00"), parse_time("1-00:00:00")
        (5400, 5400, 86400)
    """
    text = time.strip()
    if _DIGITS.fullmatch(text):
        seconds = int(text) * 60
    elif match := _CLOCK.fullmatch(text):
        days, hours = int(match["d"] or 0), int(match["h"])
        minutes, secs = int(match["m"]), int(match["s"])
        if minutes > 59 or secs > 59 or (match["d"] is not None and hours > 23):
            raise ValueError(
                f"time={time!r} has a field out of range: minutes and seconds run 0-59, and "
                "hours 0-23 after a day count"
            )
        seconds = ((days * 24 + hours) * 60 + minutes) * 60 + secs
    else:
        raise ValueError(
            f"time={time!r} is not a SLURM time limit: write minutes (90) or [D-]HH:MM:SS "
            "(01:30:00, 2-00:00:00)"
        )
    if seconds == 0:
        raise ValueError(f"time={time!r} is zero, which Slurm reads as no limit; give a duration")
    return seconds


def build_sbatch_script(
    *,
    nodes: int,
    gpus_per_node: int,
    time: str,
    script_args: Sequence[str],
    partition: str | None = None,
    cpus_per_task: int | None = None,
    job_name: str = "tandem",
    nproc_per_node: int | None = None,
    module: bool = False,
    output: str = "%x-%j.out",
    account: str | None = None,
    qos: str | None = None,
    mem: str | None = None,
    constraint: str | None = None,
    exclusive: bool = False,
    requeue: bool = True,
    signal: str | None = DEFAULT_SIGNAL,
    sbatch: Sequence[str] = (),
) -> str:
    """An sbatch script that runs ``tandem run`` on every node, requeued before its time limit.

    One srun task per node runs ``tandem run --nproc-per-node N``, which starts N workers and
    reads its node rank, the node count and the rendezvous from srun's variables.
    ``--kill-on-bad-exit=1`` ends every node when one fails, rather than leaving the others in a
    collective until their timeout.

    ``signal`` (USR1, 90 s before the limit, by default) goes to the batch shell
    (``--signal=B:...``), whose trap passes it to srun, which signals every process of the step
    on every node: the workers get it (the Trainer saves a checkpoint on USR1 and carries on;
    on TERM it saves and stops). Without ``B:`` Slurm would signal the step only and the shell
    could not requeue; with ``B:`` alone the workers would hear nothing until the requeue's
    SIGTERM, which leaves them only Slurm's KillWait to save. With ``requeue`` the trap then
    runs ``scontrol requeue`` (after half the lead for USR1/USR2, so the checkpoint commits
    first, and only if the job still runs; at once for other signals): the job restarts from
    the top under the same id, so the training script must resume from its latest checkpoint
    (the Trainer's ``resume="latest"``). ``requeue`` also lets Slurm requeue the job on
    preemption or a node failure, or an admin with ``scontrol requeue``.

    Args:
        nodes: number of nodes, at least 1.
        gpus_per_node: GPUs per node, one worker each; 0 for a CPU job.
        time: time limit, minutes ("90") or ``[D-]HH:MM:SS``; at least 150 s, so the requeue
            warning does not come at the start.
        script_args: the training script (or module, with ``module=True``) and its arguments.
        partition: the partition to submit to; the cluster's default when None.
        cpus_per_task: CPUs for each node's task, shared by its workers; Slurm's default
            (often 1) when None.
        job_name: the job's name, also the ``%x`` in ``output``.
        nproc_per_node: workers per node; ``gpus_per_node`` when None, required when it is 0.
        module: run ``script_args[0]`` as a module (``python -m``), not as a file.
        output: the log file, with Slurm's patterns (``%x`` name, ``%j`` job id).
        account: the account charged (``--account``); the user's default when None.
        qos: the quality of service (``--qos``).
        mem: memory per node as sbatch takes it (``64G``, ``16000M``; ``0``: all of it).
        constraint: node features required (``--constraint``, e.g. ``a100&ib``).
        exclusive: whole nodes, shared with no other job (``--exclusive``).
        requeue: ``--requeue`` and a requeue after ``signal``; False writes ``--no-requeue``
            (the job is then never requeued, not even after a node failure).
        signal: ``SIG@SECONDS``, what Slurm sends how long before the time limit; None for no
            signal (and no requeue before the limit).
        sbatch: further #SBATCH options, one per item (``--mail-type=END``).

    Returns:
        The script's text, ready for ``sbatch``.

    Raises:
        ValueError: a count below its minimum, more workers than GPUs, a malformed time or one
            too short for the signal's lead, a malformed signal or memory size, whitespace in a
            name or path, an ``sbatch`` line that is no option or sets one written here, or no
            script; naming the value.

    Example::

        script = build_sbatch_script(
            nodes=2, gpus_per_node=4, time="01:00:00", partition="gpu",
            script_args=["train.py", "--lr", "0.1"],
        )
        Path("train.sbatch").write_text(script)  # then: sbatch train.sbatch
    """
    nproc = _checked_counts(nodes, gpus_per_node, cpus_per_task, nproc_per_node)
    warning = parse_signal(signal) if signal is not None else None
    seconds = parse_time(time)
    if warning is not None and seconds < warning.lead_s + SIGNAL_EARLY_S:
        raise ValueError(
            f"time={time!r} is {seconds} s, too short for the signal {warning.lead_s} s "
            f"before the limit (which Slurm may send up to {SIGNAL_EARLY_S} s early); ask for "
            f"at least {warning.lead_s + SIGNAL_EARLY_S} s, or a shorter --signal lead"
        )
    for name, value in (
        ("job_name", job_name),
        ("output", output),
        ("partition", partition),
        ("account", account),
        ("qos", qos),
        ("constraint", constraint),
    ):
        check_word(name, value)
    extra = extra_directives(sbatch)
    if not script_args:
        raise ValueError("script_args is empty: give the training script (or module) to run")
    if script_args[0].startswith("-"):
        what = "module" if module else "script"
        raise ValueError(
            f"script_args[0]={script_args[0]!r} is an option, not a {what}: put the {what} "
            "first, then its arguments"
        )

    options = [f"--job-name={job_name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    if gpus_per_node > 0:
        options.append(f"--gpus-per-node={gpus_per_node}")
    if cpus_per_task is not None:
        options.append(f"--cpus-per-task={cpus_per_task}")
    if mem is not None:
        options.append(f"--mem={check_mem(mem)}")
    options.append(f"--time={time.strip()}")
    for name, value in (("partition", partition), ("account", account), ("qos", qos)):
        if value is not None:
            options.append(f"--{name}={value}")
    if constraint is not None:
        options.append(f"--constraint={constraint}")
    if exclusive:
        options.append("--exclusive")
    options += [f"--output={output}", "--open-mode=append"]
    if warning is not None:
        options.append(f"--signal=B:{warning.name}@{warning.lead_s}")
    options.append("--requeue" if requeue else "--no-requeue")
    options += extra

    # srun in Slurm 22.05 and 23.02 does not take --cpus-per-task from the job
    # (SLURM_CPUS_PER_TASK), so each task would be bound to one CPU for all its workers; the
    # step asks for it itself.
    srun = ["srun", "--kill-on-bad-exit=1"]
    if cpus_per_task is not None:
        srun.append(f"--cpus-per-task={cpus_per_task}")
    run = ["tandem", "run", "--nproc-per-node", str(nproc)]
    if module:
        run.append("-m")
    command = " ".join(shlex.quote(word) for word in [*srun, *run, *script_args])

    cpus_note = (
        ""
        if cpus_per_task is not None
        else (
            "# No --cpus-per-task was given: Slurm's default gives each node's task (all its "
            "workers)\n# as few as one CPU; `tandem slurm --cpus-per-task N` asks for more.\n"
        )
    )
    per_gpu = ", one per GPU" if gpus_per_node > 0 else ""
    return (
        "#!/bin/bash\n"
        + "".join(f"#SBATCH {option}\n" for option in options)
        + f"""
# One task per node: srun starts `tandem run` once on each of the {nodes} node(s), and it starts
# {nproc} worker(s) there{per_gpu}. It reads the node count, its node rank and the rendezvous
# (the first node, port 15000 + job id % 10000) from srun's variables. The job inherits the
# environment sbatch was run from: submit from the one where tandem is installed.
{cpus_note}{_signal_section(warning, requeue)}
# The nodes' store keys live under this job's own secret (made here, never printed; a requeued
# job makes a new one): a program that reaches node 0's port cannot read or forge them.
export TANDEM_JOB_SECRET="${{TANDEM_JOB_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')}}"

# bash runs a trap only between commands, so srun runs in the background while the shell waits
# in `wait`, which a trapped signal interrupts; the loop then waits again for srun's own status.
# --kill-on-bad-exit=1: when a node's workers fail, every node's are ended, instead of the
# others blocking in a collective until their timeout.
{command} &
srun_pid=$!
while true; do
    trapped=0
    wait "$srun_pid"
    status=$?
    [ "$trapped" -eq 1 ] || break
done
exit "$status"
"""
    )


def _signal_section(warning: SignalSpec | None, requeue: bool) -> str:
    """The script's comment and trap for the signal before the time limit ('' without one)."""
    if warning is None:
        note = (
            "\n# Slurm requeues the job on preemption or node failure (--requeue): the script "
            "then runs\n# again from the top, so the training script must resume from its "
            "latest checkpoint.\n"
            if requeue
            else "\n"
        )
        return f"#\n# No signal before the time limit (tandem slurm --signal none).{note}"
    sig, lead = warning.name, warning.lead_s
    delay = lead // 2 if sig in _CARRY_ON_SIGNALS else 0
    if requeue and delay:
        requeue_line = f'    (sleep {delay}; kill -0 "$srun_pid" 2>/dev/null && requeue) &\n'
        then = f"waits {delay} s (for the checkpoint) and, if srun still runs, requeues the job"
    elif requeue:
        requeue_line, then = "    requeue\n", "requeues the job at once (the workers stop anyway)"
    else:
        requeue_line, then = "", "does no more: the job ends at its time limit (--no-requeue)"
    requeue_fn = (
        """requeue() {
    echo "$(date): requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
}
"""
        if requeue
        else ""
    )
    return f"""#
# Before the time limit: Slurm sends {sig} to this shell {lead} s early (the B: in --signal; it
# may be up to {SIGNAL_EARLY_S} s earlier). The trap passes it to srun, which signals every
# process of the step on every node, so the workers get it: the Trainer saves a checkpoint at
# its next step boundary (on USR1, and carries on; on TERM it saves and stops). Without B: only
# the step would get the signal and this shell could not requeue; with B: and no forwarding
# the workers would first hear of it from the requeue's SIGTERM, KillWait seconds before
# SIGKILL. The trap then {then}.
# A requeued job runs this script again under the same job id (SLURM_RESTART_COUNT counts the
# restarts, --open-mode=append keeps every attempt's log), so the training script must resume
# from its latest checkpoint at start (the Trainer's resume="latest").
{requeue_fn}on_signal() {{
    trapped=1
    echo "$(date): {sig} from Slurm, {lead} s before the time limit: passing it to the workers"
    [ -z "$srun_pid" ] || kill -{sig} "$srun_pid"
{requeue_line}}}
trap on_signal {sig}
"""


def _checked_counts(
    nodes: int, gpus_per_node: int, cpus_per_task: int | None, nproc_per_node: int | None
) -> int:
    """The workers per node, after checking every count; the one place they are checked."""
    for name, value, minimum in (
        ("nodes", nodes, 1),
        ("gpus_per_node", gpus_per_node, 0),
        ("cpus_per_task", cpus_per_task, 1),
        ("nproc_per_node", nproc_per_node, 1),
    ):
        if value is None and name in ("cpus_per_task", "nproc_per_node"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r} is not an integer >= {minimum}")
    if nproc_per_node is None:
        if gpus_per_node == 0:
            raise ValueError(
                "gpus_per_node=0 makes a CPU job, whose workers per node cannot be taken from "
                "the GPUs: give nproc_per_node (--nproc-per-node)"
            )
        return gpus_per_node
    if gpus_per_node > 0 and nproc_per_node > gpus_per_node:
        raise ValueError(
            f"nproc_per_node={nproc_per_node} exceeds gpus_per_node={gpus_per_node}: each "
            "worker takes one GPU of its node"
        )
    return nproc_per_node
