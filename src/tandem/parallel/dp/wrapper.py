"""DataParallel: one process, one replica per device, one thread per replica.

Each forward is four steps (``dp_steps.py``):

1. scatter: split the batch into even slices, one per device (fewer when the batch is smaller);
2. replicate: replica 0 is the module; the others share or copy its parameters;
3. parallel_apply: run every replica on its slice in its own thread;
4. gather: concatenate the outputs on the output device.

Backward then flows from the gathered output through every replica into the original
parameters, so ``.grad`` is the gradient of the whole batch, as with the plain module.

The classic flaw is step 4: the output device holds the whole output, and computes the whole
loss, while the other devices hold a slice each. The balanced mode (``loss_fn=...`` and
``model.loss(...)``) moves the loss into step 3, next to each replica's outputs, and gathers only
one scalar per replica.

On the CPU (``device_ids=["cpu", "cpu"]``) the same mechanism runs with several replicas on one
device: torch kernels release the GIL, so the threads overlap inside them. Backward gains
nothing there: torch's autograd engine runs all CPU work in the thread that called backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tandem.parallel.dp.steps import (
    gather,
    parallel_apply,
    replicate,
    scatter,
    tensor_bytes,
)

Device = int | str | torch.device
LossFn = Callable[[Any, Any], torch.Tensor]


class DataParallel(nn.Module):
    """Data parallelism in one process: the batch split across devices, one thread per replica.

    ``forward`` returns the gathered outputs, as ``torch.nn.DataParallel`` does. With a
    ``loss_fn``, ``loss(*inputs, target=...)`` is the balanced mode: each replica computes the
    mean loss of its own slice, and only those scalars reach the output device. The result is
    ``sum_i (n_i / N) * loss_fn(output_i, target_i)``, slice i holding n_i of the N samples: for
    a ``loss_fn`` that means over the samples (``reduction="mean"`` in ``F.cross_entropy``
    without class weights, ``F.mse_loss``, ...), exactly the full-batch loss up to rounding.

    Buffers follow torch's rule: replica 0 is the module itself, so its in-place updates
    (BatchNorm running statistics, ``num_batches_tracked``) are kept; the other replicas update
    copies, which are discarded. In training mode the running statistics are thus those of
    slice 0 only; in eval mode every replica normalizes with the module's statistics and the
    outputs equal the plain module's.

    With one device (the default without CUDA) forward calls the module in the caller's thread;
    its exceptions propagate unchanged. With several, a replica's exception is raised in the
    caller as ``ReplicaError`` ("replica 1 on cuda:1 raised ...", with its thread's traceback).

    Args:
        module: the model, with its parameters and buffers on ``device_ids[0]``.
        device_ids: the replicas' devices: CUDA indices or devices, or ``"cpu"`` (repeat it for
            several CPU replicas). Default: every CUDA device, else ``["cpu"]``.
        output_device: where outputs are gathered. Default: ``device_ids[0]``.
        dim: the batch dimension of inputs, targets and outputs.
        loss_fn: ``loss_fn(output, target)`` returning the mean loss of a slice; enables
            ``loss()``.

    Attributes:
        last_gathered_bytes: bytes the last forward or loss gathered onto the output device
            (the whole output in plain mode; one scalar per replica in balanced mode).
        last_replicas: replicas the last forward or loss used.

    Example::

        model = tandem.DataParallel(Net().cuda(0), device_ids=[0, 1])
        y = model(x)                                         # gathered on cuda:0
        F.cross_entropy(y, labels).backward()

        # balanced: cuda:0 never holds the whole output
        model = tandem.DataParallel(Net().cuda(0), device_ids=[0, 1], loss_fn=F.cross_entropy)
        model.loss(x, target=labels).backward()

        # no GPU: two replicas on the CPU, one thread each
        model = tandem.DataParallel(Net(), device_ids=["cpu", "cpu"])
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[Device] | None = None,
        output_device: Device | None = None,
        dim: int = 0,
        loss_fn: LossFn | None = None,
    ) -> None:
        super().__init__()
        if device_ids is None:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            device_ids = list(range(count)) or ["cpu"]
        if len(device_ids) == 0:
            raise ValueError("device_ids=[]: pass at least one device (or None for the default)")
        self.module = module
        self.device_ids = [_as_device(d) for d in device_ids]
        self.output_device = (
            self.device_ids[0] if output_device is None else _as_device(output_device)
        )
        self.dim = dim
        self.loss_fn = loss_fn
        self.last_gathered_bytes = 0
        self.last_replicas = 0
        self._check_module_device()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter the batch, replicate the module, apply the replicas in parallel, gather.

        Example::

            y = model(x, mask=m)     # x and m split along dim; y concatenated on output_device
        """
        self._check_module_device()
        slices = scatter(inputs, kwargs, self.device_ids, self.dim)
        devices = self.device_ids[: len(slices)]
        replicas = replicate(self.module, devices)
        outputs = parallel_apply(replicas, slices, devices)
        output = gather(outputs, self.output_device, self.dim)
        self._record(len(slices), output)
        return output

    def loss(self, *inputs: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        """The balanced mode: the batch's mean loss, each replica's computed next to its outputs.

        Args:
            inputs: the module's positional arguments.
            target: what ``loss_fn`` compares the outputs with, split along ``dim`` like the
                inputs (keyword-only; ``target`` is not passed to the module).
            kwargs: the module's keyword arguments.

        Returns:
            ``sum_i (n_i / N) * loss_fn(output_i, target_i)``, a scalar on ``output_device``.

        Example::

            model = tandem.DataParallel(net, device_ids=["cpu"] * 2, loss_fn=F.cross_entropy)
            loss = model.loss(x, target=y)   # == F.cross_entropy(net(x), y)
            loss.backward()
        """
        if self.loss_fn is None:
            raise ValueError(
                "loss() needs a loss function: DataParallel(module, ..., loss_fn=F.cross_entropy)"
            )
        self._check_module_device()
        slices = scatter(inputs, kwargs, self.device_ids, self.dim, target=target)
        devices = self.device_ids[: len(slices)]
        replicas = replicate(self.module, devices)
        # The loss runs inside each replica's thread: its outputs never leave its device.
        losses = parallel_apply(
            [_LossOf(r, self.loss_fn, s.target) for r, s in zip(replicas, slices, strict=True)],
            slices,
            devices,
        )
        for i, loss in enumerate(losses):
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                raise ValueError(
                    f"loss_fn returned {shape} on replica {i}: it must return the mean loss of "
                    "the slice, a 0-dim tensor (reduction='mean')"
                )
        per_replica = gather([loss.reshape(1) for loss in losses], self.output_device, 0)
        self._record(len(slices), per_replica)
        sizes = [s.size or 0 for s in slices]
        total = sum(sizes)
        # Weighted by slice size: the slices' means combine into the whole batch's mean.
        weights = [n / total for n in sizes] if total else [1.0] * len(sizes)
        w = torch.tensor(weights, dtype=per_replica.dtype, device=per_replica.device)
        return (per_replica * w).sum()

    def _record(self, replicas: int, gathered: Any) -> None:
        self.last_replicas = replicas
        self.last_gathered_bytes = tensor_bytes(gathered)

    def _check_module_device(self) -> None:
        # Replica 0 is the module itself and runs on device_ids[0]: it must live there (torch
        # checks the same before every forward, since .to() may move it after wrapping).
        home = self.device_ids[0]
        for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
            if t.device != home:
                raise ValueError(
                    f"DataParallel: the module must have its parameters and buffers on "
                    f"device_ids[0]={home}, but {name!r} is on {t.device}"
                )


class _LossOf:
    """A replica followed by the loss of its slice: what a balanced replica's thread runs."""

    def __init__(self, replica: nn.Module, loss_fn: LossFn, target: Any) -> None:
        self.replica, self.loss_fn, self.target = replica, loss_fn, target

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.loss_fn(self.replica(*args, **kwargs), self.target)


def _as_device(d: Device) -> torch.device:
    device = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = torch.cuda.current_device() if device.index is None and count else device.index
        if index is None or index >= count:
            raise ValueError(f"device {d!r}: this machine has {count} CUDA device(s)")
        device = torch.device("cuda", index)
    return device
