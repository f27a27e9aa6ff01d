"""Emitted and bonus tokens of a verified step: torch references and Triton kernels.

The per-request row stride of every per-node -> per-request gather is ``accept_index.shape[1]``
(W), never N or a constant: SGLang read bonus tokens with stride N, which is wrong (and out of
bounds) as soon as tree drafting makes N > W (SGLang #26866).

The references are two or three fused gathers each; the Triton versions are one small launch
each (one program per request), which matters only because every launch inside a captured
iteration costs a few microseconds.
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes


def gather_accepted_tokens_reference(
    predict: torch.Tensor,  # [B*N] i64, token emitted after each node
    accept_index: torch.Tensor,  # [B, W] i64, node rows of the accepted path, -1 padded
) -> torch.Tensor:  # [B, W] i64
    """Tokens emitted by each request this step, in order; -1 where ``accept_index`` is -1."""
    expect(predict, "predict", 1, torch.int64)
    expect(accept_index, "accept_index", 2, torch.int64)
    tokens = predict[accept_index.clamp(min=0)]
    return torch.where(accept_index >= 0, tokens, -1)


def fill_bonus_tokens_reference(
    predict: torch.Tensor,  # [B*N] i64
    accept_index: torch.Tensor,  # [B, W] i64
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
) -> torch.Tensor:  # [B] i64
    """The new bonus token of each request: its last emitted token."""
    expect(accept_index, "accept_index", 2, torch.int64)
    expect(accept_lens, "accept_lens", 1, torch.int64)
    batch, width = accept_index.shape
    expect_shape(accept_lens, "accept_lens", (batch,))
    tokens = gather_accepted_tokens_reference(predict, accept_index).reshape(batch * width)
    stride = accept_index.shape[1]  # W, the row stride of `tokens` (SGLang #26866)
    rows = torch.arange(batch, dtype=torch.int64, device=accept_index.device)
    return tokens[rows * stride + accept_lens - 1]


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _gather_accepted_kernel(
    predict_ptr,  # [B*N] i64
    accept_index_ptr,  # [B, W] i64
    tokens_ptr,  # [B, W] i64, out
    width,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, offs, ok = row_lanes(BLOCK_W, width)
    index = tl.load(accept_index_ptr + b * width + offs, mask=ok, other=-1)
    token = tl.load(predict_ptr + index, mask=ok & (index >= 0), other=-1)
    tl.store(tokens_ptr + b * width + offs, token, mask=ok)


@jit
def _fill_bonus_kernel(
    predict_ptr,  # [B*N] i64
    accept_index_ptr,  # [B, W] i64
    accept_lens_ptr,  # [B] i64 in [1, W]
    bonus_ptr,  # [B] i64, out
    width,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    col = tl.load(accept_lens_ptr + b) - 1
    index = tl.load(accept_index_ptr + b * width + col)  # row stride W (SGLang #26866)
    token = tl.load(predict_ptr + index, mask=index >= 0, other=-1)
    tl.store(bonus_ptr + b, token)


def gather_accepted_tokens_triton(
    predict: torch.Tensor,  # [B*N] i64
    accept_index: torch.Tensor,  # [B, W] i64, -1 padded
) -> torch.Tensor:  # [B, W] i64
    """Triton ``gather_accepted_tokens``: one program per request gathers its W tokens."""
    expect(predict, "predict", 1, torch.int64)
    expect(accept_index, "accept_index", 2, torch.int64)
    batch, width = accept_index.shape
    tokens = torch.empty((batch, width), dtype=torch.int64, device=accept_index.device)
    if batch > 0 and width > 0:
        _gather_accepted_kernel[(batch,)](
            predict.contiguous(), accept_index.contiguous(), tokens, width,
            BLOCK_W=next_pow2(width), num_warps=1, **pdl_options(),
        )
    return tokens


def fill_bonus_tokens_triton(
    predict: torch.Tensor,  # [B*N] i64
    accept_index: torch.Tensor,  # [B, W] i64
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
) -> torch.Tensor:  # [B] i64
    """Triton ``fill_bonus_tokens``: one program per request reads
    ``predict[accept_index[b, accept_lens[b] - 1]]`` directly (no [B, W] intermediate)."""
    expect(predict, "predict", 1, torch.int64)
    expect(accept_index, "accept_index", 2, torch.int64)
    expect(accept_lens, "accept_lens", 1, torch.int64)
    batch, width = accept_index.shape
    expect_shape(accept_lens, "accept_lens", (batch,))
    bonus = torch.empty(batch, dtype=torch.int64, device=accept_index.device)
    if batch > 0:
        _fill_bonus_kernel[(batch,)](
            predict.contiguous(), accept_index.contiguous(), accept_lens.contiguous(), bonus,
            width, num_warps=1, **pdl_options(),
        )
    return bonus


def gather_accepted_tokens(
    predict: torch.Tensor,  # [B*N] i64, token emitted after each node
    accept_index: torch.Tensor,  # [B, W] i64, node rows of the accepted path, -1 padded
) -> torch.Tensor:  # [B, W] i64
    """Tokens emitted by each request this step, in order; -1 where ``accept_index`` is -1."""
    if use_triton(accept_index):
        return gather_accepted_tokens_triton(predict, accept_index)
    return gather_accepted_tokens_reference(predict, accept_index)


def fill_bonus_tokens(
    predict: torch.Tensor,  # [B*N] i64
    accept_index: torch.Tensor,  # [B, W] i64
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
) -> torch.Tensor:  # [B] i64
    """The new bonus token of each request: its last emitted token."""
    if use_triton(accept_index):
        return fill_bonus_tokens_triton(predict, accept_index, accept_lens)
    return fill_bonus_tokens_reference(predict, accept_index, accept_lens)
