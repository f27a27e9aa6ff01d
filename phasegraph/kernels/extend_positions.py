"""Positions of extend forwards (draft-extend after decode, chunked prefill), torch reference."""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect, expect_shape


def extend_positions(
    seq_lens: torch.Tensor,  # [B] i64, first position of each request's block
    width: int,
) -> torch.Tensor:  # [B*W] i64
    """Fixed-width blocks: row ``b*W + j`` is at position ``seq_lens[b] + j``."""
    expect(seq_lens, "seq_lens", 1, torch.int64)
    cols = torch.arange(width, dtype=torch.int64, device=seq_lens.device)
    return (seq_lens[:, None] + cols[None, :]).reshape(seq_lens.shape[0] * width)


def ragged_extend_positions(
    starts: torch.Tensor,  # [B] i64, first position of each request's tokens
    lens: torch.Tensor,  # [B] i64 >= 0, tokens of each request
    total_tokens: int,  # T >= sum(lens), given by the caller so that nothing syncs
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [T], request_index [T]
    """Ragged blocks packed back to back: the tokens of request b follow those of b-1.

    Token ``t`` of the packed batch belongs to request ``request_index[t]`` and sits at
    ``starts[b] + (t - offset[b])``. Tokens past ``sum(lens)`` are padding: request -1,
    position 0.
    """
    expect(starts, "starts", 1, torch.int64)
    expect(lens, "lens", 1, torch.int64)
    expect_shape(lens, "lens", tuple(starts.shape))
    batch = starts.shape[0]
    device = starts.device
    tokens = torch.arange(total_tokens, dtype=torch.int64, device=device)
    if batch == 0:
        return torch.zeros_like(tokens), torch.full_like(tokens, -1)
    ends = lens.cumsum(dim=0)  # [B], exclusive end offset of each request
    request = torch.searchsorted(ends, tokens, right=True)  # [T] in [0, B]
    padding = request >= batch
    request = request.clamp(max=batch - 1)
    offset = ends[request] - lens[request]
    positions = starts[request] + tokens - offset
    return (
        torch.where(padding, 0, positions),
        torch.where(padding, -1, request),
    )
