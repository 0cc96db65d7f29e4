"""tandem.init() creates a working process group in real processes, from every init method.

Proves: with 2 ranks, env://, tcp:// and file:// rendezvous each give every rank the right World
and a group whose all_reduce sums across ranks; a SLURM-only environment (no torchrun variables)
is enough to start; a group the user created is adopted and left alive by shutdown(); shutdown()
destroys the group tandem made.
"""

from __future__ import annotations

import importlib
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.constants import default_pg_timeout

from tandem.world import World, init, shutdown, world
from tests.harness import free_port, run_ranks
from tests.launching import TORCHRUN_VARIABLES

pytestmark = pytest.mark.distributed


def _use_group(w: World) -> tuple[World, float, bool]:
    """all_reduce the ranks (0 + 1 = 1 on two), shut down, report whether a group is left."""
    assert world() is w
    t = torch.tensor([float(w.rank)])
    dist.all_reduce(t)
    shutdown()
    return w, t.item(), dist.is_initialized()


def _env_body() -> tuple[World, float, bool]:
    return _use_group(init(timeout=30.0))


def _tcp_body(port: int) -> tuple[World, float, bool]:
    return _use_group(init("gloo", f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=30)))


def _file_body(path: str) -> tuple[World, float, bool]:
    # Ranks started by hand: nothing in the environment, rank and world size as arguments.
    rank = int(os.environ["TEST_RANK"])
    for name in TORCHRUN_VARIABLES:
        del os.environ[name]
    return _use_group(init(init_method=f"file://{path}", rank=rank, world_size=2, timeout=30))


def _slurm_body() -> tuple[World, float, bool, str]:
    port = os.environ["MASTER_PORT"]  # a free one; a job id's derived port may be taken here
    for name in TORCHRUN_VARIABLES:
        del os.environ[name]
    os.environ["MASTER_PORT"] = port
    w, total, left = _use_group(init(timeout=30))
    return w, total, left, os.environ["MASTER_ADDR"]


def _adopt_body() -> tuple[World, bool]:
    w = init()  # the harness already created a gloo group
    shutdown()
    return w, dist.is_initialized()


def _expected(rank: int, backend: str | None) -> World:
    return World(rank, rank, 2, 2, 0, backend, torch.device("cpu"), rank == 0)


def test_env_init_method():
    results = run_ranks(_env_body, world_size=2, init=None, timeout=60)
    assert results == [(_expected(r, "gloo"), 1.0, False) for r in range(2)]


def test_tcp_init_method():
    results = run_ranks(_tcp_body, world_size=2, args=(free_port(),), init=None, timeout=60)
    assert results == [(_expected(r, "gloo"), 1.0, False) for r in range(2)]


def test_file_init_method(tmp_path):
    path = str(tmp_path / "rendezvous")
    results = run_ranks(
        _file_body, world_size=2, args=(path,), init=None, env={"TEST_RANK": "{rank}"}, timeout=60
    )
    assert results == [(_expected(r, "gloo"), 1.0, False) for r in range(2)]


def test_slurm_variables_alone():
    slurm = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "{rank}",
        "SLURM_LOCALID": "{rank}",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "localhost,gpu[02-03]",
        "SLURM_JOB_ID": "4242",
    }
    results = run_ranks(_slurm_body, world_size=2, init=None, env=slurm, timeout=60)
    assert results == [(_expected(r, "gloo"), 1.0, False, "localhost") for r in range(2)]


def test_adopts_a_group_the_user_created():
    results = run_ranks(_adopt_body, world_size=2, init="gloo", timeout=60)
    assert results == [(_expected(r, "gloo"), True) for r in range(2)]


def test_a_replacement_joins_a_world_smaller_than_its_nodes_process_count(monkeypatch):
    # 4 workers on a node, 2 of them lost: the replacement (launch rank 5) is admitted as rank
    # 2 of 3, fewer than the node's LOCAL_WORLD_SIZE of 4, which a launcher's placement check
    # would refuse. Its local place (its device) stays; the rank and world size are the
    # admission's.
    from tandem.job.placement import placement_from_env

    tandem_world = importlib.import_module("tandem.world")  # the attribute is the function

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    admission = {"rank": 2, "world_size": 3, "prefix": "gen2/pg/"}

    def ask_to_join(store, me, timeout_s, form):  # admitted; the group forms within 5 s
        assert form(admission, 5.0)
        return admission

    monkeypatch.setattr(tandem_world.join, "ask_to_join", ask_to_join)
    formed: dict = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: formed.update(kw))
    timeouts: list = []  # the collectives' timeout, set once formed
    monkeypatch.setattr(c10d, "_set_pg_timeout", timeouts.append)
    monkeypatch.setattr(dist, "get_rank", lambda: formed["rank"])
    monkeypatch.setattr(dist, "get_world_size", lambda: formed["world_size"])
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    env = {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    joined = tandem_world._join(5, placement_from_env(env), torch.device("cpu"), None, None, 1.0)
    assert (formed["rank"], formed["world_size"]) == (2, 3)
    assert formed["timeout"] == timedelta(seconds=5.0) and timeouts == [default_pg_timeout]
    assert (joined.rank, joined.world_size, joined.local_rank, joined.local_world_size) == (
        2,
        3,
        1,
        4,
    )
