"""Tests marked ``cuda`` run only where a CUDA device is visible.

Every module in this folder sets ``pytestmark = pytest.mark.cuda``. On a machine without a GPU
each such test is skipped with the reason; ``TANDEM_CUDA_ON_CPU=1`` runs them on the CPU
instead (a rehearsal of their logic, see ``gpu.py``). ``ci/gpu/run`` runs them on the GPU
machine with ``pytest -m cuda``.
"""

from __future__ import annotations

import pytest

from tests.cuda import gpu


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu.have_cuda() or gpu.ON_CPU:
        return
    skip = pytest.mark.skip(
        reason="no CUDA device visible (ci/gpu/run runs these on the GPU machine; "
        "TANDEM_CUDA_ON_CPU=1 rehearses them on the CPU)"
    )
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
