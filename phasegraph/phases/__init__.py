"""The speculative phases: schemas, one pure function per phase, and the declared EAGLE graph.

The names below are imported lazily, so that :mod:`phasegraph.phases.outline` (the graph's
declaration, which ``phasegraph graph`` draws) can be imported without torch.
"""

from __future__ import annotations

import importlib

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


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phasegraph.phases' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
