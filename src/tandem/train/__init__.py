"""tandem.train: the Trainer, and the pieces of its loop.

The Trainer (:mod:`tandem.train.trainer`) runs the guides' loop: data loaders per rank
(``loaders``), the step (``step``, ``precision``), what happens between steps (``plan``,
``requests``, ``evaluation``, ``step_log``, ``loggers``, ``metrics_log``, ``progress``) and the
run's resumable state (``run_state``). Checkpoints are their own package, :mod:`tandem.checkpoint`,
which never imports this one.

Import from the submodules; this package imports nothing, so importing one piece does not pull
in the others.
"""
