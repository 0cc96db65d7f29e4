"""SLURM: the batch script ``tandem slurm`` prints; ``tandem run`` under srun finds its node.

The batch script runs one ``tandem run`` per node (``--ntasks-per-node=1``) through srun, and each
starts one worker per GPU. Under srun every node's ``tandem run`` learns the node count, its node
rank and the rendezvous host from SLURM's variables (``slurm_node.py``), so the script passes
none of them. The command line is :mod:`tandem.cli.slurm`. Nothing here imports torch:
``tandem slurm`` should print at once.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

# Slurm warns the batch shell this long before the time limit: time for the requeue request and
# for workers that checkpoint on SIGTERM to write one, without giving up much of the allocation.
SIGNAL_LEAD_S = 90
# "Due to the resolution of event handling by Slurm, the signal may be sent up to 60 seconds
# earlier than specified" (sbatch(1)): a shorter job would be warned, and requeued, at its start,
# and again at every restart.
MIN_TIME_S = SIGNAL_LEAD_S + 60

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
) -> str:
    """An sbatch script that runs ``tandem run`` on every node, requeued before its time limit.

    One srun task per node runs ``tandem run --nproc-per-node N``, which starts N workers and
    reads its node rank, the node count and the rendezvous from srun's variables.
    ``--kill-on-bad-exit=1`` ends every node when one fails, rather than leaving the others in a
    collective until their timeout. 90 s before the limit Slurm signals the batch shell with
    USR1, and the script's trap runs ``scontrol requeue``: the workers get SIGTERM and the job
    later restarts from the top under the same id, so the training script must checkpoint as it
    goes and resume from its latest checkpoint.

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

    Returns:
        The script's text, ready for ``sbatch``.

    Raises:
        ValueError: a count below its minimum, more workers than GPUs, a malformed time or one
            too short, whitespace in a name or path, or no script; naming the value.

    Example::

        script = build_sbatch_script(
            nodes=2, gpus_per_node=4, time="01:00:00", partition="gpu",
            script_args=["train.py", "--lr", "0.1"],
        )
        Path("train.sbatch").write_text(script)  # then: sbatch train.sbatch
    """
    nproc = _checked_counts(nodes, gpus_per_node, cpus_per_task, nproc_per_node)
    seconds = parse_time(time)
    if seconds < MIN_TIME_S:
        raise ValueError(
            f"time={time!r} is {seconds} s, too short for the requeue warning {SIGNAL_LEAD_S} s "
            f"before the limit (which Slurm may send up to 60 s early); ask for at least "
            f"{MIN_TIME_S} s"
        )
    for name, value in (("job_name", job_name), ("output", output), ("partition", partition)):
        # sbatch splits #SBATCH lines at whitespace and has no quoting to rely on.
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ValueError(
                f"{name}={value!r} is empty or contains whitespace; sbatch cannot read it"
            )
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
    options.append(f"--time={time.strip()}")
    if partition is not None:
        options.append(f"--partition={partition}")
    options += [
        f"--output={output}",
        "--open-mode=append",
        f"--signal=B:USR1@{SIGNAL_LEAD_S}",
        "--requeue",
    ]

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
{cpus_note}#
# Requeue before the time limit: Slurm sends USR1 to this shell {SIGNAL_LEAD_S} s before the limit
# (the B: in --signal; without it only the job steps get the signal and no trap here runs). The
# trap asks Slurm to requeue the job (--requeue allows it): the workers get SIGTERM, KillWait
# seconds before SIGKILL, and the job later runs this script again under the same job id, with
# SLURM_RESTART_COUNT counting the restarts and --open-mode=append keeping every attempt's log.
# So the training script must save checkpoints as it goes and resume from the latest at start.
requeue() {{
    echo "$(date): time limit in {SIGNAL_LEAD_S} s, requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    trapped=1
}}
trap requeue USR1

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
