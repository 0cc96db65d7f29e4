"""tandem.doctor: what a job knows about its own collectives, to name a stuck or out-of-step rank.

- ``records``: every collective this process issued, in a bounded ring (always on after
  ``tandem.init()``).
"""
