"""verify: the target scores every tree node in one forward and accepts the best path."""

from __future__ import annotations

import torch
from jaxtyping import Int32, Int64
from torch import Tensor

from phasegraph.kernels.argmax import argmax_finite, row_max_finite
from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.bonus import fill_bonus_tokens
from phasegraph.kernels.cache_slots import span_slots_and_rows
from phasegraph.kernels.penalties import token_bitmask_allows
from phasegraph.kernels.random import (
    PURPOSE_ACCEPT,
    PURPOSE_BONUS,
    counter_uniform,
    position_counter,
)
from phasegraph.kernels.simulated_accept import verify_tree_simulated
from phasegraph.kernels.tree_sampling import target_probs, verify_tree_sampling
from phasegraph.kernels.verify_greedy import verify_tree_greedy
from phasegraph.phases._common import (
    logprobs_if_asked,
    min_p_if_used,
    processed_logits,
    target_forward,
)
from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import TreeProposal, VerifyResult
from phasegraph.statemachine import phase


@phase("verify")
def verify(state: TreeProposal, ctx: SpecContext) -> VerifyResult:
    """Tree verification (SpecInfer, arXiv 2305.09781; EAGLE-2, arXiv 2406.16858).

    Node j of request b is written at logical position ``seq_len + j`` of its row and attends
    the prefix plus its ancestors (tree mask). Greedy requests accept the longest path whose
    tokens equal the target's argmax; sampled requests use lossless tree rejection sampling
    (Leviathan et al., arXiv 2211.17192, with the draft treated as deterministic), so the
    emitted tokens are distributed exactly as the target's.

    Logit bias and penalties apply per node from its own ancestry: node j predicts the token
    after the path root..j, so it is penalised with the request's output counts plus the tokens
    drafted on that path (:func:`~phasegraph.kernels.penalties.apply_penalties`); min_p
    processes each node's own row. Sampling stays lossless for the processed distributions.
    Logprobs are the target's raw ones at every node, and routed experts (where asked) those of
    every node's row, in node order: finalize compacts both along the path (SGLang #26866).

    Structured output: where the tree carries grammar masks (``token_bitmask``, XGrammar, Dong
    et al. 2024, arXiv 2411.15100), node j's processed logits allow only the tokens the grammar
    allows after the request's emitted tokens plus node j's path, so a drafted token the grammar
    forbids is never accepted and the target's distribution is the constrained one.

    A request's ``draft_cap`` c (where the batch has caps) cuts the first-child links of its
    nodes at depth >= c before verification, so no path accepts more than c drafts and the node
    at depth c draws its token as if it had no children (c = 0: exactly one target token).
    """
    memory = ctx.memory
    draft_state = state.draft
    params = draft_state.params
    B, N = state.depth.shape
    S = state.num_steps
    device = state.depth.device
    seq_lens = draft_state.seq_lens  # [B]
    # node j at logical position seq_len + j; its request's row and prefix length (one launch)
    span = span_slots_and_rows(memory.page_table, params.req_pool_idx, seq_lens, N, memory.page_size)
    attn = AttentionMetadata(
        write_slots=span.slots.reshape(-1),  # [B*N]
        page_table=memory.page_table,
        query_row=span.rows,  # [B*N] req_pool_idx[b] per node
        kv_len=span.starts,  # [B*N] seq_lens[b] per node
        extra_mask=state.tree_mask.reshape(B * N, N),
        page_size=memory.page_size,
        tree_block_writes=True,  # node j of each row's N writes position seq_len + j
    )
    next_token = state.retrieve_next_token  # [B, N]
    if params.draft_cap is not None:  # children below a request's cap are never tried
        next_token = torch.where(state.depth < params.draft_cap[:, None], next_token, -1)
    out = target_forward(ctx, state.draft_tokens, state.positions, attn)
    raw = out.logits  # [B*N, V]
    logits = processed_logits(ctx, params, raw, draft_state.output_counts, draft_state.prompt_mask,
                              state.draft_tokens, state.tree_mask, state.token_bitmask)
    if ctx.simulate_accept_drafts is not None or ctx.greedy_only:
        greedy, finite, _ = argmax_finite(logits)  # [B*N] each
        if logits is not raw:  # processed logits are clamped finite: the model's say what was not
            finite = row_max_finite(raw)
        if ctx.simulate_accept_drafts is not None:  # benchmark mode, labelled as such by the engine
            if state.token_bitmask is not None:  # accepting drafts blindly must not pass the grammar
                next_token = _links_the_grammar_allows(state.token_bitmask, state.draft_tokens, next_token)
            outcome = verify_tree_simulated(
                state.draft_tokens, next_token, greedy, S, ctx.simulate_accept_drafts,
            )
        else:
            outcome = verify_tree_greedy(
                state.draft_tokens, next_token, state.retrieve_next_sibling, greedy, S,
            )
    else:
        finite = row_max_finite(raw)  # [B*N]
        probs = target_probs(logits, params.temperature, params.top_k, params.top_p, N,
                             min_p_if_used(ctx, params))
        # the coins that choose the token at position seq_len + d + 1 (after depth d)
        chosen = seq_lens[:, None] + 1 + torch.arange(S + 1, device=device)  # [B, S+1]
        coins = counter_uniform(params.seed, position_counter(chosen, PURPOSE_ACCEPT))
        bonus_coins = counter_uniform(params.seed, position_counter(chosen, PURPOSE_BONUS))
        outcome = verify_tree_sampling(
            state.draft_tokens, next_token, state.retrieve_next_sibling,
            probs, coins, bonus_coins, S,
        )
    lp = logprobs_if_asked(ctx, raw, outcome.predict)
    return VerifyResult(
        proposal=state,
        predict=outcome.predict,
        features=out.features,
        logprobs=lp.chosen,
        top_logprobs=lp.top,
        top_logprob_ids=lp.top_ids,
        routed_experts=out.routed_experts,  # [B*N, M, Ke] where asked
        accept_index=outcome.accept_index,
        accept_lens=outcome.accept_lens,
        bonus_tokens=fill_bonus_tokens(outcome.predict, outcome.accept_index, outcome.accept_lens),
        logits_finite=finite.view(B, N),
    )


def _links_the_grammar_allows(
    token_bitmask: Int32[Tensor, "BN Vw"],
    draft_tokens: Int64[Tensor, "BN"],
    next_token: Int64[Tensor, "B N"],
) -> Int64[Tensor, "B N"]:
    """``next_token`` with each first-child link cut whose child's token the grammar forbids
    after the parent's path (mask row j: the tokens allowed after node j). Simulated acceptance
    takes drafts whatever they are, and a draft row the grammar leaves nothing in keeps its
    unmasked logits, so without the cut a forbidden token could be emitted."""
    B, N = next_token.shape
    rows = torch.arange(B * N, device=next_token.device)  # [B*N] node j of request b: b*N + j
    child = draft_tokens.view(B, N).gather(1, next_token.clamp(min=0)).reshape(-1)  # [B*N]
    allowed = token_bitmask_allows(token_bitmask, rows, child).view(B, N)
    return torch.where((next_token >= 0) & allowed, next_token, -1)
