"""DistributedDataParallel: one process per device, gradients averaged during backward.

The life of a wrapped model:

1. Construction: check that every rank built the same parameters (an error on every rank, not
   a hang, when they differ), then broadcast rank 0's parameters and buffers so that all
   replicas start identical, and attach the gradient reducer (``reducer.py``).
2. Each forward: rebuild the buckets once (second iteration), broadcast rank 0's buffers
   (BatchNorm statistics) so that every replica normalizes alike, run the module, and tell the
   reducer a backward is coming.
3. Backward: the reducer all-reduces buckets of gradients while backward continues; when it
   returns, every ``.grad`` holds the mean over ranks, and any optimizer takes the same step on
   every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from tandem._dist import group_size, require_process_group
from tandem._profile import backward_span, span
from tandem._tree import map_tensors
from tandem.doctor import records, steps
from tandem.parallel.comm_hooks import CommHook
from tandem.parallel.join import DDPJoinHook, common_rank, training_ranks
from tandem.parallel.reducer import Reducer
from tandem.parallel.replicas import broadcast_coalesced, check_device_ids, verify_same_model


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism across processes, with torch's DDP arguments, written in Python.

    Args:
        module: the model; the same on every rank (checked).
        device_ids: ``None`` (CPU, or a module already on its device) or ``[device]``, the one
            device of this process's module; inputs are moved there before forward.
        output_device: accepted for compatibility; outputs stay where the module puts them.
        dim: accepted for compatibility (the batch dimension is the user's to split).
        broadcast_buffers: broadcast rank 0's buffers before every forward in grad mode.
        process_group: the group to average over (default: the whole world).
        bucket_cap_mb: gradients are reduced in buckets of about this many MiB (default 25,
            with a first bucket of 1 MiB so that communication starts early; an explicit
            value applies to every bucket, as in torch).
        find_unused_parameters: detect, every iteration, the parameters the outputs do not
            depend on, so that backward never waits for their gradients.
        gradient_as_bucket_view: ``.grad`` tensors are views into the bucket buffers: no copy
            in or out, and less memory.
        static_graph: the graph is the same every iteration (torch's meaning): the first
            backward counts how often each parameter's gradient hook fires, which allows a
            parameter used several times per backward (reentrant activation checkpointing)
            and parameters that never get a gradient.
        comm_hook: ``hook(state, bucket) -> Future``; see ``tandem.parallel.comm_hooks``.
            torch's hooks (``torch.distributed.algorithms.ddp_comm_hooks``) work unchanged.
        comm_state: the ``state`` passed to ``comm_hook`` (default: ``process_group``).
        first_bucket_cap_mb: cap of the first rebuilt bucket, overriding torch's rule.

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
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        comm_hook: CommHook | None = None,
        comm_state: Any = None,
        first_bucket_cap_mb: float | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)  # inside tandem.join / torch's Join, see parallel/join.py
        # 1. Mistakes first, each an error on every rank: no process group in a launched job,
        #    device_ids that do not fit the module, a model that differs across ranks.
        require_process_group("tandem.DDP")
        self.device = check_device_ids(module, device_ids, "tandem.DDP", output_device)
        self.module = module
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.divide_by_initial_world_size = True  # changed only inside tandem.join

        verify_same_model(module, process_group, "tandem.DDP")
        # 2. Rank 0's values everywhere.
        self._buffers_to_sync = list(module.buffers())
        self.sync_params_and_buffers()

        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.reducer = Reducer(
            [p for _, p in trainable],
            [n for n, _ in trainable],
            group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        self._steps = steps.clock("tandem.DDP forwards", priority=1)  # for tandem run's summary
        if comm_hook is not None:
            self.register_comm_hook(process_group if comm_state is None else comm_state, comm_hook)

    @property
    def world_size(self) -> int:
        """Ranks averaged over."""
        return group_size(self.process_group)

    # Under torch.compile only the wrapped module is traced: this frame runs eagerly, and its
    # per-step work (the collectives, the bucket rebuild, the reducer's bookkeeping) happens in
    # the two functions below, which dynamo never enters. No graph break comes from tandem, and
    # the module's own graph is the same as without the wrapper. (torch's DDP is special-cased
    # inside dynamo to the same effect.)
    @torch.compiler.disable(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; with grad enabled, arm the reducer for the coming backward."""
        training = self._before_forward()
        if self.device is not None:
            device = self.device
            inputs, kwargs = map_tensors(
                lambda t: t.to(device, non_blocking=True), (inputs, kwargs)
            )
        with span("tandem.ddp.forward"):
            output = self.module(*inputs, **kwargs)
        if training:
            self._after_forward(output)
        return output

    @torch.compiler.disable
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
                self.reducer.scale = 1.0 / training_ranks(announced)
        if self._join_config.enable:
            self.announce_sync(joined=False)
        return training

    @torch.compiler.disable
    def _after_forward(self, output: Any) -> None:
        self.reducer.prepare(output, sync=self.require_backward_grad_sync)
        backward_span("tandem.ddp.backward", output)  # after the reducer's hooks: ends after it

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

            from tandem.parallel.comm_hooks import bf16_compress_hook
            model.register_comm_hook(None, bf16_compress_hook)
        """
        if not callable(hook):
            raise ValueError(f"hook={hook!r} is not callable: pass hook(state, bucket) -> Future")
        self.reducer.set_hook(hook, state)

    def sync_params_and_buffers(self, src: int = 0) -> None:
        """Overwrite parameters and buffers with group rank ``src``'s (e.g. before evaluating).

        Example::

            model.sync_params_and_buffers()
            evaluate(model)
        """
        tensors = [p.data for p in self.module.parameters()] + list(self.module.buffers())
        broadcast_coalesced(tensors, self.process_group, src=src)

    def sync_buffers(self, training: bool) -> None:
        """Broadcast the buffers before a forward (``training=False``: a joined rank's echo).

        Buffers come from rank 0 before the forward that uses them: otherwise each replica's
        BatchNorm drifts to its own data's statistics. Inside a join context rank 0 may have
        run out with stale statistics: the highest rank still training is the source.
        """
        if not self.broadcast_buffers or not self._buffers_to_sync:
            return
        src = common_rank(self, training) if self._join_config.enable else 0
        with records.tagged(f"DDP buffer broadcast, step {self.reducer.progress.step}"):
            broadcast_coalesced(
                self._buffers_to_sync, self.process_group, src=src, wait=self._wait_buffers
            )

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
