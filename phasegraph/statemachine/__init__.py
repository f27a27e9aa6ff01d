"""Generic typed phase-graph core: schemas, phases, the graph, machines, traces and renderers.

Nothing here knows about speculative decoding, and nothing here imports torch at import time.
"""

from phasegraph.statemachine.errors import (
    IllegalTransition,
    InvalidPhase,
    InvalidPhaseGraph,
    InvalidSchema,
    InvalidValidationMode,
    InvariantViolation,
    PaddingViolation,
    PhaseContractViolation,
    PhaseGraphError,
    RendererUnavailable,
    SchemaViolation,
    UnknownPhase,
)
from phasegraph.statemachine.graph import RULES, PhaseGraph
from phasegraph.statemachine.machine import Machine
from phasegraph.statemachine.modes import (
    ValidationMode,
    get_validation_mode,
    set_validation_mode,
    validation_mode,
)
from phasegraph.statemachine.outline import GraphOutline, PhaseOutline
from phasegraph.statemachine.phase import PhaseSpec, phase
from phasegraph.statemachine.schema import (
    Pad,
    Role,
    Schema,
    invariant,
    schema,
    schema_satisfies,
    tensor,
    value,
)
from phasegraph.statemachine.trace import Trace, Transition, add_listener, remove_listener

__all__ = [
    "RULES",
    "IllegalTransition",
    "InvalidPhase",
    "InvalidPhaseGraph",
    "InvalidSchema",
    "InvalidValidationMode",
    "InvariantViolation",
    "GraphOutline",
    "Machine",
    "PaddingViolation",
    "PhaseContractViolation",
    "PhaseGraph",
    "PhaseGraphError",
    "PhaseOutline",
    "PhaseSpec",
    "RendererUnavailable",
    "Pad",
    "Role",
    "Schema",
    "SchemaViolation",
    "Trace",
    "Transition",
    "UnknownPhase",
    "ValidationMode",
    "add_listener",
    "get_validation_mode",
    "invariant",
    "phase",
    "remove_listener",
    "schema",
    "schema_satisfies",
    "set_validation_mode",
    "tensor",
    "validation_mode",
    "value",
]
