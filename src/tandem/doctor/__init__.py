"""tandem.doctor: what a job knows about its own collectives, to name a stuck or out-of-step rank.

- ``records``: every collective this process issued, in a bounded ring.
- ``hang``: the one doctor thread of a process. It answers the other ranks; a rank blocked in
  a collective for long asks every rank where it is and reports which rank never arrived, with
  its stacks (``reports`` builds the text); when no rank has issued a collective for as long,
  one report says where each rank is.
- ``mismatch``: ranks whose collectives differ (op, shape, dtype) all raise
  ``CollectiveMismatchError`` within seconds, found by ``hang``'s check or, in strict mode, before
  each collective; ``aborts`` holds Gloo's abort on a size mismatch until they have.
- ``trace``: a timeline of every rank (Chrome trace JSON), ``tandem run --trace DIR``;
  ``trace_png`` draws one.
- ``steps`` and ``stragglers``: each rank's step times and time waiting in collectives, and
  the rank the others wait for, in ``tandem run``'s exit summary.

The records and the hang reports start with the process group (``tandem.init()``, or the first
tandem engine built on a group made by hand): :func:`start`, which also starts the trace when
``TANDEM_TRACE_DIR`` is set.
"""

from __future__ import annotations


def start() -> None:
    """Record every collective and watch for hangs from now on (idempotent).

    Example::

        dist.init_process_group("gloo")
        tandem.doctor.start()       # tandem.init() and tandem's engines call it for you
    """
    from tandem.doctor import hang, records, trace

    records.install()
    hang.Reporter.start()
    trace.start_from_env()  # `tandem run --trace DIR`: a timeline of this rank too
