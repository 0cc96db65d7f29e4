"""Runnable examples: each is one script that runs unchanged on one process and on many.

- ``wine``: a small MLP classifying scikit-learn's bundled wine data (13 features, 3 classes)
  with :class:`tandem.DDP` and a sharded sampler; rank 0 prints the loss averaged over all
  ranks and the test accuracy each epoch.

Example::

    python -m tandem.examples.wine                          # one process
    tandem run --nproc-per-node 2 -m tandem.examples.wine   # two processes, same code
"""
