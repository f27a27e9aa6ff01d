"""Float32 products of 17-512 token rows as three-pass TF32 tiles.

Above 16 rows (the skinny kernel's largest tile, :mod:`phasegraph.kernels.linear`) a float32
product ``y = x W^T + b`` used to go to cuBLAS, which with TF32 off (the library's exactness
setting) runs FFMA kernels on the CUDA cores. These rows are a tree verify at batch >= 2 (16
rows per request), a chain verify, draft step or draft-extend at batch >= 5, and short prefills.
The kernel here computes them on tensor cores in three TF32 passes, ``hi*hi + hi*lo + lo*hi``
with ``hi = tf32(a)`` and ``lo = tf32(a - hi)`` (Triton's ``input_precision="tf32x3"``; the
split-precision scheme of Ootomo & Yokota, "Recovering single precision accuracy from Tensor
Cores while surpassing the FP32 theoretical peak performance", IJHPCA 2022), which keeps
float32-level error (within ~3e-7 of float64 at the bench pair's shapes, as cuBLAS's FFMA).

One program per ``block_m x block_n`` output tile and K slice; the row-block index varies
fastest, so the programs that share a weight tile run side by side and read it from L2 once.
With ``split_k`` > 1 every slice stores a float32 partial: a consumer that takes a
:class:`~phasegraph.kernels.split_sum.SplitSum` (the norm after ``o`` and ``down``, SwiGLU after
``gate_up``) sums them as it reads (``defer``); otherwise :func:`~phasegraph.kernels.split_sum.
total_triton` sums them in slice order. Either way the result never depends on which program
ran first, so a CUDA-graph replay equals the eager call bit for bit.

Dispatch: :func:`tiled_config` names the tile where :data:`FP32_TILE_CONFIGS` (measured against
cuBLAS per product, then on whole steps) has a
rule; :func:`phasegraph.kernels.linear.linear` runs it then, and ``F.linear`` (the reference)
everywhere else above 16 rows. Tiles come from a fixed table, never
from autotuning, so nothing is timed or compiled differently during capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phasegraph.kernels._dispatch import cdiv, jit, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels.split_sum import SplitSum, total_triton
from phasegraph.kernels.tile_tables import TileConfig, TileRule

MIN_M, MAX_M = 17, 512  # rows the table covers (the skinny kernel takes 1-16)


def _r(m_lo: int, m_hi: int, n: int, k: int, summed: TileConfig | None,
       deferred: TileConfig | None = None) -> TileRule:
    return TileRule((m_lo, m_hi), (n, n), (k, k), summed, deferred or summed)


_T = TileConfig
# The bench pair's shapes (target: hidden 768, qkv 1280, MLP 2560, vocabulary 8192; EAGLE-3
# head: fc 768 x 2304, qkv 1280 x 1536), picked by a sweep against cuBLAS (H100,
# 2026-11-25): per row range, the tile with the least time over the row
# counts timed in it, where it beats cuBLAS at each. Comments: row count, cuBLAS -> best tile,
# us per product in a CUDA graph with weights from memory (a deferred product's time leaves out
# what its consumer spends reading the slices). First match wins; other shapes stay with cuBLAS
# (not measured). On whole steps (H100, GPU time per step against
# cuBLAS): baseline at batch 32 -14.2 %, chain S=3 at batch 8 / 32 -17.4 / -16.3 %, tree K=4
# S=4 N=16 -15.7 / -20.6 %, batch 1 unchanged. Not here: 16-row tiles for the tree's verify at
# batch 1. Alone they beat the skinny kernel's deferred o (3.6 -> 3.2 us) and gate_up (10.0 ->
# 7.9) with 8 K slices, but the norm and SwiGLU then read 8 slices,
# and the tree iteration lost 5.7 % (0.751 -> 0.793 ms).
FP32_TILE_CONFIGS: tuple[TileRule, ...] = (
    # target qkv
    _r(17, 32, 1280, 768, _T(32, 64, 64, 4, 3, 8)),  # 32: 10.5 -> 6.9
    _r(33, 64, 1280, 768, _T(64, 32, 64, 4, 3, 8)),  # 40: 12.3 -> 7.0; 64: 12.1 -> 7.2
    _r(65, 128, 1280, 768, _T(64, 32, 64, 4, 3, 4)),  # 128: 13.8 -> 9.2
    _r(129, 256, 1280, 768, _T(64, 64, 32, 4, 3, 4)),  # 160: 16.9 -> 10.7; 256: 20.5 -> 14.1
    _r(257, 512, 1280, 768, _T(64, 64, 32, 4, 3, 2)),  # 512: 33.0 -> 22.5
    # target o (deferred: the norm after it sums the slices)
    _r(17, 32, 768, 768, _T(64, 32, 64, 4, 3, 4), _T(32, 64, 32, 4, 3, 8)),  # 32: 9.8 -> 4.0
    _r(33, 64, 768, 768, _T(64, 32, 64, 4, 3, 4), _T(64, 32, 32, 4, 3, 8)),  # 40: 10.1 -> 4.1; 64: 10.2 -> 4.2
    _r(65, 128, 768, 768, _T(64, 32, 32, 4, 3, 8), _T(64, 64, 32, 4, 3, 8)),  # 128: 12.3 -> 5.7
    _r(129, 256, 768, 768, _T(64, 32, 64, 4, 3, 4), _T(64, 64, 32, 4, 3, 8)),  # 160: 13.1 -> 6.7; 256: 15.2 -> 7.4
    _r(257, 512, 768, 768, _T(64, 64, 32, 4, 3, 4)),  # 512: 21.7 -> 11.5
    # target gate_up (deferred: SwiGLU sums the slices)
    _r(17, 32, 5120, 768, _T(32, 64, 32, 4, 3, 4)),  # 32: 16.9 -> 10.9
    _r(33, 64, 5120, 768, _T(64, 64, 32, 4, 3, 4)),  # 40: 21.2 -> 12.2; 64: 20.5 -> 12.7
    _r(65, 128, 5120, 768, _T(64, 32, 64, 4, 3, 1), _T(128, 64, 32, 8, 3, 4)),  # 128: 33.8 -> 21.2
    _r(129, 256, 5120, 768, _T(64, 32, 64, 4, 3, 1), _T(128, 64, 32, 8, 3, 4)),  # 160: 46.7 -> 27.0; 256: 53.9 -> 33.7
    _r(257, 512, 5120, 768, _T(128, 64, 32, 8, 3, 2)),  # 512: 105.6 -> 60.4
    # target down (deferred: the norm after it sums the slices)
    _r(17, 32, 768, 2560, _T(32, 64, 64, 4, 3, 8)),  # 32: 15.3 -> 8.6
    _r(33, 64, 768, 2560, _T(64, 32, 64, 4, 3, 8)),  # 40: 18.1 -> 8.9; 64: 17.9 -> 8.8
    _r(65, 128, 768, 2560, _T(64, 32, 64, 4, 3, 8)),  # 128: 21.2 -> 11.1
    _r(129, 256, 768, 2560, _T(64, 64, 32, 4, 3, 8)),  # 160: 27.2 -> 16.7; 256: 32.1 -> 17.6
    _r(257, 512, 768, 2560, _T(64, 64, 32, 4, 3, 4), _T(128, 64, 32, 8, 3, 8)),  # 512: 53.1 -> 31.8
    # lm_head
    _r(17, 32, 8192, 768, _T(32, 128, 32, 4, 3, 4)),  # 32: 25.1 -> 14.8
    _r(33, 64, 8192, 768, _T(64, 64, 64, 4, 3, 2)),  # 40: 26.4 -> 18.5; 64: 27.2 -> 18.9
    _r(65, 128, 8192, 768, _T(128, 64, 64, 8, 3, 1)),  # 128: 45.0 -> 25.2
    _r(129, 256, 8192, 768, _T(128, 128, 64, 8, 3, 1)),  # 160: 63.6 -> 38.6; 256: 74.8 -> 40.6
    _r(257, 512, 8192, 768, _T(128, 128, 64, 8, 3, 1)),  # 512: 130.1 -> 79.2
    # EAGLE-3 head fc
    _r(17, 32, 768, 2304, _T(32, 64, 32, 4, 3, 8)),  # 32: 14.4 -> 10.3
    _r(33, 64, 768, 2304, _T(64, 32, 64, 4, 3, 8)),  # 40: 16.9 -> 10.9; 64: 17.2 -> 10.9
    _r(65, 128, 768, 2304, _T(64, 32, 32, 4, 3, 8)),  # 128: 20.0 -> 13.4
    _r(129, 256, 768, 2304, _T(64, 64, 32, 4, 3, 8)),  # 160: 25.2 -> 17.5; 256: 29.7 -> 18.4
    _r(257, 512, 768, 2304, _T(64, 64, 32, 4, 3, 4)),  # 512: 49.1 -> 31.3
    # EAGLE-3 head qkv
    _r(17, 32, 1280, 1536, _T(64, 32, 64, 4, 3, 8)),  # 32: 13.7 -> 10.1
    _r(33, 64, 1280, 1536, _T(64, 32, 64, 4, 3, 8)),  # 40: 15.5 -> 10.2; 64: 15.6 -> 10.4
    _r(65, 128, 1280, 1536, _T(64, 64, 32, 4, 3, 8)),  # 128: 20.8 -> 14.0
    _r(129, 256, 1280, 1536, _T(64, 64, 32, 4, 3, 4)),  # 160: 27.3 -> 16.6; 256: 31.8 -> 22.9
    _r(257, 512, 1280, 1536, _T(128, 64, 32, 8, 3, 8)),  # 512: 54.5 -> 39.5
)


def pick_tile(m: int, n: int, k: int, defer: bool = False) -> TileConfig | None:
    """The table's tile for ``m`` rows of an ``[n, k]`` float32 weight (``defer``: for a caller
    that takes a :class:`SplitSum`), or None where cuBLAS keeps the product."""
    if not MIN_M <= m <= MAX_M:
        return None
    for rule in FP32_TILE_CONFIGS:
        if rule.m_range[0] <= m <= rule.m_range[1] and rule.n_range[0] <= n <= rule.n_range[1] \
                and rule.k_range[0] <= k <= rule.k_range[1]:
            return rule.deferred if defer else rule.summed
    return None


def tiled_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 defer: bool = False) -> TileConfig | None:
    """The tile :func:`phasegraph.kernels.linear.linear` runs for this product, or None where it
    stays with ``F.linear`` (not float32, not 17..512 rows, a non-contiguous operand, no Triton
    for ``x``'s device, or no rule)."""
    if x.dtype != torch.float32 or not MIN_M <= x.shape[0] <= MAX_M or not use_triton(x):
        return None
    if any(t is not None and (t.dtype != x.dtype or not t.is_contiguous()) for t in (x, weight, bias)):
        return None
    return pick_tile(x.shape[0], weight.shape[0], weight.shape[1], defer)


@jit(do_not_specialize=["M"])
def _tiled_kernel(
    x_ptr,  # [M, K] f32
    w_ptr,  # [N, K] f32
    b_ptr,  # [N] f32 (HAS_BIAS)
    out_ptr,  # [M, N] f32, or [SPLIT_K, M, N] f32 partials (SPLIT_K > 1)
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is whole BLOCK_K tiles, so is every slice (no K mask)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)  # fastest: the row blocks of one weight tile run together
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # whole tiles per slice
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K  # [BM, 1]
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # [1, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k  # [BK]
        if EVEN_K:
            a = tl.load(x_rows + k[None, :], mask=row_ok[:, None], other=0.0)  # [BM, BK]
            w = tl.load(w_cols + k[:, None], mask=col_ok[None, :], other=0.0)  # [BK, BN]
        else:
            k_ok = k < k_hi
            a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision="tf32x3")
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]  # [BM, BN]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:  # the bias is the consumer's, after the slices
        tl.store(out_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0)[None, :]
        tl.store(out_ptr + offs, acc, mask=mask)


def tiled_linear_triton(
    x: torch.Tensor,  # [M, K] float32, contiguous
    weight: torch.Tensor,  # [N, K] float32, contiguous
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: TileConfig,
    defer: bool = False,
) -> torch.Tensor | SplitSum:  # [M, N]
    """``x @ weight.T + bias`` in three-pass TF32 tiles. ``defer``: with ``split_k`` > 1, hand
    the partials on unsummed as a :class:`SplitSum` (its consumer sums them)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        raise ValueError("the tiled product takes float32 operands only")
    if weight.shape[1] != k or (bias is not None and tuple(bias.shape) != (n,)):
        raise ValueError(f"weight {tuple(weight.shape)} / bias {None if bias is None else tuple(bias.shape)} "
                         f"do not fit x {tuple(x.shape)}")
    if not (x.is_contiguous() and weight.is_contiguous() and (bias is None or bias.is_contiguous())):
        raise ValueError("the tiled product needs contiguous operands")
    if k == 0:
        raise ValueError("weight: K must be positive")
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=torch.float32, device=x.device)
    bm, bn, bk, warps, stages, split = config
    tiles = cdiv(k, bk)
    split = cdiv(tiles, cdiv(tiles, min(split, tiles)))  # whole tiles per slice, none empty
    out_shape = (split, m, n) if split > 1 else (m, n)
    out = torch.empty(out_shape, dtype=torch.float32, device=x.device)
    _tiled_kernel[(cdiv(m, bm), cdiv(n, bn), split)](
        x, weight, out if bias is None else bias, out, m, n, k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, HAS_BIAS=bias is not None,
        EVEN_K=k % bk == 0,
        num_warps=warps, num_stages=stages, **pdl_options(),
    )
    if split == 1:
        return out
    summands = SplitSum(out, m, bias, torch.float32)
    return summands if defer else total_triton(summands)


def tiled_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``)."""
    return F.linear(x, weight, bias)
