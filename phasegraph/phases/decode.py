"""decode: one autoregressive step of the target alone (the baseline, ``method="none"``)."""

from __future__ import annotations

import torch

from phasegraph.kernels.random import PURPOSE_SAMPLE, counter_uniform, position_counter
from phasegraph.kernels.sampling import sample_tokens
from phasegraph.phases._common import causal_extend_metadata
from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import DraftState
from phasegraph.statemachine import phase


@phase("decode")
def decode(state: DraftState, ctx: SpecContext) -> DraftState:
    """Commit each request's bonus token at position ``seq_len`` and sample the next one."""
    params = state.params
    # token b is request b, at position seq_len (rows of distinct requests)
    attn = causal_extend_metadata(ctx.memory, params.req_pool_idx, None, state.seq_lens,
                                  one_query_per_row=True)
    out = ctx.target.forward(state.bonus_tokens, state.seq_lens, attn, logits_index=None)
    coins = counter_uniform(params.seed, position_counter(state.seq_lens + 1, PURPOSE_SAMPLE))  # [B]
    nxt, _, emitted = sample_tokens(out.logits, params.temperature, params.top_k, params.top_p, coins,
                                    ctx.greedy_only)
    logprobs = None
    if ctx.return_logprobs:
        logprobs = torch.log_softmax(out.logits.float(), dim=-1).gather(1, nxt[:, None])[:, 0]
    return DraftState(
        params=params,
        seq_lens=state.seq_lens + 1,
        bonus_tokens=nxt,
        remaining=(state.remaining - 1).clamp(min=0),  # a finished row may run once more (overlap)
        topk_p=state.topk_p,
        topk_index=state.topk_index,
        hidden=None,
        bonus_logprobs=logprobs,
        emitted=emitted,  # what the host appends: nxt, or NONFINITE_LOGITS
    )
