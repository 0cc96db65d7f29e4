"""Deprecated import path: this module is :mod:`tandem.parallel.ddp.comm_hooks` now.

``tandem.parallel.comm_hooks`` keeps working, with a :class:`DeprecationWarning`, for one release.

Example::

    import tandem.parallel.ddp.comm_hooks   # the path to use now
"""

from tandem._moved import moved
from tandem.parallel.ddp.comm_hooks import *  # noqa: F403

moved("tandem.parallel.comm_hooks", "tandem.parallel.ddp.comm_hooks")
