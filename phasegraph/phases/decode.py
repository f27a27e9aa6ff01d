"""decode: one autoregressive step of the target alone (the baseline, ``method="none"``)."""

from __future__ import annotations

import torch

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.penalties import count_tokens
from phasegraph.kernels.random import PURPOSE_SAMPLE, counter_uniform, position_counter
from phasegraph.kernels.sampling import sample_tokens
from phasegraph.phases._common import (
    causal_extend_metadata,
    extend_draft,
    logprobs_if_asked,
    min_p_if_used,
    processed_logits,
    target_forward,
)
from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import DraftState
from phasegraph.statemachine import phase


@phase("decode")
def decode(state: DraftState, ctx: SpecContext) -> DraftState:
    """Commit each request's bonus token at position ``seq_len`` and sample the next one (with
    the batch's bias and penalties where a request uses them, then counting the new token).

    In a speculative engine an iteration without drafts runs this too, and extends the draft
    over the committed token as draft-extend would (one row per request: the new token with the
    target's feature of this step), so that the first draft after iterations without drafts
    starts from current candidates and a complete draft KV, as if it had drafted all along.

    A structured-output request's logits are masked by its grammar (XGrammar, Dong et al. 2024,
    arXiv 2411.15100) after its emitted tokens: the reference speculation must match."""
    params = state.params
    # token b is request b, at position seq_len (rows of distinct requests)
    attn = causal_extend_metadata(ctx.memory, params.req_pool_idx, None, state.seq_lens,
                                  one_query_per_row=True)
    out = target_forward(ctx, state.bonus_tokens, state.seq_lens, attn)
    raw = out.logits  # [B, V]
    # the grammar's masks after each request's emitted tokens (bonus included): host state, read
    # through the context as the models are (None: no request has structured output)
    bitmask = None if ctx.grammar is None else ctx.grammar.next_token_bitmask(raw.shape[0])  # [B, Vw]
    logits = processed_logits(ctx, params, raw, state.output_counts, state.prompt_mask, token_bitmask=bitmask)
    coins = counter_uniform(params.seed, position_counter(state.seq_lens + 1, PURPOSE_SAMPLE))  # [B]
    nxt, _, emitted = sample_tokens(logits, params.temperature, params.top_k, params.top_p, coins,
                                    ctx.greedy_only, min_p_if_used(ctx, params), raw if logits is not raw else None)
    lp = logprobs_if_asked(ctx, raw, nxt)
    topk_p, topk_index, hidden = state.topk_p, state.topk_index, state.hidden
    if ctx.draft is not None and ctx.tree is not None:
        topk_p, topk_index, hidden = _extend_draft(state, ctx, out.features, nxt, emitted, attn)
    return DraftState(
        params=params,
        seq_lens=state.seq_lens + 1,
        bonus_tokens=nxt,
        remaining=(state.remaining - 1).clamp(min=0),  # a finished row may run once more (overlap)
        topk_p=topk_p,
        topk_index=topk_index,
        hidden=hidden,
        output_counts=count_tokens(state.output_counts, emitted) if ctx.penalties else None,
        prompt_mask=state.prompt_mask if ctx.penalties else None,
        bonus_logprobs=lp.chosen,
        bonus_top_logprobs=lp.top,
        bonus_top_ids=lp.top_ids,
        bonus_routed_experts=out.routed_experts,  # [B, M, Ke] where asked: row b gave nxt[b]
        emitted=emitted,  # what the host appends: nxt, or NONFINITE_LOGITS
    )


def _extend_draft(state: DraftState, ctx: SpecContext, features: torch.Tensor, nxt: torch.Tensor,
                  emitted: torch.Tensor, attn: AttentionMetadata):
    """The draft extended over this step's committed row: the row of draft position
    ``seq_len + lead`` carries the new token (EAGLE kinds: with the target's feature at
    ``seq_len``, the position this step committed), as draft-extend lays out a path of one."""
    params = state.params
    B = nxt.shape[0]
    positions = state.seq_lens + ctx.kv_lead  # [B]
    if ctx.kv_lead:  # the target's rows sit one position behind the draft's
        attn = causal_extend_metadata(ctx.memory, params.req_pool_idx, None, positions, one_query_per_row=True)
    # the grammar's masks after the new token (a non-finite row's mark is no token)
    bitmask = None if ctx.grammar is None else ctx.grammar.next_token_bitmask_after(emitted[:, None])
    select = torch.arange(B, device=nxt.device)
    return extend_draft(ctx, nxt, features, positions, attn, select, bitmask)
