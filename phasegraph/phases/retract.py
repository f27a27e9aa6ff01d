"""retract: give back everything some requests hold, so the rest fit in the KV pool."""

from __future__ import annotations

import torch

from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import DraftState, RowSelection
from phasegraph.statemachine import phase
from phasegraph.statemachine.rows import select_rows


@phase("retract")
def retract(state: DraftState, ctx: SpecContext, *, rows: RowSelection) -> DraftState:
    """Free every page (over-allocation and draft branch regions included) and the page-table
    row of each request in ``rows``; the scheduler requeues them to resume from their prompt
    plus the tokens they already emitted."""
    B = state.seq_lens.shape[0]
    keep = torch.ones(B, dtype=torch.bool, device=state.seq_lens.device)
    keep[rows.rows] = False
    ctx.memory.release_rows(state.params.req_pool_idx[rows.rows])
    return select_rows(state, keep.nonzero()[:, 0])
