"""Residual add fused with RMSNorm, the two ops every pre-norm decoder layer opens with.

RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization"):
``y = w * x / sqrt(mean(x^2) + eps)``. The reference reproduces transformers' ``LlamaRMSNorm``
op for op (normalise in float32, cast back, then multiply the weight in the model dtype), so the
fused decoder path equals transformers' modules bit for bit in fp32 and to the rounding of the
same ops in bf16. The Triton version does the add, the statistics and the scale in one launch
(the reference takes ~8 kernels), which is what matters for a batch-1 decode step: 2 norms per
layer x 32 layers at ~3 µs of launch gap each.
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect_float, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, tl, use_triton


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    expect_float(x, "x", 2)
    expect_shape(weight, "weight", (x.shape[1],))
    if residual is not None:
        expect_shape(residual, "residual", tuple(x.shape))
        if residual.dtype != x.dtype:
            raise ValueError(f"residual: expected dtype {x.dtype}, got {residual.dtype}")


def add_rms_norm_reference(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H] or None (first layer: the residual is x itself)
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual [T, H])
    """``s = x + residual``; return ``(rms_norm(s) * weight, s)``, as transformers computes it."""
    _check(x, residual, weight)
    summed = x if residual is None else residual + x  # [T, H] in the model dtype
    h = summed.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)  # [T, 1]
    normed = weight * (h * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed, summed


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H] (unused without HAS_RESIDUAL)
    weight_ptr,  # [H]
    normed_ptr,  # [T, H] out
    summed_ptr,  # [T, H] out
    hidden,
    stride_x,
    stride_r,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    inside = cols < hidden
    x = tl.load(x_ptr + t * stride_x + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_r + cols, mask=inside, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like the torch add
    else:
        s = x
    tl.store(summed_ptr + t * hidden + cols, s, mask=inside)
    h = s.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / hidden
    n = (h * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=inside, other=0.0)
    y = (w.to(tl.float32) * n.to(tl.float32)).to(x.dtype)
    tl.store(normed_ptr + t * hidden + cols, y, mask=inside)


def add_rms_norm_triton(
    x: torch.Tensor,  # [T, H], unit stride along H
    residual: torch.Tensor | None,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual [T, H])
    """Triton ``add_rms_norm``: one program per token row (reads x, residual and the weight once,
    writes the sum and the normed row once)."""
    _check(x, residual, weight)
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        return add_rms_norm_reference(x, residual, weight, eps)
    tokens, hidden = x.shape
    normed = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    summed = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return normed, summed
    block = next_pow2(hidden)
    _add_rms_norm_kernel[(tokens,)](
        x, x if residual is None else residual, weight, normed, summed,
        hidden, x.stride(0), x.stride(0) if residual is None else residual.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block,
        num_warps=8 if block >= 4096 else 4,
    )
    return normed, summed


def add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H] or None
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual [T, H])
    """``(rms_norm(x + residual) * weight, x + residual)`` (Triton on CUDA)."""
    if use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)
