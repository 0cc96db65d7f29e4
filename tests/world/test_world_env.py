"""Reading the launcher's environment, and tandem.init/world/shutdown within one process.

Proves: placement_from_env reads torchrun's, SLURM's and OpenMPI's variables into the same
Placement, prefers torchrun over SLURM over OpenMPI, lets MASTER_ADDR/MASTER_PORT override SLURM's
derived rendezvous, derives one SLURM port per job; every bad value raises a ValueError naming the
variable and its value; a lone process gets a one-process World without a process group;
world() refuses to guess before init() in a multi-process job; NCCL's device is set before the
group is created.
"""

from __future__ import annotations

import importlib
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tandem.job.placement import (
    Placement,
    override_placement,
    placement_from_env,
    slurm_master_port,
)
from tandem.world import World, init, shutdown, world

# `tandem.world` the attribute is the function: the module, for monkeypatching its seam.
tandem_world = importlib.import_module("tandem.world")

TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "host0",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08,11],cpu3",
    "SLURM_JOB_ID": "4242",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables, and no World left over from another test."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_")) or name in TORCHRUN or name == "NODE_RANK":
            monkeypatch.delenv(name)
    shutdown()
    yield monkeypatch
    shutdown()


# ---- each launcher ---------------------------------------------------------------------------


def test_torchrun():
    assert placement_from_env(TORCHRUN) == Placement(5, 1, 8, 4, 1, "host0", 29500, "torchrun")


def test_torchrun_node_rank_from_node_rank_or_derived():
    env = {k: v for k, v in TORCHRUN.items() if k != "GROUP_RANK"}
    assert placement_from_env({**env, "NODE_RANK": "1"}).node_rank == 1
    assert placement_from_env(env).node_rank == 5 // 4


def test_torchrun_without_local_variables_assumes_one_node():
    p = placement_from_env({"RANK": "2", "WORLD_SIZE": "3"})
    assert (p.local_rank, p.local_world_size, p.node_rank) == (2, 3, 0)
    assert (p.master_addr, p.master_port) == (None, None)


def test_slurm():
    assert placement_from_env(SLURM) == Placement(
        6, 2, 8, 4, 1, "gpu07", slurm_master_port(4242), "slurm"
    )


def test_slurm_ntasks_per_node_and_nodelist_fallback():
    env = {k: v for k, v in SLURM.items() if k not in ("SLURM_JOB_NODELIST",)}
    env |= {"SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "junk", "SLURM_NODELIST": "b,a"}
    p = placement_from_env(env)
    assert (p.local_world_size, p.master_addr) == (4, "b")


def test_slurm_uneven_tasks_per_node():
    env = SLURM | {"SLURM_TASKS_PER_NODE": "3,2(x2)", "SLURM_NTASKS": "7"}
    first_node = env | {"SLURM_NODEID": "0", "SLURM_PROCID": "2"}
    third_node = env | {"SLURM_NODEID": "2", "SLURM_PROCID": "6", "SLURM_LOCALID": "1"}
    assert placement_from_env(first_node).local_world_size == 3
    assert placement_from_env(third_node).local_world_size == 2


def test_slurm_explicit_master_overrides_derived():
    p = placement_from_env(SLURM | {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "12345"})
    assert (p.master_addr, p.master_port) == ("10.0.0.9", 12345)


def test_slurm_port_is_stable_per_job_and_unprivileged():
    assert placement_from_env(SLURM).master_port == placement_from_env(SLURM).master_port
    assert slurm_master_port(4242) == 15000 + 4242
    assert slurm_master_port(123456) == 15000 + 3456
    ports = {slurm_master_port(job) for job in range(100_000, 110_000)}
    assert len(ports) == 10_000  # consecutive jobs never share a port
    assert all(15000 <= p < 25000 for p in ports)  # above 1023, below the ephemeral range
    with pytest.raises(ValueError, match="-1"):
        slurm_master_port(-1)


def test_openmpi():
    assert placement_from_env(OPENMPI) == Placement(3, 1, 4, 2, 1, None, None, "openmpi")
    p = placement_from_env(OPENMPI | {"MASTER_ADDR": "h", "MASTER_PORT": "2000"})
    assert (p.master_addr, p.master_port) == ("h", 2000)


def test_no_launcher_is_one_process():
    assert placement_from_env({}) == Placement(0, 0, 1, 1, 0, None, None, "none")
    assert placement_from_env({"LOCAL_RANK": "3"}).source == "none"


def test_precedence_torchrun_then_slurm_then_openmpi():
    assert placement_from_env(TORCHRUN | SLURM | OPENMPI).source == "torchrun"
    assert placement_from_env(SLURM | OPENMPI).source == "slurm"
    assert placement_from_env(OPENMPI).source == "openmpi"


def test_override_rank_and_world_size():
    p = override_placement(placement_from_env({}), rank=1, world_size=3)
    assert p == Placement(1, 1, 3, 3, 0, None, None, "none")
    p = override_placement(placement_from_env(TORCHRUN), rank=6)
    assert (p.rank, p.local_rank, p.world_size) == (6, 1, 8)
    assert override_placement(p) is p


# ---- bad input: the error names the variable and its value ----------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not < WORLD_SIZE=4"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE=two"),
        ({"RANK": "1.5", "WORLD_SIZE": "4"}, "RANK=1.5"),
        ({"RANK": "", "WORLD_SIZE": "4"}, "RANK=''"),
        ({"RANK": "-1", "WORLD_SIZE": "4"}, "RANK=-1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
        ({"RANK": "0"}, "WORLD_SIZE"),
        (TORCHRUN | {"LOCAL_RANK": "4"}, "LOCAL_RANK=4 is not < LOCAL_WORLD_SIZE=4"),
        (TORCHRUN | {"LOCAL_WORLD_SIZE": "9"}, "LOCAL_WORLD_SIZE=9"),
        (TORCHRUN | {"GROUP_RANK": "-2"}, "GROUP_RANK=-2"),
        (TORCHRUN | {"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        (TORCHRUN | {"MASTER_PORT": "0"}, "MASTER_PORT=0"),
        (TORCHRUN | {"MASTER_PORT": "http"}, "MASTER_PORT=http"),
        (TORCHRUN | {"MASTER_ADDR": ""}, "MASTER_ADDR=''"),
        (SLURM | {"SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not < SLURM_NTASKS=8"),
        (SLURM | {"SLURM_LOCALID": "4"}, "SLURM_LOCALID=4 is not < SLURM_TASKS_PER_NODE[1]=4"),
        (SLURM | {"SLURM_NTASKS": "x"}, "SLURM_NTASKS=x"),
        (SLURM | {"SLURM_NODEID": "2"}, "SLURM_NODEID=2"),
        (SLURM | {"SLURM_TASKS_PER_NODE": "4(2)"}, "SLURM_TASKS_PER_NODE=4(2)"),
        (SLURM | {"SLURM_JOB_NODELIST": "gpu[01-"}, "SLURM_JOB_NODELIST=gpu[01-"),
        (SLURM | {"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID=abc"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID"),
        (
            OPENMPI | {"OMPI_COMM_WORLD_SIZE": "3"},
            "OMPI_COMM_WORLD_RANK=3 is not < OMPI_COMM_WORLD_SIZE=3",
        ),
        (OPENMPI | {"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK=2"),
        ({"MASTER_PORT": "65536"}, "MASTER_PORT=65536"),
    ],
)
def test_bad_environment_names_variable_and_value(env, expected):
    with pytest.raises(ValueError) as info:
        placement_from_env(env)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"rank": 2, "world_size": 2}, "rank=2 is not < world_size=2"),
        ({"rank": 0}, "world_size"),
        ({"rank": "0", "world_size": 2}, "rank='0'"),
        ({"rank": -1, "world_size": 2}, "rank=-1"),
    ],
)
def test_bad_override_names_argument_and_value(kwargs, expected):
    with pytest.raises(ValueError) as info:
        override_placement(placement_from_env({}), **kwargs)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"backend": "tcp"}, "backend='tcp'"),
        ({"init_method": "http://host:1"}, "init_method='http://host:1'"),
        ({"init_method": "tcp://host"}, "init_method='tcp://host'"),
        ({"init_method": "tcp://host:70000"}, "init_method='tcp://host:70000'"),
        ({"init_method": "tcp://:29500"}, "init_method='tcp://:29500'"),
        ({"init_method": "file://relative/path"}, "init_method='file://relative/path'"),
        ({"timeout": -1}, "timeout=-1"),
        ({"timeout": timedelta(0)}, "timeout=datetime.timedelta(0)"),
        ({"timeout": "30"}, "timeout='30'"),
        ({"rank": 3, "world_size": 2}, "rank=3"),
    ],
)
def test_init_rejects_bad_arguments(clean_env, kwargs, expected):
    with pytest.raises(ValueError) as info:
        init(**kwargs)
    assert expected in str(info.value)
    assert not dist.is_initialized()


def test_init_rejects_bad_environment(clean_env):
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK=2 is not < WORLD_SIZE=2"):
        init()


@pytest.mark.skipif(dist.is_mpi_available(), reason="this torch has MPI")
def test_mpi_without_mpi_says_so(clean_env):
    with pytest.raises(RuntimeError, match="no MPI support"):
        init("mpi")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_nccl_without_cuda_says_so(clean_env):
    with pytest.raises(RuntimeError, match="backend='nccl' needs CUDA"):
        init("nccl")


def test_local_rank_without_that_cuda_device(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 1)
    clean_env.setenv("CUDA_VISIBLE_DEVICES", "3")
    for name, value in TORCHRUN.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 .* 1 CUDA device.*CUDA_VISIBLE_DEVICES=3"):
        init()
    assert not dist.is_initialized()


# ---- init / world / shutdown in one process --------------------------------------------------


def test_one_process_needs_no_process_group(clean_env):
    w = init()
    assert w == World(0, 0, 1, 1, 0, None, w.device, True)
    assert w.device == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    assert not dist.is_initialized()
    assert world() is w
    shutdown()
    shutdown()  # twice, and with no group: both fine
    assert not dist.is_initialized()


def test_world_before_init_in_one_process(clean_env):
    assert world() == World(0, 0, 1, 1, 0, None, world().device, True)


def test_world_before_init_in_a_job_raises(clean_env):
    clean_env.setenv("SLURM_STEP_ID", "0")
    clean_env.setenv("SLURM_PROCID", "1")
    clean_env.setenv("SLURM_NTASKS", "2")
    clean_env.setenv("SLURM_LOCALID", "1")
    clean_env.setenv("SLURM_NODEID", "0")
    clean_env.setenv("SLURM_TASKS_PER_NODE", "2")
    with pytest.raises(RuntimeError, match=r"tandem.init\(\) first"):
        world()


def test_world_record_is_immutable_and_consistent():
    w = World(0, 0, 1, 1, 0, None, torch.device("cpu"), True)
    with pytest.raises(AttributeError):
        w.rank = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="is_main=False"):
        World(0, 0, 1, 1, 0, None, torch.device("cpu"), False)


def test_nccl_sets_the_device_before_creating_the_group(clean_env):
    """Without a GPU here, record the calls: set_device must come before init_process_group."""
    calls = []
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 2)
    clean_env.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))
    clean_env.setattr(dist, "is_nccl_available", lambda: True)
    clean_env.setattr(
        dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw))
    )
    clean_env.setattr(dist, "get_rank", lambda: 1)
    clean_env.setattr(dist, "get_world_size", lambda: 2)
    clean_env.setattr(dist, "get_backend", lambda: "nccl")
    store = object()  # no peers to meet here: the rendezvous hands over a stand-in store
    clean_env.setattr(tandem_world, "_meet", lambda *a, **kw: calls.append(("meet", a)) or store)
    for name, value in {
        **TORCHRUN,
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        clean_env.setenv(name, value)
    clean_env.setenv("GROUP_RANK", "0")

    w = init(timeout=12.5)

    assert calls[0] == ("set_device", "cuda:1")
    assert calls[1][0] == "meet" and calls[1][1][2:] == (1, 2)  # rank 1 of 2 checks in
    assert calls[2][:2] == ("init", "nccl")
    assert calls[2][2] == {
        "init_method": None,
        "store": store,
        "rank": 1,
        "world_size": 2,
        "timeout": timedelta(seconds=12.5),
    }
    assert (w.backend, w.device, w.rank, w.is_main) == ("nccl", torch.device("cuda:1"), 1, False)


def test_slurm_batch_script_itself_is_one_process():
    # the batch shell has the job's SLURM_NTASKS and SLURM_PROCID=0 but is no srun task
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    placement = placement_from_env(batch)
    assert (placement.world_size, placement.source) == (1, "none")
