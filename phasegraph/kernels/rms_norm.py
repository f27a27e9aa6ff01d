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

from phasegraph.kernels._checks import expect, expect_float, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes
from phasegraph.kernels.split_sum import SplitSum, load_total, materialize, split_args


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
def _normalise(s, w, hidden, eps):
    """``w * s / sqrt(mean(s^2) + eps)`` of one row, rounded as the reference rounds it
    (statistics and scaling in float32, cast, weight product in float32, cast)."""
    h = s.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / hidden
    n = (h * (1.0 / tl.sqrt(variance + eps))).to(s.dtype)
    return (w.to(tl.float32) * n.to(tl.float32)).to(s.dtype)


@jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, H], or [S, R, H] float32 partials (SLICES)
    residual_ptr,  # [T, H] (unused without HAS_RESIDUAL)
    weight_ptr,  # [H]
    normed_ptr,  # [T, H] out
    summed_ptr,  # [T, H] out
    x_bias_ptr,  # [H] the split product's bias (SLICES and X_BIAS)
    hidden,
    stride_x,
    stride_r,
    slice_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    SLICES: tl.constexpr,  # > 0: x is that many float32 partials of a split-K product
    X_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    t, cols, inside = row_lanes(BLOCK_H, hidden)
    x = load_total(x_ptr, t * stride_x + cols, inside, slice_stride, x_bias_ptr, cols,
                   SLICES, X_BIAS, summed_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_r + cols, mask=inside, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like the torch add
    else:
        s = x
    tl.store(summed_ptr + t * hidden + cols, s, mask=inside)
    w = tl.load(weight_ptr + cols, mask=inside, other=0.0)
    tl.store(normed_ptr + t * hidden + cols, _normalise(s, w, hidden, eps), mask=inside)


def add_rms_norm_triton(
    x: torch.Tensor | SplitSum,  # [T, H], unit stride along H
    residual: torch.Tensor | None,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual [T, H])
    """Triton ``add_rms_norm``: one program per token row (reads x, residual and the weight once,
    writes the sum and the normed row once). A :class:`SplitSum` ``x`` is summed as it is read."""
    split = isinstance(x, SplitSum)
    if not split:
        _check(x, residual, weight)
        if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
            return add_rms_norm_reference(x, residual, weight, eps)
    else:
        _check_split(x, residual, weight)
    tokens, hidden = x.shape
    dtype = x.dtype
    normed = torch.empty((tokens, hidden), dtype=dtype, device=x.device)
    summed = torch.empty((tokens, hidden), dtype=dtype, device=x.device)
    if tokens == 0:
        return normed, summed
    base, slices, slice_stride, x_bias = split_args(x)
    stride_x = hidden if split else x.stride(0)
    block = next_pow2(hidden)
    _add_rms_norm_kernel[(tokens,)](
        base, base if residual is None else residual, weight, normed, summed,
        weight if x_bias is None else x_bias,
        hidden, stride_x, stride_x if residual is None else residual.stride(0), slice_stride,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        SLICES=slices,
        X_BIAS=x_bias is not None,
        BLOCK_H=block,
        num_warps=8 if block >= 4096 else 4, **pdl_options(),
    )
    return normed, summed


def _check_split(x: SplitSum, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    """A deferred product feeds the norm like the tensor it stands for would."""
    expect_shape(weight, "weight", (x.shape[1],))
    if residual is not None:
        expect_shape(residual, "residual", tuple(x.shape))
        if residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(f"residual: expected a unit-stride {x.dtype} tensor, got {residual.dtype}")


def add_rms_norm(
    x: torch.Tensor | SplitSum,  # [T, H]
    residual: torch.Tensor | None,  # [T, H] or None
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual [T, H])
    """``(rms_norm(x + residual) * weight, x + residual)`` (Triton on CUDA). ``x`` may be a
    deferred split-K product (:class:`SplitSum`), summed as the kernel reads it."""
    if use_triton(x.partials if isinstance(x, SplitSum) else x):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(materialize(x), residual, weight, eps)


# --------------------------------------------------------------------------------------------
# Two rows normalised side by side (the EAGLE-3 head's input)


def _check_concat(a, a_weight, b, b_weight, a_rows=None) -> None:
    expect_float(a, "a", 2)
    expect_float(b, "b", 2)
    if a_rows is None:
        if b.shape[0] != a.shape[0] or b.dtype != a.dtype:
            raise ValueError(f"b: expected {a.shape[0]} rows of {a.dtype}, got {tuple(b.shape)} {b.dtype}")
    else:
        expect(a_rows, "a_rows", 1, torch.int64)
        expect_shape(a_rows, "a_rows", (b.shape[0],))
        if a_rows.device != a.device:
            raise ValueError(f"a_rows: expected a tensor on {a.device}, got one on {a_rows.device}")
    expect_shape(a_weight, "a_weight", (a.shape[1],))
    expect_shape(b_weight, "b_weight", (b.shape[1],))


def rms_norm_concat_reference(
    a: torch.Tensor,  # [T, Ha], or [V, Ha] rows to gather with a_rows
    a_weight: torch.Tensor,  # [Ha]
    a_eps: float,
    b: torch.Tensor,  # [T, Hb]
    b_weight: torch.Tensor,  # [Hb]
    b_eps: float,
    a_rows: torch.Tensor | None = None,  # [T] int64
) -> torch.Tensor:  # [T, Ha + Hb], dtype of b
    """``cat([rms_norm(a) * a_weight, rms_norm(b) * b_weight], -1)``: the EAGLE-3 head's input
    (Li et al., 2025, "EAGLE-3", arXiv 2503.01840: the token embedding and the fused feature,
    each normed, side by side), each half rounded as ``add_rms_norm_reference``. With
    ``a_rows``, ``a`` is a table (the embedding) and row t's first half normalises
    ``a[a_rows[t]]`` cast to b's dtype: the lookup and the cast are exact, so this equals
    gathering and casting first."""
    _check_concat(a, a_weight, b, b_weight, a_rows)
    if a_rows is not None:
        a = a.index_select(0, a_rows).to(b.dtype)  # [T, Ha]
    a_normed, _ = add_rms_norm_reference(a, None, a_weight, a_eps)
    b_normed, _ = add_rms_norm_reference(b, None, b_weight, b_eps)
    return torch.cat([a_normed, b_normed], dim=-1)


@jit
def _rms_norm_concat_kernel(
    a_ptr, b_ptr,  # [T, Ha] (or [V, Ha] with A_ROWS), [T, Hb] (unit stride along H)
    a_rows_ptr,  # [T] int64: the row of a for each token (A_ROWS)
    a_weight_ptr, b_weight_ptr,  # [Ha], [Hb]
    out_ptr,  # [T, Ha + Hb] out, contiguous, dtype of b
    a_hidden, b_hidden, stride_a, stride_b, a_eps, b_eps,
    A_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    second = tl.program_id(1) == 1  # program (t, 0) normalises a's row, (t, 1) b's
    hidden = tl.where(second, b_hidden, a_hidden)
    eps = tl.where(second, b_eps, a_eps)
    cols = tl.arange(0, BLOCK_H)
    inside = cols < hidden
    if second:
        x = tl.load(b_ptr + t * stride_b + cols, mask=inside, other=0.0)
        w = tl.load(b_weight_ptr + cols, mask=inside, other=0.0)
    else:
        row = t
        if A_ROWS:
            row = tl.load(a_rows_ptr + t)
        x = tl.load(a_ptr + row * stride_a + cols, mask=inside, other=0.0).to(out_ptr.dtype.element_ty)
        w = tl.load(a_weight_ptr + cols, mask=inside, other=0.0)
    offset = tl.where(second, a_hidden, 0)
    tl.store(out_ptr + t * (a_hidden + b_hidden) + offset + cols, _normalise(x, w, hidden, eps),
             mask=inside)


def rms_norm_concat_triton(
    a: torch.Tensor,  # [T, Ha] (or [V, Ha] with a_rows), unit stride along Ha
    a_weight: torch.Tensor,  # [Ha]
    a_eps: float,
    b: torch.Tensor,  # [T, Hb], unit stride along Hb
    b_weight: torch.Tensor,  # [Hb]
    b_eps: float,
    a_rows: torch.Tensor | None = None,  # [T] int64
) -> torch.Tensor:  # [T, Ha + Hb], dtype of b
    """Triton ``rms_norm_concat``: a (token, half) grid writing both halves of each output row,
    in place of two norm kernels and a concatenation (and, with ``a_rows``, of the embedding
    lookup and its cast)."""
    _check_concat(a, a_weight, b, b_weight, a_rows)
    if a.stride(1) != 1 or b.stride(1) != 1 or not (a_weight.is_contiguous() and b_weight.is_contiguous()):
        return rms_norm_concat_reference(a, a_weight, a_eps, b, b_weight, b_eps, a_rows)
    tokens, b_hidden = b.shape
    a_hidden = a.shape[1]
    out = torch.empty((tokens, a_hidden + b_hidden), dtype=b.dtype, device=b.device)
    if tokens == 0:
        return out
    block = next_pow2(max(a_hidden, b_hidden))
    _rms_norm_concat_kernel[(tokens, 2)](
        a, b, out if a_rows is None else a_rows.contiguous(), a_weight, b_weight, out,
        a_hidden, b_hidden, a.stride(0), b.stride(0), float(a_eps), float(b_eps),
        A_ROWS=a_rows is not None,
        BLOCK_H=block,
        num_warps=8 if block >= 4096 else 4, **pdl_options(),
    )
    return out


def rms_norm_concat(
    a: torch.Tensor,  # [T, Ha], or [V, Ha] rows to gather with a_rows
    a_weight: torch.Tensor,  # [Ha]
    a_eps: float,
    b: torch.Tensor,  # [T, Hb]
    b_weight: torch.Tensor,  # [Hb]
    b_eps: float,
    a_rows: torch.Tensor | None = None,  # [T] int64
) -> torch.Tensor:  # [T, Ha + Hb], dtype of b
    """``cat([rms_norm(a) * a_weight, rms_norm(b) * b_weight], -1)`` (one Triton launch on CUDA);
    with ``a_rows``, the first half normalises ``a[a_rows]`` cast to b's dtype."""
    if use_triton(b):
        return rms_norm_concat_triton(a, a_weight, a_eps, b, b_weight, b_eps, a_rows)
    return rms_norm_concat_reference(a, a_weight, a_eps, b, b_weight, b_eps, a_rows)
