"""`tandem run` takes every torchrun flag, with torchrun's meaning; torch's own code is the oracle.

- Every option string of torchrun's parser (``torch.distributed.run.get_args_parser()``), as
  ``--flag value`` and ``--flag=value``, parses under `tandem run` into the same destination
  with the same value: a flag torch adds later fails here.
- ``--nnodes``, ``--rdzv-endpoint``, ``--rdzv-conf`` and ``--redirects``/``--tee`` values parse
  as torch's own parsers parse them; which streams of which local rank go to a file and which to
  the console is what torch's ``DefaultLogsSpecs.reify`` decides, in torch's directory layout.
- A real run with ``--log-dir -r -t --local-ranks-filter`` writes those files with the workers'
  lines and shows only the chosen ranks; workers get exactly torchrun's environment for
  ``--role`` and ``--rdzv-id`` (compared with a real torchrun).
- The DDP tutorial's multi-node command (``--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT``, no
  ``--node-rank``) runs two nodes on loopback, numbered by arrival; a third node, arriving when
  MAX nodes run, is refused with an error naming the maximum (elastic admission below MAX:
  test_elastic.py).
- Bad input (an etcd backend, ``--nnodes 3:2``) is one clear line and status 2; ``tandem
  --version`` prints the package's version and every verb's ``--help`` shows defaults and
  torchrun's groups.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std, to_map
from torch.distributed.elastic.rendezvous.utils import (
    _parse_rendezvous_config,
    parse_rendezvous_endpoint,
)

import tandem
from tandem.cli import build_parser
from tandem.launch.logfiles import LogPlan, parse_filters
from tandem.launch.rendezvous import LaunchError
from tandem.launch.torchrun_flags import (
    STD_ERR,
    STD_OUT,
    parse_endpoint,
    parse_nnodes,
    parse_rdzv_conf,
    parse_std,
)
from tests.harness import free_port
from tests.launch.test_run import TANDEM, WORKERS, _env_lines, tandem_run

# A valid value for each torchrun flag that takes one (choices: the first choice).
SAMPLE = {
    "nnodes": "1",
    "rdzv_endpoint": "node0:29603",
    "rdzv_conf": "join_timeout=60",
    "signals_to_handle": "SIGTERM,SIGUSR2",
    "redirects": "3",
    "tee": "0:1",
    "local_ranks_filter": "0,1",
    "master_addr": "10.0.0.1",
}
# torch parses these into lists; tandem keeps the text (it only warns they are not applied).
LISTS = {"duplicate_stdout_filters", "duplicate_stderr_filters"}


def _torchrun_options() -> list[tuple[str, argparse.Action]]:
    return [
        (option, action)
        for action in torchrun.get_args_parser()._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    ]


@pytest.mark.parametrize(("option", "action"), _torchrun_options(), ids=lambda x: str(x)[:40])
def test_every_torchrun_flag_parses_to_torchruns_value(option, action):
    ours = build_parser()
    if action.nargs == 0:
        forms = [[option]]
    else:
        value = action.choices[0] if action.choices else SAMPLE.get(action.dest, "1")
        forms = [[option, value]]
        if option.startswith("--"):
            forms.append([f"{option}={value}"])
    for form in forms:
        args = ours.parse_args(["run", *form, "train.py", "--lr", "1"])
        theirs = torchrun.get_args_parser().parse_args([*form, "train.py", "--lr", "1"])
        assert args.script == "train.py" and args.script_args == ["--lr", "1"], form
        expected = getattr(theirs, action.dest)
        got = getattr(args, action.dest)
        if action.dest in LISTS:
            assert got.split(",") == expected, form
        else:
            assert got == expected, (form, got, expected)


@pytest.mark.parametrize("text", ["1", "2", "1:2", "3:3"])
def test_nnodes_as_torch_parses_it(text):
    assert parse_nnodes(text) == torchrun.parse_min_max_nnodes(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [("3:2", "MIN 3 is larger than MAX 2"), ("0", "must be >= 1"), ("a:b", "not N or MIN:MAX")],
)
def test_bad_nnodes_name_the_value(text, message):
    with pytest.raises(LaunchError, match=message):
        parse_nnodes(text)


@pytest.mark.parametrize("text", ["node0:29603", "node0", "10.0.0.1:1", "[::1]:5000"])
def test_endpoint_as_torch_parses_it(text):
    assert parse_endpoint(text, 29400) == parse_rendezvous_endpoint(text, 29400)


def test_rdzv_conf_as_torch_parses_it():
    text = "join_timeout=60, is_host=1,last_call_timeout=5"
    assert parse_rdzv_conf(text) == _parse_rendezvous_config(text)


@pytest.mark.parametrize("redirects", ["0", "1", "2", "3", "0:1,2:2", "1:3"])
@pytest.mark.parametrize("tee", ["0", "3", "0:2,1:1"])
def test_log_files_and_console_as_torchs_logs_specs(tmp_path, redirects, tee):
    nproc = 3
    specs = DefaultLogsSpecs(
        log_dir=str(tmp_path / "torch"),
        redirects=to_map(Std.from_str(redirects), nproc),
        tee=to_map(Std.from_str(tee), nproc),
    )
    envs = {r: {"TORCHELASTIC_RUN_ID": "456", "TORCHELASTIC_RESTART_COUNT": "0"} for r in range(3)}
    dest = specs.reify(envs)
    plan = LogPlan(
        tmp_path / "ours", "456", parse_std(redirects, nproc), parse_std(tee, nproc, "tee")
    )
    plan.begin(attempt=0)
    if redirects == "0" and tee == "0":
        # tandem's documented difference: a log dir alone keeps every stream (torch: none)
        assert all(
            plan.stream(r, n)[0] and plan.stream(r, n)[1] for r in range(3) for n in _STREAMS
        )
        return
    for local_rank in range(nproc):
        for name, files, teed in (
            ("stdout", dest.stdouts, dest.tee_stdouts),
            ("stderr", dest.stderrs, dest.tee_stderrs),
        ):
            directory, shown = plan.stream(local_rank, name)
            theirs = files[local_rank]
            assert (directory is not None) == bool(theirs), (local_rank, name)
            # torch shows a stream that has no file, or one it tees
            assert shown == (not theirs or local_rank in teed), (local_rank, name)
            if directory is not None:
                ours_rel = (directory / f"{name}.log").relative_to(tmp_path / "ours")
                theirs_rel = Path(theirs).relative_to(tmp_path / "torch")
                # <run_id>_<random>/attempt_0/<local rank>/<stream>.log
                assert ours_rel.parts[1:] == theirs_rel.parts[1:]
                assert ours_rel.parts[0].startswith("456_")
                assert theirs_rel.parts[0].startswith("456_")


_STREAMS = ("stdout", "stderr")


def test_std_bits_match_torchs():
    assert (Std.OUT.value, Std.ERR.value) == (STD_OUT, STD_ERR)


@pytest.mark.launch
def test_log_dir_redirects_and_filter_in_a_real_run(tmp_path):
    result = tandem_run(
        "--nproc-per-node=3",
        f"--log-dir={tmp_path}",
        "--redirects=0:1",  # local rank 0's stdout only to its file
        "--tee=1:3,2:3",
        "--local-ranks-filter=0,1",  # rank 2 off the console, not out of the files
        "--rdzv-id=456",
        WORKERS,
        "env",
    )
    assert result.returncode == 0, result.stderr
    assert sorted(_env_lines(result.stdout)) == [1]
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("456_")
    for local_rank in range(3):
        stdout = run_dir / "attempt_0" / str(local_rank) / "stdout.log"
        env = json.loads(stdout.read_text().split("ENV ", 1)[1])
        assert env["RANK"] == str(local_rank)
        # local rank 0's stderr was chosen by neither flag: no file, as under torchrun
        assert (run_dir / "attempt_0" / str(local_rank) / "stderr.log").exists() == (local_rank > 0)


DUMP_ENV = """
import json, os, sys
name = f"{sys.argv[1]}-{os.environ['RANK']}.json"
with open(os.path.join(os.environ["ENV_OUT"], name), "w") as f:
    json.dump(dict(os.environ), f)
"""
# Where tandem's worker environment differs from torchrun's on purpose (README's table):
EXPLAINED = {
    "MASTER_PORT",  # a free port of its own
    "TORCHELASTIC_ERROR_FILE",  # torchrun: in a temporary log dir; tandem: with --log-dir only
    "TORCHELASTIC_USE_AGENT_STORE",  # one node: no agent store, the workers' rank 0 hosts one
}


@pytest.mark.launch
def test_workers_get_all_of_torchruns_environment(tmp_path):
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP_ENV)
    flags = [
        "--nproc-per-node",
        "2",
        "--role",
        "trainer",
        "--rdzv-id",
        "456",
        "--max-restarts",
        "2",
    ]
    env = {**os.environ, "ENV_OUT": str(tmp_path)}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *flags, "--master-port",
         str(free_port()), str(script), "torch"],
        capture_output=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    assert tandem_run(*flags, str(script), "tandem", env=env).returncode == 0
    for rank in (0, 1):
        theirs = json.loads((tmp_path / f"torch-{rank}.json").read_text())
        ours = json.loads((tmp_path / f"tandem-{rank}.json").read_text())
        set_by_torchrun = {k for k, v in theirs.items() if os.environ.get(k) != v} - EXPLAINED
        assert {"ROLE_NAME", "TORCHELASTIC_RUN_ID", "GROUP_RANK"} <= set_by_torchrun
        for name in sorted(set_by_torchrun):
            assert ours.get(name) == theirs[name], (name, ours.get(name), theirs[name])
        assert ours["ROLE_NAME"] == "trainer" and ours["TORCHELASTIC_RUN_ID"] == "456"


@pytest.mark.launch
def test_the_ddp_tutorials_c10d_command_on_two_nodes():
    port = free_port()
    flags = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-id=456", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*TANDEM, "run", *flags, WORKERS, "torchrun_script"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    lines = sorted(line for out, _ in outs for line in out.splitlines() if "SUM" in line)
    assert lines == [f"[rank {k}] SUM 6.0 WORLD 4 RANK {k}" for k in range(4)]
    # each node ran one node's ranks: {0, 1} on one, {2, 3} on the other
    ranks = [sorted(int(r) for r in re.findall(r"\[rank (\d)\] SUM", out)) for out, _ in outs]
    assert sorted(ranks) == [[0, 1], [2, 3]]


@pytest.mark.launch
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rdzv-backend", "etcd"], "--rdzv-backend 'etcd' is not supported: tandem run has "
         "static"),
        (["--nnodes", "3:2"], "--nnodes '3:2': MIN 3 is larger than MAX 2"),
        (["--nnodes=2", "--rdzv-backend=c10d"], "c10d with --nnodes 2 needs --rdzv-endpoint"),
        (["--redirects", "4"], "--redirects '4': '4' is not 0, 1 (stdout), 2 or 3"),
        (["--signals-to-handle", "SIGNOPE"], "'SIGNOPE' is not a signal name"),
    ],
)  # fmt: skip
def test_bad_torchrun_values_are_one_clear_line(args, message):
    result = tandem_run(*args, WORKERS, "env", timeout=20)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_version_and_every_help_shows_defaults():
    out = subprocess.run([*TANDEM, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"tandem {tandem.__version__}"
    parser = build_parser()
    help_text = parser._subparsers._group_actions[0].choices["run"].format_help()
    for group in ("worker/node size:", "rendezvous:", "user-code launch:", "tandem's own:"):
        assert group in help_text
    assert "(default: static)" in help_text and "(default: 0.1)" in help_text
    for name, verb in _leaf_parsers(parser):
        options = [a for a in verb._actions if a.option_strings and a.dest != "help"]
        if options:
            assert "(default" in verb.format_help(), name


def _leaf_parsers(parser, name="tandem"):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(name, parser)]
    return [
        leaf for verb, p in subs[0].choices.items() for leaf in _leaf_parsers(p, f"{name} {verb}")
    ]


def test_pet_variables_are_defaults_as_under_torchrun(monkeypatch):
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_MAX_RESTARTS", "3")
    args = build_parser().parse_args(["run", "train.py"])
    theirs = torchrun.get_args_parser().parse_args(["train.py"])
    for name in ("nnodes", "standalone", "max_restarts"):
        assert getattr(args, name) == getattr(theirs, name), name
    assert build_parser().parse_args(["run", "--nnodes", "4", "t.py"]).nnodes == "4"


@pytest.mark.launch
def test_nnodes_min_max_on_one_node_starts_with_min():
    result = tandem_run("--nnodes=1:2", "--standalone", "--nproc-per-node=2", WORKERS, "env")
    assert result.returncode == 0, result.stderr
    assert sorted(_env_lines(result.stdout)) == [0, 1]
    assert "--nnodes 1:2: the job starts with 1 node(s)" in result.stderr


@pytest.mark.launch
def test_c10d_node_beyond_max_is_refused_clearly(tmp_path):
    """Two nodes of 1:2 run (a node below MAX would wait and be admitted: test_elastic.py)."""
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, pathlib, time\n"
        "pathlib.Path(os.environ['OUT'], os.environ['RANK']).touch()\n"
        "time.sleep(6)\n"
    )
    port = free_port()
    flags = ["--nnodes=1:2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    env = {**os.environ, "OUT": str(tmp_path)}
    first = [subprocess.Popen([*TANDEM, "run", *flags, str(script)], stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]  # fmt: skip
    deadline = time.monotonic() + 60
    while not ((tmp_path / "0").exists() and (tmp_path / "1").exists()):
        assert time.monotonic() < deadline, "the first two nodes never started their workers"
        time.sleep(0.1)
    late = tandem_run(*flags, str(script), timeout=30, env={"OUT": str(tmp_path)})
    assert late.returncode == 2, late.stderr
    assert "already runs on 2 nodes, its --nnodes maximum 2" in late.stderr, late.stderr
    assert "raise MAX in --nnodes MIN:MAX" in late.stderr
    assert [p.wait(timeout=60) for p in first] == [0, 0], [p.stderr.read() for p in first]


@pytest.mark.parametrize("text", ["loss", "loss,NaN", "a,,b,c", ",,", "x,,,,y"])
def test_duplicate_filters_parse_as_torchs(text):
    theirs = torchrun.get_args_parser().parse_args(["--duplicate-stdout-filters", text, "train.py"])
    assert parse_filters(text) == theirs.duplicate_stdout_filters


def test_filtered_logs_are_where_torch_puts_them(tmp_path):
    specs = DefaultLogsSpecs(log_dir=str(tmp_path / "torch"))
    envs = {r: {"TORCHELASTIC_RUN_ID": "456", "TORCHELASTIC_RESTART_COUNT": "0"} for r in range(2)}
    dest = specs.reify(envs)
    plan = LogPlan(tmp_path / "ours", "456", duplicate_filters={"stdout": ["a"], "stderr": ["b"]})
    plan.begin(attempt=0)
    for name, theirs in (("stdout", dest.filtered_stdout), ("stderr", dest.filtered_stderr)):
        ours = plan.filtered[name].path.relative_to(tmp_path / "ours")
        assert ours.parts[1:] == Path(theirs).relative_to(tmp_path / "torch").parts[1:]
    plan.close()


PRINTS = """
import os, sys
rank = os.environ["RANK"]
print(f"step 1 loss 0.{rank}", flush=True)
print(f"lr 0.1 on {rank}", flush=True)
print(f"a,b from {rank}", flush=True)
print(f"warning: slow rank {rank}", file=sys.stderr, flush=True)
print(f"note {rank}", file=sys.stderr, flush=True)
"""


@pytest.mark.launch
def test_duplicate_filters_copy_the_matching_console_lines(tmp_path):
    script = tmp_path / "prints.py"
    script.write_text(PRINTS)
    result = tandem_run(
        "--nproc-per-node=2",
        f"--log-dir={tmp_path / 'logs'}",
        "--duplicate-stdout-filters=loss,a,,b",  # "loss" or "a,b"
        "--duplicate_stderr_filters", "warning",
        "--local-ranks-filter=0",  # rank 1 is off the console: nor copied
        str(script),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "not applied" not in result.stderr
    (run_dir,) = (tmp_path / "logs").iterdir()
    stdout = (run_dir / "attempt_0" / "filtered_stdout.log").read_text().splitlines()
    stderr = (run_dir / "attempt_0" / "filtered_stderr.log").read_text().splitlines()
    assert sorted(stdout) == ["[rank 0] a,b from 0", "[rank 0] step 1 loss 0.0"]
    assert stderr == ["[rank 0] warning: slow rank 0"]
    # The console shows the same lines (the copy is of what it shows).
    assert all(line in result.stdout for line in stdout), result.stdout
