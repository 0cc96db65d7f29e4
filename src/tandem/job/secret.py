"""The job's secret: the store keys of its launchers and workers live under a name made from it.

``TANDEM_JOB_SECRET`` is shared by every node of a job (``tandem slurm`` and ``tandem run
--hostfile`` make one when it is unset); the keys that the launchers and ``tandem.init`` write
in the job's TCPStore live under a prefix derived from it, so a client without the secret can
neither read them nor forge one (a "failed" key that would stop the job). Imports no torch.

Example::

    prefix = f"/worker/{key_scope()}attempt_0"   # the same on every process of the job
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

#: A secret every node of a job shares (``tandem slurm`` makes one per job): the store keys of
#: the launchers and of ``tandem.init`` live under a name derived from it, so a client without it
#: can neither read them nor forge one (a "failed" key that would stop the job).
SECRET_VARIABLE = "TANDEM_JOB_SECRET"


def key_scope(environ: Mapping[str, str] = os.environ) -> str:
    """The store-key prefix the job's secret gives (``""`` without one); never the secret itself.

    Example::

        >>> key_scope({"TANDEM_JOB_SECRET": "s3cret"})
        'job-1ec1c26b50d5d3c58d9583181af80766/'
        >>> key_scope({})
        ''
    """
    secret = environ.get(SECRET_VARIABLE)
    if not secret:
        return ""
    return f"job-{hashlib.sha256(secret.encode()).hexdigest()[:32]}/"
