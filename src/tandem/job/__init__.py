"""What a process knows of its job, read the same way by the launcher, the workers and the doctor.

- ``placement``: where this process sits (rank, local rank, world size, node), from torchrun's,
  SLURM's or OpenMPI's environment, by a pure function;
- ``hostlist``: SLURM's compressed host lists expanded;
- ``checkin``: the workers' check-in at start (every rank arrives, or a bad environment fails
  fast and names itself) and check-out at the end;
- ``secret``: the job's secret, under which its store keys live;
- ``join``: a replacement worker asking to join a job that recovers in memory.

This package imports no torch at import time (the launcher uses it before any worker starts)
and nothing from :mod:`tandem.launch`, :mod:`tandem.doctor` or :mod:`tandem.data`: those
import it.

Example::

    from tandem.job.placement import placement_from_env
    placement = placement_from_env(os.environ)   # placement.rank, placement.world_size, ...
"""
