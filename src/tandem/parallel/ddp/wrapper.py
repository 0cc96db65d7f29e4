"""DistributedDataParallel: one process per device, gradients averaged during backward.

The life of a wrapped model:

1. Construction: check that every rank built the same parameters (an error on every rank, not
   a hang, when they differ), then broadcast rank 0's parameters and buffers so that all
   replicas start identical, and attach the gradient reducer (``reducer.py``).
2. Each forward: rebuild the buckets once (second iteration), broadcast rank 0's buffers
   (BatchNorm statistics; the module's buffers as they are now, so that a buffer the module
   reassigned is the one sent) so that every replica normalizes alike, run the module, and tell
   the reducer a backward is coming.
3. Backward: the reducer all-reduces buckets of gradients while backward continues; when it
   returns, every ``.grad`` holds the mean over ranks, and any optimizer takes the same step on
   every rank.

Hybrid (``hybrid=True``, or ``shard_group=`` with ``replicate_group=``, a 2-D mesh's groups):
the ranks form a grid (:mod:`tandem.groups`), rows the nodes, columns across them, and each
bucket's all-reduce becomes three collectives
(:func:`~tandem.parallel.ddp.comm_hooks.hybrid_allreduce_hook`): a reduce-scatter within the
row, an all-reduce of this rank's slice across the column, an all-gather within the row. Only
the slice leaves the node. Everything else (buffers, checks, join) runs over the whole grid.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from tandem._compile import eager_only
from tandem._dist import group_rank, group_size, require_process_group
from tandem._profile import backward_span, span
from tandem._tree import map_tensors
from tandem.doctor import records, step_clock
from tandem.groups import Grid, GridNames, resolve_grid
from tandem.parallel.ddp.comm_hooks import CommHook, HybridState, hybrid_allreduce_hook
from tandem.parallel.ddp.join import join as join_context
from tandem.parallel.ddp.join import training_ranks
from tandem.parallel.ddp.reducer import Reducer
from tandem.parallel.replicas import broadcast_coalesced, check_device_ids, verify_same_model


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism across processes, with torch's DDP arguments, written in Python.

    The arguments are torch 2.13's, in torch's order and with torch's meaning; the keyword-only
    ones after them are tandem's own.

    Args:
        module: the model; the same on every rank (checked).
        device_ids: ``None`` (CPU, or a module already on its device) or ``[device]``, the one
            device of this process's module; inputs are moved there before forward.
        output_device: accepted for compatibility; outputs stay where the module puts them.
        dim: accepted for compatibility (the batch dimension is the user's to split).
        broadcast_buffers: deprecated in torch 2.13 (a ``FutureWarning``, as torch's): ``False``
            neither broadcasts the buffers at construction nor before each forward. Use
            ``forward_sync_buffers``; given both, ``forward_sync_buffers`` wins.
        init_sync: at construction, check that every rank built the same model and broadcast
            rank 0's parameters and buffers. ``False`` skips both: the replicas must then start
            identical by other means (the same seed, a loaded checkpoint).
        process_group: the group to average over (default: the whole world).
        bucket_cap_mb: gradients are reduced in buckets of about this many MiB (default 25,
            with a first bucket of 1 MiB so that communication starts early; an explicit
            value applies to every bucket, as in torch).
        find_unused_parameters: detect, every iteration, the parameters the outputs do not
            depend on, so that backward never waits for their gradients; parameters behind an
            output the loss leaves out (a tuple or dict output, partly used) are handled too.
            A parameter used on no rank keeps its ``.grad`` (None stays None).
        check_reduction: deprecated and without effect, as in torch (a ``FutureWarning``).
        gradient_as_bucket_view: ``.grad`` tensors are views into the bucket buffers: no copy
            in or out, and less memory.
        static_graph: the graph is the same every iteration (torch's meaning): the first
            backward counts how often each parameter's gradient hook fires, which allows a
            parameter used several times per backward (reentrant activation checkpointing)
            and parameters that never get a gradient.
        delay_all_reduce_named_params: not supported (``NotImplementedError``): tandem.DDP
            reduces every parameter that requires grad in its buckets.
        param_to_hook_all_reduce: goes with ``delay_all_reduce_named_params``; not supported.
        mixed_precision: torch's experimental ``_MixedPrecision``: not supported
            (``NotImplementedError``); use ``torch.autocast`` or tandem.Trainer's precision.
        device_mesh: a one-dimensional ``DeviceMesh``, whose group is averaged over (instead
            of ``process_group``); more dimensions are refused, as torch refuses them (for a
            2-D mesh (replicate, shard) pass ``shard_group=mesh.get_group(1)``,
            ``replicate_group=mesh.get_group(0)``: hybrid). A mesh sliced out of a larger one
            (data parallel alongside tensor parallel) is not supported.
        skip_all_reduce_unused_params: with ``find_unused_parameters`` (or ``static_graph``), a
            bucket whose parameters are all unused in a backward is not reduced, and their
            ``.grad`` stay as they are. The unused parameters must be the same on every rank.
        bucket_cap_mb_list: the caps in MiB of the first, second, ... bucket, the last repeated
            (torch's); ``bucket_cap_mb`` is then ignored. The first buckets are cut with it too.
        batched_grad_copy: gradients are copied into their bucket when it is full, in one call,
            and the bucket divided by the world size (torch's bits for that option).
        forward_sync_buffers: broadcast rank 0's buffers before every forward in grad mode
            (default True), and take the last joiner's buffers at the end of a join context.
            The buffers are broadcast at construction whatever its value (see ``init_sync``).
        comm_hook: ``hook(state, bucket) -> Future``; see ``tandem.parallel.ddp.comm_hooks``.
            torch's hooks (``torch.distributed.algorithms.ddp_comm_hooks``) work unchanged.
        comm_state: the ``state`` passed to ``comm_hook`` (default: ``process_group``).
        first_bucket_cap_mb: cap of the first rebuilt bucket, overriding torch's rule.
        hybrid: ``True``: average in a grid made from the launcher's node layout
            (``LOCAL_WORLD_SIZE`` ranks per node): each bucket is reduce-scattered within the
            node, its slices all-reduced across the nodes, and all-gathered within the node,
            so only 1/``LOCAL_WORLD_SIZE`` of the gradient crosses the nodes' links. On one
            node it is plain tandem.DDP. Not with ``process_group``, ``device_mesh`` or
            ``comm_hook``.
        shard_group: with ``replicate_group``, the grid made by hand: this rank's row (the
            group the bucket is reduce-scattered and all-gathered in). Alone, the same as
            ``process_group``.
        replicate_group: this rank's column: the ranks at its place in every other row, across
            which the slices are all-reduced. Needs ``shard_group``; the two are checked to
            form a grid (ValueError on every rank if not).

    Example::

        tandem.init()
        model = tandem.DDP(Net().to(tandem.world().device))
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()          # .grad = mean over ranks
            opt.step()
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        comm_hook: CommHook | None = None,
        comm_state: Any = None,
        first_bucket_cap_mb: float | None = None,
        hybrid: bool = False,
        shard_group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)  # inside tandem.join / torch's Join, see parallel/join.py
        # 1. Mistakes first, each an error on every rank: no process group in a launched job,
        #    an argument tandem.DDP does not implement, device_ids that do not fit the module,
        #    a model that differs across ranks, a model with nothing to train.
        require_process_group("tandem.DDP")
        _refuse_unsupported(
            delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision
        )
        grid = _grid(process_group, device_mesh, hybrid, shard_group, replicate_group, comm_hook)
        if grid is None:
            process_group = _group_of_mesh(device_mesh, process_group)
        else:
            # Averaged over the whole grid: the buffers, the checks and join run over it; the
            # buckets go through the rows and columns (the hook installed below).
            process_group = grid.everyone.group
            if grid.shard.size == 1 or not grid.hybrid:
                # A row of one rank (nothing to scatter) or one row (one node, or shard_group
                # alone: nothing to replicate): a plain all-reduce over the grid, done as one.
                grid = None
        self.grid: Grid | None = grid
        self.shard_group = None if grid is None else grid.shard.group
        self.replicate_group = None if grid is None else grid.replicate.group
        self.device_mesh = device_mesh
        self.forward_sync_buffers, init_sync_buffers = _buffer_flags(
            broadcast_buffers, forward_sync_buffers
        )
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is "
                "deprecated. Please avoid using it.",
                FutureWarning,
                stacklevel=2,
            )
        self.device = check_device_ids(module, device_ids, "tandem.DDP", output_device)
        self.module = module
        self.output_device = output_device
        self.dim = dim
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.require_backward_grad_sync = True
        self.divide_by_initial_world_size = True  # changed only inside tandem.join

        if init_sync:
            verify_same_model(module, process_group, "tandem.DDP")
        trainable = _trainable(module)
        if not trainable:
            raise RuntimeError(
                "tandem.DDP: the module has no parameter that requires a gradient, so there is "
                "nothing to average (DistributedDataParallel is not needed when a module "
                "doesn't have any parameter that requires a gradient). Wrap the model you train."
            )
        # The buffers as (module, name): re-read before each broadcast, so that a buffer the
        # module reassigned (self.buf = self.buf + 1) is the one sent, as torch re-reads them.
        self._buffer_slots = _buffer_slots(module)
        # 2. Rank 0's values everywhere.
        if init_sync:
            self.sync_params_and_buffers(buffers=init_sync_buffers)

        # torch.func.functional_call swaps the module's tensors for the call: the reducer's
        # parameters then take no part, and this forward arms no backward (see _arms_backward).
        owner, _, name = trainable[0][0].rpartition(".")
        self._first_param = (module.get_submodule(owner), name, trainable[0][1])
        self.reducer = Reducer(
            [p for _, p in trainable],
            [n for n, _ in trainable],
            group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            bucket_cap_mb_list=bucket_cap_mb_list,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy,
        )
        # torch's attributes: the cap in bytes, and the per-bucket caps (empty without a list).
        caps = self.reducer.caps
        self.bucket_bytes_cap = max(caps) if bucket_cap_mb_list else caps[-1]
        self.bucket_bytes_cap_list = list(caps) if bucket_cap_mb_list else []
        self._initial_bucket_sizes = _bucket_sizes(self.reducer)  # _get_ddp_logging_data
        # The clock of tandem run's exit summary.
        self._steps = step_clock.clock("tandem.DDP forwards", priority=1)
        if grid is not None:
            # The reducer's divisor, read at each bucket: tandem.join may change it.
            state = HybridState(
                grid.shard.group, grid.replicate.group, divisor=lambda: self.reducer.divisor
            )
            self.reducer.set_hook(hybrid_allreduce_hook, state)
        elif comm_hook is not None:
            self.register_comm_hook(process_group if comm_state is None else comm_state, comm_hook)

    @property
    def world_size(self) -> int:
        """Ranks averaged over."""
        return group_size(self.process_group)

    @property
    def broadcast_buffers(self) -> bool:
        """torch's former name of ``forward_sync_buffers`` (reads and sets it)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # Under torch.compile only the wrapped module is traced: this frame runs eagerly, and its
    # per-step work (the collectives, the bucket rebuild, the reducer's bookkeeping) happens in
    # the two functions below, which dynamo never enters. No graph break comes from tandem, and
    # the module's own graph is the same as without the wrapper. (torch's DDP is special-cased
    # inside dynamo to the same effect.) The module is called through `_run_module`, a frame of
    # tandem's own where dynamo starts its graph: called straight from here, a module of torch's
    # own (nn.Sequential, say) would not be compiled at all, dynamo skipping torch's frames.
    @eager_only(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; with grad enabled, arm the reducer for the coming backward."""
        training = self._before_forward()
        if self.device is not None:
            device = self.device
            inputs, kwargs = map_tensors(
                lambda t: t.to(device, non_blocking=True), (inputs, kwargs)
            )
        with span("tandem.ddp.forward"):
            output = _run_module(self.module, inputs, kwargs)
        if training:
            self._after_forward(output)
        return output

    @eager_only
    def _before_forward(self) -> bool:
        training = torch.is_grad_enabled() and bool(self.reducer.params)
        # Inside a join context, tell the ranks that ran out of data that this one has not.
        announced = Join.notify_join_context(self)
        if training:
            self.reducer.progress.step += 1
            self._steps.tick()
            self.reducer.start_step()
            self.reducer.rebuild()
            self.sync_buffers(training=True)
            if announced is not None and not self.divide_by_initial_world_size:
                self.reducer.divisor = training_ranks(announced)
        if self._join_config.enable:
            self.announce_sync(joined=False)
        return training

    def _arms_backward(self) -> bool:
        # False while torch.func.functional_call has swapped the module's parameters for
        # tensors of its own: as in torch's DDP, that forward's backward reduces nothing (the
        # given tensors get their plain gradients, the module's parameters none); the rest of
        # the forward (buffers broadcast, join) is as usual. One look at one parameter; only
        # if it was swapped are the others looked at: some swapped and some not is the
        # module's usual backward, whose missing gradients raise as usual.
        owner, name, param = self._first_param
        if owner._parameters.get(name) is param:
            return True
        for qualified, p in zip(self.reducer.names, self.reducer.params, strict=True):
            path, _, attr = qualified.rpartition(".")
            if self.module.get_submodule(path)._parameters.get(attr) is p:
                return True
        return False

    @eager_only
    def _after_forward(self, output: Any) -> None:
        if not self._arms_backward():
            return
        self.reducer.prepare(output, sync=self.require_backward_grad_sync)
        backward_span("tandem.ddp.backward", output)  # after the reducer's hooks: ends after it

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """torch's ``DistributedDataParallel.join``: ``tandem.join([self], ...)`` (see
        ``tandem.parallel.ddp.join``), for training with uneven inputs across ranks.

        Example::

            with model.join():
                for x, y in my_shard:        # ranks may hold different numbers of batches
                    loss_fn(model(x), y).backward()
        """
        return join_context(
            [self],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block averages the sum.

        Example::

            with model.no_sync():
                for x, y in micro_batches[:-1]:
                    loss_fn(model(x), y).backward()    # no communication
            loss_fn(model(last_x), last_y).backward()  # one all-reduce of the sum
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the default mean all-reduce with ``hook(state, bucket) -> Future``.

        Example::

            from tandem.parallel.ddp.comm_hooks import bf16_compress_hook
            model.register_comm_hook(None, bf16_compress_hook)
        """
        if not callable(hook):
            raise ValueError(f"hook={hook!r} is not callable: pass hook(state, bucket) -> Future")
        if self.grid is not None:
            raise ValueError(
                f"tandem.DDP: register_comm_hook({getattr(hook, '__name__', hook)!r}) on a hybrid "
                f"model ({self.grid.describe()}): its buckets are reduced by the hybrid hook "
                "(reduce-scatter in the node, all-reduce across nodes, all-gather in the node), "
                "which a hook of your own would replace; wrap without hybrid to use your hook"
            )
        self.reducer.set_hook(hook, state)

    def sync_params_and_buffers(self, src: int = 0, buffers: bool = True) -> None:
        """Overwrite parameters and buffers (or only the parameters) with group rank ``src``'s
        (e.g. before evaluating).

        Example::

            model.sync_params_and_buffers()
            evaluate(model)
        """
        tensors = [p.data for p in self.module.parameters()]
        if buffers:
            tensors += list(self.module.buffers())
        broadcast_coalesced(tensors, self.process_group, src=src)

    def sync_buffers(self, training: bool) -> None:
        """Broadcast the buffers before a forward (``training=False``: a joined rank's echo).

        Buffers come from rank 0 before the forward that uses them: otherwise each replica's
        BatchNorm drifts to its own data's statistics. Inside a join context rank 0 may have
        run out with stale statistics: the highest rank still training is the source.
        """
        if not self.forward_sync_buffers or not self._buffer_slots:
            return
        src = common_rank(self, training) if self._join_config.enable else 0
        # Read again every time (cheap: no walk over the modules): the module may have
        # reassigned a buffer since the last forward.
        buffers = [b for m, n in self._buffer_slots if (b := m._buffers.get(n)) is not None]
        with records.tagged(f"DDP buffer broadcast, step {self.reducer.progress.step}"):
            broadcast_coalesced(buffers, self.process_group, src=src, wait=self._wait_buffers)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """The fields of torch's ``_get_ddp_logging_data()`` that tandem.DDP keeps, with torch's
        names and formats (torch's timings and environment variables are not among them).

        Example::

            model._get_ddp_logging_data()["num_buckets_reduced"]   # in the last backward
        """
        reducer = self.reducer
        params = reducer.params
        data: dict[str, Any] = {
            "module_name": type(self.module).__name__,
            "world_size": self.world_size,
            "rank": dist.get_rank(self.process_group),
            "backend_name": dist.get_backend(self.process_group),
            "broadcast_buffers": int(self.forward_sync_buffers),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "bucket_sizes": self._initial_bucket_sizes,
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "has_rebuilt_buckets": int(reducer.rebuilt and not reducer.find_unused),
            "num_buckets_reduced": reducer.buckets_reduced,
        }
        if data["has_rebuilt_buckets"]:
            data["rebuilt_bucket_sizes"] = _bucket_sizes(reducer)
            data["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(str(i) for i in bucket) for bucket in reducer.layout
            )
        return data

    def _wait_buffers(self, work: dist.Work) -> None:
        self.reducer.wait(work, "buffer broadcast")

    def announce_sync(self, joined: bool) -> bool:
        """Inside a join context: all-reduce whether this iteration's backward syncs.

        Training ranks add 1 unless under no_sync, joined ranks add 0 and read the sum: with
        no rank syncing, the joined ones skip the gradient collectives too.
        """
        flag = float(not joined and self.require_backward_grad_sync)
        t = torch.tensor([flag], device=self.join_device)
        work = dist.all_reduce(t, group=self.process_group, async_op=True)
        if not joined:
            return True
        records.wait(work)
        return t.item() != 0

    # -- torch's Joinable interface (tandem.join, torch.distributed.algorithms.Join) ----------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """What this rank does in each iteration after it ran out of inputs."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Where the join context's own all-reduces run: the device of the parameters."""
        return next(self.module.parameters()).device

    @property
    def join_process_group(self) -> Any:
        """The group whose ranks join."""
        return self.process_group if self.process_group is not None else dist.group.WORLD


DDP = DistributedDataParallel


def _run_module(module: nn.Module, inputs: tuple, kwargs: dict) -> Any:
    # Its own frame, outside torch's code: under torch.compile the graph starts here.
    return module(*inputs, **kwargs)


def _refuse_unsupported(
    delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any, mixed_precision: Any
) -> None:
    # torch 2.13 arguments that tandem.DDP does not implement: an error, never a silent ignore.
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the "
            "same time."
        )
    if delay_all_reduce_named_params is not None:
        raise NotImplementedError(
            "tandem.DDP: delay_all_reduce_named_params / param_to_hook_all_reduce are not "
            "supported: tandem.DDP reduces every parameter that requires grad in its buckets, "
            "overlapped with backward. Leave them unset (those parameters are then averaged "
            "with the others), or use torch.nn.parallel.DistributedDataParallel"
        )
    if mixed_precision is not None:
        raise NotImplementedError(
            f"tandem.DDP: mixed_precision={mixed_precision!r} (torch's experimental DDP mixed "
            "precision) is not supported: run the forward under torch.autocast, or use "
            "tandem.Trainer's precision option"
        )


# The descriptions of the groups hybrid=True makes: tandem.doctor's records name them so.
GRID_NAMES = GridNames(shard="ddp shard", replicate="ddp replicate", everyone="ddp")


def _grid(
    process_group: Any,
    device_mesh: Any,
    hybrid: Any,
    shard_group: Any,
    replicate_group: Any,
    comm_hook: Any,
) -> Grid | None:
    """The grid tandem.DDP's arguments describe; None for torch's own (``process_group`` or a
    1-D ``device_mesh``, left to torch's rules and errors). A collective over the grid's ranks
    when it is hybrid (the groups are checked, or made from the node layout)."""
    # A device_mesh alone is torch's (1-D only: a 2-D one is refused as torch's DDP refuses it,
    # torch's own test suite checks that); a mesh's groups give the hybrid form instead.
    if hybrid is False and shard_group is None and replicate_group is None:
        return None
    if comm_hook is not None:
        raise ValueError(
            f"tandem.DDP: comm_hook={getattr(comm_hook, '__name__', comm_hook)!r} with a hybrid "
            "grid (hybrid=True, or shard_group= with replicate_group=): the "
            "buckets are reduced by the hybrid hook (reduce-scatter in the node, all-reduce "
            "across nodes, all-gather in the node), which yours would replace; pass one of them"
        )
    return resolve_grid(
        process_group=process_group,
        shard_group=shard_group,
        replicate_group=replicate_group,
        hybrid=hybrid,
        device_mesh=device_mesh,
        names=GRID_NAMES,
        wrapper="tandem.DDP",
    )


def _group_of_mesh(device_mesh: Any, process_group: Any) -> Any:
    # torch's rules: a device_mesh replaces process_group, and must be one-dimensional.
    if device_mesh is None:
        return process_group
    if process_group:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    if device_mesh._get_root_mesh() != device_mesh:
        raise NotImplementedError(
            f"tandem.DDP: device_mesh={device_mesh} is sliced out of a larger mesh (data "
            "parallel alongside tensor parallel), for which torch converts the module's DTensor "
            "parameters; tandem.DDP does not. Use torch.nn.parallel.DistributedDataParallel "
            "there, or pass process_group=device_mesh.get_group() for a module of plain tensors"
        )
    return device_mesh.get_group(mesh_dim=0)


def _buffer_flags(broadcast_buffers: bool | None, forward_sync: bool | None) -> tuple[bool, bool]:
    """(forward_sync_buffers, broadcast buffers at construction), with torch 2.13's warnings."""
    if broadcast_buffers is not None:
        if forward_sync is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                "`broadcast_buffers` is deprecated and its value is ignored when "
                "`forward_sync_buffers` is provided.",
                FutureWarning,
                stacklevel=3,
            )
        else:
            warnings.warn(
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
                "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still "
                "syncs buffers at init. If you rely on buffers NOT being synced at init (e.g. "
                "rank-local buffers), keep using `broadcast_buffers=False`.",
                FutureWarning,
                stacklevel=3,
            )
    if forward_sync is not None:
        return bool(forward_sync), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective


def _bucket_sizes(reducer: Reducer) -> str:
    # torch's format of bucket sizes in its logging data: bytes, comma separated.
    return ", ".join(str(b.flat.numel() * b.flat.element_size()) for b in reducer.buckets)


def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    # Shared parameters once (named_parameters removes duplicates), those that require grad.
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every buffer, each tensor once, in named_buffers() order."""
    slots, seen = [], set()
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                slots.append((m, name))
    return slots


class DDPJoinHook(JoinHook):
    """What a tandem.DDP rank does each iteration after it ran out (see the module docstring)."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """Shadow one forward and backward of the ranks still training."""
        ddp = self.ddp
        ddp.reducer.rebuild()
        ddp.sync_buffers(training=False)
        if not ddp.announce_sync(joined=True):
            return  # the others are under no_sync: no gradient collectives this iteration
        ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the last rank to join (its buffers too, unless
        ``forward_sync_buffers=False``: rank-local buffers stay the rank's, as in torch)."""
        ddp = self.ddp
        src = common_rank(ddp, is_last_joiner)
        ddp.sync_params_and_buffers(src=src, buffers=ddp.forward_sync_buffers)
        ddp.divide_by_initial_world_size = True
        ddp.reducer.divisor = ddp.reducer.world_size


def common_rank(ddp: DistributedDataParallel, candidate: bool) -> int:
    """The highest group rank among the ranks passing ``candidate=True`` (one all-reduce)."""
    rank = group_rank(ddp.process_group)
    t = torch.tensor([rank if candidate else -1], device=ddp.join_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ddp.process_group)
    chosen = int(t.item())
    assert chosen >= 0, "no rank was a candidate"
    return chosen


def drop_zero_grads(model: nn.Module) -> int:
    """Set ``.grad`` to None where it is all zeros; return how many were dropped.

    After tandem.DDP a parameter that took no part in a step on this rank still gets the mean
    gradient, and where no rank used it that mean is zeros. SGD with weight decay or momentum,
    and Adam, would still move such a parameter; with ``.grad = None`` the optimizer skips it,
    so a sub-network that sat out the step is left exactly as it was.

    Example::

        loss.backward()
        tandem.drop_zero_grads(model)
        optimizer.step()
    """
    dropped = 0
    for p in model.parameters():
        if p.grad is not None and not p.grad.any():
            p.grad = None
            dropped += 1
    return dropped
