"""Real SLURM jobs: what srun gives tandem, and the script `tandem slurm` prints, on a live cluster.

Proves: under srun with one task per rank and no launcher, tandem.init() takes rank, world size
and rendezvous from SLURM's variables alone (the first host of the nodelist, port
15000 + job id % 10000), Gloo connects there, and both ranks end with identical parameters equal
to one process trained on both ranks' batches. The script build_sbatch_script prints is accepted
by sbatch, runs one `tandem run` per node through srun with the arguments intact and the node
placement node_placement_from_slurm derives, and trains the same way through the real
`tandem run`; its trap passes the pre-timeout USR1 on to the step's processes and then requeues
the job, after which it runs again (SLURM_RESTART_COUNT=1) and completes. Preemption: a Trainer
job (`--requeue`) that `scontrol requeue` interrupts after its first checkpoint runs again,
prints the Trainer's "resumed from" line for a checkpoint of the first attempt, and ends with all
its epochs and exactly the steps of an uninterrupted run. The scheduling options tandem slurm
adds (--mem, --exclusive, --signal, extra --sbatch lines) are accepted by the real sbatch.
Before the time limit: USR1 sent to the batch shell (as --signal=B:USR1 does) reaches the
Trainer's workers through the trap and srun, and they save a checkpoint and train on; the
requeue that follows stops them, and the job resumes and completes.

Skipped, saying why, where no SLURM cluster answers; ci/slurm/setup.sh makes a one-node one.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tandem.job.hostlist import expand_hostlist
from tandem.job.placement import slurm_master_port
from tandem.launch.slurm import build_sbatch_script
from tests.slurm import train_job, trainer_job

# One job at a time: the one-node cluster has 2 CPUs, and a job that waits for another's to end
# would spend its timeout queued.
pytestmark = [pytest.mark.xdist_group("slurm"), pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 180
# How often a job's state is read. Not `sbatch --wait`: its polls back off to 30 s apart, which
# turns a 4 s job into a 10 s test.
POLL_S = 0.25
# A requeued job waits out the credential lifetime before it starts again: 5 s on the CI
# cluster, 120 s by Slurm's default.
REQUEUE_TIMEOUT_S = 240
# The states of a job that will not run again (a requeued one passes through PENDING).
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
}
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _cluster_problem() -> str | None:
    """Why no job can run here, or None when a node is up to take one."""
    missing = [tool for tool in ("sbatch", "sinfo", "scontrol") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not on PATH (ci/slurm/setup.sh installs a one-node cluster)"
    try:
        done = subprocess.run(
            ["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s"
    states = done.stdout.split()
    if done.returncode != 0 or not {"idle", "mixed"} & set(states):
        answer = (done.stdout + done.stderr).strip() or "nothing"
        return f"no idle SLURM node (sinfo said: {answer}); run ci/slurm/setup.sh"
    return None


@pytest.fixture(scope="module", autouse=True)
def _cluster():
    problem = _cluster_problem()
    if problem is not None:
        print(f"skipping SLURM jobs: {problem}")
        pytest.skip(problem)


def _job_environment(**extra: str) -> dict[str, str]:
    """This environment, for sbatch to export into the job, minus any launcher's variables.

    A variable left from an enclosing torchrun or SLURM job would win over the ones srun sets.
    """
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in LAUNCHER_VARIABLES and not name.startswith(("SLURM_", "OMPI_"))
    }
    path = [str(REPO / "src"), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", **extra)
    return env


class Job:
    """A batch job submitted with ``sbatch``: its id, its output file, and waiting for its end."""

    def __init__(self, script: Path, out: Path, env: dict[str, str]) -> None:
        self.out = out
        submitted = subprocess.run(
            ["sbatch", "--parsable", f"--output={out}", f"--chdir={REPO}", str(script)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}\n{script.read_text()}"
        self.id = int(submitted.stdout.split(";")[0])  # "ID" or "ID;CLUSTER"

    def field(self, name: str) -> str:
        """A field of ``scontrol show job``, e.g. ``NodeList`` or ``Restarts``."""
        done = subprocess.run(
            ["scontrol", "show", "job", str(self.id)], capture_output=True, text=True, check=True
        )
        for word in done.stdout.split():
            key, _, value = word.partition("=")
            if key == name:
                return value
        raise AssertionError(f"no {name} in scontrol show job {self.id}:\n{done.stdout}")

    def log(self) -> str:
        return self.out.read_text() if self.out.exists() else "(no output yet)"

    def wait_for(self, condition, what: str, timeout: float = JOB_TIMEOUT_S) -> None:
        """Poll ``condition``; past ``timeout`` cancel the job and fail with its output."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                subprocess.run(["scancel", str(self.id)], check=False)
                pytest.fail(f"job {self.id}: waited {timeout} s for {what}; output:\n{self.log()}")
            time.sleep(POLL_S)

    def finish(self, timeout: float = JOB_TIMEOUT_S) -> str:
        """Wait until the job ends, assert it succeeded, return its output."""
        self.wait_for(lambda: self.field("JobState") in FINISHED, "the job to end", timeout)
        state, code = self.field("JobState"), self.field("ExitCode")
        assert (state, code) == ("COMPLETED", "0:0"), f"job {self.id} {state} {code}:\n{self.log()}"
        return self.log()


def _expected_sum() -> float:
    """The parameters' sum after one process trains on both ranks' batches together."""
    model = train_job.make_model()
    per_rank = [train_job.batches(rank) for rank in (0, 1)]
    both = [
        (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(*per_rank, strict=True)
    ]
    train_job.train(model, both)
    return train_job.flat_parameters(model).sum().item()


def _rank_reports(log: str) -> dict[int, dict[str, str]]:
    """train_job's lines, ``RANK r key value key value ...``, by rank (any prefix dropped)."""
    reports = {}
    for line in log.splitlines():
        if "RANK " in line:
            fields = line[line.index("RANK ") :].split()
            reports[int(fields[1])] = dict(zip(fields[2::2], fields[3::2], strict=True))
    assert sorted(reports) == [0, 1], log
    return reports


def _assert_trained_together(ranks: dict[int, dict[str, str]]) -> None:
    assert ranks[0]["world"] == ranks[1]["world"] == "2"
    assert ranks[0]["params"] == ranks[1]["params"]
    assert float(ranks[0]["sum"]) == pytest.approx(_expected_sum(), rel=1e-12, abs=1e-12)


def _bin_with_tandem(tmp_path: Path, body: str) -> Path:
    """A directory holding a ``tandem`` executable: this interpreter running ``body``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tandem = bin_dir / "tandem"
    tandem.write_text(f"#!{sys.executable}\nimport os, sys, time\n{body}")
    tandem.chmod(0o755)
    return bin_dir


REAL_TANDEM = "from tandem.cli import main\nsys.exit(main())\n"


def _submit_printed_script(tmp_path: Path, tandem: str, **options) -> Job:
    """Submit ``tandem slurm``'s script for one node of 2 processes (``options`` added to
    build_sbatch_script's), with a ``tandem`` on PATH that runs ``tandem`` (REAL_TANDEM: the
    real ``tandem run``, with this interpreter)."""
    bin_dir = _bin_with_tandem(tmp_path, tandem)
    script = tmp_path / "job.sh"
    options = {"cpus_per_task": 1, **options}
    script.write_text(
        build_sbatch_script(nodes=1, gpus_per_node=0, nproc_per_node=2, time="00:05:00", **options)
    )
    env = _job_environment(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return Job(script, tmp_path / "out.txt", env)


def test_srun_ranks_train_in_step_without_launcher(tmp_path):
    script = tmp_path / "job.sh"
    command = shlex.join([sys.executable, str(REPO / "tests" / "slurm" / "train_job.py")])
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --job-name=tandem-test-ddp\n"
        "#SBATCH --nodes=1\n"
        "#SBATCH --ntasks=2\n"
        "#SBATCH --time=00:03:00\n"
        f"srun --kill-on-bad-exit=1 {command}\n"
    )

    job = Job(script, tmp_path / "out.txt", _job_environment())
    ranks = _rank_reports(job.finish())

    master = f"{expand_hostlist(job.field('NodeList'))[0]}:{slurm_master_port(job.id)}"
    assert {r["master"] for r in ranks.values()} == {master}
    _assert_trained_together(ranks)


def test_printed_script_trains_through_tandem_run(tmp_path):
    # The real `tandem run`, through a `tandem` on PATH that uses this interpreter.
    job = _submit_printed_script(
        tmp_path,
        REAL_TANDEM,
        job_name="tandem-test-run",
        script_args=[str(REPO / "tests" / "slurm" / "train_job.py")],
    )

    _assert_trained_together(_rank_reports(job.finish()))


def test_printed_script_runs_tandem_run_per_node_and_requeues(tmp_path):
    # A stand-in `tandem` on PATH: it reports what the script ran it with and where
    # node_placement_from_slurm puts it, then waits for the requeue on the first attempt only.
    stand_in = (
        "from tandem.launch.slurm_node import node_placement_from_slurm\n"
        "attempt = os.environ.get('SLURM_RESTART_COUNT', '0')\n"
        "print('TANDEM', attempt, repr(sys.argv[1:]), repr(node_placement_from_slurm(os.environ)),"
        " os.environ['SLURM_JOB_NODELIST'], sep='\\t', flush=True)\n"
        "import signal\n"
        "signal.signal(signal.SIGUSR1, lambda *_: print('TANDEM got USR1', flush=True))\n"
        "if attempt == '0':\n"
        "    time.sleep(120)\n"
    )
    script_args = ["train.py", "--note", "two words", "it's", "$HOME", "a;b", '"q"']
    job = _submit_printed_script(
        tmp_path,
        stand_in,
        job_name="tandem-test-requeue",
        script_args=script_args,
        # The requeue follows half the lead after the signal: 2 s, not 45.
        signal="USR1@4",
    )
    job.wait_for(lambda: "TANDEM\t0\t" in job.log(), "the first attempt to start")
    # What Slurm does 4 s before the limit (--signal=B:USR1@4), without waiting for it.
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(job.id)], check=True)
    log = job.finish(REQUEUE_TIMEOUT_S)

    assert f"requeueing job {job.id}" in log
    # The trap passed the signal on through srun to the step (the stand-in `tandem`).
    assert "TANDEM got USR1" in log, log
    attempts = [line.split("\t") for line in log.splitlines() if line.startswith("TANDEM\t")]
    assert [a[1] for a in attempts] == ["0", "1"], log
    for _, _, argv, placement, nodelist in attempts:
        assert argv == repr(["run", "--nproc-per-node", "2", *script_args])
        host = expand_hostlist(nodelist)[0]
        assert placement == repr((1, 0, host, slurm_master_port(job.id)))
    assert job.field("Restarts") == "1"


def test_requeued_trainer_job_resumes_from_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    job = _submit_printed_script(
        tmp_path,
        REAL_TANDEM,
        cpus_per_task=2,
        job_name="tandem-test-preempt",
        requeue=True,
        mem="1G",
        exclusive=True,
        sbatch=["--comment=tandem-test"],
        script_args=[str(REPO / "tests" / "slurm" / "trainer_job.py"), str(run_dir)],
    )
    latest = run_dir / "checkpoints" / "latest"
    job.wait_for(latest.exists, "the first checkpoint")
    # What a preemption with PreemptMode=REQUEUE (or an admin) does to a running job.
    subprocess.run(["scontrol", "requeue", str(job.id)], check=True)
    log = job.finish(REQUEUE_TIMEOUT_S)

    assert job.field("Restarts") == "1"
    finals = [line[line.index("FINAL") :].split() for line in log.splitlines() if "FINAL" in line]
    # The first attempt stopped early (on the requeue's SIGTERM, or killed), the second ran on.
    assert finals[-1][-1] == "1", log
    assert not any(f[-1] == "0" and f[2] == str(trainer_job.EPOCHS) for f in finals), log
    resumed = [line for line in log.splitlines() if "resumed from" in line]
    assert len(resumed) == 1, log
    assert str(run_dir / "checkpoints" / "ckpt-e") in resumed[0]
    # All the epochs, and the steps of an uninterrupted run: the resume lost and redid none.
    steps = trainer_job.EPOCHS * trainer_job.SAMPLES // (2 * trainer_job.BATCH)
    assert finals[-1][:5] == ["FINAL", "epochs", str(trainer_job.EPOCHS), "steps", str(steps)]


def test_signal_before_the_limit_checkpoints_the_workers_then_requeues(tmp_path):
    run_dir = tmp_path / "run"
    epochs = 8  # about a second each: training goes on for the 2 s before the requeue
    job = _submit_printed_script(
        tmp_path,
        REAL_TANDEM,
        cpus_per_task=2,
        job_name="tandem-test-signal",
        # The requeue follows half the lead after the signal: 2 s.
        signal="USR1@4",
        # No checkpoints but those the signals ask for.
        script_args=[
            str(REPO / "tests" / "slurm" / "trainer_job.py"),
            str(run_dir),
            str(epochs),
            "1000",
        ],
    )
    job.wait_for(lambda: "epoch   1 " in job.log(), "the first epoch")
    # What Slurm does 4 s before the limit (--signal=B:USR1@4), without waiting for it.
    subprocess.run(["scancel", "--batch", "--signal=USR1", str(job.id)], check=True)
    log = job.finish(REQUEUE_TIMEOUT_S)

    first, _, second = log.partition(f"requeueing job {job.id}")
    assert second, log
    # The workers saved on USR1 (no other save was due) and trained on: CHECKPOINT is printed
    # at a later step.
    assert "CHECKPOINT " in first.partition("USR1 from Slurm")[2], log
    assert "resumed from" in second, log
    steps = epochs * trainer_job.SAMPLES // (2 * trainer_job.BATCH)
    assert f"FINAL epochs {epochs} steps {steps} stopped_by None restart 1" in second, log
