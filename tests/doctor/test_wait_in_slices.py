"""``mismatch.wait_in_slices``: a slice that runs out is not an error unless the work failed.

Gloo's ``Work.wait(timeout)`` throws "timed out" both when the slice runs out and when the
collective itself fails by its own timeout; only the work's completion tells them apart. A work
that completes between the slice running out and the look at it has succeeded (a loaded machine
makes that window real): the wait must return, not raise the slice's timeout. Fakes stand in
for the Work: the window cannot be hit on purpose with a real collective.
"""

from __future__ import annotations

import pytest

from tandem.doctor import mismatch


class _Work:
    """A Work whose first ``slices`` timed waits run out; done after ``done_after`` of them."""

    def __init__(self, slices: int, done_after: int, error: str | None = None) -> None:
        self.slices, self.done_after, self.error = slices, done_after, error
        self.timed_waits = 0

    def wait(self, timeout: object = None) -> bool:
        if timeout is None:  # the plain wait: the collective's own outcome
            if self.error is not None:
                raise RuntimeError(self.error)
            return True
        self.timed_waits += 1
        if self.timed_waits <= self.slices:
            raise RuntimeError("Operation timed out!")
        return self.wait()

    def is_completed(self) -> bool:
        return self.timed_waits >= self.done_after


def test_work_done_just_after_its_slice_ran_out_returns():
    work = _Work(slices=3, done_after=3)  # the third slice runs out, then the work is done
    mismatch.wait_in_slices(work)
    assert work.timed_waits == 3


def test_slices_repeat_until_the_work_is_done():
    work = _Work(slices=2, done_after=10)
    mismatch.wait_in_slices(work)
    assert work.timed_waits == 3  # two ran out, the third returned


def test_a_failed_work_raises_its_own_error():
    work = _Work(slices=1, done_after=1, error="Connection closed by peer")
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        mismatch.wait_in_slices(work)
