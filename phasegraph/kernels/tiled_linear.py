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

Dispatch: :func:`tiled_config` names the tile where the device's table (the ``tiled_float32``
table of its file in ``phasegraph/kernels/configs/``, measured against cuBLAS per product, then
on whole steps; :mod:`~phasegraph.kernels.tile_tables` reads it) has a rule;
:func:`phasegraph.kernels.linear.linear` runs it then, and ``F.linear`` (the reference)
everywhere else above 16 rows. Tiles come from a fixed table, never from autotuning, so nothing
is timed or compiled differently during capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phasegraph.kernels._dispatch import cdiv, jit, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels.split_sum import SplitSum, total_triton
from phasegraph.kernels.tile_tables import TileConfig, match_tile, tables_for

MIN_M, MAX_M = 17, 512  # rows the table covers (the skinny kernel takes 1-16)


# The table (phasegraph/kernels/configs/, one file per GPU; tile_tables.py reads it) has rules
# only for the bench pair's shapes; other shapes stay with cuBLAS (not measured). A deferred
# tile's consumer (the norm after o and down, SwiGLU after gate_up) sums the slices as it reads.
# It starts at 17 rows: at 16, alone its tiles beat the skinny kernel's deferred products, but
# the norm and SwiGLU then read 8 slices and the tree iteration lost.


def pick_tile(m: int, n: int, k: int, defer: bool = False,
              device: torch.device | None = None) -> TileConfig | None:
    """The table's tile for ``m`` rows of an ``[n, k]`` float32 weight on ``device`` (``None``:
    the current CUDA device, if any; ``defer``: for a caller that takes a :class:`SplitSum`), or
    None where cuBLAS keeps the product."""
    if not MIN_M <= m <= MAX_M:
        return None
    rule = match_tile(tables_for(device).tiled_float32, m, n, k)
    if rule is None:
        return None
    return rule.deferred if defer else rule.summed


def tiled_config(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 defer: bool = False) -> TileConfig | None:
    """The tile :func:`phasegraph.kernels.linear.linear` runs for this product, or None where it
    stays with ``F.linear`` (not float32, not 17..512 rows, a non-contiguous operand, no Triton
    for ``x``'s device, or no rule)."""
    if x.dtype != torch.float32 or not MIN_M <= x.shape[0] <= MAX_M or not use_triton(x):
        return None
    if any(t is not None and (t.dtype != x.dtype or not t.is_contiguous()) for t in (x, weight, bias)):
        return None
    return pick_tile(x.shape[0], weight.shape[0], weight.shape[1], defer, x.device)


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
