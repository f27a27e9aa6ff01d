"""Shared fixtures. The phasegraph pytest plugin (strict validation) is active in every test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
