"""tandem.train: the Trainer and what it needs to resume a run exactly.

- ``checkpoint``: atomic, checksummed checkpoints loaded without running pickled code
  (``save_checkpoint``, ``load_checkpoint``, ``list_checkpoints``, ``latest_checkpoint``).
- ``rng``: one process's random number generator states, captured and restored
  (``capture_rng_state``, ``restore_rng_state``).

Import from the submodules; this package imports nothing, so importing one piece does not pull
in the others.
"""
