"""draft-extend: the draft reads the newly committed tokens and proposes depth-1 candidates."""

from __future__ import annotations

import torch

from phasegraph.phases._common import causal_extend_metadata, extend_draft
from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import DraftExtendInput, DraftState
from phasegraph.statemachine import phase


@phase("draft-extend")
def draft_extend(state: DraftExtendInput, ctx: SpecContext) -> DraftState:
    """Extend the draft's KV over the committed rows and take the top-k of each request's last row.

    After prefill the rows are the prompt; after decode they are the accepted path compacted to
    the front (rows past a request's accept length are padding that writes only behind its
    committed length). Without a draft (the autoregressive baseline) the state carries K = 0.
    A structured-output request's candidates are those its grammar allows after its new tokens.
    """
    params = state.params
    B = state.seq_lens.shape[0]
    device = state.seq_lens.device
    if ctx.draft is None or ctx.tree is None:
        empty_p = torch.zeros(B, 0, dtype=torch.float32, device=device)
        empty_i = torch.zeros(B, 0, dtype=torch.int64, device=device)
        return DraftState(
            params=params, seq_lens=state.seq_lens, bonus_tokens=state.bonus_tokens,
            remaining=state.remaining, topk_p=empty_p, topk_index=empty_i, hidden=None,
            output_counts=state.output_counts, prompt_mask=state.prompt_mask,
        )
    attn = causal_extend_metadata(ctx.memory, params.req_pool_idx, state.token_req, state.positions)
    bitmask = None
    if ctx.grammar is not None:  # the grammar after the tokens this phase's input emitted
        emitted = getattr(state, "emitted", None)  # [B, W] after verify; after prefill the first token
        bitmask = ctx.grammar.next_token_bitmask_after(emitted if emitted is not None else state.bonus_tokens[:, None])
    topk_p, topk_ids, hidden = extend_draft(ctx, state.input_ids, state.features, state.positions, attn,
                                            state.select_index, bitmask)
    return DraftState(
        params=params,
        seq_lens=state.seq_lens,
        bonus_tokens=state.bonus_tokens,
        remaining=state.remaining,
        topk_p=topk_p,
        topk_index=topk_ids,
        hidden=hidden,
        output_counts=state.output_counts,  # the penalty state rides along (None when unused)
        prompt_mask=state.prompt_mask,
    )
