"""Runnable examples: each is one script that runs unchanged on one process and on many.

- ``wine``: the guides' wine classifier (13 features, 64 hidden units, 3 classes) on
  scikit-learn's bundled wine data, trained with :class:`tandem.Trainer`.
- ``digits``: a small CNN on scikit-learn's bundled 8x8 digits, trained with the Trainer.
- ``lm``: a character-level transformer language model on the standard library's docstrings,
  trained with bf16-mixed, clipping, warm-up + cosine and accumulation.

Rank 0 prints the loss averaged over all ranks and the exact test accuracy each epoch;
checkpoints go to ``--run-dir``, and ``--resume latest`` continues a run.

Example::

    python -m tandem.examples.wine                          # one process
    tandem run --nproc-per-node 2 -m tandem.examples.wine   # two processes, same code
    tandem run --nproc-per-node 2 -m tandem.examples.digits --resume latest
"""
