"""pytest plugin ``phasegraph`` (entry point ``pytest11``). Loads without importing torch.

- ``--phasegraph-validate=strict|boundary|off`` sets the validation mode of every machine that
  has no mode of its own (default ``strict``: full schema checks and invariants in tests), in
  place of the ``PHASEGRAPH_VALIDATE`` environment variable;
- fixture ``phase_graph``: the declared EAGLE phase graph;
- fixture ``phase_trace``: a :class:`~phasegraph.testing.PhaseTraceRecorder` of every transition
  the test causes, with assertions such as ``assert_followed_by("verify", "finalize-tree-path")``;
- marker ``gpu``: tests that need CUDA, skipped where no GPU is present.
"""

from __future__ import annotations

import sys

import pytest

from phasegraph.statemachine.modes import ValidationMode, set_validation_mode
from phasegraph.testing.recorder import PhaseTraceRecorder

_OPTION = "--phasegraph-validate"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("phasegraph")
    group.addoption(
        _OPTION,
        action="store",
        default="strict",
        choices=[m.value for m in ValidationMode],
        help="validation mode for phasegraph machines during tests (default: strict)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped where none is present")
    set_validation_mode(config.getoption(_OPTION))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    if "torch" in sys.modules or _torch_installed():
        import torch

        if torch.cuda.is_available():
            return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine with -m gpu)")
    for item in gpu_items:
        item.add_marker(skip)


def _torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


@pytest.fixture
def phase_graph():
    """The declared EAGLE phase graph (imports torch on first use)."""
    from phasegraph.phases import EAGLE_GRAPH

    return EAGLE_GRAPH


@pytest.fixture
def phase_trace():
    """Records every phase transition of every machine during the test."""
    recorder = PhaseTraceRecorder().start()
    try:
        yield recorder
    finally:
        recorder.stop()
