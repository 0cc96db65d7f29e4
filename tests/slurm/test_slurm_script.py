"""`tandem slurm`'s scheduling options, the signal before the time limit, and extra directives.

Proves: --account, --qos, --mem, --constraint and --exclusive each become exactly their #SBATCH
line (and nothing when not given), inside the block sbatch reads; --sbatch adds any other
directive, and refuses one the script writes itself, naming tandem slurm's option for it;
--signal SIG@T becomes `--signal=B:SIG@T` with a trap for SIG, and --no-requeue becomes
`--no-requeue` with no `scontrol requeue` anywhere; a bad signal, memory size or short time
raises naming the value. Run by bash with stub srun and scontrol, the trap passes the signal to
srun (which signals the step's processes on every node); with --requeue, USR1 is followed by
`scontrol requeue` half the lead later if srun still runs, and by none if the training ended
first; TERM is followed by the requeue at once; with --no-requeue nothing is requeued. The
command line takes every option and reports bad values; every variant of the script is valid bash.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tandem.cli import slurm as slurm_cli
from tandem.launch.slurm import build_sbatch_script
from tandem.launch.slurm_options import SignalSpec, check_mem, parse_signal
from tests.slurm.test_slurm import _STUB_SCONTROL, _STUB_SRUN, REFERENCE, _args, _start

BASE = {**REFERENCE, "time": "01:00:00"}


def _sbatch_lines(script: str) -> list[str]:
    """The #SBATCH block (sbatch reads it only up to the first line that is not a comment)."""
    lines = script.splitlines()[1:]
    block = []
    for line in lines:
        if not line.startswith("#SBATCH "):
            break
        block.append(line.removeprefix("#SBATCH "))
    return block


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("stubs")
    for name, text in (("srun", _STUB_SRUN), ("scontrol", _STUB_SCONTROL)):
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
    return directory


# --- the #SBATCH lines ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "line"),
    [
        ({"account": "proj-42"}, "--account=proj-42"),
        ({"qos": "high"}, "--qos=high"),
        ({"mem": "64G"}, "--mem=64G"),
        ({"mem": "0"}, "--mem=0"),
        ({"mem": "16000"}, "--mem=16000"),
        ({"constraint": "a100&ib"}, "--constraint=a100&ib"),
        ({"exclusive": True}, "--exclusive"),
        ({"requeue": False}, "--no-requeue"),
        ({"signal": "USR1@300"}, "--signal=B:USR1@300"),
        ({"signal": "SIGTERM@120"}, "--signal=B:TERM@120"),
        ({"signal": "B:usr2@60"}, "--signal=B:USR2@60"),
        ({"signal": "10@120"}, "--signal=B:USR1@120"),
        ({"sbatch": ["--mail-type=END,FAIL"]}, "--mail-type=END,FAIL"),
        ({"sbatch": ["#SBATCH --gres=gpu:a100:4"]}, "--gres=gpu:a100:4"),
        ({"sbatch": ["mail-user=me@lab.org"]}, "--mail-user=me@lab.org"),
        ({"sbatch": ["-x node3"]}, "-x node3"),
    ],
)
def test_each_option_is_its_own_sbatch_line(option, line):
    default = _sbatch_lines(build_sbatch_script(**BASE))
    lines = _sbatch_lines(build_sbatch_script(**BASE, **option))
    added = [x for x in lines if x not in default]
    replaced = [x for x in default if x not in lines]
    assert added == [line]
    # Only --requeue and the default signal are replaced; everything else is added.
    assert replaced in ([], ["--requeue"], ["--signal=B:USR1@90"])


def test_options_not_given_write_nothing():
    lines = _sbatch_lines(build_sbatch_script(**BASE))
    for name in ("--account", "--qos", "--mem", "--constraint", "--exclusive", "--no-requeue"):
        assert not any(x.startswith(name) for x in lines), lines


def test_several_extra_directives_keep_their_order():
    extra = ["--mail-type=END", "--nice=10", "--gres=gpu:1"]
    assert _sbatch_lines(build_sbatch_script(**BASE, sbatch=extra))[-3:] == extra


def test_no_signal_means_no_trap():
    script = build_sbatch_script(**BASE, signal=None)
    assert not any(x.startswith("--signal") for x in _sbatch_lines(script))
    assert not any(line.startswith("trap ") for line in script.splitlines())
    assert "--requeue" in _sbatch_lines(script)  # still requeued on preemption


def test_no_requeue_never_runs_scontrol():
    script = build_sbatch_script(**BASE, requeue=False)
    assert "scontrol" not in script
    assert "trap on_signal USR1" in script


def test_signal_lead_sets_the_shortest_time():
    build_sbatch_script(**{**BASE, "time": "00:06:00"}, signal="USR1@300")
    with pytest.raises(ValueError, match="at least 360 s, or a shorter --signal lead"):
        build_sbatch_script(**{**BASE, "time": "00:05:59"}, signal="USR1@300")
    # Without a signal only a positive time is needed.
    build_sbatch_script(**{**BASE, "time": "1"}, signal=None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"signal": "USR1"}, "signal='USR1' is not SIG@SECONDS"),
        ({"signal": "USR1@"}, "signal='USR1@' is not SIG@SECONDS"),
        ({"signal": "USR1@-5"}, "signal='USR1@-5' is not SIG@SECONDS"),
        ({"signal": "R:USR1@90"}, "signal='R:USR1@90' is not SIG@SECONDS"),
        ({"signal": "USR9@90"}, "'USR9' is not a signal"),
        ({"signal": "99@90"}, "'99' is not a signal"),
        ({"signal": "KILL@90"}, "SIGKILL cannot be caught"),
        ({"signal": "STOP@90"}, "SIGSTOP cannot be caught"),
        ({"signal": "USR1@0"}, "0 s before the time limit is outside"),
        ({"signal": "USR1@70000"}, "70000 s before the time limit is outside"),
        ({"mem": "16 GB"}, "mem='16 GB' is not a SLURM memory size"),
        ({"mem": "1.5G"}, "mem='1.5G'"),
        ({"mem": "16GiB"}, "mem='16GiB'"),
        ({"mem": "-1"}, "mem='-1'"),
        ({"account": "my account"}, "account='my account'"),
        ({"qos": ""}, "qos=''"),
        ({"constraint": "a100 & ib"}, "constraint='a100 & ib'"),
        ({"sbatch": [""]}, "sbatch='' is not one sbatch option"),
        ({"sbatch": ["--mail-type=END\n#SBATCH -N 9"]}, "is not one sbatch option"),
        (
            {"sbatch": ["--time=2:00:00"]},
            "sets --time, which tandem slurm writes itself: use --time",
        ),
        ({"sbatch": ["-t1:00:00"]}, "sets -t1:00:00, which tandem slurm writes itself: use --time"),
        ({"sbatch": ["-A other"]}, "sets -A, which tandem slurm writes itself: use --account"),
        ({"sbatch": ["--ntasks-per-node=4"]}, "fixes \\(one task per node"),
        ({"sbatch": ["--signal=B:USR2@60"]}, "use --signal"),
        ({"sbatch": ["--no-requeue"]}, "use --no-requeue"),
    ],
)
def test_bad_values_raise_naming_them(change, message):
    with pytest.raises(ValueError, match=message):
        build_sbatch_script(**{**BASE, **change})


def test_parsers():
    assert parse_signal(" SIGUSR2@45 ") == SignalSpec("USR2", 45)
    assert check_mem("512m") == "512m"


# --- the trap, run by bash ----------------------------------------------------------------------


def _run_signalled(stubs: Path, work: Path, spec: str, **options) -> tuple[subprocess.Popen, Path]:
    """Run the script and send its shell the signal of ``spec`` once srun runs."""
    script = build_sbatch_script(**BASE, signal=spec, **options)
    job = _start(script, stubs, work, SRUN_WAIT="1", SRUN_EXIT="0")
    deadline = time.monotonic() + 30
    while not (work / "srun.args").exists():  # srun starts after the trap is set
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0]
        time.sleep(0.02)
    os.kill(job.pid, signal.Signals["SIG" + parse_signal(spec).name])
    return job, work


def test_usr1_reaches_srun_and_no_requeue_follows_when_the_training_ends_first(stubs, tmp_path):
    job, work = _run_signalled(stubs, tmp_path, "USR1@4")  # requeue due 2 s later
    deadline = time.monotonic() + 10
    while not (work / "srun.signals").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    (work / "release").touch()  # the training ends before the requeue is due
    output, _ = job.communicate(timeout=30)
    time.sleep(2.5)  # past the time the requeue would have run
    assert job.returncode == 0, output
    assert (work / "srun.signals").read_text() == "USR1\n"
    assert not (work / "scontrol.args").exists(), output


def test_term_is_passed_on_and_requeued_at_once(stubs, tmp_path):
    start = time.monotonic()
    job, work = _run_signalled(stubs, tmp_path, "TERM@100")
    output, _ = job.communicate(timeout=30)
    assert time.monotonic() - start < 10
    assert _args(work / "scontrol.args") == ["requeue", "77"]
    assert (work / "srun.signals").read_text() == "TERM\n"
    assert job.returncode == 0, output


def test_no_requeue_only_passes_the_signal_on(stubs, tmp_path):
    job, work = _run_signalled(stubs, tmp_path, "USR1@2", requeue=False)
    deadline = time.monotonic() + 10
    while not (work / "srun.signals").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(1.5)  # past half the lead
    (work / "release").touch()
    output, _ = job.communicate(timeout=30)
    assert (work / "srun.signals").read_text() == "USR1\n"
    assert not (work / "scontrol.args").exists(), output
    assert job.returncode == 0, output


# --- the command line ---------------------------------------------------------------------------


def _cli(argv: str, capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="tandem")
    slurm_cli.register(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(argv.split())
        code = args.func(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_takes_every_option(capsys):
    code, out, err = _cli(
        "slurm --nodes 2 --gpus-per-node 4 --time 01:00:00 --partition gpu --account proj"
        " --qos high --mem 64G --constraint a100 --exclusive --no-requeue --signal TERM@120"
        " --sbatch mail-type=END --sbatch=--nice=5 -- train.py --lr 0.1",
        capsys,
    )
    assert (code, err) == (0, "")
    assert out == build_sbatch_script(
        **BASE,
        account="proj",
        qos="high",
        mem="64G",
        constraint="a100",
        exclusive=True,
        requeue=False,
        signal="TERM@120",
        sbatch=["mail-type=END", "--nice=5"],
    )


def test_cli_signal_none(capsys):
    code, out, _ = _cli(
        "slurm --nodes 2 --gpus-per-node 4 --time 60 --partition gpu --signal none -- train.py"
        " --lr 0.1",
        capsys,
    )
    assert code == 0
    assert out == build_sbatch_script(**{**BASE, "time": "60"}, signal=None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--signal USR1", "signal='USR1' is not SIG@SECONDS"),
        ("--signal KILL@90", "SIGKILL cannot be caught"),
        ("--mem 16GB", "mem='16GB' is not a SLURM memory size"),
        ("--sbatch time=5", "sets --time, which tandem slurm writes itself"),
        ("--account a --account=b --qos", "--qos: expected one argument"),
    ],
)
def test_cli_rejects_bad_values_naming_them(argv, message, capsys):
    code, out, err = _cli(f"slurm --nodes 1 --gpus-per-node 4 --time 60 {argv} -- t.py", capsys)
    assert code == 2
    assert out == ""
    assert message in err


@pytest.mark.parametrize(
    "options",
    [
        {"signal": None},
        {"signal": None, "requeue": False},
        {"requeue": False},
        {"signal": "TERM@100"},
        {"signal": "USR2@100", "sbatch": ["--comment=a b"]},
    ],
)
def test_every_variant_passes_bash_syntax_check(options, tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(build_sbatch_script(**BASE, **options))
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
