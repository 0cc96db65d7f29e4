"""Launching: the launcher's environment, SLURM, the worker supervisor, spawn and rendezvous.

Modules here import no torch: the launcher imports them before it starts any worker, and a
command line tool that takes seconds to print its help is a tool people stop using. The
command line itself (argument parsing) is :mod:`tandem.cli`; nothing here imports
:mod:`tandem.data`.
"""
