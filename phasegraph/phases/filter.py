"""filter: keep the chosen rows of the batch and free the KV of every other row."""

from __future__ import annotations

import torch

from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import DraftState, RowSelection
from phasegraph.statemachine import phase
from phasegraph.statemachine.rows import select_rows


@phase("filter")
def filter_batch(state: DraftState, ctx: SpecContext, *, keep: RowSelection) -> DraftState:
    """Drop finished or aborted requests: their pages and page-table rows go back to the pool."""
    B = state.seq_lens.shape[0]
    dropped = torch.ones(B, dtype=torch.bool, device=state.seq_lens.device)
    dropped[keep.rows] = False
    ctx.memory.release_rows(state.params.req_pool_idx[dropped])
    return select_rows(state, keep.rows)
