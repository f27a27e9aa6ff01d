"""merge: admit newly prefilled requests into the running batch."""

from __future__ import annotations

from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import DraftState
from phasegraph.statemachine import phase
from phasegraph.statemachine.rows import concat_rows


@phase("merge")
def merge(state: DraftState, ctx: SpecContext, *, other: DraftState) -> DraftState:
    """The running batch's rows followed by ``other``'s. Only draft states merge (SGLang #24859)."""
    return concat_rows(state, other)
