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


@attrs.frozen(eq=False)
class VerifyOutcome:
    """Result of verifying B draft trees of N nodes, S draft steps (W = S+1)."""

    predict: torch.Tensor  # [B*N] i64, token emitted after each node if it is on the path
    accept_index: torch.Tensor  # [B, W] i64, node rows b*N + j of the path from the root, -1 pad
    accept_lens: torch.Tensor  # [B] i64, accepted drafts + 1 (bonus), in [1, W]


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


def verify_tree_greedy(
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
