"""prefill-extend: the target reads new prompts and samples each request's first token."""

from __future__ import annotations

import torch

from phasegraph.kernels.random import PURPOSE_SAMPLE, counter_uniform, position_counter
from phasegraph.kernels.sampling import sample_tokens
from phasegraph.phases._common import causal_extend_metadata
from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import PrefillInput, PrefillResult
from phasegraph.statemachine import phase


@phase("prefill-extend", input=PrefillInput, output=PrefillResult)
def prefill_extend(state: PrefillInput, ctx: SpecContext) -> PrefillResult:
    """Run the target over the prompts (writing their KV) and sample the first new token.

    The result is draft-extend's input: row p of a prompt carries token p+1 and the target's
    feature at p; the last row carries the sampled token (EAGLE, arXiv 2401.15077, §3).
    """
    params = state.params
    rows = params.req_pool_idx[state.token_req]  # [T]
    attn = causal_extend_metadata(ctx.memory, rows, state.positions)
    out = ctx.target.forward(state.input_ids, state.positions, attn, logits_index=state.select_index)
    logits = out.logits  # [B, V]
    coins = counter_uniform(params.seed, position_counter(state.seq_lens, PURPOSE_SAMPLE))  # [B]
    first = sample_tokens(logits, params.temperature, params.top_k, params.top_p, coins, ctx.greedy_only)
    shifted = state.input_ids.roll(-1)  # row p <- token p+1 (the wrap-around rows are overwritten)
    shifted = shifted.index_copy(0, state.select_index, first)
    first_logprobs = None
    if ctx.return_logprobs:
        first_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, first[:, None])[:, 0]
    return PrefillResult(
        params=params,
        input_ids=shifted,
        positions=state.positions,
        features=out.features,
        token_req=state.token_req,
        select_index=state.select_index,
        seq_lens=state.seq_lens,
        bonus_tokens=first,
        remaining=state.remaining - 1,
        first_logprobs=first_logprobs,
    )
