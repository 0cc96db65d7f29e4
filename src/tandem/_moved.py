"""Old import paths that moved: each keeps working for one release, with a DeprecationWarning.

A module that moved leaves a small module at its old path that star-imports the new one and
calls :func:`moved`, so that a script written against the old path runs and says where to go.

Example::

    # src/tandem/launch/meeting.py
    from tandem._moved import moved
    from tandem.job.checkin import *  # noqa: F403

    moved("tandem.launch.meeting", "tandem.job.checkin")
"""

from __future__ import annotations

import warnings

#: The release after which the old paths are removed.
UNTIL = "0.1"


def moved(old: str, new: str) -> None:
    """Warn (``DeprecationWarning``, pointing at the importer) that ``old`` is now ``new``."""
    warnings.warn(
        f"{old} moved to {new}; the old path goes away in the release after {UNTIL}",
        DeprecationWarning,
        stacklevel=3,
    )
