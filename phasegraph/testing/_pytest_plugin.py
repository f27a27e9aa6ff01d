"""pytest plugin ``phasegraph`` (entry point ``pytest11``). Loads without importing torch.

- ``--phasegraph-validate=strict|boundary|off`` sets the validation mode of every machine that
  has no mode of its own (default ``strict``: full schema checks and invariants in tests), in
  place of the ``PHASEGRAPH_VALIDATE`` environment variable;
- fixture ``phase_graph``: the declared EAGLE phase graph;
- fixture ``phase_trace``: a :class:`~phasegraph.testing.PhaseTraceRecorder` of every transition
  the test causes, with assertions such as ``assert_followed_by("verify", "finalize-tree-path")``;
- marker ``gpu``: tests that need CUDA, skipped where no GPU is present;
- ``--phasegraph-coverage``: at the end, for each phase graph the tests ran, the edges they
  took and those they never did (under pytest-xdist too: the workers' counts are summed).
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from phasegraph.statemachine.modes import ValidationMode, set_validation_mode
from phasegraph.statemachine.trace import Transition, add_listener, remove_listener
from phasegraph.testing.recorder import PhaseTraceRecorder

_OPTION = "--phasegraph-validate"
_COVERAGE = "--phasegraph-coverage"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("phasegraph")
    group.addoption(
        _OPTION,
        action="store",
        default="strict",
        choices=[m.value for m in ValidationMode],
        help="validation mode for phasegraph machines during tests (default: strict)",
    )
    group.addoption(_COVERAGE, action="store_true",
                    help="report the edges of each phase graph the tests took, and those never taken")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped where none is present")
    set_validation_mode(config.getoption(_OPTION))
    if config.getoption(_COVERAGE):
        config.pluginmanager.register(_EdgeCoverage(), "phasegraph-coverage")


class _EdgeCoverage:
    """Counts the (graph, source, target) transitions of every machine; the controller of an
    xdist run sums its workers' counts. Edges are those of the graph declared last under each
    name, sent along by the workers (the controller may never import the graphs)."""

    def __init__(self) -> None:
        self.taken: Counter[tuple[str, str, str]] = Counter()
        self.edges: dict[str, set[tuple[str, str]]] = {}

    def pytest_sessionstart(self) -> None:
        add_listener(self._on_transition)

    def _on_transition(self, t: Transition) -> None:
        if t.source is not None:
            self.taken[(t.graph, t.source, t.target)] += 1

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from phasegraph.statemachine.graph import declared_edges  # (its module reaches torch)

        remove_listener(self._on_transition)
        for graph in {g for g, _, _ in self.taken}:
            self.edges.setdefault(graph, set()).update(declared_edges(graph) or ())
        out = getattr(session.config, "workeroutput", None)
        if out is not None:  # an xdist worker: its counts go to the controller
            out["phasegraph_edges"] = ([[*k, n] for k, n in self.taken.items()],
                                       {g: sorted(map(list, e)) for g, e in self.edges.items()})

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        taken, edges = getattr(node, "workeroutput", {}).get("phasegraph_edges", ([], {}))
        for graph, source, target, n in taken:
            self.taken[(graph, source, target)] += n
        for graph, pairs in edges.items():
            self.edges.setdefault(graph, set()).update(map(tuple, pairs))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(terminalreporter.config, "workeroutput"):
            return
        terminalreporter.section("phasegraph edge coverage")
        if not self.taken:
            terminalreporter.write_line("no phase graph ran")
        for graph in sorted(self.edges):
            edges = self.edges[graph]
            taken = {(s, t) for g, s, t in self.taken if g == graph}
            never = sorted(edges - taken)
            line = f"{graph}: {len(edges & taken)}/{len(edges)} edges taken"
            terminalreporter.write_line(line + (f"; never: {', '.join(f'{s} -> {t}' for s, t in never)}" if never else ""))


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
