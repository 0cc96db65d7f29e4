"""Deprecated import path: this module is :mod:`tandem.checkpoint.run_dir` now.

``tandem.train.checkpoint`` keeps working, with a :class:`DeprecationWarning`, for one release.

Example::

    import tandem.checkpoint.run_dir   # the path to use now
"""

from tandem._moved import moved
from tandem.checkpoint.run_dir import *  # noqa: F403

moved("tandem.train.checkpoint", "tandem.checkpoint.run_dir")
