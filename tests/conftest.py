"""Collection for the test suite, which also runs the library's doctests.

The test command runs with ``--doctest-modules`` (pyproject.toml), and pytest then imports
every ``.py`` file it collects. Under ``tests/`` only the test modules (and packages) are
collected: the other files are programs the tests start (``launch/workers.py`` reads its mode
from ``sys.argv`` at import) or helpers the tests import themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recovery.chains import Chains


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    name = collection_path.name
    if collection_path.suffix != ".py" or name in ("__init__.py", "conftest.py"):
        return None
    return None if name.startswith("test_") else True


@pytest.fixture(autouse=True)
def _reports_in_tmp(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hang, step and checkpoint reports go to a temporary folder, never into the checkout.

    A test that wants them sets ``TANDEM_REPORT_DIR`` itself (it overrides this one).
    """
    monkeypatch.setenv("TANDEM_REPORT_DIR", str(tmp_path_factory.mktemp("reports")))


@pytest.fixture(scope="session")
def chains(tmp_path_factory: pytest.TempPathFactory) -> Chains:
    """The recovery tests' oracle chains (:mod:`tests.recovery.chains`), each distinct one run
    once a session in this pytest worker, the missing ones of a batch in one launch."""
    return Chains(tmp_path_factory.mktemp("chains"))
