"""The SwiGLU activation of a merged gate/up projection: ``silu(gate) * up``.

SwiGLU (Shazeer, 2020, "GLU Variants Improve Transformer"). The fused decoder path computes
gate and up in one matrix product ``[T, 2I]``; this takes its two halves. The reference is the
op sequence of transformers' ``LlamaMLP`` (``act_fn(gate) * up`` in the model dtype); the Triton
version is one launch instead of two (and reads the merged product once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phasegraph.kernels._checks import expect_float
from phasegraph.kernels._dispatch import cdiv, jit, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_block
from phasegraph.kernels.split_sum import SplitSum, load_total, materialize, split_args


def _check(gate_up: torch.Tensor) -> None:
    expect_float(gate_up, "gate_up", 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected an even last dimension, got {tuple(gate_up.shape)}")


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(gate_up[:, :I]) * gate_up[:, I:]``, each op rounded to the model dtype."""
    _check(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --------------------------------------------------------------------------------------------
# Triton


@jit
def swiglu(gate, up):
    """``silu(gate) * up`` of two tiles in the model dtype, each op rounded to it as
    ``F.silu(gate) * up`` rounds (the math every SwiGLU kernel here shares)."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu, rounded like F.silu
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2I], or [S, R, 2I] float32 partials (SLICES)
    out_ptr,  # [T, I] out
    bias_ptr,  # [2I] the split product's bias (SLICES and HAS_BIAS)
    inner,
    stride_in,
    slice_stride,
    SLICES: tl.constexpr,  # > 0: gate_up is that many float32 partials of a split-K product
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    t, cols, inside = row_block(BLOCK, inner)
    dtype = out_ptr.dtype.element_ty
    gate = load_total(gate_up_ptr, t * stride_in + cols, inside, slice_stride, bias_ptr, cols,
                      SLICES, HAS_BIAS, dtype)
    up = load_total(gate_up_ptr, t * stride_in + inner + cols, inside, slice_stride, bias_ptr,
                    inner + cols, SLICES, HAS_BIAS, dtype)
    tl.store(out_ptr + t * inner + cols, swiglu(gate, up), mask=inside)


def silu_mul_triton(gate_up: torch.Tensor | SplitSum) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """Triton ``silu_mul``: a 2-d grid of (token, block of I) programs; reads 2I, writes I. A
    :class:`SplitSum` is summed as it is read."""
    split = isinstance(gate_up, SplitSum)
    if split:
        if gate_up.shape[1] % 2:
            raise ValueError(f"gate_up: expected an even last dimension, got {tuple(gate_up.shape)}")
    else:
        _check(gate_up)
        if gate_up.stride(1) != 1:
            return silu_mul_reference(gate_up)
    tokens, width = gate_up.shape
    inner = width // 2
    out = torch.empty((tokens, inner), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0 or inner == 0:
        return out
    base, slices, slice_stride, bias = split_args(gate_up)
    block = 1024
    _silu_mul_kernel[(tokens, cdiv(inner, block))](
        base, out, out if bias is None else bias, inner, width if split else base.stride(0),
        slice_stride, SLICES=slices, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        **pdl_options(),
    )
    return out


def silu_mul(gate_up: torch.Tensor | SplitSum) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(gate) * up`` of a merged gate/up product (Triton on CUDA); a deferred split-K
    product (:class:`SplitSum`) is summed as the kernel reads it."""
    if use_triton(gate_up.partials if isinstance(gate_up, SplitSum) else gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_reference(materialize(gate_up))
