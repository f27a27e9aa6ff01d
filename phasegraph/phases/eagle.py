"""The declared EAGLE phase graph, built from its outline (:mod:`phasegraph.phases.outline`:
the edges, and the picture of the flow), with the phase functions of this package.

Building it checks the graph's rules (every phase reachable, schemas compatible on every edge,
...) and that each phase's name and schemas are the ones the outline declares.
"""

from __future__ import annotations

from phasegraph.phases.decode import decode
from phasegraph.phases.draft import draft
from phasegraph.phases.draft_extend import draft_extend
from phasegraph.phases.filter import filter_batch
from phasegraph.phases.finalize_tree_path import finalize_tree_path
from phasegraph.phases.merge import merge
from phasegraph.phases.outline import EAGLE_OUTLINE, EDGES
from phasegraph.phases.prefill_extend import prefill_extend
from phasegraph.phases.retract import retract
from phasegraph.phases.split import split
from phasegraph.phases.verify import verify
from phasegraph.statemachine import PhaseGraph

FUNCTIONS = (prefill_extend, draft_extend, draft, verify, finalize_tree_path, decode, merge, filter_batch, retract,
             split)


def build_eagle_graph() -> PhaseGraph:
    """Build (and check) the EAGLE phase graph."""
    return PhaseGraph.from_outline(EAGLE_OUTLINE, FUNCTIONS)


EAGLE_GRAPH = build_eagle_graph()
# the phases in the outline's order, each with its summary, for graphs built over them
PHASES = tuple(EAGLE_GRAPH)

__all__ = ["EAGLE_GRAPH", "EDGES", "PHASES", "build_eagle_graph"]
