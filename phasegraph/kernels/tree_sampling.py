"""Target-probability processing and lossless token-tree rejection sampling, torch reference.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192) generalised to token trees
(SpecInfer, arXiv 2305.09781), in the target-only form of SGLang's
``TreeSpeculativeSamplingTargetOnly``: the draft tree is treated as deterministic, so only the
target distribution p enters. At each depth the children x_1..x_m of the last accepted node are
tried in sibling order with one uniform coin u: child i is accepted when
``u < p(x_1) + ... + p(x_i)`` (an inverse-CDF draw over ``[x_1, ..., x_m, rest]``). If none is
accepted, the bonus token is drawn from p with the tried children removed and renormalised. Each
depth therefore emits token x with probability exactly p(x), so the emitted sequence has the
target's distribution.

Cumulative sums run in float64: in float32 a running sum near 1 swallows probabilities below
~6e-8, which would silently starve long vocabulary tails.
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect, expect_float, expect_shape
from phasegraph.kernels.verify_greedy import VerifyOutcome, _check_tree_lists, _start_outcome


def target_probs(
    logits: torch.Tensor,  # [B*N, V] float, target logits of every node
    temperature: torch.Tensor,  # [B] float, <= 0 means greedy
    top_k: torch.Tensor,  # [B] i64, 0 (or >= V) = off
    top_p: torch.Tensor,  # [B] float, 1.0 = off
    nodes_per_request: int,
) -> torch.Tensor:  # [B*N, V] f32
    """Sampling distribution of every node: softmax(logits / T), then top-k, then top-p.

    Top-k keeps the k most likely tokens (ties to the lower id). Top-p then keeps the smallest
    most-likely-first prefix whose mass is >= top_p of the top-k mass (always at least one
    token). The kept probabilities are renormalised. Rows of greedy requests (T <= 0) are a
    one-hot on the argmax of the logits (first maximum), so sampling reproduces greedy exactly.
    """
    expect_float(logits, "logits", 2)
    expect_float(temperature, "temperature", 1)
    expect(top_k, "top_k", 1, torch.int64)
    expect_float(top_p, "top_p", 1)
    batch = temperature.shape[0]
    expect_shape(top_k, "top_k", (batch,))
    expect_shape(top_p, "top_p", (batch,))
    rows, vocab = logits.shape
    if rows != batch * nodes_per_request:
        raise ValueError(f"logits has {rows} rows, expected B*N = {batch}*{nodes_per_request}")
    device = logits.device

    def per_node(x: torch.Tensor) -> torch.Tensor:  # [B] -> [B*N]
        return x[:, None].expand(batch, nodes_per_request).reshape(rows)

    temp = per_node(temperature.to(torch.float32))
    k = per_node(top_k)
    p = per_node(top_p.to(torch.float32))
    greedy = temp <= 0

    logits = logits.to(torch.float32)
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temp)[:, None], dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [B*N, V]
    rank = torch.arange(vocab, dtype=torch.int64, device=device)

    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    keep = rank[None, :] < k[:, None]
    in_top_k = torch.where(keep, sorted_p, 0.0)
    cum = in_top_k.cumsum(dim=-1)
    before = cum - in_top_k  # mass strictly before each rank
    top_p_keep = (before < p[:, None] * cum[:, -1:]) | (p[:, None] >= 1.0) | (rank[None, :] == 0)
    kept_sorted = torch.where(keep & top_p_keep, sorted_p, 0.0)
    kept = torch.zeros_like(probs).scatter(1, order, kept_sorted)
    kept = kept / kept.sum(dim=-1, keepdim=True)

    one_hot = (rank[None, :] == logits.argmax(dim=-1)[:, None]).to(torch.float32)
    return torch.where(greedy[:, None], one_hot, kept)


def _inverse_cdf(
    weights: torch.Tensor,  # [B, V] f64, non-negative, unnormalised
    coins: torch.Tensor,  # [B] f64 in [0, 1)
    fallback: torch.Tensor,  # [B] i64, used when every weight is zero
) -> torch.Tensor:  # [B] i64
    """Draw one index per row from ``weights`` by inverse CDF; never a zero-weight index."""
    vocab = weights.shape[1]
    ids = torch.arange(vocab, dtype=torch.int64, device=weights.device)
    cum = weights.cumsum(dim=-1)
    threshold = coins * cum[:, -1]
    pick = (cum <= threshold[:, None]).sum(dim=-1)  # first index whose cumsum passes the coin
    last_positive = torch.where(weights > 0, ids, -1).amax(dim=-1)
    # Rounding can leave the coin at or past the total: take the last positive-weight index.
    pick = torch.where(pick > last_positive, last_positive, pick)
    return torch.where(last_positive < 0, fallback, pick)


def verify_tree_sampling(
    draft_tokens: torch.Tensor,  # [B*N] i64
    retrieve_next_token: torch.Tensor,  # [B, N] i64, first child, -1
    retrieve_next_sibling: torch.Tensor,  # [B, N] i64, next sibling, -1
    probs: torch.Tensor,  # [B*N, V] f32, target distribution after each node
    coins: torch.Tensor,  # [B, S+1] float uniform in [0, 1), one per depth
    bonus_coins: torch.Tensor,  # [B, S+1] float uniform in [0, 1), one per depth
    num_steps: int,
) -> VerifyOutcome:
    """Lossless target-only tree rejection sampling (see the module docstring).

    Depth d (0..S) uses ``coins[:, d]`` to accept a child of the last accepted node and, when
    none is accepted, ``bonus_coins[:, d]`` to draw the bonus token. ``predict`` holds the
    accepted child token or the bonus for path nodes, and the most likely target token for
    nodes off the path (a valid id that is never emitted; at T = 0 it equals greedy verify).
    A sibling repeating an already tried token adds no mass. Should rounding leave no mass
    outside the tried children, the last tried child with positive mass is accepted.
    """
    batch, num_nodes = _check_tree_lists(
        draft_tokens, retrieve_next_token, retrieve_next_sibling, num_steps
    )
    expect(probs, "probs", 2, torch.float32)
    expect_float(coins, "coins", 2)
    expect_float(bonus_coins, "bonus_coins", 2)
    vocab = probs.shape[1]
    expect_shape(probs, "probs", (batch * num_nodes, vocab))
    expect_shape(coins, "coins", (batch, num_steps + 1))
    expect_shape(bonus_coins, "bonus_coins", (batch, num_steps + 1))
    device = probs.device
    node_base, accept_index, accept_lens = _start_outcome(batch, num_nodes, num_steps, device)
    num_children = max(num_nodes - 1, 0)

    predict = probs.argmax(dim=-1)  # [B*N]
    last = torch.zeros(batch, dtype=torch.int64, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    for depth in range(num_steps + 1):
        row = node_base + last  # [B]
        p = probs.index_select(0, row).to(torch.float64)  # [B, V]
        threshold = coins[:, depth].to(torch.float64) * p.sum(dim=-1)
        cum = torch.zeros(batch, dtype=torch.float64, device=device)
        chosen = torch.full_like(last, -1)
        last_positive = torch.full_like(last, -1)  # last tried child with positive mass
        if depth < num_steps:  # a path holds at most S drafts
            child = retrieve_next_token.gather(1, last[:, None]).squeeze(1)
        else:
            child = torch.full_like(last, -1)
        # Tokens tried so far at this depth; a node has at most N-1 children.
        tried_tokens = torch.zeros(batch, num_children, dtype=torch.int64, device=device)
        tried_fresh = torch.zeros(batch, num_children, dtype=torch.bool, device=device)
        for i in range(num_children):
            valid = child >= 0
            token = draft_tokens[node_base + child.clamp(min=0)]
            in_vocab = (token >= 0) & (token < vocab)
            token = token.clamp(0, vocab - 1)
            repeated = ((tried_tokens[:, :i] == token[:, None]) & tried_fresh[:, :i]).any(dim=1)
            fresh = valid & in_vocab & ~repeated
            tried_tokens[:, i] = token
            tried_fresh[:, i] = fresh
            mass = torch.where(fresh, p.gather(1, token[:, None]).squeeze(1), 0.0)
            cum = cum + mass
            hit = fresh & (mass > 0) & (threshold < cum)
            chosen = torch.where(hit, child, chosen)
            last_positive = torch.where(fresh & (mass > 0), child, last_positive)
            sibling = retrieve_next_sibling.gather(1, child.clamp(min=0)[:, None]).squeeze(1)
            child = torch.where(valid & ~hit, sibling, -1)

        tried = torch.zeros_like(p).scatter_add(1, tried_tokens, tried_fresh.to(p.dtype)) > 0
        rest = torch.where(tried, 0.0, p)  # p without the tried children
        no_rest = ~(rest > 0).any(dim=-1)
        chosen = torch.where((chosen < 0) & no_rest, last_positive, chosen)
        accepted = alive & (chosen >= 0)

        bonus = _inverse_cdf(rest, bonus_coins[:, depth].to(torch.float64), p.argmax(dim=-1))
        chosen_token = draft_tokens[node_base + chosen.clamp(min=0)]
        emitted = torch.where(accepted, chosen_token, bonus)
        predict = predict.scatter(0, row, torch.where(alive, emitted, predict[row]))
        if depth < num_steps:
            accept_index[:, depth + 1] = torch.where(accepted, node_base + chosen, -1)
        accept_lens = accept_lens + accepted.to(torch.int64)
        last = torch.where(accepted, chosen, last)
        alive = accepted

    return VerifyOutcome(predict=predict, accept_index=accept_index, accept_lens=accept_lens)
