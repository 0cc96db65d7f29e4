"""`tandem slurm`'s batch script and the node placement `tandem run` reads under srun.

Proves: the script's #SBATCH block asks for exactly one task per node with the GPUs, CPUs, time,
partition, log and requeue options given, ahead of any command (where sbatch stops reading);
bash itself hands srun the script's arguments unchanged, whatever quotes, spaces, `$` or
newlines they hold (checked against hypothesis' strings by running the script with a stub srun),
and shlex reads the srun line the same way; when USR1 reaches the batch shell, the trap passes it to
srun and then runs `scontrol requeue $SLURM_JOB_ID`, and the script still ends with srun's own
exit status (tests/slurm/test_slurm_script.py covers the other options); the
command line takes dashed and underscored options and `--`, and rejects bad values naming them;
node_placement_from_slurm reads what srun sets (the step's variables first), returns None outside
a step, and names the variable and value of every bad one; importing the module imports no torch.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.cli import slurm as slurm_cli
from tandem.launch.slurm import build_sbatch_script, parse_time
from tandem.launch.slurm_node import node_placement_from_slurm

REFERENCE = {
    "nodes": 2,
    "gpus_per_node": 4,
    "time": "01:00:00",
    "partition": "gpu",
    "script_args": ["train.py", "--lr", "0.1"],
}


def _sbatch_options(script: str) -> dict[str, str | None]:
    """The #SBATCH options, ``--name=value`` as {name: value} and a bare ``--flag`` as None."""
    options: dict[str, str | None] = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            name, eq, value = line.removeprefix("#SBATCH ").partition("=")
            options[name] = value if eq else None
    return options


def _srun_words(script: str) -> list[str]:
    """The srun command's words, as shlex reads them; quoted arguments may span lines."""
    start = script.index("\nsrun ") + 1
    # In the background, so that the trap can run while the shell waits.
    end = script.index(" &\nsrun_pid=$!\n", start)
    return shlex.split(script[start:end])


# --- the script ---------------------------------------------------------------------------------


def test_reference_script_asks_for_one_task_per_node_and_a_requeue():
    script = build_sbatch_script(**REFERENCE)

    assert script.startswith("#!/bin/bash\n")
    assert _sbatch_options(script) == {
        "--job-name": "tandem",
        "--nodes": "2",
        "--ntasks-per-node": "1",
        "--gpus-per-node": "4",
        "--time": "01:00:00",
        "--partition": "gpu",
        "--output": "%x-%j.out",
        "--open-mode": "append",
        "--signal": "B:USR1@90",
        "--requeue": None,
    }
    assert _srun_words(script) == [
        "srun",
        "--kill-on-bad-exit=1",
        "tandem",
        "run",
        "--nproc-per-node",
        "4",
        "train.py",
        "--lr",
        "0.1",
    ]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "trap on_signal USR1" in script


def test_sbatch_block_comes_before_any_command():
    # sbatch stops reading #SBATCH lines at the first line that is not a comment.
    lines = build_sbatch_script(**REFERENCE, cpus_per_task=8).splitlines()
    sbatch = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert sbatch == list(range(1, len(sbatch) + 1))


def test_cpus_per_task_reaches_the_job_and_the_step():
    # srun in Slurm 22.05-23.02 does not inherit --cpus-per-task from the job.
    script = build_sbatch_script(**REFERENCE, cpus_per_task=16)
    assert _sbatch_options(script)["--cpus-per-task"] == "16"
    assert _srun_words(script)[:3] == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=16"]
    default = build_sbatch_script(**REFERENCE)
    assert "--cpus-per-task" not in _sbatch_options(default)
    assert not any(word.startswith("--cpus-per-task") for word in _srun_words(default))


def test_cpu_job_takes_workers_from_nproc_and_asks_for_no_gpus():
    script = build_sbatch_script(
        nodes=3, gpus_per_node=0, nproc_per_node=8, time="90", script_args=["a.py"]
    )
    options = _sbatch_options(script)
    assert "--gpus-per-node" not in options
    assert (options["--nodes"], options["--time"]) == ("3", "90")
    assert _srun_words(script)[-4:] == ["run", "--nproc-per-node", "8", "a.py"]


def test_module_form_and_names():
    script = build_sbatch_script(
        **{**REFERENCE, "script_args": ["tandem.examples.wine", "--epochs", "3"]},
        module=True,
        job_name="wine",
        output="logs/%x-%j.log",
        nproc_per_node=2,
    )
    assert _srun_words(script)[2:] == [
        "tandem",
        "run",
        "--nproc-per-node",
        "2",
        "-m",
        "tandem.examples.wine",
        "--epochs",
        "3",
    ]
    options = _sbatch_options(script)
    assert (options["--job-name"], options["--output"]) == ("wine", "logs/%x-%j.log")


def test_no_partition_leaves_the_clusters_default():
    assert "--partition" not in _sbatch_options(
        build_sbatch_script(**{**REFERENCE, "partition": None})
    )


# --- the script, run by bash with stub srun and scontrol ---------------------------------------

_STUB_SRUN = """#!/bin/bash
# Records the signals it gets (as srun would pass them to the tasks) instead of dying of them.
for sig in USR1 USR2 TERM; do trap "echo $sig >> $STUB_DIR/srun.signals" $sig; done
printf '%s\\0' "$@" > "$STUB_DIR/srun.args"
# Stay running until the test (or the stub scontrol) says so, then exit with SRUN_EXIT.
while [ -n "$SRUN_WAIT" ] && [ ! -e "$STUB_DIR/release" ]; do sleep 0.02; done
exit "${SRUN_EXIT:-0}"
"""
_STUB_SCONTROL = """#!/bin/bash
printf '%s\\0' "$@" > "$STUB_DIR/scontrol.args"
touch "$STUB_DIR/release"
"""


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("stubs")
    for name, text in (("srun", _STUB_SRUN), ("scontrol", _STUB_SCONTROL)):
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
    return directory


def _start(script: str, stubs: Path, work: Path, **env: str) -> subprocess.Popen:
    path = work / "job.sh"
    path.write_text(script)
    for leftover in ("srun.args", "srun.signals", "scontrol.args", "release"):
        (work / leftover).unlink(missing_ok=True)
    environ = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "STUB_DIR": str(work),
        "SLURM_JOB_ID": "77",
        **env,
    }
    return subprocess.Popen(
        ["bash", str(path)], env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _args(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def test_script_passes_bash_syntax_check(tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(build_sbatch_script(**REFERENCE, cpus_per_task=4))
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


_argument = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\0"))


@settings(max_examples=60, deadline=None)
@given(args=st.lists(_argument, max_size=5))
def test_bash_gives_srun_the_arguments_unchanged(stubs, tmp_path_factory, args):
    work = tmp_path_factory.mktemp("job")
    script_args = ["my script.py", *args]
    script = build_sbatch_script(**{**REFERENCE, "script_args": script_args})
    done = _start(script, stubs, work)
    output, _ = done.communicate(timeout=30)

    assert done.returncode == 0, output
    expected = ["--kill-on-bad-exit=1", "tandem", "run", "--nproc-per-node", "4", *script_args]
    assert _args(work / "srun.args") == expected
    assert _srun_words(script)[1:] == expected
    path = work / "job.sh"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


def test_script_exits_with_sruns_status(stubs, tmp_path):
    done = _start(build_sbatch_script(**REFERENCE), stubs, tmp_path, SRUN_EXIT="3")
    output, _ = done.communicate(timeout=30)
    assert done.returncode == 3, output
    assert not (tmp_path / "scontrol.args").exists()


def test_usr1_reaches_srun_then_requeues_and_the_script_waits_for_srun(stubs, tmp_path):
    # A lead of 4 s: the requeue comes half of it (2 s) after the signal.
    script = build_sbatch_script(**REFERENCE, signal="USR1@4")
    job = _start(script, stubs, tmp_path, SRUN_WAIT="1", SRUN_EXIT="5")
    deadline = time.monotonic() + 30
    while not (tmp_path / "srun.args").exists():  # srun starts after the trap is set
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
        time.sleep(0.02)

    # Slurm's --signal=B:USR1 signals the batch shell alone, not its children.
    os.kill(job.pid, signal.SIGUSR1)
    output, _ = job.communicate(timeout=30)

    assert _args(tmp_path / "scontrol.args") == ["requeue", "77"]
    assert (tmp_path / "srun.signals").read_text() == "USR1\n"
    assert b"requeueing job 77" in output
    # The interrupted `wait` was resumed: the status is srun's, not the 138 of the signal.
    assert job.returncode == 5, output


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nodes": 0}, "nodes=0"),
        ({"nodes": True}, "nodes=True"),
        ({"nodes": "2"}, "nodes='2'"),
        ({"gpus_per_node": -1}, "gpus_per_node=-1"),
        ({"cpus_per_task": 0}, "cpus_per_task=0"),
        ({"nproc_per_node": 0}, "nproc_per_node=0"),
        ({"nproc_per_node": 5}, "nproc_per_node=5 exceeds gpus_per_node=4"),
        ({"gpus_per_node": 0}, "gpus_per_node=0"),
        ({"time": "1:00"}, "time='1:00'"),
        ({"time": "abc"}, "time='abc'"),
        ({"time": "01:60:00"}, "time='01:60:00'"),
        ({"time": "00:00:61"}, "time='00:00:61'"),
        ({"time": "1-24:00:00"}, "time='1-24:00:00'"),
        ({"time": "0"}, "time='0'"),
        ({"time": "00:00:00"}, "time='00:00:00'"),
        ({"time": "2"}, "time='2' is 120 s"),
        ({"time": "-5"}, "time='-5'"),
        ({"partition": "gpu a100"}, "partition='gpu a100'"),
        ({"partition": ""}, "partition=''"),
        ({"job_name": "my\njob"}, "job_name='my\\\\njob'"),
        ({"output": "my logs/%j.out"}, "output='my logs/%j.out'"),
        ({"script_args": []}, "script_args is empty"),
        ({"script_args": ["--lr", "0.1"]}, "script_args\\[0\\]='--lr'"),
    ],
)
def test_bad_values_raise_naming_them(change, message):
    with pytest.raises(ValueError, match=message):
        build_sbatch_script(**{**REFERENCE, **change})


@pytest.mark.parametrize(
    ("time", "seconds"),
    [
        ("90", 5400),
        ("01:00:00", 3600),
        ("1:02:03", 3723),
        ("100:00:00", 360000),
        ("2-00:00:00", 172800),
        ("0-00:03:00", 180),
        (" 30 ", 1800),
    ],
)
def test_parse_time(time, seconds):
    assert parse_time(time) == seconds


def test_shortest_time_leaves_room_for_the_warning():
    build_sbatch_script(**{**REFERENCE, "time": "00:02:30"})
    with pytest.raises(ValueError, match="at least 150 s"):
        build_sbatch_script(**{**REFERENCE, "time": "00:02:29"})


# --- the command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem")
    slurm_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        args = _parser().parse_args(argv)
        code = args.func(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv",
    [
        "slurm --nodes 2 --gpus-per-node 4 --time 01:00:00 --partition gpu -- train.py --lr 0.1",
        "slurm --nodes=2 --gpus_per_node=4 --time=01:00:00 --partition=gpu -- train.py --lr 0.1",
        "slurm --nodes 2 --gpus-per-node 4 --time 01:00:00 --partition gpu train.py --lr 0.1",
    ],
)
def test_cli_prints_the_reference_script(argv, capsys):
    code, out, err = _cli(argv.split(), capsys)
    assert (code, err) == (0, "")
    assert out == build_sbatch_script(**REFERENCE)


def test_cli_options_reach_the_script(capsys):
    argv = (
        "slurm --nodes 1 --gpus_per_node 0 --nproc_per_node 3 --cpus-per-task 6 --time 2-00:00:00"
        " --job_name wine --output w.log -m -- tandem.examples.wine -m x"
    )
    code, out, _ = _cli(argv.split(), capsys)
    assert code == 0
    assert out == build_sbatch_script(
        nodes=1,
        gpus_per_node=0,
        nproc_per_node=3,
        cpus_per_task=6,
        time="2-00:00:00",
        job_name="wine",
        output="w.log",
        module=True,
        script_args=["tandem.examples.wine", "-m", "x"],
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("slurm --nodes 0 --gpus-per-node 4 --time 60 -- t.py", "'0' is not an integer >= 1"),
        ("slurm --nodes 1 --gpus-per-node -2 --time 60 -- t.py", "'-2' is not an integer >= 0"),
        ("slurm --nodes 1 --gpus-per-node x --time 60 -- t.py", "'x' is not an integer >= 0"),
        ("slurm --nodes 1 --gpus-per-node 4 --time 1:00 -- t.py", "time='1:00'"),
        ("slurm --nodes 1 --gpus-per-node 0 --time 60 -- t.py", "give nproc_per_node"),
        ("slurm --nodes 1 --gpus-per-node 4 --time 60", "script_args is empty"),
        ("slurm --nodes 1 --gpus-per-node 4 --time 60 --", "script_args is empty"),
        ("slurm --gpus-per-node 4 --time 60 -- t.py", "--nodes"),
    ],
)
def test_cli_rejects_bad_values_naming_them(argv, message, capsys):
    code, out, err = _cli(argv.split(), capsys)
    assert code == 2
    assert out == ""
    assert message in err


# --- node placement under srun ------------------------------------------------------------------

# What srun set for a task of `srun -N1 -n1` on the one-node CI cluster (Slurm 22.05), trimmed.
SRUN_ONE_NODE = {
    "SLURM_JOB_ID": "17",
    "SLURM_JOBID": "17",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NNODES": "1",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_NTASKS": "1",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_NODELIST": "vm",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}
# Node 1 of a two-node step, one task per node.
SRUN_TWO_NODES = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}


def _without(environ: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in names}


def test_placement_of_an_srun_task():
    assert node_placement_from_slurm(SRUN_ONE_NODE) == (1, 0, "vm", 15017)
    assert node_placement_from_slurm(SRUN_TWO_NODES) == (2, 1, "gpu07", 18456)


def test_placement_falls_back_to_the_jobs_variables():
    env = _without(SRUN_TWO_NODES, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_STEP_NODELIST")
    assert node_placement_from_slurm({**env, "SLURM_JOB_NUM_NODES": "2"}) == (
        2,
        1,
        "gpu07",
        18456,
    )
    env = _without(SRUN_TWO_NODES, "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST")
    assert node_placement_from_slurm({**env, "SLURM_JOBID": "9", "SLURM_NODELIST": "n[3-4]"}) == (
        2,
        1,
        "n3",
        15009,
    )


def test_placement_of_a_step_on_part_of_the_job_uses_the_steps_nodes():
    # `srun -N2 -w gpu[11-12]` inside a job on gpu[07-08,11-12]
    env = {
        **SRUN_TWO_NODES,
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_NODELIST": "gpu[07-08,11-12]",
        "SLURM_STEP_NODELIST": "gpu[11-12]",
        "SLURM_NODELIST": "gpu[11-12]",
    }
    assert node_placement_from_slurm(env) == (2, 1, "gpu11", 18456)


def test_master_variables_override_the_derived_rendezvous():
    env = {**SRUN_TWO_NODES, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    assert node_placement_from_slurm(env) == (2, 1, "10.0.0.1", 29400)


def test_batch_script_of_one_node_gets_a_placement():
    # The batch shell has no SLURM_STEP_ID; on one node tandem run may run there without srun.
    env = _without(SRUN_ONE_NODE, "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_STEP_NUM_NODES")
    assert node_placement_from_slurm(env) == (1, 0, "vm", 15017)


@pytest.mark.parametrize(
    "environ",
    [
        {},
        {"SLURM_NODEID": "0", "SLURM_NNODES": "1"},  # no job id
        # salloc's shell: a job, but no SLURM_NODEID
        {"SLURM_JOB_ID": "5", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"},
        {"SLURM_JOB_ID": "5", "SLURM_NODEID": "0"},  # no node count
    ],
)
def test_no_placement_outside_a_step(environ):
    assert node_placement_from_slurm(environ) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not < SLURM_STEP_NUM_NODES=2"),
        ({"SLURM_NODEID": "-1"}, "SLURM_NODEID='-1'"),
        ({"SLURM_STEP_NUM_NODES": "two"}, "SLURM_STEP_NUM_NODES='two'"),
        ({"SLURM_STEP_NUM_NODES": "0"}, "SLURM_STEP_NUM_NODES='0'"),
        ({"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID='12a'"),
        (
            {"SLURM_STEP_NODELIST": "gpu[07-"},
            "SLURM_STEP_NODELIST=gpu\\[07- is not a valid hostlist",
        ),
        ({"SLURM_STEP_NODELIST": ""}, "SLURM_STEP_NODELIST='' names no host"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({"MASTER_ADDR": " "}, "MASTER_ADDR=' '"),
        ({"SLURM_STEP_NUM_TASKS": "8"}, "SLURM_STEP_NUM_TASKS=8 tasks on SLURM_STEP_NUM_NODES=2"),
    ],
)
def test_bad_variables_raise_naming_them(change, message):
    with pytest.raises(ValueError, match=message):
        node_placement_from_slurm({**SRUN_TWO_NODES, **change})


def test_no_nodelist_raises():
    env = _without(SRUN_TWO_NODES, "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST")
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST is set"):
        node_placement_from_slurm(env)


def test_batch_script_of_several_nodes_raises():
    # `tandem run` without srun in a two-node job: node 1 would never start.
    env = _without(SRUN_TWO_NODES, "SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS")
    with pytest.raises(ValueError, match=r"SLURM_NNODES=2, no SLURM_STEP_ID.*srun"):
        node_placement_from_slurm({**env, "SLURM_NODEID": "0"})


def test_importing_the_module_imports_no_torch():
    code = "import sys, tandem.launch.slurm; print(sorted(m for m in sys.modules if 'torch' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
