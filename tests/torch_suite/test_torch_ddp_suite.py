"""PyTorch's own DDP tests, run with tandem.DDP in place of torch's DistributedDataParallel.

Every test of torch's ``DistributedTest._DistTestBase`` (``torch/testing/_internal/
distributed/distributed_test.py``, Gloo, world size 2) that passes under both engines today
(``known.PASS_BOTH``), and the 14 of issue 25 whose behaviour tandem.DDP must match
(``known.BEHAVIOUR``), each as one pytest test here. docs/torch-ddp-suite.md has the whole
table; ``python -m tests.torch_suite`` re-measures it.

The torch tests run in batches: one runner process per group (``GROUPS``, one pytest-xdist
group each) imports torch's suite once and forks the two ranks of every test; the first test
of a group runs the batch and the others read their outcome from it. A failure names the
torch test's first error line and lists the whole batch. Each torch test has a 30 s
timeout, the batch ``BUDGET_S``.
"""

from __future__ import annotations

import time

import pytest

from tests.torch_suite import known
from tests.torch_suite.driver import Outcome, run_engine
from tests.torch_suite.runner import first_error_line

# Issue 25's behaviour tests that tandem.DDP does not pass yet. Strict: when a fix lands the
# test XPASSes, which fails the run until its name is taken out of here.
NOT_YET_PASSING: tuple[str, ...] = ()  # every behaviour test of issue 25 passes now

MUST_PASS = known.PASS_BOTH + known.BEHAVIOUR
GROUPS = 2
BUDGET_S = 200  # one group's batch (about 30 s on 2 cores)


def _group(name: str) -> int:
    return MUST_PASS.index(name) % GROUPS


_outcomes: dict[str, Outcome] = {}  # this pytest process's batches


def _outcome(name: str) -> tuple[Outcome, str]:
    group = [n for n in MUST_PASS if _group(n) == _group(name)]
    if name not in _outcomes:
        _outcomes.update(run_engine("tandem", group, budget_s=BUDGET_S))
    batch = "\n".join(_outcomes[n].line for n in group if n in _outcomes)
    return _outcomes[name], batch


def _param(name: str) -> object:
    marks = [pytest.mark.xdist_group(f"torch_suite_{_group(name)}")]
    if name in NOT_YET_PASSING:
        group, reason = known.TANDEM_FAILS[name]
        marks.append(pytest.mark.xfail(strict=True, reason=f"{group}: {reason}"))
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.distributed
@pytest.mark.timeout(BUDGET_S + 60)
@pytest.mark.parametrize("name", [_param(n) for n in MUST_PASS])
def test_passes_under_tandem(name: str) -> None:
    outcome, batch = _outcome(name)
    assert outcome.status == "pass", f"{outcome.line}\n\nthe whole batch under tandem.DDP:\n{batch}"
    # The swap reached the test: the ranks built tandem.DDP, not torch's class.
    assert outcome.constructed > 0, f"{name} passed without building tandem.DDP"


def test_constants_agree() -> None:
    assert set(NOT_YET_PASSING) <= set(known.BEHAVIOUR)
    assert not set(known.PASS_BOTH) & set(known.TANDEM_FAILS)
    assert len(set(MUST_PASS)) == len(MUST_PASS)


@pytest.mark.distributed
@pytest.mark.xdist_group("torch_suite_1")
def test_a_hanging_test_fails_at_its_timeout_and_the_batch_goes_on() -> None:
    started = time.monotonic()
    names = ["test_DistributedDataParallelCPU", "test_ddp_create_graph"]
    outcomes = run_engine("tandem", names, timeout_s=2, hang=True)
    elapsed = time.monotonic() - started
    for outcome in outcomes.values():
        assert outcome.status == "fail" and "timed out after" in outcome.message, outcome.line
    assert elapsed < 30, f"two hung tests took {elapsed:.0f} s to fail"


def test_first_error_line() -> None:
    report = (
        "Process 1 exited with error code 10 and exception:\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "    g()\n"
        "AttributeError: 'DistributedDataParallel' object has no attribute 'join'\n"
        "\n"
        "To execute this test, run the following from the base repo dir:\n"
        "Process 0 exited with error code 10 and exception:\n"
        "Traceback (most recent call last):\n"
        "ValueError: other\n"
    )
    assert first_error_line(report) == (
        "rank 1: AttributeError: 'DistributedDataParallel' object has no attribute 'join'"
    )
    assert first_error_line("RuntimeError: Process 0 terminated or timed out after 3 s") == (
        "RuntimeError: Process 0 terminated or timed out after 3 s"
    )
