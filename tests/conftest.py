"""Shared fixtures. The phasegraph pytest plugin (strict validation) is active in every test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def engine_root(tmp_path_factory):
    """One session directory holding every tiny checkpoint of the engine tests."""
    return tmp_path_factory.mktemp("engine-checkpoints")


@pytest.fixture(scope="session")
def engine():
    """One demo engine per test process, shared by the serving tests: each wraps it in its own
    AsyncEngine, and leaves it idle with every KV page free (``idle_engine`` checks)."""
    from tests.serving.support import demo_engine  # the serving tests' imports, only where used

    return demo_engine()


@pytest.fixture
def idle_engine(engine):
    """The shared engine, checked idle and fully free after the test."""
    from tests.serving.support import assert_all_free

    yield engine
    assert_all_free(engine)


# Tiny CPU models: one thread avoids oversubscription on the 2-core CI machine (6x faster here).
torch.set_num_threads(1)
