"""tandem.FullyShardedDataParallel: parameters, gradients and optimizer state sharded (ZeRO 2, 3).

- ``wrapper``: :class:`FullyShardedDataParallel` itself (construction, forward, clipping,
  state dicts);
- ``units``: which submodules become units, agreed by every rank; ``flat``: one unit's
  parameters as one flat buffer, sharded, with its all-gather and reduce-scatter (and, hybrid,
  all-reduce); ``mesh``: the groups it is sharded over and replicated across;
- ``hooks``: what runs around every unit's forward and backward; ``precision``: the mixed
  precision policy and its casts;
- ``layout``: what a wrapped model is made of, as data; ``state``: its full and sharded state
  dicts and the optimizer's; ``reshard``: sharded checkpoints cut anew for another world size.

Example::

    from tandem.parallel.fsdp import FullyShardedDataParallel   # or tandem.FullyShardedDataParallel
    model = FullyShardedDataParallel(net, auto_wrap={nn.TransformerEncoderLayer})
"""

from tandem.parallel.fsdp.precision import MixedPrecisionPolicy
from tandem.parallel.fsdp.wrapper import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel", "MixedPrecisionPolicy"]
