"""Fixtures of the engine tests: one session directory holding every tiny checkpoint."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine_root(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-checkpoints")
