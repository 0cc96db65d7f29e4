"""tandem.DataParallel: one process, one replica per device, one thread per replica.

- ``wrapper``: :class:`DataParallel` itself, with the loss computed beside each replica so
  that the output device holds no more than the others;
- ``steps``: its four steps as functions: scatter, replicate, parallel_apply, gather.

Example::

    from tandem.parallel.dp import DataParallel   # or tandem.DataParallel
    model = DataParallel(net, device_ids=[0, 1])
"""

from tandem.parallel.dp.wrapper import DataParallel

__all__ = ["DataParallel"]
