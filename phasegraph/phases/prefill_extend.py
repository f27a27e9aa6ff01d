"""prefill-extend: the target reads new prompts and samples each request's first token."""

from __future__ import annotations

import torch

from phasegraph.kernels.logprobs import TokenLogprobs, token_logprobs
from phasegraph.kernels.penalties import count_tokens, prefill_token_counts
from phasegraph.kernels.random import PURPOSE_SAMPLE, counter_uniform, position_counter
from phasegraph.kernels.sampling import sample_tokens
from phasegraph.phases._common import (
    causal_extend_metadata,
    logprobs_if_asked,
    min_p_if_used,
    processed_logits,
    target_forward,
)
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

    Where a request uses penalties the phase makes the batch's count state (prompt presence and
    the counts of its output, :func:`prefill_token_counts`), penalises the first token's logits
    with it and counts the first token. Where a request asks for prompt logprobs the target
    scores every row, and row p's logprob is that of the token after position p. Routed
    experts (where asked) are those of each request's last prompt row.
    """
    params = state.params
    attn = causal_extend_metadata(ctx.memory, params.req_pool_idx, state.token_req, state.positions)
    every_row = ctx.prompt_logprobs is not None
    out = target_forward(ctx, state.input_ids, state.positions, attn,
                         None if every_row else state.select_index)
    raw = out.logits[state.select_index] if every_row else out.logits  # [B, V]
    counts = prompt = None
    if ctx.penalties:
        counts, prompt = prefill_token_counts(state.input_ids, state.positions, state.token_req,
                                              state.prompt_lens, raw.shape[1])
    logits = processed_logits(ctx, params, raw, counts, prompt, token_bitmask=state.token_bitmask)
    coins = counter_uniform(params.seed, position_counter(state.seq_lens, PURPOSE_SAMPLE))  # [B]
    sampled, finite, _ = sample_tokens(logits, params.temperature, params.top_k, params.top_p, coins, ctx.greedy_only,
                                       min_p_if_used(ctx, params), raw if logits is not raw else None)
    first = torch.where(state.forced_tokens >= 0, state.forced_tokens, sampled)  # [B]
    if counts is not None:
        counts = count_tokens(counts, first)
    first_lp = logprobs_if_asked(ctx, raw, first)
    routed = None if out.routed_experts is None else out.routed_experts[state.select_index]  # [B, M, Ke]
    lead = ctx.kv_lead
    # row p <- token p+1 (the wrap-around rows are overwritten by each request's first token)
    next_ids = state.input_ids.roll(-1).index_copy(0, state.select_index, first)
    prompt_lp = token_logprobs(out.logits, next_ids, ctx.prompt_logprobs) if every_row else None
    if lead == 0:
        ids, positions, token_req, select, features = (
            next_ids, state.positions, state.token_req, state.select_index, out.features)
    else:
        ids, positions, token_req, select, features = _rows_with_bonus(state, first, out.features)
        if prompt_lp is not None:  # onto the prompt's rows (the bonus rows hold 0)
            prompt_lp = TokenLogprobs(*(None if x is None else _onto_prompt_rows(state, x) for x in prompt_lp))
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
        output_counts=counts,
        prompt_mask=prompt,
        first_logprobs=first_lp.chosen,
        first_top_logprobs=first_lp.top,
        first_top_ids=first_lp.top_ids,
        prompt_logprobs=None if prompt_lp is None else prompt_lp.chosen,
        prompt_top_logprobs=None if prompt_lp is None else prompt_lp.top,
        prompt_top_ids=None if prompt_lp is None else prompt_lp.top_ids,
        logits_finite=finite,
        first_routed_experts=routed,
    )


def _onto_prompt_rows(state: PrefillInput, x: torch.Tensor) -> torch.Tensor:
    """Per-token values [T, ...] placed on the prompt rows of the lead-1 layout (T + B rows,
    :func:`_rows_with_bonus`); the bonus rows hold zeros."""
    B, T = state.seq_lens.shape[0], state.input_ids.shape[0]
    rows = torch.arange(T, device=x.device) + state.token_req  # [T] earlier bonus rows shift
    return x.new_zeros(T + B, *x.shape[1:]).index_copy(0, rows, x)


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
