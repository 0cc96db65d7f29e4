"""tandem.DDP: one process per device, gradients averaged by bucketed all-reduce during backward.

- ``wrapper``: :class:`DistributedDataParallel` itself (forward, ``no_sync``, buffers, the
  parameter check and broadcast at construction) and its join hook, as torch keeps them;
- ``reducer``: the gradient reducer: hooks, the buckets (cut, rebuilt once, saved), their
  launches and the end of backward;
- ``buckets``: which gradients travel together (caps, cuts, buffers); pure, no communication;
- ``end_of_backward``: the check that tells every rank whether any rank missed gradients;
- ``out_of_step``: a wait that lasts asks every rank where it is and names the rank out of step;
- ``comm_hooks``: how a bucket becomes the mean (allreduce, fp16/bf16 compression, ...);
- ``join``: :func:`join`, training with uneven inputs across ranks.

Example::

    from tandem.parallel.ddp import DistributedDataParallel   # or tandem.DDP
    model = DistributedDataParallel(net)
"""

from tandem.parallel.ddp.join import join
from tandem.parallel.ddp.wrapper import DistributedDataParallel, drop_zero_grads

__all__ = ["DistributedDataParallel", "drop_zero_grads", "join"]
