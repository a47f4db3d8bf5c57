"""Fixtures for the whole suite."""

from __future__ import annotations

import pytest


@pytest.fixture
def forked_launch():
    """For this test, quietsync's local launcher forks its workers from the test harness's forkserver instead of
    spawning fresh interpreters (tests/launcher.py: same worker code, same failure report; not for tests of the
    launcher's processes)."""
    from tests.launcher import forked_launcher

    with forked_launcher():
        yield
