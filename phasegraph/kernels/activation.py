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
from phasegraph.kernels._dispatch import cdiv, jit, tl, use_triton


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
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2I]
    out_ptr,  # [T, I] out
    inner,
    stride_in,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < inner
    gate = tl.load(gate_up_ptr + t * stride_in + cols, mask=inside, other=0.0)
    up = tl.load(gate_up_ptr + t * stride_in + inner + cols, mask=inside, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu, rounded like F.silu
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + t * inner + cols, y, mask=inside)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """Triton ``silu_mul``: a 2-d grid of (token, block of I) programs; reads 2I, writes I."""
    _check(gate_up)
    if gate_up.stride(1) != 1:
        return silu_mul_reference(gate_up)
    tokens, width = gate_up.shape
    inner = width // 2
    out = torch.empty((tokens, inner), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0 or inner == 0:
        return out
    block = 1024
    _silu_mul_kernel[(tokens, cdiv(inner, block))](
        gate_up, out, inner, gate_up.stride(0), BLOCK=block, num_warps=4
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(gate) * up`` of a merged gate/up product (Triton on CUDA)."""
    if use_triton(gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)
