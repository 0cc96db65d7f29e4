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

Hybrid (``hybrid=True``, or ``shard_group=`` with ``replicate_group=``): the ranks form a grid
(:mod:`tandem.groups`), rows the nodes. The state is sharded within the row only: owners are
assigned over the row's ranks, so rank i of every node owns the same parameters and each node
holds one full copy of the state, split over its own ranks; phase 3 broadcasts within the row,
and nothing crosses the nodes' links in ``step()``. The gradients are the mean over every rank
already (tandem.DDP, flat or hybrid), so the rows step alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from tandem._dist import global_rank, global_ranks, group_rank, group_size, require_process_group
from tandem._profile import span
from tandem.doctor import records, step_clock
from tandem.groups import GridNames, resolve_grid
from tandem.parallel.replicas import verify_same_parameters
from tandem.parallel.sharding import assign_owners, owned_indices


class ShardedOptimizer(Optimizer):
    """Any ``torch.optim`` optimizer, its state sharded across the ranks (ZeRO stage 1).

    ``param_groups`` hold all parameters with their hyperparameters, as for a plain optimizer;
    ``zero_grad`` clears every parameter's gradient. The closure of ``step(closure)`` is called
    once, before the inner step (optimizers that re-evaluate it, like LBFGS, are not supported).

    Checkpoints: ``state_dict()`` is this rank's shard and loads back with ``load_state_dict``
    into the same world size and parameters; ``full_state_dict(to)`` gathers the state of a plain
    optimizer over all parameters on rank ``to`` (it loads into ``optimizer_class(params)``), and
    ``load_full_state_dict`` takes such a dict on every rank, whatever the world size. Shards of
    a run of another world size are resharded without gathering: ``reshard_state_dicts`` builds
    this rank's shard from those of the ranks ``source_ranks`` names.

    Args:
        params: parameters or parameter-group dicts, as for ``optimizer_class``; the same on
            every rank (checked).
        optimizer_class: the inner optimizer, e.g. ``torch.optim.AdamW``.
        process_group: the group the parameters are sharded over (default: the whole world).
        hybrid: ``True``: shard within each node only (the launcher's node layout,
            ``LOCAL_WORLD_SIZE`` ranks per node): every node holds the whole state, split over
            its ranks, and updated parameters are exchanged within the node. On one node it is
            the flat form. Not with ``process_group``.
        shard_group: with ``replicate_group``, the grid made by hand: this rank's row, the
            group the state is sharded over. Alone, the same as ``process_group``.
        replicate_group: this rank's column (its place on every other row); checked with
            ``shard_group`` to form a grid (ValueError on every rank if not). No collective
            of ``step()`` runs in it.
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
        hybrid: bool = False,
        shard_group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        require_process_group("tandem.ShardedOptimizer")
        groups = _as_groups(params)
        # Every rank of the grid (the process group itself when flat): checks and full states.
        everyone = process_group
        if hybrid is not False or shard_group is not None or replicate_group is not None:
            grid = resolve_grid(
                process_group=process_group,
                shard_group=shard_group,
                replicate_group=replicate_group,
                hybrid=hybrid,
                names=GRID_NAMES,
                wrapper="tandem.ShardedOptimizer",
            )
            process_group, everyone = grid.shard.group, grid.everyone.group
            replicate_group = grid.replicate.group
        self.process_group = process_group  # the row: the state is sharded over it
        self.replicate_group = replicate_group  # None when flat
        self._everyone = everyone
        self.world_size = group_size(process_group)
        self.rank = group_rank(process_group)
        self._row = global_ranks(process_group)  # the row's global ranks, by group rank
        self.params = [p for g in groups for p in g["params"]]
        # The owners are computed independently on every rank: different parameters would
        # mean different owners and a hang in phase 3, so fail on every rank now instead.
        verify_same_parameters(
            [(f"param_groups[{i}]", p) for i, g in enumerate(groups) for p in g["params"]],
            everyone,
            wrapper="tandem.ShardedOptimizer",
        )
        self.owners = assign_owners(self._sizes(), self.world_size)
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
        self._hyperparameters_to_inner()
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
            with step_clock.waiting:  # the time this rank waits for the owners
                records.wait(work)
            if owner == self.rank:
                continue
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _hyperparameters_to_inner(self) -> None:
        # A scheduler sets the outer groups' hyperparameters (lr); the inner optimizer, which
        # steps and is saved, takes them here.
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the state; loads back on the same rank and world size.

        ``rank`` and ``world_size`` are this rank's place in the group the state is sharded
        over (hybrid: the node's), ``row`` that group's global ranks: a run of another layout
        finds every slice in the files of ``row`` (see ``tandem.parallel.adapters``).
        """
        # Saved after scheduler.step() and before the next step(): the lr the scheduler set.
        self._hyperparameters_to_inner()
        return {
            "shard": self.optimizer.state_dict(),
            "rank": self.rank,
            "world_size": self.world_size,
            "owners": list(self.owners),
            "row": list(self._row),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's shard saved by :meth:`state_dict` (same world size and parameters)."""
        saved = (state_dict.get("rank"), state_dict.get("world_size"), state_dict.get("owners"))
        if saved != (self.rank, self.world_size, self.owners):
            raise ValueError(
                f"shard of rank {saved[0]} of {saved[1]} (owners {saved[2]}) cannot load into "
                f"rank {self.rank} of {self.world_size} (owners {self.owners}); to change the "
                "world size, reshard_state_dicts() the saved shards, or use full_state_dict() "
                "and load_full_state_dict()"
            )
        self.optimizer.load_state_dict(state_dict["shard"])
        self._hyperparameters_from_inner()

    def full_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """Gather the full state on group rank ``to``, as a plain optimizer's ``state_dict()``.

        A collective: every rank must call it. Returns the dict on rank ``to``, None elsewhere.
        Hybrid: ``to`` is a rank of the whole grid (a global rank when it spans the world); the
        ranks of its node gather there (each node holds the whole state), the others send
        nothing.

        Example::

            full = opt.full_state_dict(to=0)
            if rank == 0:
                torch.optim.AdamW(model.parameters()).load_state_dict(full)   # loads as is
        """
        ranks = group_size(self._everyone)
        if not 0 <= to < ranks:
            raise ValueError(f"to={to} not in [0, {ranks})")
        dst = global_rank(self._everyone, to)
        if dst not in self._row:
            return None  # another node gathers the state: this one holds the same
        self._hyperparameters_to_inner()  # as in state_dict(): the scheduler's latest lr
        inner = self.optimizer.state_dict()
        mine = self._global_indices()
        # Tensors travel to the CPU first: gather_object pickles them.
        shard = {
            mine[i]: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in inner["state"].items()
        }
        shards: list[Any] | None  # every row rank's shard, on rank `to` only
        if self.world_size == 1:
            shards = [shard]
        else:
            shards = [None] * self.world_size if dst == self._row[self.rank] else None
            dist.gather_object(shard, shards, dst=dst, group=self.process_group)
        if dst != self._row[self.rank]:
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
        self.optimizer.load_state_dict(self._inner_from_full(state_dict))
        self._hyperparameters_from_inner()

    def source_ranks(self, world_size: int) -> list[int]:
        """The ranks of a ``world_size``-rank run whose shards hold this rank's parameters' state.

        Owners are :func:`~tandem.parallel.sharding.assign_owners`' answer for ``world_size``,
        computed here without reading anything. A rank that owns nothing still needs one shard,
        for the hyperparameters: rank 0's.

        Example::

            files = {q: torch.load(f"rank{q}.pt") for q in opt.source_ranks(saved_world_size)}
            opt.load_state_dict(opt.reshard_state_dicts(files))
        """
        old = assign_owners(self._sizes(), world_size)
        return sorted({old[i] for i in owned_indices(self.owners, self.rank)}) or [0]

    def reshard_state_dicts(self, saved: Mapping[int, dict[str, Any]]) -> dict[str, Any]:
        """This rank's :meth:`state_dict` rebuilt from shards a run of another world size saved.

        No communication: each rank reads the shards of the ranks that owned its parameters
        (:meth:`source_ranks`), so that no rank ever holds the whole state.

        Args:
            saved: ``{saved rank: its state_dict()}``, at least those of :meth:`source_ranks`.

        Raises:
            ValueError: the shards disagree on their world size or owners, or were cut from
                other parameters (their owners are not this model's at that world size).

        Example::

            saved = {q: torch.load(f"ckpt/rank{q}.pt")["optimizer"] for q in opt.source_ranks(2)}
            opt.load_state_dict(opt.reshard_state_dicts(saved))     # saved by 2 ranks, here 3
        """
        first = saved[min(saved)]
        world, owners = first["world_size"], list(first["owners"])
        expected = assign_owners(self._sizes(), world)
        if owners != expected:
            raise ValueError(
                f"ShardedOptimizer shards of a {world}-rank run name owners {owners}; these "
                f"{len(self.params)} parameters at {world} ranks have owners {expected}: the "
                "shards belong to another model or parameter order"
            )
        state: dict[int, Any] = {}
        for rank, shard in sorted(saved.items()):
            if (shard["rank"], shard["world_size"], list(shard["owners"])) != (rank, world, owners):
                raise ValueError(
                    f"the shard read as rank {rank} of {world} says it is rank {shard['rank']} "
                    f"of {shard['world_size']} with owners {shard['owners']}"
                )
            # Inner index k of rank q is q's k-th owned parameter in registration order: how
            # the constructor built q's inner optimizer.
            ids = owned_indices(owners, rank)
            state.update({ids[k]: s for k, s in shard["shard"]["state"].items()})
        groups, start = [], 0
        for saved_group, g in zip(first["shard"]["param_groups"], self.param_groups, strict=True):
            hyper = {k: v for k, v in saved_group.items() if k != "params"}
            groups.append({**hyper, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        full = {"state": state, "param_groups": groups}
        return {
            "shard": self._inner_from_full(full),
            "rank": self.rank,
            "world_size": self.world_size,
            "owners": list(self.owners),
        }

    def _sizes(self) -> list[int]:
        """What owners are balanced by: every parameter's bytes, in registration order."""
        return [p.numel() * p.element_size() for p in self.params]

    def _inner_from_full(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The inner optimizer's state dict: this rank's part of a plain optimizer's."""
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
        return {"state": inner_state, "param_groups": inner_groups}

    def _global_indices(self) -> list[int]:
        """Index into ``self.params`` of each inner parameter, in the inner optimizer's order."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return [index[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def _hyperparameters_from_inner(self) -> None:
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            outer.update({k: v for k, v in inner.items() if k != "params"})


# The descriptions of the groups hybrid=True makes: tandem.doctor's records name them so.
GRID_NAMES = GridNames(shard="zero shard", replicate="zero replicate", everyone="zero")


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
