"""prefill-extend: the target reads new prompts and samples each request's first token."""

from __future__ import annotations

import torch

from phasegraph.kernels.random import PURPOSE_SAMPLE, counter_uniform, position_counter
from phasegraph.kernels.sampling import sample_tokens
from phasegraph.phases._common import causal_extend_metadata
from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import PrefillInput, PrefillResult
from phasegraph.statemachine import phase


@phase("prefill-extend")
def prefill_extend(state: PrefillInput, ctx: SpecContext) -> PrefillResult:
    """Run the target over the prompts (writing their KV) and sample the first new token.

    The result is draft-extend's input. For EAGLE kinds (KV lead 0) row p of a prompt carries
    token p+1 and the target's feature at p; the last row carries the sampled token (EAGLE,
    arXiv 2401.15077, §3). For a standalone draft (lead 1) row p carries token p at its own
    position and one more row per request carries the sampled token. A resumed request's first
    token is forced to the bonus token it had emitted before its retraction.
    """
    params = state.params
    attn = causal_extend_metadata(ctx.memory, params.req_pool_idx, state.token_req, state.positions)
    out = ctx.target.forward(state.input_ids, state.positions, attn, logits_index=state.select_index)
    logits = out.logits  # [B, V]
    coins = counter_uniform(params.seed, position_counter(state.seq_lens, PURPOSE_SAMPLE))  # [B]
    sampled, finite, _ = sample_tokens(logits, params.temperature, params.top_k, params.top_p, coins, ctx.greedy_only)
    first = torch.where(state.forced_tokens >= 0, state.forced_tokens, sampled)  # [B]
    first_logprobs = None
    if ctx.return_logprobs:
        first_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, first[:, None])[:, 0]
    lead = ctx.kv_lead
    if lead == 0:
        ids = state.input_ids.roll(-1)  # row p <- token p+1 (the wrap-around rows are overwritten)
        ids = ids.index_copy(0, state.select_index, first)
        positions, token_req, select, features = state.positions, state.token_req, state.select_index, out.features
    else:
        ids, positions, token_req, select, features = _rows_with_bonus(state, first, out.features)
    return PrefillResult(
        params=params,
        input_ids=ids,
        positions=positions,
        features=features,
        token_req=token_req,
        select_index=select,
        seq_lens=state.seq_lens,
        bonus_tokens=first,
        remaining=state.remaining - 1,
        lead=lead,
        first_logprobs=first_logprobs,
        logits_finite=finite,
    )


def _rows_with_bonus(state: PrefillInput, first: torch.Tensor, features: torch.Tensor):
    """Lead-1 rows: every prompt token at its own position, then one row per request carrying
    the first sampled token at position seq_len (T + B rows)."""
    B = state.seq_lens.shape[0]
    T = state.input_ids.shape[0]
    device = state.input_ids.device
    b = torch.arange(B, device=device)
    prompt_rows = torch.arange(T, device=device) + state.token_req  # [T] earlier bonus rows shift
    bonus_rows = state.select_index + b + 1  # [B]
    ids = torch.empty(T + B, dtype=torch.int64, device=device)
    ids[prompt_rows] = state.input_ids
    ids[bonus_rows] = first
    positions = torch.empty_like(ids)
    positions[prompt_rows] = state.positions
    positions[bonus_rows] = state.seq_lens
    token_req = torch.empty_like(ids)
    token_req[prompt_rows] = state.token_req
    token_req[bonus_rows] = b
    feats = features.new_zeros(T + B, features.shape[1])
    feats[prompt_rows] = features
    return ids, positions, token_req, bonus_rows, feats
