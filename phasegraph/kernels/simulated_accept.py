"""Simulated acceptance for benchmarks: accept a chosen number of drafts, whatever they are.

Benchmark mode only (SGLang's and vLLM's benchmark modes do the same): with random weights no
draft would be accepted, so speed at a given acceptance length is measured by making verify
accept the first ``accept_drafts`` nodes along the first-child chain of every tree. The emitted
tokens are then the drafted ones, not the target's: outputs of a simulated run are labelled as
such and never compared with a baseline.
"""

from __future__ import annotations

import torch

from phasegraph.kernels.verify_greedy import VerifyOutcome


def verify_tree_simulated(
    draft_tokens: torch.Tensor,  # [B*N] int64
    retrieve_next_token: torch.Tensor,  # [B, N] int64, first child, -1
    target_predict: torch.Tensor,  # [B*N] int64, target argmax after each node
    num_steps: int,
    accept_drafts: int,
) -> VerifyOutcome:
    """Accept the root and the first ``min(accept_drafts, S)`` nodes of the first-child chain
    (fewer where the tree is shallower); ``predict`` of each accepted node but the last is the
    next accepted node's token, so the bonus is the target's choice after the last one."""
    B, N = retrieve_next_token.shape
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
