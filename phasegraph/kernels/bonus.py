"""Emitted and bonus tokens of a verified step, torch reference.

The per-request row stride of every per-node -> per-request gather is ``accept_index.shape[1]``
(W), never N or a constant: SGLang read bonus tokens with stride N, which is wrong (and out of
bounds) as soon as tree drafting makes N > W (seed 000, PR #26866).
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect, expect_shape


def gather_accepted_tokens(
    predict: torch.Tensor,  # [B*N] i64, token emitted after each node
    accept_index: torch.Tensor,  # [B, W] i64, node rows of the accepted path, -1 padded
) -> torch.Tensor:  # [B, W] i64
    """Tokens emitted by each request this step, in order; -1 where ``accept_index`` is -1."""
    expect(predict, "predict", 1, torch.int64)
    expect(accept_index, "accept_index", 2, torch.int64)
    tokens = predict[accept_index.clamp(min=0)]
    return torch.where(accept_index >= 0, tokens, -1)


def fill_bonus_tokens(
    predict: torch.Tensor,  # [B*N] i64
    accept_index: torch.Tensor,  # [B, W] i64
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
) -> torch.Tensor:  # [B] i64
    """The new bonus token of each request: its last emitted token."""
    expect(accept_index, "accept_index", 2, torch.int64)
    expect(accept_lens, "accept_lens", 1, torch.int64)
    batch, width = accept_index.shape
    expect_shape(accept_lens, "accept_lens", (batch,))
    tokens = gather_accepted_tokens(predict, accept_index).reshape(batch * width)
    stride = accept_index.shape[1]  # W, the row stride of `tokens` (seed 000)
    rows = torch.arange(batch, dtype=torch.int64, device=accept_index.device)
    return tokens[rows * stride + accept_lens - 1]
