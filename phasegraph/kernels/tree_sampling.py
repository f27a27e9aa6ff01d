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

``verify_tree_sampling`` dispatches to ``verify_tree_sampling_triton`` on CUDA tensors (else
``verify_tree_sampling_reference``). ``target_probs`` has no Triton version: it is a fixed
sequence of fused, sync-free torch ops (softmax, one segmented stable sort per row, cumsum,
scatter) that CUDA graphs capture as they are. Its cost is the sort, several passes over
``B*N x V``; a Triton top-k/top-p without a sort (radix select per row) could cut that, but it
must reproduce the stable-sort tie rule and the top-p prefix rule exactly, which is left for when
``benchmarks/bench_kernels.py`` shows it matters next to the verify forward.
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect, expect_float, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes
from phasegraph.kernels.verify_greedy import (
    VerifyOutcome,
    _check_tree_lists,
    _root_path,
    _start_outcome,
    _store_path,
    _take,
)


def target_probs(
    logits: torch.Tensor,  # [B*N, V] float, target logits of every node
    temperature: torch.Tensor,  # [B] float, <= 0 means greedy
    top_k: torch.Tensor,  # [B] i64, 0 (or >= V) = off
    top_p: torch.Tensor,  # [B] float, 1.0 = off
    nodes_per_request: int,
    min_p: torch.Tensor | None = None,  # [B] float in [0, 1], 0 = off; None: off for all
) -> torch.Tensor:  # [B*N, V] f32
    """Sampling distribution of every node: softmax(logits / T), then top-k, top-p, min_p.

    Top-k keeps the k most likely tokens (ties to the lower id). Top-p then keeps the smallest
    most-likely-first prefix whose mass is >= top_p of the top-k mass (always at least one
    token). min_p then keeps the tokens whose probability is at least ``min_p`` times the most
    likely one's (in the row itself: the ratio is the same before and after renormalising, and
    top-k and top-p always keep the most likely token). The kept probabilities are
    renormalised. Rows of greedy requests (T <= 0) are a one-hot on the argmax of the logits
    (first maximum), so sampling reproduces greedy exactly. Logit bias and penalties are
    applied to ``logits`` before (:mod:`phasegraph.kernels.penalties`).
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
    if min_p is not None:  # the row's most likely token sits at rank 0
        expect_float(min_p, "min_p", 1)
        expect_shape(min_p, "min_p", (batch,))
        floor = per_node(min_p.to(torch.float32)) * sorted_p[:, 0]  # [B*N]
        kept_sorted = torch.where(sorted_p >= floor[:, None], kept_sorted, 0.0)
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


def _check_sampling(
    draft_tokens, retrieve_next_token, retrieve_next_sibling, probs, coins, bonus_coins, num_steps
) -> tuple[int, int, int]:
    """Checks of :func:`verify_tree_sampling`'s inputs; ``(B, N, V)``."""
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
    return batch, num_nodes, vocab


def verify_tree_sampling_reference(
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
    batch, num_nodes, vocab = _check_sampling(
        draft_tokens, retrieve_next_token, retrieve_next_sibling, probs, coins, bonus_coins,
        num_steps,
    )
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


# --------------------------------------------------------------------------------------------
# Triton


@jit(do_not_specialize=["vocab"])
def _row_stats_kernel(
    probs_ptr,  # [R, V] f32
    argmax_ptr,  # [R] i64, out: first index of the row maximum
    sum_ptr,  # [R] f64, out: sum of the row
    positive_ptr,  # [R] i64, out: number of entries > 0
    vocab,
    stride_r,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    row_ptr = probs_ptr + r * stride_r
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = r * 0
    total = tl.zeros([], tl.float64)
    positive = r * 0
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        ok = idx < vocab
        x = tl.load(row_ptr + idx, mask=ok, other=float("-inf"))
        block_best = tl.max(x, axis=0)
        block_idx = start + tl.argmax(x, axis=0, tie_break_left=True)
        take = block_best > best  # strictly: an earlier block keeps ties
        best_idx = tl.where(take, block_idx, best_idx)
        best = tl.where(take, block_best, best)
        total += tl.sum(tl.where(ok, x, 0.0).to(tl.float64), axis=0)
        positive += tl.sum((x > 0).to(tl.int64), axis=0)
    tl.store(argmax_ptr + r, best_idx)
    tl.store(sum_ptr + r, total)
    tl.store(positive_ptr + r, positive)


@jit(do_not_specialize=["vocab"])
def _verify_sampling_kernel(
    draft_tokens_ptr,  # [B*N] i64
    next_token_ptr,  # [B, N] i64
    next_sibling_ptr,  # [B, N] i64
    probs_ptr,  # [B*N, V] f32
    coins_ptr,  # [B, S+1] float
    bonus_coins_ptr,  # [B, S+1] float
    row_sum_ptr,  # [B*N] f64
    row_positive_ptr,  # [B*N] i64
    predict_ptr,  # [B*N] i64, in: row argmax; out: predict
    accept_index_ptr,  # [B, S+1] i64, out
    accept_lens_ptr,  # [B] i64, out
    num_nodes,
    num_steps,
    vocab,
    stride_pr,
    stride_cb,
    stride_cd,
    stride_bb,
    stride_bd,
    BLOCK_NODES: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, offs, node_ok = row_lanes(BLOCK_NODES, num_nodes)
    base = b * num_nodes
    tokens = tl.load(draft_tokens_ptr + base + offs, mask=node_ok, other=-1)
    first_child = tl.load(next_token_ptr + b * num_nodes + offs, mask=node_ok, other=-1)
    sibling = tl.load(next_sibling_ptr + b * num_nodes + offs, mask=node_ok, other=-1)

    offs_w, path, last, length, alive = _root_path(base, BLOCK_W)  # path: [W] node rows
    zero64 = tl.zeros([], tl.float64)
    # The depth where the walk stops (exactly one: depth S has no children) draws the bonus.
    stop_row = base
    stop_tried = tl.full([BLOCK_NODES], -1, tl.int64)
    stop_coin = zero64
    stop_rest = zero64
    for depth in range(0, num_steps + 1):
        row = base + last
        total = tl.load(row_sum_ptr + row)
        threshold = tl.load(coins_ptr + b * stride_cb + depth * stride_cd).to(tl.float64) * total
        cum = zero64
        chosen = last * 0 - 1
        last_positive = chosen
        positive_tried = last * 0
        tried = tl.full([BLOCK_NODES], -1, tl.int64)  # fresh tokens tried at this depth
        child = tl.where(depth < num_steps, _take(first_child, offs, last), -1)
        i = 0
        while (child >= 0) & (i < num_nodes - 1):
            token = _take(tokens, offs, child)
            repeated = tl.max(tl.where(tried == token, 1, 0), axis=0) > 0
            fresh = (token >= 0) & (token < vocab) & (repeated == 0)
            mass = tl.load(probs_ptr + row * stride_pr + token, mask=fresh, other=0.0)
            mass = mass.to(tl.float64)
            cum += mass
            positive = fresh & (mass > 0)
            hit = positive & (threshold < cum)
            chosen = tl.where(hit, child, chosen)
            last_positive = tl.where(positive, child, last_positive)
            positive_tried += positive.to(tl.int64)
            tried = tl.where((offs == i) & fresh, token, tried)
            child = tl.where(hit, -1, _take(sibling, offs, child))
            i += 1
        # No positive mass outside the tried children: accept the last positive one.
        no_rest = tl.load(row_positive_ptr + row) <= positive_tried
        chosen = tl.where((chosen < 0) & no_rest, last_positive, chosen)
        accepted = alive & (chosen >= 0)
        stopping = alive & (chosen < 0)
        bonus_coin = tl.load(bonus_coins_ptr + b * stride_bb + depth * stride_bd)
        stop_row = tl.where(stopping, row, stop_row)
        stop_tried = tl.where(stopping, tried, stop_tried)
        stop_coin = tl.where(stopping, bonus_coin.to(tl.float64), stop_coin)
        stop_rest = tl.where(stopping, total - cum, stop_rest)  # mass outside tried children
        tl.store(predict_ptr + row, _take(tokens, offs, chosen), mask=accepted)
        path = tl.where((offs_w == depth + 1) & accepted, base + chosen, path)
        length += accepted.to(tl.int64)
        last = tl.where(accepted, chosen, last)
        alive = accepted

    # Bonus: inverse CDF over the stop row with the tried children removed (float64).
    threshold = stop_coin * stop_rest
    offs_v = tl.arange(0, BLOCK_V)
    row_ptr = probs_ptr + stop_row * stride_pr
    running = zero64
    count = base * 0  # entries whose cumulative mass is <= threshold
    last_pos = base * 0 - 1  # last entry with mass
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs_v
        ok = idx < vocab
        p = tl.load(row_ptr + idx, mask=ok, other=0.0).to(tl.float64)
        in_block = (stop_tried >= start) & (stop_tried < start + BLOCK_V)
        if tl.max(in_block.to(tl.int32), axis=0) > 0:
            for k in range(0, BLOCK_NODES):
                p = tl.where(idx == _take(stop_tried, offs, k), 0.0, p)
        c = running + tl.cumsum(p, axis=0)
        count += tl.sum(((c <= threshold) & ok).to(tl.int64), axis=0)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(p > 0, idx, -1), axis=0))
        running = tl.max(c, axis=0)
    pick = tl.where(count > last_pos, last_pos, count)
    fallback = tl.load(predict_ptr + stop_row)  # row argmax: the stop row was never overwritten
    tl.store(predict_ptr + stop_row, tl.where(last_pos < 0, fallback, pick))
    _store_path(accept_index_ptr, accept_lens_ptr, b, offs_w, path, length, num_steps)


def verify_tree_sampling_triton(
    draft_tokens: torch.Tensor,  # [B*N] i64
    retrieve_next_token: torch.Tensor,  # [B, N] i64, first child, -1
    retrieve_next_sibling: torch.Tensor,  # [B, N] i64, next sibling, -1
    probs: torch.Tensor,  # [B*N, V] f32
    coins: torch.Tensor,  # [B, S+1] float uniform in [0, 1)
    bonus_coins: torch.Tensor,  # [B, S+1] float uniform in [0, 1)
    num_steps: int,
) -> VerifyOutcome:
    """Triton tree rejection sampling, two launches.

    1. ``(B*N,)`` programs, one per node row: one pass over its V probabilities gives the row
       argmax (``predict`` of nodes off the path, the fallback draw), the float64 row sum and the
       count of positive entries. This pass reads all ``B*N*V*4`` bytes once; it is the floor,
       since the reference's ``predict`` needs every row's argmax.
    2. ``(B,)`` programs, one per request: the walk down the tree as in the reference (child
       masses are single gathers, the threshold uses the row sum of step 1), then one inverse-CDF
       pass over the row where the walk stopped, with the tried children zeroed (the reference
       makes several full ``[B, V]`` float64 passes at every depth).

    Equal to the reference except where a coin lands within float64 rounding (~1e-16) of a
    cumulative boundary, since row sums are added in a different order.
    """
    batch, num_nodes, vocab = _check_sampling(
        draft_tokens, retrieve_next_token, retrieve_next_sibling, probs, coins, bonus_coins,
        num_steps,
    )
    device = probs.device
    rows = batch * num_nodes
    out = VerifyOutcome.empty(batch, num_nodes, num_steps, device)
    if batch == 0:
        return out
    if probs.stride(1) != 1:
        probs = probs.contiguous()
    row_sum = torch.empty(rows, dtype=torch.float64, device=device)
    row_positive = torch.empty(rows, dtype=torch.int64, device=device)
    _row_stats_kernel[(rows,)](
        probs, out.predict, row_sum, row_positive, vocab, probs.stride(0),
        BLOCK_V=min(4096, next_pow2(vocab)),
        num_warps=8, **pdl_options(),
    )
    _verify_sampling_kernel[(batch,)](
        draft_tokens.contiguous(),
        retrieve_next_token.contiguous(),
        retrieve_next_sibling.contiguous(),
        probs,
        coins,
        bonus_coins,
        row_sum,
        row_positive,
        out.predict,
        out.accept_index,
        out.accept_lens,
        num_nodes,
        num_steps,
        vocab,
        probs.stride(0),
        *coins.stride(),
        *bonus_coins.stride(),
        BLOCK_NODES=next_pow2(num_nodes),
        BLOCK_W=next_pow2(num_steps + 1),
        BLOCK_V=min(2048, next_pow2(vocab)),
        num_warps=4, **pdl_options(),
    )
    return out


def verify_tree_sampling(
    draft_tokens: torch.Tensor,  # [B*N] i64
    retrieve_next_token: torch.Tensor,  # [B, N] i64, first child, -1
    retrieve_next_sibling: torch.Tensor,  # [B, N] i64, next sibling, -1
    probs: torch.Tensor,  # [B*N, V] f32, target distribution after each node
    coins: torch.Tensor,  # [B, S+1] float uniform in [0, 1), one per depth
    bonus_coins: torch.Tensor,  # [B, S+1] float uniform in [0, 1), one per depth
    num_steps: int,
) -> VerifyOutcome:
    """Lossless target-only tree rejection sampling (see
    :func:`verify_tree_sampling_reference`); Triton on CUDA tensors."""
    impl = (
        verify_tree_sampling_triton if use_triton(draft_tokens) else verify_tree_sampling_reference
    )
    return impl(
        draft_tokens, retrieve_next_token, retrieve_next_sibling, probs, coins, bonus_coins,
        num_steps,
    )
