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

# Tiny CPU models: one thread avoids oversubscription on the 2-core CI machine (6x faster here).
torch.set_num_threads(1)
