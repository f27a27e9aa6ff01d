"""The speculative phases: schemas, one pure function per phase, and the declared EAGLE graph.

The names below are imported lazily, so that :mod:`phasegraph.phases.outline` (the graph's
declaration, which ``phasegraph graph`` draws) can be imported without torch.
"""

from __future__ import annotations

from phasegraph import lazy_getattr

_LAZY = {
    "SpecContext": "phasegraph.phases.context",
    "TreeShape": "phasegraph.phases.context",
    "check_tree_shape": "phasegraph.phases.context",
    "EAGLE_GRAPH": "phasegraph.phases.eagle",
    "build_eagle_graph": "phasegraph.phases.eagle",
    **dict.fromkeys(
        ("ACCEPTED", "NODE", "REQUEST", "TOKEN", "BatchParams", "DraftExtendInput", "DraftState",
         "FinalizedPath", "PrefillInput", "PrefillResult", "RowSelection", "TreeProposal", "VerifyResult",
         "finalized_schema_for", "node_fields"),
        "phasegraph.phases.schemas",
    ),
}

__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
