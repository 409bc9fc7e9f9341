"""Fixtures of the tests of ctxpool/."""

from __future__ import annotations

import pytest


@pytest.fixture
def loop():
    """A :class:`tests.ctxpool.pool_driver.Loop` whose pools are shut down after the test; then no segment
    or worker process may be left."""
    from tests.ctxpool.pool_driver import checked_loop
    yield from checked_loop()


@pytest.fixture
def examples():
    """Factory: ``examples(*tensors)`` -> refs to an example input kept in a segment until the test ends."""
    from tests.ctxpool.pool_driver import example_maker
    yield from example_maker()
