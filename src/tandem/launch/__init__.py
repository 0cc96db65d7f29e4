"""Launching: reading the launcher's environment, SLURM hostlists, and (later) the CLI.

Modules here import no torch: the launcher imports them before it starts any worker, and a
command line tool that takes seconds to print its help is a tool people stop using.
"""
