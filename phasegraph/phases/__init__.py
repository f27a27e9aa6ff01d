"""The speculative phases: schemas, one pure function per phase, and the declared EAGLE graph."""

from phasegraph.phases.context import SpecContext, TreeShape, check_tree_shape
from phasegraph.phases.eagle import EAGLE_GRAPH, build_eagle_graph
from phasegraph.phases.schemas import (
    ACCEPTED,
    NODE,
    REQUEST,
    TOKEN,
    BatchParams,
    DraftExtendInput,
    DraftState,
    FinalizedPath,
    PrefillInput,
    PrefillResult,
    RowSelection,
    TreeProposal,
    VerifyResult,
    finalized_schema_for,
    node_fields,
)

__all__ = [
    "ACCEPTED",
    "EAGLE_GRAPH",
    "NODE",
    "REQUEST",
    "TOKEN",
    "BatchParams",
    "DraftExtendInput",
    "DraftState",
    "FinalizedPath",
    "PrefillInput",
    "PrefillResult",
    "RowSelection",
    "SpecContext",
    "TreeProposal",
    "TreeShape",
    "VerifyResult",
    "build_eagle_graph",
    "check_tree_shape",
    "finalized_schema_for",
    "node_fields",
]
