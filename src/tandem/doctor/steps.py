"""Deprecated import path: this module is :mod:`tandem.doctor.step_clock` now.

``tandem.doctor.steps`` keeps working, with a :class:`DeprecationWarning`, for one release.

Example::

    import tandem.doctor.step_clock   # the path to use now
"""

from tandem._moved import moved
from tandem.doctor.step_clock import *  # noqa: F403

moved("tandem.doctor.steps", "tandem.doctor.step_clock")
