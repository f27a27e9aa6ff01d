"""Positions of extend forwards (draft-extend after decode, chunked prefill).

Torch references (``*_reference``) and Triton versions; the public names dispatch on device.
Both are a handful of index ops; the Triton versions exist to make each one launch.
``extend_rows`` is ``extend_positions`` plus each row's request, from the same launch.
"""

from __future__ import annotations

import torch

from phasegraph.kernels import _dispatch
from phasegraph.kernels._checks import expect, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes


def extend_positions_reference(
    seq_lens: torch.Tensor,  # [B] i64, first position of each request's block
    width: int,
) -> torch.Tensor:  # [B*W] i64
    """Fixed-width blocks: row ``b*W + j`` is at position ``seq_lens[b] + j``."""
    expect(seq_lens, "seq_lens", 1, torch.int64)
    cols = torch.arange(width, dtype=torch.int64, device=seq_lens.device)
    return (seq_lens[:, None] + cols[None, :]).reshape(seq_lens.shape[0] * width)


def extend_rows_reference(
    seq_lens: torch.Tensor,  # [B] i64, first position of each request's block
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [B*W], token_req [B*W]
    """:func:`extend_positions_reference` and the request of each row (``b`` at ``b*W + j``)."""
    positions = extend_positions_reference(seq_lens, width)
    batch = seq_lens.shape[0]
    return positions, torch.arange(batch, device=seq_lens.device).repeat_interleave(width)


def _check_ragged(starts: torch.Tensor, lens: torch.Tensor) -> int:
    """Checks of :func:`ragged_extend_positions`'s inputs; the batch size."""
    expect(starts, "starts", 1, torch.int64)
    expect(lens, "lens", 1, torch.int64)
    expect_shape(lens, "lens", tuple(starts.shape))
    return starts.shape[0]


def ragged_extend_positions_reference(
    starts: torch.Tensor,  # [B] i64, first position of each request's tokens
    lens: torch.Tensor,  # [B] i64 >= 0, tokens of each request
    total_tokens: int,  # T >= sum(lens), given by the caller so that nothing syncs
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [T], request_index [T]
    """Ragged blocks packed back to back: the tokens of request b follow those of b-1.

    Token ``t`` of the packed batch belongs to request ``request_index[t]`` and sits at
    ``starts[b] + (t - offset[b])``. Tokens past ``sum(lens)`` are padding: request -1,
    position 0.
    """
    batch = _check_ragged(starts, lens)
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


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _extend_positions_kernel(
    seq_lens_ptr,  # [B] i64
    positions_ptr,  # [B*W] i64, out
    token_req_ptr,  # [B*W] i64, out (WITH_REQ)
    width,
    BLOCK_W: tl.constexpr,
    WITH_REQ: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, cols, ok = row_lanes(BLOCK_W, width)
    tl.store(positions_ptr + b * width + cols, tl.load(seq_lens_ptr + b) + cols, mask=ok)
    if WITH_REQ:
        tl.store(token_req_ptr + b * width + cols, b + cols * 0, mask=ok)


def _launch_extend_positions(seq_lens: torch.Tensor, width: int, with_req: bool):
    """``(positions, token_req)``; without ``with_req`` the second is ``positions`` itself."""
    expect(seq_lens, "seq_lens", 1, torch.int64)
    batch = seq_lens.shape[0]
    positions = torch.empty(batch * width, dtype=torch.int64, device=seq_lens.device)
    token_req = torch.empty(batch * width, dtype=torch.int64, device=seq_lens.device) \
        if with_req else positions  # an unwritten stand-in without ``with_req`` (no allocation)
    if positions.numel() > 0:
        _extend_positions_kernel[(batch,)](
            seq_lens.contiguous(), positions, token_req, width, BLOCK_W=next_pow2(width),
            WITH_REQ=with_req, num_warps=1, **pdl_options(),
        )
    return positions, token_req


def extend_positions_triton(
    seq_lens: torch.Tensor,  # [B] i64
    width: int,
) -> torch.Tensor:  # [B*W] i64
    """Triton ``extend_positions``: one program per request (simple; one launch instead of 3)."""
    return _launch_extend_positions(seq_lens, width, with_req=False)[0]


def extend_rows_triton(
    seq_lens: torch.Tensor,  # [B] i64
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [B*W], token_req [B*W]
    """Triton ``extend_rows``: the extend_positions launch also stores each row's request (in
    place of an arange and a repeat_interleave)."""
    return _launch_extend_positions(seq_lens, width, with_req=True)


@jit(do_not_specialize=["batch"])
def _ragged_positions_kernel(
    starts_ptr,  # [B] i64
    lens_ptr,  # [B] i64 >= 0
    positions_ptr,  # [T] i64, out
    request_ptr,  # [T] i64, out
    batch,
    total_tokens,
    BLOCK_T: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    # request[t] = #{b : ends[b] <= t} (searchsorted right); offset[t] = sum of those lens.
    request = tokens * 0
    offset = tokens * 0
    running = tl.sum(request, axis=0)  # 0, i64
    for start in range(0, batch, BLOCK_B):
        b = start + tl.arange(0, BLOCK_B)
        ok = b < batch
        lens = tl.load(lens_ptr + b, mask=ok, other=0)
        ends = running + tl.cumsum(lens, axis=0)
        done = (ends[None, :] <= tokens[:, None]) & ok[None, :]  # [T, B]
        request += tl.sum(done.to(tl.int64), axis=1)
        offset += tl.sum(tl.where(done, lens[None, :], 0), axis=1)
        running += tl.sum(lens, axis=0)
    padding = request >= batch
    start_pos = tl.load(starts_ptr + request, mask=~padding, other=0)
    ok = tokens < total_tokens
    tl.store(positions_ptr + tokens, tl.where(padding, 0, start_pos + tokens - offset), mask=ok)
    tl.store(request_ptr + tokens, tl.where(padding, -1, request), mask=ok)


def ragged_extend_positions_triton(
    starts: torch.Tensor,  # [B] i64
    lens: torch.Tensor,  # [B] i64 >= 0
    total_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [T], request_index [T]
    """Triton ``ragged_extend_positions``: programs over blocks of tokens; each recomputes the
    running request ends in chunks of requests and counts, per token, the ends at or before it
    (the reference's cumsum + searchsorted + gathers in one launch)."""
    batch = _check_ragged(starts, lens)
    device = starts.device
    positions = torch.empty(total_tokens, dtype=torch.int64, device=device)
    request = torch.empty(total_tokens, dtype=torch.int64, device=device)
    if total_tokens > 0:
        block_t = min(32, next_pow2(total_tokens))
        _ragged_positions_kernel[(_dispatch.cdiv(total_tokens, block_t),)](
            starts.contiguous(), lens.contiguous(), positions, request, batch, total_tokens,
            BLOCK_T=block_t,
            BLOCK_B=min(32, next_pow2(batch)),
            num_warps=1 if block_t <= 16 else 4, **pdl_options(),
        )
    return positions, request


def extend_positions(
    seq_lens: torch.Tensor,  # [B] i64, first position of each request's block
    width: int,
) -> torch.Tensor:  # [B*W] i64
    """Fixed-width blocks: row ``b*W + j`` is at position ``seq_lens[b] + j``."""
    if use_triton(seq_lens):
        return extend_positions_triton(seq_lens, width)
    return extend_positions_reference(seq_lens, width)


def extend_rows(
    seq_lens: torch.Tensor,  # [B] i64, first position of each request's block
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [B*W], token_req [B*W]
    """Fixed-width blocks: row ``b*W + j`` is at position ``seq_lens[b] + j`` and belongs to
    request ``b``."""
    if use_triton(seq_lens):
        return extend_rows_triton(seq_lens, width)
    return extend_rows_reference(seq_lens, width)


def ragged_extend_positions(
    starts: torch.Tensor,  # [B] i64, first position of each request's tokens
    lens: torch.Tensor,  # [B] i64 >= 0, tokens of each request
    total_tokens: int,  # T >= sum(lens), given by the caller so that nothing syncs
) -> tuple[torch.Tensor, torch.Tensor]:  # positions [T], request_index [T]
    """Ragged blocks packed back to back (see :func:`ragged_extend_positions_reference`)."""
    if use_triton(starts):
        return ragged_extend_positions_triton(starts, lens, total_tokens)
    return ragged_extend_positions_reference(starts, lens, total_tokens)
