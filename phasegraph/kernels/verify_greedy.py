"""Greedy token-tree verification (SpecInfer, arXiv 2305.09781; SGLang ``VerifyTreeGreedy``).

Walk down from the root: among the children of the last accepted node, taken in sibling-list
order, accept the first whose token equals the target's argmax after that node; stop when none
matches. The target's argmax after the last accepted node is the bonus token, so the emitted
tokens are exactly what target-only greedy decoding would produce.
"""

from __future__ import annotations

import attrs
import torch

from phasegraph.kernels._checks import expect, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes


@attrs.frozen(eq=False)
class VerifyOutcome:
    """Result of verifying B draft trees of N nodes, S draft steps (W = S+1)."""

    predict: torch.Tensor  # [B*N] i64, token emitted after each node if it is on the path
    accept_index: torch.Tensor  # [B, W] i64, node rows b*N + j of the path from the root, -1 pad
    accept_lens: torch.Tensor  # [B] i64, accepted drafts + 1 (bonus), in [1, W]

    @classmethod
    def empty(cls, batch: int, num_nodes: int, num_steps: int, device: torch.device) -> VerifyOutcome:
        """Uninitialised outputs for a kernel that writes every element of them."""
        return cls(
            predict=torch.empty(batch * num_nodes, dtype=torch.int64, device=device),
            accept_index=torch.empty((batch, num_steps + 1), dtype=torch.int64, device=device),
            accept_lens=torch.empty(batch, dtype=torch.int64, device=device),
        )


def _check_tree_lists(
    draft_tokens: torch.Tensor,  # [B*N] i64
    retrieve_next_token: torch.Tensor,  # [B, N] i64
    retrieve_next_sibling: torch.Tensor,  # [B, N] i64
    num_steps: int,
) -> tuple[int, int]:
    """Check the shared verify inputs and return ``(B, N)``."""
    expect(draft_tokens, "draft_tokens", 1, torch.int64)
    expect(retrieve_next_token, "retrieve_next_token", 2, torch.int64)
    expect(retrieve_next_sibling, "retrieve_next_sibling", 2, torch.int64)
    batch, num_nodes = retrieve_next_token.shape
    expect_shape(retrieve_next_sibling, "retrieve_next_sibling", (batch, num_nodes))
    expect_shape(draft_tokens, "draft_tokens", (batch * num_nodes,))
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}")
    return batch, num_nodes


def _start_outcome(
    batch: int, num_nodes: int, num_steps: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(node_base [B], accept_index [B, S+1], accept_lens [B])`` with only the root."""
    node_base = torch.arange(batch, dtype=torch.int64, device=device) * num_nodes
    accept_index = torch.full((batch, num_steps + 1), -1, dtype=torch.int64, device=device)
    accept_index[:, 0] = node_base
    accept_lens = torch.ones(batch, dtype=torch.int64, device=device)
    return node_base, accept_index, accept_lens


def verify_tree_greedy_reference(
    draft_tokens: torch.Tensor,  # [B*N] i64, node tokens (node 0 = bonus of the last step)
    retrieve_next_token: torch.Tensor,  # [B, N] i64, first child, -1
    retrieve_next_sibling: torch.Tensor,  # [B, N] i64, next sibling, -1
    target_predict: torch.Tensor,  # [B*N] i64, target argmax after each node
    num_steps: int,
) -> VerifyOutcome:
    """Accept the longest root path whose tokens agree with the target's greedy choices.

    ``predict`` is ``target_predict`` itself (copied): on the accepted path the token after
    each accepted node is the next accepted draft or, after the last one, the bonus token.
    """
    batch, num_nodes = _check_tree_lists(
        draft_tokens, retrieve_next_token, retrieve_next_sibling, num_steps
    )
    expect(target_predict, "target_predict", 1, torch.int64)
    expect_shape(target_predict, "target_predict", (batch * num_nodes,))
    device = draft_tokens.device
    node_base, accept_index, accept_lens = _start_outcome(batch, num_nodes, num_steps, device)

    last = torch.zeros(batch, dtype=torch.int64, device=device)  # node index within request
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    for depth in range(1, num_steps + 1):
        want = target_predict[node_base + last]  # [B]
        child = retrieve_next_token.gather(1, last[:, None]).squeeze(1)  # [B], -1 = none
        chosen = torch.full_like(last, -1)
        for _ in range(num_nodes - 1):  # a node has at most N-1 children
            valid = child >= 0
            token = draft_tokens[node_base + child.clamp(min=0)]
            match = valid & (token == want)
            chosen = torch.where(match, child, chosen)
            sibling = retrieve_next_sibling.gather(1, child.clamp(min=0)[:, None]).squeeze(1)
            child = torch.where(valid & ~match, sibling, -1)
        alive = alive & (chosen >= 0)
        accept_index[:, depth] = torch.where(alive, node_base + chosen, -1)
        accept_lens = accept_lens + alive.to(torch.int64)
        last = torch.where(alive, chosen, last)

    return VerifyOutcome(
        predict=target_predict.clone(), accept_index=accept_index, accept_lens=accept_lens
    )


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _take(vec, offs, index):
    """``vec[index]`` for a register vector (a masked reduction; ``index`` out of range -> 0)."""
    return tl.sum(tl.where(offs == index, vec, 0), axis=0)


@jit
def _request_tree(draft_tokens_ptr, next_token_ptr, target_ptr, num_nodes, stride_tr,
                  BLOCK_NODES: tl.constexpr):
    """This program's request: its node tokens, the target's predictions and the first children,
    in registers, with the node offsets, their mask and the request's first node row."""
    b, offs, node_ok = row_lanes(BLOCK_NODES, num_nodes)
    base = b * num_nodes
    tokens = tl.load(draft_tokens_ptr + base + offs, mask=node_ok, other=-1)
    target = tl.load(target_ptr + base + offs, mask=node_ok, other=-1)
    first_child = tl.load(next_token_ptr + b * stride_tr + offs, mask=node_ok, other=-1)
    return b, offs, node_ok, base, tokens, target, first_child


@jit
def _root_path(base, BLOCK_W: tl.constexpr):
    """A path holding only the root: ``(offs_w, path [W] node rows, last node, length, alive)``."""
    offs_w = tl.arange(0, BLOCK_W)
    path = tl.where(offs_w == 0, base, -1)
    last = base * 0  # node index of the last accepted node (i64 scalar)
    length = last + 1
    return offs_w, path, last, length, length > 0


@jit
def _store_path(accept_index_ptr, accept_lens_ptr, b, offs_w, path, length, num_steps):
    tl.store(accept_index_ptr + b * (num_steps + 1) + offs_w, path, mask=offs_w <= num_steps)
    tl.store(accept_lens_ptr + b, length)


@jit
def _verify_greedy_kernel(
    draft_tokens_ptr,  # [B*N] i64
    next_token_ptr,  # [B, N] i64
    next_sibling_ptr,  # [B, N] i64
    target_ptr,  # [B*N] i64
    predict_ptr,  # [B*N] i64, out: copy of target
    accept_index_ptr,  # [B, S+1] i64, out
    accept_lens_ptr,  # [B] i64, out
    num_nodes,
    num_steps,
    stride_tr,  # row stride of next_token
    stride_sr,  # row stride of next_sibling
    BLOCK_NODES: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, offs, node_ok, base, tokens, target, first_child = _request_tree(
        draft_tokens_ptr, next_token_ptr, target_ptr, num_nodes, stride_tr, BLOCK_NODES)
    sibling = tl.load(next_sibling_ptr + b * stride_sr + offs, mask=node_ok, other=-1)
    tl.store(predict_ptr + base + offs, target, mask=node_ok)

    offs_w, path, last, length, alive = _root_path(base, BLOCK_W)  # path: [W] node rows
    for depth in range(1, num_steps + 1):
        want = _take(target, offs, last)
        child = _take(first_child, offs, last)
        chosen = last * 0 - 1
        tried = 0
        # Children in sibling order; the first whose token is the target's choice wins. A node
        # has at most N-1 children (the bound also stops a malformed cyclic list).
        while (child >= 0) & (tried < num_nodes - 1):
            match = _take(tokens, offs, child) == want
            chosen = tl.where(match, child, chosen)
            child = tl.where(match, -1, _take(sibling, offs, child))
            tried += 1
        alive = alive & (chosen >= 0)
        path = tl.where((offs_w == depth) & alive, base + chosen, path)
        length += alive.to(tl.int64)
        last = tl.where(alive, chosen, last)
    _store_path(accept_index_ptr, accept_lens_ptr, b, offs_w, path, length, num_steps)


def verify_tree_greedy_triton(
    draft_tokens: torch.Tensor,  # [B*N] i64
    retrieve_next_token: torch.Tensor,  # [B, N] i64
    retrieve_next_sibling: torch.Tensor,  # [B, N] i64
    target_predict: torch.Tensor,  # [B*N] i64
    num_steps: int,
) -> VerifyOutcome:
    """Triton greedy verification: one program (one warp) per request.

    The request's N node tokens, target predictions and retrieve lists are loaded once into
    registers; the walk down the tree (at most S depths, at most N-1 siblings each) then reads
    them with register reductions instead of dependent global loads. The same program copies
    ``target_predict`` into ``predict`` and writes ``accept_index``/``accept_lens``: one launch
    instead of the reference's ~10 small ops per sibling step and depth. Bytes: 4 B*N int64 in,
    B*N + B*(S+1) + B out; negligible FLOPs.
    """
    batch, num_nodes = _check_tree_lists(
        draft_tokens, retrieve_next_token, retrieve_next_sibling, num_steps
    )
    expect(target_predict, "target_predict", 1, torch.int64)
    expect_shape(target_predict, "target_predict", (batch * num_nodes,))
    out = VerifyOutcome.empty(batch, num_nodes, num_steps, draft_tokens.device)
    if batch > 0:
        next_token = retrieve_next_token.contiguous()
        next_sibling = retrieve_next_sibling.contiguous()
        _verify_greedy_kernel[(batch,)](
            draft_tokens.contiguous(),
            next_token,
            next_sibling,
            target_predict.contiguous(),
            out.predict,
            out.accept_index,
            out.accept_lens,
            num_nodes,
            num_steps,
            next_token.stride(0),
            next_sibling.stride(0),
            BLOCK_NODES=next_pow2(num_nodes),
            BLOCK_W=next_pow2(num_steps + 1),
            num_warps=1, **pdl_options(),
        )
    return out


def verify_tree_greedy(
    draft_tokens: torch.Tensor,  # [B*N] i64, node tokens (node 0 = bonus of the last step)
    retrieve_next_token: torch.Tensor,  # [B, N] i64, first child, -1
    retrieve_next_sibling: torch.Tensor,  # [B, N] i64, next sibling, -1
    target_predict: torch.Tensor,  # [B*N] i64, target argmax after each node
    num_steps: int,
) -> VerifyOutcome:
    """Greedy tree verification (see :func:`verify_tree_greedy_reference`); Triton on CUDA."""
    impl = verify_tree_greedy_triton if use_triton(draft_tokens) else verify_tree_greedy_reference
    return impl(draft_tokens, retrieve_next_token, retrieve_next_sibling, target_predict, num_steps)
