"""Fixtures of the launcher tests that build nodes as network namespaces."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.launch.netns_switch import can_make_switch, switch


@pytest.fixture
def net_of() -> Iterator:
    """``net_of(n)``: a switch of ``n`` nodes, removed at the end of the test; skips where
    network namespaces cannot be made (not root, no ``ip``)."""
    ok, reason = can_make_switch()
    if not ok:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        yield lambda n: stack.enter_context(switch(n))
