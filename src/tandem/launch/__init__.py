"""Launching: the ``tandem run`` supervisor, rendezvous, elastic membership, SLURM, ssh, spawn.

Modules here import no torch: the launcher imports them before it starts any worker, and a
command line tool that takes seconds to print its help is a tool people stop using. The
command line itself (argument parsing) is :mod:`tandem.cli`; what a worker knows of its job
(its placement, host lists, the check-in, the job secret) is :mod:`tandem.job`, shared with
the workers and the doctor; nothing here imports :mod:`tandem.data`.
"""
