"""Deprecated import path: this module is :mod:`tandem.job.checkin` now.

``tandem.launch.meeting`` keeps working, with a :class:`DeprecationWarning`, for one release.

Example::

    import tandem.job.checkin   # the path to use now
"""

from tandem._moved import moved
from tandem.job.checkin import *  # noqa: F403

moved("tandem.launch.meeting", "tandem.job.checkin")
