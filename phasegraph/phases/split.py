"""split: take some rows of the running batch as a group of their own, keeping every row's KV."""

from __future__ import annotations

from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import DraftState, RowSelection
from phasegraph.statemachine import phase
from phasegraph.statemachine.rows import select_rows


@phase("split")
def split(state: DraftState, ctx: SpecContext, *, keep: RowSelection) -> DraftState:
    """The rows ``keep`` as a batch. Unlike filter nothing is freed: the scheduler runs each
    group of a batch in its own shape (one group held to fewer drafts or none) and merges the
    groups back after the iteration."""
    return select_rows(state, keep.rows)
