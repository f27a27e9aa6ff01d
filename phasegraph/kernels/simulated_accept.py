"""Simulated acceptance for benchmarks: accept a chosen number of drafts, whatever they are.

Benchmark mode only (SGLang's and vLLM's benchmark modes do the same): with random weights no
draft would be accepted, so speed at a given acceptance length is measured by making verify
accept the first ``accept_drafts`` nodes along the first-child chain of every tree. The emitted
tokens are then the drafted ones, not the target's: outputs of a simulated run are labelled as
such and never compared with a baseline.

``verify_tree_simulated_reference`` is the CPU path and the oracle; on CUDA
``verify_tree_simulated_triton`` does the walk in one launch (the reference's loop was ~17 small
torch ops per accepted depth, ~50 launches in a chain iteration's graph, which a benchmark of the
iteration's speed should not carry).
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels.verify_greedy import (
    VerifyOutcome,
    _request_tree,
    _root_path,
    _store_path,
    _take,
)


def _check(draft_tokens, retrieve_next_token, target_predict, num_steps, accept_drafts) -> tuple[int, int]:
    expect(draft_tokens, "draft_tokens", 1, torch.int64)
    expect(retrieve_next_token, "retrieve_next_token", 2, torch.int64)
    expect(target_predict, "target_predict", 1, torch.int64)
    batch, num_nodes = retrieve_next_token.shape
    expect_shape(draft_tokens, "draft_tokens", (batch * num_nodes,))
    expect_shape(target_predict, "target_predict", (batch * num_nodes,))
    if num_steps < 0 or accept_drafts < 0:
        raise ValueError(f"num_steps and accept_drafts must be >= 0, got {num_steps} and {accept_drafts}")
    return batch, num_nodes


def verify_tree_simulated_reference(
    draft_tokens: torch.Tensor,  # [B*N] int64
    retrieve_next_token: torch.Tensor,  # [B, N] int64, first child, -1
    target_predict: torch.Tensor,  # [B*N] int64, target argmax after each node
    num_steps: int,
    accept_drafts: int,
) -> VerifyOutcome:
    """Accept the root and the first ``min(accept_drafts, S)`` nodes of the first-child chain
    (fewer where the tree is shallower); ``predict`` of each accepted node but the last is the
    next accepted node's token, so the bonus is the target's choice after the last one."""
    B, N = _check(draft_tokens, retrieve_next_token, target_predict, num_steps, accept_drafts)
    device = draft_tokens.device
    node_base = torch.arange(B, dtype=torch.int64, device=device) * N  # [B]
    accept_index = torch.full((B, num_steps + 1), -1, dtype=torch.int64, device=device)
    accept_index[:, 0] = node_base
    accept_lens = torch.ones(B, dtype=torch.int64, device=device)
    predict = target_predict.clone()
    last = torch.zeros(B, dtype=torch.int64, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    for depth in range(1, min(accept_drafts, num_steps) + 1):
        child = retrieve_next_token.gather(1, last[:, None])[:, 0]  # [B]
        alive = alive & (child >= 0)
        token = draft_tokens[node_base + child.clamp(min=0)]
        rows = node_base + last
        predict[rows] = torch.where(alive, token, predict[rows])
        accept_index[:, depth] = torch.where(alive, node_base + child, -1)
        accept_lens = accept_lens + alive.long()
        last = torch.where(alive, child, last)
    return VerifyOutcome(predict=predict, accept_index=accept_index, accept_lens=accept_lens)


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _simulated_accept_kernel(
    draft_tokens_ptr,  # [B*N] i64
    next_token_ptr,  # [B, N] i64, first child
    target_ptr,  # [B*N] i64
    predict_ptr,  # [B*N] i64, out
    accept_index_ptr,  # [B, S+1] i64, out
    accept_lens_ptr,  # [B] i64, out
    num_nodes,
    num_steps,
    depths,  # min(accept_drafts, num_steps)
    stride_tr,
    BLOCK_NODES: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, offs, node_ok, base, tokens, predict, first_child = _request_tree(
        draft_tokens_ptr, next_token_ptr, target_ptr, num_nodes, stride_tr, BLOCK_NODES)
    offs_w, path, last, length, alive = _root_path(base, BLOCK_W)  # path: [W] node rows
    for depth in range(1, depths + 1):
        child = _take(first_child, offs, last)
        alive = alive & (child >= 0)
        # the node before an accepted child predicts that child's token
        predict = tl.where(alive & (offs == last), _take(tokens, offs, child), predict)
        path = tl.where((offs_w == depth) & alive, base + child, path)
        length += alive.to(tl.int64)
        last = tl.where(alive, child, last)
    tl.store(predict_ptr + base + offs, predict, mask=node_ok)
    _store_path(accept_index_ptr, accept_lens_ptr, b, offs_w, path, length, num_steps)


def verify_tree_simulated_triton(
    draft_tokens: torch.Tensor,  # [B*N] int64
    retrieve_next_token: torch.Tensor,  # [B, N] int64, first child, -1
    target_predict: torch.Tensor,  # [B*N] int64
    num_steps: int,
    accept_drafts: int,
) -> VerifyOutcome:
    """Triton simulated acceptance: one program (one warp) per request walks its first-child
    chain in registers, as :func:`~phasegraph.kernels.verify_greedy.verify_tree_greedy_triton`
    walks the tree, and writes ``predict``, ``accept_index`` and ``accept_lens`` in one launch."""
    batch, num_nodes = _check(draft_tokens, retrieve_next_token, target_predict, num_steps, accept_drafts)
    out = VerifyOutcome.empty(batch, num_nodes, num_steps, draft_tokens.device)
    if batch > 0:
        next_token = retrieve_next_token.contiguous()
        _simulated_accept_kernel[(batch,)](
            draft_tokens.contiguous(), next_token, target_predict.contiguous(), out.predict,
            out.accept_index, out.accept_lens, num_nodes, num_steps, min(accept_drafts, num_steps),
            next_token.stride(0),
            BLOCK_NODES=next_pow2(num_nodes), BLOCK_W=next_pow2(num_steps + 1), num_warps=1,
            **pdl_options(),
        )
    return out


def verify_tree_simulated(
    draft_tokens: torch.Tensor,  # [B*N] int64
    retrieve_next_token: torch.Tensor,  # [B, N] int64, first child, -1
    target_predict: torch.Tensor,  # [B*N] int64, target argmax after each node
    num_steps: int,
    accept_drafts: int,
) -> VerifyOutcome:
    """Simulated acceptance (see :func:`verify_tree_simulated_reference`); Triton on CUDA."""
    impl = verify_tree_simulated_triton if use_triton(draft_tokens) else verify_tree_simulated_reference
    return impl(draft_tokens, retrieve_next_token, target_predict, num_steps, accept_drafts)
