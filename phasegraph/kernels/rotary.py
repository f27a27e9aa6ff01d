"""Rotary position embedding of queries and keys, fused with the paged KV write.

RoPE (Su et al., 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding"), in the
"rotate half" layout of the Llama family: ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = [-x2, x1]``. ``cos``/``sin`` come from the model's own rotary module (so
every rope scaling it supports carries over): either one row per token, or (``rows`` given) a
table of rows per position that the kernel gathers from itself, which saves the two gathers a
forward would otherwise launch (runtime/models/rotary_table.py). The reference is transformers'
``apply_rotary_pos_emb`` followed by :func:`~phasegraph.kernels.attention.write_kv_reference`;
the Triton version rotates q and k, and writes the rotated key and the value into the pool, in
one launch (the reference takes ~12 kernels per layer). Each product and the sum are rounded to
the model dtype as torch rounds them.
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect, expect_float, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes
from phasegraph.kernels.attention import write_kv_reference


def _check(q, k, v, cos, sin, k_cache, v_cache, slots, rows=None) -> None:
    expect_float(q, "q", 3)
    expect_float(k, "k", 3)
    expect_shape(v, "v", tuple(k.shape))
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q: rotary embedding needs an even head_dim, got {head_dim}")
    expect_shape(k, "k", (tokens, k.shape[1], head_dim))
    if rows is None:
        expect_shape(cos, "cos", (tokens, head_dim))
        expect_shape(sin, "sin", (tokens, head_dim))
    else:  # tables: one row per position
        expect(rows, "rows", 1, torch.int64)
        expect_shape(rows, "rows", (tokens,))
        expect_shape(cos, "cos", (cos.shape[0], head_dim))
        expect_shape(sin, "sin", tuple(cos.shape))
    expect(slots, "slots", 1, torch.int64)
    expect_shape(slots, "slots", (tokens,))
    expect_shape(v_cache, "v_cache", tuple(k_cache.shape))
    if tuple(k_cache.shape[1:]) != tuple(k.shape[1:]):
        raise ValueError(f"k_cache: rows of shape {tuple(k.shape[1:])} expected, got {tuple(k_cache.shape)}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_write_kv_reference(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D], or [P, D] with rows
    sin: torch.Tensor,  # [T, D], or [P, D] with rows
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    slots: torch.Tensor,  # [T] i64; negative entries go to the sink slot 0
    rows: torch.Tensor | None = None,  # [T] i64: token t's row of the cos/sin tables
) -> torch.Tensor:  # rotated q [T, H, D]
    """Rotate ``q`` and ``k`` by their positions' angles; write rotated k and v at ``slots``."""
    _check(q, k, v, cos, sin, k_cache, v_cache, slots, rows)
    if rows is not None:
        cos, sin = cos.index_select(0, rows), sin.index_select(0, rows)  # [T, D]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]
    q_rot = q * cos + rotate_half(q) * sin
    k_rot = k * cos + rotate_half(k) * sin
    write_kv_reference(k_cache, v_cache, slots, k_rot, v)
    return q_rot


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _rotate(x1, x2, c1, c2, s1, s2):
    """Both halves of ``x * cos + rotate_half(x) * sin``, each op rounded to x's dtype."""
    dt = x1.dtype
    f = tl.float32
    a1 = (x1.to(f) * c1).to(dt).to(f)
    b1 = (-x2.to(f) * s1).to(dt).to(f)
    a2 = (x2.to(f) * c2).to(dt).to(f)
    b2 = (x1.to(f) * s2).to(dt).to(f)
    return (a1 + b1).to(dt), (a2 + b2).to(dt)


@jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr,  # [T, H, D], [T, Hkv, D], [T, Hkv, D] (unit stride along D)
    cos_ptr, sin_ptr,  # [T, D], or [P, D] tables (INDEXED)
    k_cache_ptr, v_cache_ptr,  # [slots, Hkv, D]
    slots_ptr,  # [T] i64
    rows_ptr,  # [T] i64: token t's table row (INDEXED)
    q_out_ptr,  # [T, H, D] out, contiguous
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_st,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INDEXED: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    t, cols, inside = row_lanes(BLOCK_HALF, HALF)
    head = tl.program_id(1)
    if INDEXED:
        row = tl.load(rows_ptr + t)
    else:
        row = t
    c1 = tl.load(cos_ptr + row * stride_ct + cols, mask=inside, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * stride_ct + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_st + cols, mask=inside, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_st + HALF + cols, mask=inside, other=0.0).to(tl.float32)
    if head < NUM_Q_HEADS:
        src = q_ptr + t * stride_qt + head * stride_qh
        y1, y2 = _rotate(tl.load(src + cols, mask=inside), tl.load(src + HALF + cols, mask=inside),
                         c1, c2, s1, s2)
        dst = q_out_ptr + (t * NUM_Q_HEADS + head) * (2 * HALF)
        tl.store(dst + cols, y1, mask=inside)
        tl.store(dst + HALF + cols, y2, mask=inside)
    else:
        kv_head = head - NUM_Q_HEADS
        slot = tl.maximum(tl.load(slots_ptr + t), 0)
        src = k_ptr + t * stride_kt + kv_head * stride_kh
        y1, y2 = _rotate(tl.load(src + cols, mask=inside), tl.load(src + HALF + cols, mask=inside),
                         c1, c2, s1, s2)
        dst = k_cache_ptr + slot * stride_kcs + kv_head * stride_kch
        tl.store(dst + cols, y1.to(k_cache_ptr.dtype.element_ty), mask=inside)
        tl.store(dst + HALF + cols, y2.to(k_cache_ptr.dtype.element_ty), mask=inside)
        vsrc = v_ptr + t * stride_vt + kv_head * stride_vh
        vdst = v_cache_ptr + slot * stride_vcs + kv_head * stride_vch
        v1 = tl.load(vsrc + cols, mask=inside)
        v2 = tl.load(vsrc + HALF + cols, mask=inside)
        tl.store(vdst + cols, v1.to(v_cache_ptr.dtype.element_ty), mask=inside)
        tl.store(vdst + HALF + cols, v2.to(v_cache_ptr.dtype.element_ty), mask=inside)


def rotary_write_kv_triton(
    q: torch.Tensor,  # [T, H, D], unit stride along D (views into a merged qkv product)
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D], or [P, D] with rows
    sin: torch.Tensor,  # [T, D], or [P, D] with rows
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    slots: torch.Tensor,  # [T] i64
    rows: torch.Tensor | None = None,  # [T] i64 in [0, P): token t's row of the tables
) -> torch.Tensor:  # rotated q [T, H, D]
    """Triton ``rotary_write_kv``: a (token, head) grid over H query heads and Hkv key/value
    heads; every element of q, k, v is read once and written once (q to a fresh tensor, k and v
    into the pool). With ``rows`` each program reads its token's cos/sin row of the tables."""
    _check(q, k, v, cos, sin, k_cache, v_cache, slots, rows)
    unit = all(x.stride(-1) == 1 for x in (q, k, v, cos, sin, k_cache, v_cache))
    if not unit:
        return rotary_write_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slots, rows)
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    slots = slots.contiguous()
    indexed = rows is not None
    rows = rows.contiguous() if indexed else slots  # (unread without INDEXED)
    half = head_dim // 2
    _rotary_write_kv_kernel[(tokens, num_heads + num_kv_heads)](
        q, k, v, cos, sin, k_cache, v_cache, slots, rows, q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_Q_HEADS=num_heads,
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        INDEXED=indexed,
        num_warps=1, **pdl_options(),
    )
    return q_out


def rotary_write_kv(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D], or [P, D] with rows
    sin: torch.Tensor,  # [T, D], or [P, D] with rows
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    slots: torch.Tensor,  # [T] i64; negative entries go to the sink slot 0
    rows: torch.Tensor | None = None,  # [T] i64 in [0, P): token t's row of the cos/sin tables
) -> torch.Tensor:  # rotated q [T, H, D]
    """RoPE on q and k, then k and v written into the paged pool (Triton on CUDA)."""
    if use_triton(q):
        return rotary_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slots, rows)
    return rotary_write_kv_reference(q, k, v, cos, sin, k_cache, v_cache, slots, rows)
