"""tandem.doctor: what a job knows about its own collectives, to name a stuck or out-of-step rank.

- ``records``: every collective this process issued, in a bounded ring.
- ``hang``: a rank blocked in a collective for long asks every rank where it is and reports
  which rank never arrived, with its stacks.

Both start with the process group (``tandem.init()``, or the first tandem engine built on a
group made by hand): :func:`start`.
"""

from __future__ import annotations


def start() -> None:
    """Record every collective and watch for hangs from now on (idempotent).

    Example::

        dist.init_process_group("gloo")
        tandem.doctor.start()       # tandem.init() and tandem's engines call it for you
    """
    from tandem.doctor import hang, records

    records.install()
    hang.Reporter.start()
