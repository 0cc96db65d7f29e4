"""FullyShardedDataParallel (ZeRO 2 and 3) saves and loads state like tandem.DDP.

The oracle is tandem.DDP with the plain torch optimizer, run side by side in the same ranks on the
same per-rank data. The model has units the world sizes here do not divide (auto_wrap={nn.Linear}:
a Linear of 35 elements, a nested Linear of 15, the root's own parameter of 3) and a buffer between
its parameters in state_dict order. Proven, float32, tolerance 1e-6, AdamW, stages 2 and 3:

- ``full_state_dict`` on rank ``to`` (None elsewhere) equals DDP's ``state_dict()`` (keys, order,
  values) and loads strictly into the plain module; ``full_optim_state_dict`` equals the plain
  optimizer's ``state_dict()`` and loads into ``torch.optim.AdamW`` over the plain module; a full
  model and optimizer state saved at world size 2 resumes at world size 4 exactly as DDP resumed
  from the same state does; a full state loaded back at the same world size and a sharded state
  saved one file per rank and loaded into a fresh wrapper (other initial values and buffers)
  continue bit for bit like the uninterrupted run; a sharded state of another rank, of another world
  size or of another wrapping is refused with a ValueError that points to the full state dict; a
  full state with a missing, an unexpected or a wrongly-shaped key is refused naming it;
- the model's ``layout``, all these functions read of it, is the plain module's names in its
  order (state_dict keys, parameters), its units' names, this rank and world size, the stage,
  and the layout the sharded state records; it cannot be changed.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tandem
from tests.harness import run_ranks
from tests.parallel.fsdp.models import (
    FSDP,
    TOL,
    adamw,
    compare,
    diff,
    gathered_tensors,
    make_net,
    optim_match,
    optim_ok,
    refused,
    side_by_side,
    train,
    train_step,
)

pytestmark = pytest.mark.distributed


def _save_and_reload(tmp: str) -> dict:
    """World size 2: full and sharded states, their round trips and refusals."""
    rank = dist.get_rank()
    out: dict = {}
    for stage in (2, 3):
        model, opt, oracle, ref = side_by_side(make_net, "adamw", stage, {nn.Linear})
        train(model, opt, oracle, ref, 3)
        full = model.full_state_dict()
        full_at_1 = model.full_state_dict(to=1)
        full_optim = model.full_optim_state_dict(opt)
        r: dict = {
            "none_elsewhere": (full is None) == (rank != 0) and (full_at_1 is None) == (rank != 1),
            "layout": _layout_facts(model, stage),
        }
        if rank == 0:
            expected = oracle.module.state_dict()
            r["keys"] = list(full) == list(expected)
            r["diff"] = diff(full, expected)
            plain = make_net(seed=5)
            plain.load_state_dict(full, strict=True)
            r["plain_diff"] = diff(plain.state_dict(), expected)
            reference = ref.state_dict()
            r["optim"] = optim_match(full_optim, reference)
            plain_opt = adamw(plain.parameters())
            plain_opt.load_state_dict(copy.deepcopy(full_optim))
            r["plain_optim_loaded"] = len(plain_opt.state) == len(reference["state"])
            torch.save({"model": full, "optim": full_optim}, os.path.join(tmp, f"full{stage}.pt"))
        else:
            r["optim_none"] = full_optim is None
        # full state, back at the same world size: every rank needs it
        objects = [full, full_optim]
        dist.broadcast_object_list(objects, src=0)
        again = FSDP(make_net(seed=3), stage=stage, auto_wrap={nn.Linear})
        again_opt = adamw(again.parameters())
        again.load_full_state_dict(objects[0])
        again.load_full_optim_state_dict(again_opt, copy.deepcopy(objects[1]))
        # sharded state, one file per rank
        shard_dir = os.path.join(tmp, f"sharded{stage}")
        os.makedirs(shard_dir, exist_ok=True)
        torch.save(
            {"model": model.sharded_state_dict(), "optim": opt.state_dict()},
            os.path.join(shard_dir, f"rank{rank}.pt"),
        )
        dist.barrier()
        saved = torch.load(os.path.join(shard_dir, f"rank{rank}.pt"), weights_only=True)
        fresh_net = make_net(seed=4)
        fresh_net.shift.fill_(7.0)
        fresh = FSDP(fresh_net, stage=stage, auto_wrap={nn.Linear})
        fresh.load_sharded_state_dict(saved["model"])
        fresh_opt = adamw(fresh.parameters())
        fresh_opt.load_state_dict(copy.deepcopy(saved["optim"]))
        for s in range(3, 6):
            for m, o in ((model, opt), (again, again_opt), (fresh, fresh_opt)):
                train_step(m, o, s)
        keys = list(oracle.module.state_dict())
        ours = gathered_tensors(model, keys)
        r["full_resume_bitwise"] = all(
            torch.equal(ours[k], v) for k, v in gathered_tensors(again, keys).items()
        ) and all(
            torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
        )
        r["sharded_resume_bitwise"] = all(
            torch.equal(ours[k], v) for k, v in gathered_tensors(fresh, keys).items()
        ) and all(
            torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
        )
        # refusals
        other = torch.load(os.path.join(shard_dir, f"rank{1 - rank}.pt"), weights_only=True)
        r["other_rank"] = refused(fresh.load_sharded_state_dict, other["model"])
        rewrapped = FSDP(make_net(), stage=stage, auto_wrap=None)
        r["other_wrap"] = refused(rewrapped.load_sharded_state_dict, saved["model"])
        r["plain_as_sharded"] = refused(fresh.load_sharded_state_dict, make_net().state_dict())
        plain_state = make_net().state_dict()
        missing = {k: v for k, v in plain_state.items() if k != "inp.bias"}
        r["missing"] = refused(fresh.load_full_state_dict, missing)
        r["unexpected"] = refused(
            fresh.load_full_state_dict, {**plain_state, "extra.weight": torch.ones(1)}
        )
        r["shape"] = refused(fresh.load_full_state_dict, {**plain_state, "inp.bias": torch.ones(4)})
        # the refusals left the model as it was
        r["unchanged_by_refusals"] = all(
            torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
        )
        out[stage] = r
    return out


def _layout_facts(model, stage: int) -> dict:
    """What ``model.layout`` says, against the plain module and the sharded state dict."""
    layout, plain = model.layout, make_net()
    try:
        layout.stage = 5
        frozen = False
    except dataclasses.FrozenInstanceError:
        frozen = True
    names = [n for n, _ in plain.named_parameters()]
    return {
        "state_keys": layout.state_keys == tuple(plain.state_dict()),
        "param_fqns": layout.param_fqns == tuple(names),
        "key_fqn": dict(layout.key_fqn) == {n: n for n in names},
        "unit_names": sorted(layout.unit_names) == ["", "block.0", "inp"],
        "where": (layout.rank, layout.world_size, layout.stage)
        == (dist.get_rank(), dist.get_world_size(), stage),
        "signature": layout.signature() == model.sharded_state_dict()["layout"],
        "frozen": frozen,
    }


def _resume_at_four(tmp: str) -> dict:
    """World size 4: the state saved at world size 2 resumes like DDP resumed from it."""
    rank = dist.get_rank()
    out: dict = {}
    for stage in (2, 3):
        saved = torch.load(os.path.join(tmp, f"full{stage}.pt"), weights_only=True)
        model = FSDP(make_net(seed=2), stage=stage, auto_wrap={nn.Linear})
        opt = adamw(model.parameters())
        model.load_full_state_dict(copy.deepcopy(saved["model"]))
        model.load_full_optim_state_dict(opt, copy.deepcopy(saved["optim"]))
        oracle = tandem.DDP(make_net(seed=2))
        oracle.module.load_state_dict(copy.deepcopy(saved["model"]))
        ref = adamw(oracle.parameters())
        ref.load_state_dict(copy.deepcopy(saved["optim"]))
        roundtrip = model.full_state_dict()
        for s in range(3, 6):
            train_step(model, opt, s)
            train_step(oracle, ref, s)
        expected = oracle.module.state_dict()
        old = torch.load(
            os.path.join(tmp, f"sharded{stage}", f"rank{rank % 2}.pt"), weights_only=True
        )
        out[stage] = {
            "roundtrip_bitwise": None
            if roundtrip is None
            else list(roundtrip) == list(saved["model"])
            and all(torch.equal(roundtrip[k], v) for k, v in saved["model"].items()),
            **compare(model, expected),
            "other_world_size": refused(model.load_sharded_state_dict, old["model"]),
        }
    return out


def test_state_dicts(tmp_path):
    tmp = str(tmp_path)
    saved = run_ranks(_save_and_reload, 2, args=(tmp,), timeout=90)
    for rank, per_stage in enumerate(saved):
        for stage, r in per_stage.items():
            context = f"rank {rank}, stage {stage}: {r}"
            assert r["none_elsewhere"], context
            assert all(r["layout"].values()), context
            if rank == 0:
                assert r["keys"] and r["diff"] <= TOL and r["plain_diff"] <= TOL, context
                assert optim_ok(r["optim"]), context
                assert r["plain_optim_loaded"], context
            else:
                assert r["optim_none"], context
            assert r["full_resume_bitwise"] and r["sharded_resume_bitwise"], context
            for refusal in ("other_rank", "other_wrap"):
                assert r[refusal] is not None and "full state dict" in r[refusal], context
            assert r["plain_as_sharded"] is not None, context
            assert "load_full_state_dict" in r["plain_as_sharded"], context
            assert r["missing"] is not None and "inp.bias" in r["missing"], context
            assert r["unexpected"] is not None and "extra.weight" in r["unexpected"], context
            assert r["shape"] is not None and "inp.bias" in r["shape"], context
            assert r["unchanged_by_refusals"], context

    resumed = run_ranks(_resume_at_four, 4, args=(tmp,), timeout=90)
    for rank, per_stage in enumerate(resumed):
        for stage, r in per_stage.items():
            context = f"rank {rank} of 4, stage {stage}: {r}"
            assert r["roundtrip_bitwise"] is (True if rank == 0 else None), context
            assert r["diff"] <= TOL and r["same_everywhere"], context
            message = r["other_world_size"]
            assert message is not None and "full state dict" in message, context
            assert "of 2" in message and "of 4" in message, context
