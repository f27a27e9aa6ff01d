"""The declared EAGLE phase graph.

::

    prefill-extend -> draft-extend -> DraftState
    DraftState -> draft -> verify -> finalize-tree-path -> draft-extend -> DraftState
    DraftState -> decode -> DraftState                      (target alone, the baseline)
    DraftState -> merge | filter | retract -> DraftState    (scheduler operations)

Only phases that output a :class:`DraftState` lead to the scheduler operations, so a verify
result can never reach merge (SGLang #24859), and verify is always followed by finalize-tree-path,
which always leads to draft-extend (no phase is skipped when every request finishes).
"""

from __future__ import annotations

from phasegraph.phases.decode import decode
from phasegraph.phases.draft import draft
from phasegraph.phases.draft_extend import draft_extend
from phasegraph.phases.filter import filter_batch
from phasegraph.phases.finalize_tree_path import finalize_tree_path
from phasegraph.phases.merge import merge
from phasegraph.phases.prefill_extend import prefill_extend
from phasegraph.phases.retract import retract
from phasegraph.phases.verify import verify
from phasegraph.statemachine import PhaseGraph

PHASES = (
    prefill_extend,
    draft_extend,
    draft,
    verify,
    finalize_tree_path,
    decode,
    merge,
    filter_batch,
    retract,
)

#: Phases that produce a DraftState, and the phases a DraftState may go to.
DRAFT_STATE_SOURCES = ("draft-extend", "decode", "merge", "filter", "retract")
DRAFT_STATE_TARGETS = ("draft", "decode", "merge", "filter", "retract")

EDGES = (
    ("prefill-extend", "draft-extend"),
    ("draft", "verify"),
    ("verify", "finalize-tree-path"),
    ("finalize-tree-path", "draft-extend"),
    *((a, b) for a in DRAFT_STATE_SOURCES for b in DRAFT_STATE_TARGETS),
)


def build_eagle_graph() -> PhaseGraph:
    """Build (and check) the EAGLE phase graph."""
    return PhaseGraph("eagle", PHASES, EDGES, entry="prefill-extend")


EAGLE_GRAPH = build_eagle_graph()
