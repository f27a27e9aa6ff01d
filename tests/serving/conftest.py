"""One demo engine per test process, shared by the serving tests: each wraps it in its own
AsyncEngine, and leaves it idle with every KV page free."""

from __future__ import annotations

import pytest

from tests.serving.support import assert_all_free, demo_engine


@pytest.fixture(scope="session")
def engine():
    return demo_engine()


@pytest.fixture
def idle_engine(engine):
    """The shared engine, checked idle and fully free after the test."""
    yield engine
    assert_all_free(engine)
