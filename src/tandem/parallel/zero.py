"""ShardedOptimizer: ZeRO stage 1, each rank keeps the optimizer state of its own parameters only.

Every parameter has one owner (``tandem.parallel.sharding.assign_owners``, balanced by bytes).
Each rank builds the inner optimizer over the parameters it owns, so Adam's two moments exist
once across the group instead of once per rank. One ``step()``:

1. Gradients are already the mean over ranks: the model is wrapped in ``tandem.DDP`` (or the
   caller all-reduced them). Nothing to do here; stage 2
   (``FullyShardedDataParallel(stage=2)``) reduce-scatters them instead.
2. Each rank steps the inner optimizer on its own parameters, with the hyperparameters of the
   outer ``param_groups`` (so LR schedulers on this optimizer reach the inner one).
3. Every parameter is broadcast from its owner: per owner and dtype, the owner flattens its
   parameters into one buffer, one asynchronous broadcast each, all issued before any is waited
   on; afterwards every rank holds identical parameters.

With one process (no process group) the owner of everything is rank 0, the inner optimizer
covers all parameters and phase 3 has nothing to send.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from tandem._dist import global_rank, group_rank, group_size, require_process_group
from tandem._profile import span
from tandem.doctor import records
from tandem.parallel.replicas import verify_same_parameters
from tandem.parallel.sharding import assign_owners


class ShardedOptimizer(Optimizer):
    """Any ``torch.optim`` optimizer, its state sharded across the ranks (ZeRO stage 1).

    ``param_groups`` hold all parameters with their hyperparameters, as for a plain optimizer;
    ``zero_grad`` clears every parameter's gradient. The closure of ``step(closure)`` is called
    once, before the inner step (optimizers that re-evaluate it, like LBFGS, are not supported).

    Checkpoints: ``state_dict()`` is this rank's shard and loads back with ``load_state_dict``
    into the same world size and parameters; ``full_state_dict(to)`` gathers the state of a plain
    optimizer over all parameters on rank ``to`` (it loads into ``optimizer_class(params)``), and
    ``load_full_state_dict`` takes such a dict on every rank, whatever the world size.

    Args:
        params: parameters or parameter-group dicts, as for ``optimizer_class``; the same on
            every rank (checked).
        optimizer_class: the inner optimizer, e.g. ``torch.optim.AdamW``.
        process_group: the group the parameters are sharded over (default: the whole world).
        **defaults: the inner optimizer's arguments (``lr``, ``momentum``, ...).

    Example::

        model = tandem.DDP(net)                     # phase 1: gradients averaged in backward
        opt = tandem.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        loss_fn(model(x), y).backward()
        opt.step()                                  # every rank ends with the same parameters
        opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        *,
        process_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        require_process_group("tandem.ShardedOptimizer")
        groups = _as_groups(params)
        self.process_group = process_group
        self.world_size = group_size(process_group)
        self.rank = group_rank(process_group)
        self.params = [p for g in groups for p in g["params"]]
        # The owners are computed independently on every rank: different parameters would
        # mean different owners and a hang in phase 3, so fail on every rank now instead.
        verify_same_parameters(
            [(f"param_groups[{i}]", p) for i, g in enumerate(groups) for p in g["params"]],
            process_group,
            wrapper="tandem.ShardedOptimizer",
        )
        self.owners = assign_owners(
            [p.numel() * p.element_size() for p in self.params], self.world_size
        )
        owned = {id(p) for p, r in zip(self.params, self.owners, strict=True) if r == self.rank}

        # Empty groups are kept so that inner group i is outer group i, even on a rank that
        # owns nothing in it (or nothing at all, when ranks outnumber parameters).
        self.optimizer = optimizer_class(
            [{**g, "params": [p for p in g["params"] if id(p) in owned]} for g in groups],
            **defaults,
        )
        # The outer groups take the inner optimizer's completed hyperparameters (its defaults
        # filled in) and all parameters, so that they read like a plain optimizer's.
        full = [
            {**inner, "params": g["params"]}
            for g, inner in zip(groups, self.optimizer.param_groups, strict=True)
        ]
        super().__init__(full, self.optimizer.defaults)
        self._plan = _broadcast_plan(self.params, self.owners)

    @property
    def inner_state_bytes(self) -> int:
        """Bytes of optimizer state tensors on this rank."""
        return sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Used by the constructor only: owners are fixed once the optimizer is built."""
        if hasattr(self, "_plan"):
            raise NotImplementedError(
                "ShardedOptimizer.add_param_group after construction: the owners of the "
                f"{len(self.params)} parameters are fixed; build a new ShardedOptimizer instead"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step on every rank (see the module docstring for the phases)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Phase 1: the gradients are already averaged (tandem.DDP, during backward).
        # Phase 2: step this rank's shard with the current outer hyperparameters.
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        with span("tandem.zero.step"):
            self.optimizer.step()
        # Phase 3: every parameter from its owner.
        with span("tandem.zero.broadcast"), records.tagged("ZeRO broadcast from owners"):
            self._broadcast_from_owners()
        return loss

    def _broadcast_from_owners(self) -> None:
        if self.world_size == 1:
            return
        pending = []
        for owner, tensors in self._plan:
            if owner == self.rank:
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            else:
                flat = torch.empty(
                    sum(t.numel() for t in tensors),
                    dtype=tensors[0].dtype,
                    device=tensors[0].device,
                )
            src = global_rank(self.process_group, owner)
            work = dist.broadcast(flat, src=src, group=self.process_group, async_op=True)
            pending.append((owner, tensors, flat, work))
        # Waiting only after all are issued lets the broadcasts of different owners overlap.
        for owner, tensors, flat, work in pending:
            work.wait()
            if owner == self.rank:
                continue
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state; loads back on the same rank and world size."""
        return {
            "shard": self.optimizer.state_dict(),
            "rank": self.rank,
            "world_size": self.world_size,
            "owners": list(self.owners),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's shard saved by :meth:`state_dict` (same world size and parameters)."""
        saved = (state_dict.get("rank"), state_dict.get("world_size"), state_dict.get("owners"))
        if saved != (self.rank, self.world_size, self.owners):
            raise ValueError(
                f"shard of rank {saved[0]} of {saved[1]} (owners {saved[2]}) cannot load into "
                f"rank {self.rank} of {self.world_size} (owners {self.owners}); use "
                "full_state_dict() and load_full_state_dict() to change the world size"
            )
        self.optimizer.load_state_dict(state_dict["shard"])
        self._hyperparameters_from_inner()

    def full_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """Gather the full state on group rank ``to``, as a plain optimizer's ``state_dict()``.

        A collective: every rank must call it. Returns the dict on rank ``to``, None elsewhere.

        Example::

            full = opt.full_state_dict(to=0)
            if rank == 0:
                torch.optim.AdamW(model.parameters()).load_state_dict(full)   # loads as is
        """
        if not 0 <= to < self.world_size:
            raise ValueError(f"to={to} not in [0, {self.world_size})")
        inner = self.optimizer.state_dict()
        mine = self._global_indices()
        # Tensors travel to the CPU first: gather_object pickles them.
        shard = {
            mine[i]: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in inner["state"].items()
        }
        shards: list[Any] | None  # every rank's shard, on rank `to` only
        if self.world_size == 1:
            shards = [shard]
        else:
            shards = [None] * self.world_size if self.rank == to else None
            dist.gather_object(
                shard, shards, dst=global_rank(self.process_group, to), group=self.process_group
            )
        if self.rank != to:
            return None
        assert shards is not None  # rank `to` gathered into its list
        state = {i: s for part in shards for i, s in part.items()}
        groups, start = [], 0
        for g in self.param_groups:
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": list(range(start, start + len(g["params"]))),
                }
            )
            start += len(g["params"])
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain optimizer's state dict (e.g. from :meth:`full_state_dict`) on every rank.

        Each rank keeps the state of the parameters it owns, so the world size may differ from
        the one that saved it.
        """
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in groups] != sizes:
            raise ValueError(
                f"state dict with groups of {[len(g['params']) for g in groups]} parameters "
                f"does not match this optimizer's groups of {sizes}"
            )
        saved_ids = [i for g in groups for i in g["params"]]
        mine = self._global_indices()
        inner_groups, inner_state, inner_id = [], {}, 0
        for g, inner in zip(groups, self.optimizer.param_groups, strict=True):
            ids = []
            for _ in inner["params"]:
                saved = saved_ids[mine[inner_id]]
                if saved in state_dict["state"]:
                    inner_state[inner_id] = state_dict["state"][saved]
                ids.append(inner_id)
                inner_id += 1
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self._hyperparameters_from_inner()

    def _global_indices(self) -> list[int]:
        """Index into ``self.params`` of each inner parameter, in the inner optimizer's order."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return [index[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def _hyperparameters_from_inner(self) -> None:
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            outer.update({k: v for k, v in inner.items() if k != "params"})


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Parameters or group dicts -> a list of group dicts with ``params`` as lists."""
    items = list(params)
    if not items:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups = []
    for g in items:
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        groups.append({**g, "params": ps})
    return groups


def _broadcast_plan(
    params: list[torch.Tensor], owners: list[int]
) -> list[tuple[int, list[torch.Tensor]]]:
    """Phase 3's collectives: one per (owner, device, dtype), in an order every rank shares.

    Every rank derives the same list from the same owners, so the broadcasts match up.
    """
    plan: dict[tuple[int, str, str], list[torch.Tensor]] = {}
    for p, owner in zip(params, owners, strict=True):
        plan.setdefault((owner, p.device.type, str(p.dtype)), []).append(p)
    return [(key[0], tensors) for key, tensors in sorted(plan.items(), key=lambda kv: kv[0])]
