"""Matrix products of few token rows ("skinny GEMM"), with the decoder layer's prologues fused.

At batch 1 a decode step is a stream of weight matrices: each product ``y = x W^T + b`` with
``x [M, K]``, ``W [N, K]`` and M = 1..16 tokens reads W once and does almost no arithmetic, so
its floor is ``N K`` bytes over the memory bandwidth. cuBLAS picks 64-wide tiles plus a split-K
reduce kernel for these shapes (~62-74% of copy bandwidth on the attention products of an 8B
model). The Triton kernel here gives each program ``BLOCK_N`` output columns, streams their
weight rows once over K in ``BLOCK_K`` chunks, accumulates in float32 and writes its columns
itself, in one launch. Optionally (``SkinnyConfig.split_k``, for few output columns) the
programs of a column block take slices of K: each stores its partial, and the last to arrive
(an atomic counter) sums the partials in slice order, so the result never depends on arrival
order and a CUDA-graph replay equals the eager call bit for bit either way. The counters are one
buffer per device, so split-K products must not run on two streams of a device at once (the
engine issues every product on one stream); the float32 rules of the bench pair's shapes and
the H200's 4-row 8B down product use it. Two forms: a broadcast multiply-sum over up to 16 rows
(at one row, with K <= 4096, one weight row per program and the whole K in one load is fastest)
and a ``tl.dot`` on a 16-row tile (padded rows masked; cp.async-pipelined weight tiles, wgmma
when W is the left operand).

Two prologues ride on the product's operand load, so the standalone kernels before the qkv,
gate_up and down products of a decoder layer disappear for small M:

- :func:`add_rms_norm_linear`: ``s = x + residual`` and RMSNorm of ``s`` (rounded exactly as
  :func:`~phasegraph.kernels.rms_norm.add_rms_norm_reference`: sum in the model dtype, normalise
  in float32, cast, multiply the weight, cast), then the product. Every program computes the row
  statistics itself (one extra pass over the H inputs, served by L2); program 0 stores ``s``.
- :func:`silu_mul_linear`: ``silu(gate) * up`` of a merged gate/up product (rounded as
  :func:`~phasegraph.kernels.activation.silu_mul_reference`), then the product.

Dispatch (the kernel-module convention of ``_dispatch.py``): the Triton kernel runs on CUDA for
M <= :data:`MAX_M` rows and contiguous inputs where the device's table says it wins: one file per
GPU name in ``phasegraph/kernels/configs/``, measured against cuBLAS by
``benchmarks/bench_linear.py`` (:mod:`~phasegraph.kernels.tile_tables` reads it; a GPU without
a file reads ``generic.json``). bf16/fp16: every product up to 16 rows, the fused prologues at
one row (at 2..16 rows the norm / silu kernel runs, then the Triton product). float32: K <= 4096,
IEEE multiply-sums, except the wide products at 2..16 rows, which run a three-pass TF32
``tl.dot`` (float32-level error) or stay with cuBLAS; longer K stays with cuBLAS. float32
products of 17..512 rows run the three-pass TF32 tiles of
:mod:`~phasegraph.kernels.tiled_linear` where its table has a rule.
Otherwise the public names run the ops they replace (``F.linear``; ``add_rms_norm`` then
``F.linear``; ``silu_mul`` then ``F.linear``), so large-M numbers are unchanged; a float32
product of 2..16 rows on the CPU is ``F.linear`` transposed (:func:`cpu_skinny_linear`).
The block shapes come from a fixed table, never from autotuning, so nothing is timed or compiled
differently during capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phasegraph.kernels._checks import expect_float, expect_shape
from phasegraph.kernels._dispatch import (
    PDL_LAUNCH,
    cdiv,
    early_weights_mode,
    jit,
    next_pow2,
    pdl_enter,
    pdl_options,
    tl,
    use_triton,
)
from phasegraph.kernels.activation import silu_mul, silu_mul_reference, swiglu
from phasegraph.kernels.rms_norm import add_rms_norm, add_rms_norm_reference
from phasegraph.kernels.split_sum import SplitSum
from phasegraph.kernels.tile_tables import SkinnyConfig, SkinnyRule, match_skinny, tables_for
from phasegraph.kernels.tiled_linear import tiled_config, tiled_linear_triton

MAX_M = 16  # the kernel's largest row tile (tl.dot needs >= 16 rows; padded rows are masked)
HALF_DTYPES = (torch.bfloat16, torch.float16)
TRITON_DTYPES = (*HALF_DTYPES, torch.float32)  # float32 where its table has a rule

_NONE, _RMS_NORM, _SILU_MUL = 0, 1, 2  # prologue kinds


def _check_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   inner: int, name: str) -> None:
    """``x`` is [M, *] and feeds ``inner`` inputs of ``weight [N, inner]`` (+ ``bias [N]``)."""
    expect_float(weight, "weight", 2)
    if weight.shape[1] != inner:
        raise ValueError(
            f"weight: expected shape (N, {inner}) for {name} of shape {tuple(x.shape)}, "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight: expected dtype {x.dtype}, got {weight.dtype}")
    if bias is not None:
        expect_shape(bias, "bias", (weight.shape[0],))
        if bias.dtype != x.dtype:
            raise ValueError(f"bias: expected dtype {x.dtype}, got {bias.dtype}")


def _check_linear(x, weight, bias) -> None:
    expect_float(x, "x", 2)
    _check_product(x, weight, bias, x.shape[1], "x")


def _check_norm_linear(x, residual, norm_weight, weight, bias) -> None:
    expect_float(x, "x", 2)
    if residual is not None:
        expect_shape(residual, "residual", tuple(x.shape))
        if residual.dtype != x.dtype:
            raise ValueError(f"residual: expected dtype {x.dtype}, got {residual.dtype}")
    expect_shape(norm_weight, "norm_weight", (x.shape[1],))
    _check_product(x, weight, bias, x.shape[1], "x")


def _check_silu_linear(gate_up, weight, bias) -> None:
    expect_float(gate_up, "gate_up", 2)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected an even last dimension, got {tuple(gate_up.shape)}")
    _check_product(gate_up, weight, bias, gate_up.shape[1] // 2, "gate_up")


# --------------------------------------------------------------------------------------------
# References (CPU path and oracle)


def linear_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [M, N]
    """``x @ weight.T + bias`` (``F.linear``); with ``out_dtype``, summed in float32 and rounded
    once, to ``out_dtype``."""
    _check_linear(x, weight, bias)
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(out_dtype)


def add_rms_norm_linear_reference(
    x: torch.Tensor,  # [M, H]
    residual: torch.Tensor | None,  # [M, H] or None
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    weight: torch.Tensor,  # [N, H]
    bias: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:  # (y [M, N], summed [M, H])
    """``add_rms_norm_reference`` then ``F.linear`` of the normed rows."""
    _check_norm_linear(x, residual, norm_weight, weight, bias)
    normed, summed = add_rms_norm_reference(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


def silu_mul_linear_reference(
    gate_up: torch.Tensor,  # [M, 2I]
    weight: torch.Tensor,  # [N, I]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [M, N]
    """``silu_mul_reference`` then :func:`linear_reference`."""
    _check_silu_linear(gate_up, weight, bias)
    return linear_reference(silu_mul_reference(gate_up), weight, bias, out_dtype)


# Rows at which the CPU runs :func:`cpu_skinny_linear` (one row is a BLAS vector product either way)
CPU_SKINNY_ROWS = (2, 16)


def cpu_skinny_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N], contiguous
    """``F.linear`` computed as ``(weight @ x.T).T``. For a few rows on the CPU, BLAS runs that
    orientation as one pass over the weights on every core, where ``F.linear``'s ``x @ W.T``
    takes a small-M path that streams them far slower: a verify of a few tokens then costs
    little more than a decode step, which is what speculation needs."""
    y = torch.mm(weight, x.t()).t().contiguous()  # [M, N]
    return y if bias is None else y.add_(bias)


def _cpu_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 == weight.dtype and x.dim() == 2
            and CPU_SKINNY_ROWS[0] <= x.shape[0] <= CPU_SKINNY_ROWS[1])


# --------------------------------------------------------------------------------------------
# Triton


# The launch tables (phasegraph/kernels/configs/, one file per GPU; tile_tables.py reads them)
# come from benchmarks/bench_linear.py. What their rules say, and why:
# - one row: a multiply-sum with one weight row per program and the whole K in one load (K <=
#   4096); for longer K a 512-wide loop, since the whole-K tile repeats the prologue per row.
# - 2..16 rows: tl.dot on a 16-row tile, wide products as wgmma tiles with W the left operand.
#   Fused prologues are off there: on that form they were slower than the norm / silu kernel
#   followed by the Triton product.
# - float32: an IEEE tl.dot runs on FMA units (half cuBLAS's speed), hence multiply-sums; the
#   three-pass TF32 dot wins only where N gives it enough 32-wide programs; K > 4096 is cuBLAS's.
# - split-K: products with few column blocks (the bench pair's 768- and 1280-wide ones) leave
#   most SMs idle; slicing K puts more programs in flight.
# - a vocabulary-wide lm_head (N >= 65536) stays with cuBLAS at 5..16 rows (not measured there).
# - an H200's one-row norm prologue takes two weight rows per program: each program computes the
#   row statistics once, and on its faster memory that pass per weight row shows.
# Where no rule answers, these defaults (the general rules' forms):
_GEMV_LOOP = SkinnyConfig(16, 512, 4, 3, dot=False)  # 16 weight rows, K in 512-chunks, 3 deep
_DOT = SkinnyConfig(32, 256, 4, 4, dot=True)
_FP32_GEMV_WHOLE_K = SkinnyConfig(2, 4096, 4, 1, dot=False)  # two weight rows, K at once
_FP32_GEMV4 = SkinnyConfig(4, 512, 4, 3, dot=False)  # [4, 4, 512] sums, 3 deep
_FP32_GEMV16 = SkinnyConfig(8, 64, 4, 3, dot=False)  # [16, 8, 64] sums, 3 deep


def _lookup(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
            device: torch.device | None = None) -> SkinnyRule | None:
    return match_skinny(tables_for(device).skinny(dtype), m, n, k)


def pick_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | None = None) -> SkinnyConfig:
    """The table's launch shape for ``m`` rows of an ``[n, k]`` weight (a default if none) on
    ``device`` (``None``: the current CUDA device, if any)."""
    rule = _lookup(m, n, k, dtype, device)
    if rule is not None:
        return rule.config
    if dtype == torch.float32:
        return _FP32_GEMV_WHOLE_K if m == 1 else _FP32_GEMV4 if m <= 4 else _FP32_GEMV16
    return _GEMV_LOOP if m == 1 else _DOT


@jit
def _load_rows(ptr, offs, mask, other_ptr, other_offs, ADD: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of ``ptr`` (+ the same tile of ``other_ptr``, rounded like the
    torch add)."""
    v = tl.load(ptr + offs, mask=mask, other=0.0)
    if ADD:
        r = tl.load(other_ptr + other_offs, mask=mask, other=0.0)
        v = (v.to(tl.float32) + r.to(tl.float32)).to(v.dtype)
    return v


@jit
def _operand(
    x_ptr, res_ptr, nw_ptr, rows, cols, M, K, stride_x, stride_r, rstd,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
):
    """The left operand tile [BLOCK_M, BLOCK_K] in the model dtype, prologue applied."""
    if EVEN_K:
        mask = rows[:, None] < M
    else:
        mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows[:, None] * stride_x + cols[None, :]
    if PROLOGUE == 2:  # silu(gate) * up, gate_up = [gate | up] of width 2K
        gate = tl.load(x_ptr + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + offs + K, mask=mask, other=0.0)
        a = swiglu(gate, up)
    elif PROLOGUE == 1:  # rms_norm(x + residual) * norm_weight
        s = _load_rows(x_ptr, offs, mask, res_ptr, rows[:, None] * stride_r + cols[None, :],
                       HAS_RESIDUAL)
        if EVEN_K:
            nw = tl.load(nw_ptr + cols)
        else:
            nw = tl.load(nw_ptr + cols, mask=cols < K, other=0.0)
        n = (s.to(tl.float32) * rstd[:, None]).to(s.dtype)
        a = (nw.to(tl.float32)[None, :] * n.to(tl.float32)).to(s.dtype)
    else:
        a = tl.load(x_ptr + offs, mask=mask, other=0.0)
    return a


@jit
def _mac(acc, a, w, DOT: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
         PRECISION: tl.constexpr):
    """acc += a [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K]^T, in the accumulator's layout."""
    if DOT:
        if PRECISION != "default":  # float32 operands
            if SWAP:
                acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        else:
            if SWAP:
                acc = tl.dot(w, tl.trans(a), acc)
            else:
                acc = tl.dot(a, tl.trans(w), acc)
    elif BLOCK_M == 1:  # acc [BLOCK_N, BLOCK_K]: products summed over K once, at the end
        acc += w.to(tl.float32) * a.to(tl.float32)
    else:  # acc [BLOCK_M, BLOCK_N, BLOCK_K]
        acc += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@jit
def _finish(acc, DOT: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] float32 result of an accumulator built by ``_mac``."""
    if DOT:
        if SWAP:
            out = tl.trans(acc)
        else:
            out = acc
    elif BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    return out


@jit
def _w_tile(w_rows, n_in, cols, K, EVEN_K: tl.constexpr):
    """W's rows ``w_rows`` [BLOCK_N, 1] at columns ``cols`` [BLOCK_K]: [BLOCK_N, BLOCK_K]."""
    if EVEN_K:
        return tl.load(w_rows + cols[None, :], mask=n_in[:, None], other=0.0)
    return tl.load(w_rows + cols[None, :], mask=n_in[:, None] & (cols[None, :] < K), other=0.0)


@jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,  # [M, K] (PROLOGUE 2: [M, 2K] gate | up)
    res_ptr,  # [M, K] residual (PROLOGUE 1 with HAS_RESIDUAL)
    nw_ptr,  # [K] norm weight (PROLOGUE 1)
    w_ptr,  # [N, K]
    b_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N] out
    summed_ptr,  # [M, K] out (PROLOGUE 1), written by program 0
    partial_ptr,  # [SPLIT_K, BLOCK_M, N] float32 scratch (SPLIT_K > 1)
    arrived_ptr,  # [column blocks] int32, zero between launches (SPLIT_K > 1)
    M,
    N,
    K,
    stride_x,
    stride_r,
    stride_w,
    stride_y,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STATS_K: tl.constexpr,
    DOT: tl.constexpr,
    SWAP: tl.constexpr,
    PRECISION: tl.constexpr,  # "default" (half dtypes), or a float32 dot's input_precision
    EVEN_K: tl.constexpr,
    SINGLE_K: tl.constexpr,  # each program's K range is one tile: the whole K, or its K slice
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DEFER: tl.constexpr,  # split-K: store the partials only; the consumer sums them (SplitSum)
    EARLY_W: tl.constexpr,  # SINGLE_K: load the weight tile before the PDL wait
):
    """``y = x W^T (+ b)`` for up to BLOCK_M rows: one program per BLOCK_N output columns (and
    per K slice with SPLIT_K), W streamed once (module docstring)."""
    pid = tl.program_id(0)
    k_begin, k_end = 0, K
    if SPLIT_K > 1:  # this program's slice of K: whole BLOCK_K tiles
        per_slice = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_begin = tl.program_id(1) * per_slice
        k_end = tl.minimum(k_begin + per_slice, K)
    cols_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = cols_n < N
    ks = tl.arange(0, BLOCK_K)
    tile_cols = k_begin + ks  # SINGLE_K: the program's one K tile (its slice's, with SPLIT_K)
    w_rows = w_ptr + cols_n.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    if EARLY_W:  # SINGLE_K, weights no kernel writes: the whole W tile, while the one before runs
        w_early = _w_tile(w_rows, n_in, tile_cols, K, EVEN_K)  # [BLOCK_N, BLOCK_K]
    pdl_enter(PDL)
    rows = tl.arange(0, BLOCK_M)
    row_in = rows < M

    if SINGLE_K:  # one K tile: load the operand once (the norm's statistics: SPLIT_K is 1)
        if EARLY_W:
            w = w_early
        else:
            w = _w_tile(w_rows, n_in, tile_cols, K, EVEN_K)
        if PROLOGUE == 1:
            if EVEN_K:
                mask = row_in[:, None]
            else:
                mask = row_in[:, None] & (ks[None, :] < K)
            s = _load_rows(x_ptr, rows[:, None] * stride_x + ks[None, :], mask,
                           res_ptr, rows[:, None] * stride_r + ks[None, :], HAS_RESIDUAL)
            tl.store(summed_ptr + rows[:, None] * K + ks[None, :], s, mask=mask & (pid == 0))
            h = s.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / K + eps)  # [BLOCK_M]
            if EVEN_K:
                nw = tl.load(nw_ptr + ks)
            else:
                nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0)
            n = (h * rstd[:, None]).to(s.dtype)
            a = (nw.to(tl.float32)[None, :] * n.to(tl.float32)).to(s.dtype)
        else:
            a = _operand(x_ptr, res_ptr, nw_ptr, rows, tile_cols, M, K, stride_x, stride_r, 0.0,
                         PROLOGUE, HAS_RESIDUAL, EVEN_K)
        if DOT:
            if SWAP:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            out = _finish(_mac(acc, a, w, DOT, SWAP, BLOCK_M, PRECISION), DOT, SWAP, BLOCK_M)
        elif BLOCK_M == 1:
            out = tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)[None, :]
        else:
            out = tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:
        if DOT:
            if SWAP:
                acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        elif BLOCK_M == 1:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if PROLOGUE == 1:  # row statistics of s = x + residual (program 0 also stores s)
            sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, STATS_K):
                cols = k0 + tl.arange(0, STATS_K)
                mask = row_in[:, None] & (cols[None, :] < K)
                s = _load_rows(x_ptr, rows[:, None] * stride_x + cols[None, :], mask,
                               res_ptr, rows[:, None] * stride_r + cols[None, :], HAS_RESIDUAL)
                tl.store(summed_ptr + rows[:, None] * K + cols[None, :], s,
                         mask=mask & (pid == 0))
                h = s.to(tl.float32)
                sq += tl.sum(h * h, axis=1)
            rstd = 1.0 / tl.sqrt(sq / K + eps)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):  # W tiles, STAGES deep
            cols = k0 + ks
            w = _w_tile(w_rows, n_in, cols, K, EVEN_K)
            a = _operand(x_ptr, res_ptr, nw_ptr, rows, cols, M, K, stride_x, stride_r, rstd,
                         PROLOGUE, HAS_RESIDUAL, EVEN_K)
            acc = _mac(acc, a, w, DOT, SWAP, BLOCK_M, PRECISION)
        out = _finish(acc, DOT, SWAP, BLOCK_M)

    y_offs = rows[:, None] * stride_y + cols_n[None, :]
    y_mask = row_in[:, None] & n_in[None, :]
    if SPLIT_K > 1:  # publish this slice's partial; the last slice to arrive writes y
        part_offs = rows[:, None] * N + cols_n[None, :]  # [BLOCK_M, BLOCK_N] in one slice
        tl.store(partial_ptr + tl.program_id(1) * BLOCK_M * N + part_offs, out, mask=y_mask)
        if not DEFER:  # else the consumer sums the partials (SplitSum)
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(arrived_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k_slice in range(SPLIT_K):  # slice order, whatever the arrival order
                    total += tl.load(partial_ptr + k_slice * BLOCK_M * N + part_offs, mask=y_mask,
                                     other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    b = tl.load(b_ptr + cols_n, mask=n_in, other=0.0)
                    total += b.to(tl.float32)[None, :]
                tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
                tl.atomic_xchg(arrived_ptr + pid, 0, sem="relaxed", scope="gpu")  # for the next launch
    else:
        if HAS_BIAS:
            b = tl.load(b_ptr + cols_n, mask=n_in, other=0.0)
            out += b.to(tl.float32)[None, :]
        tl.store(y_ptr + y_offs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


EARLY_WEIGHT_MAX_BYTES = 32 << 20  # measured: the bench pair's products gain, the 8B shape's lose


def early_weight_load(one_tile: bool, static_weight: bool, weight_bytes: int, pdl: bool) -> bool:
    """Whether a product loads its weight tile before its PDL wait (``pdl_enter``).

    A kernel launched early is placed while the kernel before it still runs; loading its weights
    then overlaps the two, which is safe only for weights no kernel writes (``static_weight``:
    a model's parameters). Only one-tile products (each program's K range one tile: the whole K,
    the table's one-row forms, or one split-K slice) do it, and only up to
    ``EARLY_WEIGHT_MAX_BYTES`` of weights: small products gain the overlap, while large ones
    (many waves of programs) and products that loop over K lose more to the contention than
    they gain (measured with ``benchmarks/bench_linear.py``).
    ``PHASEGRAPH_EARLY_WEIGHTS``: ``auto`` (default) this rule; ``on`` any size; ``off`` never.
    """
    mode = early_weights_mode()
    if not (pdl and one_tile and static_weight) or mode == "off":
        return False
    return mode == "on" or weight_bytes <= EARLY_WEIGHT_MAX_BYTES


_ARRIVED: dict[torch.device, torch.Tensor] = {}  # per device: split-K arrival counters, all zero
_ARRIVED_SLOTS = 8192  # column blocks one split-K launch may use


def _arrival_counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed split-K counters (every launch leaves them zero again); None if they
    do not exist yet and the stream is capturing a CUDA graph (a zeroing recorded in a capture
    would run only at replay, so the caller runs without split-K instead)."""
    counters = _ARRIVED.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _ARRIVED[device] = torch.zeros(_ARRIVED_SLOTS, dtype=torch.int32, device=device)
    return counters


def _launch(prologue: int, x, residual, norm_weight, eps, weight, bias,
            config: SkinnyConfig | None, warmup: bool = False, defer: bool = False,
            static_weight: bool = False, out_dtype: torch.dtype | None = None):
    """(y, summed); with ``defer`` and a split-K config, y is a :class:`SplitSum`; y is
    ``out_dtype`` (default ``x``'s): the float32 sums rounded once, to that dtype."""
    m = x.shape[0]
    n, k = weight.shape
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    summed = torch.empty((m, k), dtype=x.dtype, device=x.device) if prologue == _RMS_NORM else None
    if m == 0 or n == 0:
        return y, summed
    if m > MAX_M:
        raise ValueError(f"x: the skinny product takes at most {MAX_M} rows, got {m}")
    cfg = config or pick_config(m, n, k, x.dtype, x.device)
    block_m = 16 if cfg.dot else next_pow2(m)  # multiply-sum: [BLOCK_M, BLOCK_N, BLOCK_K] sums
    block_k = min(cfg.block_k, max(next_pow2(k), 16))
    stats_k = min(max(next_pow2(k), 16), max(16, 8192 // block_m))
    precision = cfg.precision if x.dtype == torch.float32 else "default"
    if k == 0:
        raise ValueError("weight: K must be positive")
    split = cfg.split_k
    if split < 1:
        raise ValueError(f"config: split_k must be >= 1, got {split}")
    if split > 1 and prologue == _RMS_NORM:
        raise ValueError("config: split_k > 1 takes no norm prologue (every slice would need the "
                         "row statistics over the whole K)")
    tiles = cdiv(k, block_k)
    split = cdiv(tiles, cdiv(tiles, min(split, tiles)))  # whole tiles per slice, none empty
    blocks = cdiv(n, cfg.block_n)
    defer = defer and split > 1
    counters = None
    if split > 1 and not defer:
        counters = _arrival_counters(x.device) if blocks <= _ARRIVED_SLOTS else None
        if counters is None:
            split = 1
    partials = torch.empty((split, block_m, n), dtype=torch.float32, device=x.device) \
        if split > 1 else y
    single = split == tiles  # one K tile per program: the whole K, or one tile per K slice
    launch = PDL_LAUNCH if cfg.pdl else pdl_options()
    args = (
        x, x if residual is None else residual, x if norm_weight is None else norm_weight,
        weight, weight if bias is None else bias, y, y if summed is None else summed,
        partials, y if counters is None else counters,
        m, n, k, x.stride(0), x.stride(0) if residual is None else residual.stride(0),
        weight.stride(0), y.stride(0), float(eps),
    )
    meta = dict(
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, STATS_K=stats_k,
        DOT=cfg.dot, SWAP=cfg.dot and cfg.swap, PRECISION=precision, EVEN_K=k % block_k == 0,
        SINGLE_K=single, STAGES=cfg.num_stages, SPLIT_K=split, DEFER=defer,
        EARLY_W=early_weight_load(single, static_weight, weight.numel() * weight.element_size(),
                                  launch["PDL"]),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch,
    )
    grid = (blocks, split)
    if warmup:
        _skinny_kernel.warmup(*args, grid=grid, **meta)
    else:
        _skinny_kernel[grid](*args, **meta)
    if defer:
        return SplitSum(partials, m, bias, y.dtype), summed
    return y, summed


def _require_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the Triton product needs unit stride along the last dimension")
    return x


def linear_triton(
    x: torch.Tensor,  # [M, K], M <= 16
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: SkinnyConfig | None = None,
    warmup: bool = False,
    defer: bool = False,
    static_weight: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | SplitSum:  # [M, N]
    """Triton ``linear``: one program per ``block_n`` output columns, weight streamed once.
    ``warmup`` compiles without launching (the output is then not written); ``defer`` hands a
    split-K product on as a :class:`SplitSum` (its slices summed by the consumer);
    ``static_weight`` promises that no kernel writes ``weight`` (see :func:`early_weight_load`);
    ``out_dtype``: the output's dtype (default ``x``'s)."""
    _check_linear(x, weight, bias)
    _require_rows(x, "x")
    _require_rows(weight, "weight")
    y, _ = _launch(_NONE, x, None, None, 0.0, weight, bias, config, warmup, defer, static_weight,
                   out_dtype)
    return y


def add_rms_norm_linear_triton(
    x: torch.Tensor,  # [M, H], M <= 16
    residual: torch.Tensor | None,  # [M, H]
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    weight: torch.Tensor,  # [N, H]
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: SkinnyConfig | None = None,
    warmup: bool = False,
    static_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (y [M, N], summed [M, H])
    """Triton ``add_rms_norm_linear``: the norm is the product's operand prologue (no split-K,
    so never deferred)."""
    _check_norm_linear(x, residual, norm_weight, weight, bias)
    if norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight: expected dtype {x.dtype}, got {norm_weight.dtype}")
    _require_rows(x, "x")
    _require_rows(weight, "weight")
    if residual is not None:
        _require_rows(residual, "residual")
    return _launch(_RMS_NORM, x, residual, norm_weight, eps, weight, bias, config, warmup,
                   static_weight=static_weight)


def silu_mul_linear_triton(
    gate_up: torch.Tensor,  # [M, 2I], M <= 16
    weight: torch.Tensor,  # [N, I]
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: SkinnyConfig | None = None,
    warmup: bool = False,
    defer: bool = False,
    static_weight: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | SplitSum:  # [M, N]
    """Triton ``silu_mul_linear``: ``silu(gate) * up`` is the product's operand prologue."""
    _check_silu_linear(gate_up, weight, bias)
    _require_rows(gate_up, "gate_up")
    _require_rows(weight, "weight")
    y, _ = _launch(_SILU_MUL, gate_up, None, None, 0.0, weight, bias, config, warmup, defer,
                   static_weight, out_dtype)
    return y


# --------------------------------------------------------------------------------------------
# Dispatch


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fused: bool,
          *others: torch.Tensor | None) -> bool:
    """Whether the Triton product runs (else the ops it replaces)."""
    if not use_triton(x) or x.dtype not in TRITON_DTYPES or not 1 <= x.shape[0] <= MAX_M:
        return False
    tensors = (x, weight, bias, *others)
    if any(t is not None and (t.dtype != x.dtype or not t.is_contiguous()) for t in tensors):
        return False
    rule = _lookup(x.shape[0], weight.shape[0], weight.shape[1], x.dtype, x.device)
    if rule is None:  # half precision: the default tiles; float32: only where measured
        return x.dtype in HALF_DTYPES
    return rule.fused if fused else rule.plain


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    defer: bool = False,
    static_weight: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | SplitSum:  # [M, N]
    """``F.linear`` (the Triton skinny product on CUDA for few rows; float32 at 17..512 rows, the
    three-pass TF32 tiles of :mod:`~phasegraph.kernels.tiled_linear` where its table has a rule;
    :func:`cpu_skinny_linear` for float32 at 2..16 rows on the CPU).
    ``defer``: where the table splits K, return the unsummed :class:`SplitSum` for a consumer
    that takes one (``add_rms_norm``, ``silu_mul`` and the fused forms below).
    ``static_weight``: no kernel ever writes ``weight`` (a model's parameter), so a one-tile
    product may load it before the kernel before it ends (:func:`early_weight_load`).
    ``out_dtype`` (default ``x``'s): a half-precision product summed in float32 comes back
    rounded once, to this dtype (tensor-parallel partial sums are float32 until summed)."""
    _check_linear(x, weight, bias)
    if _fits(x, weight, bias, False):
        return linear_triton(x, weight, bias, defer=defer, static_weight=static_weight, out_dtype=out_dtype)
    if out_dtype is not None and out_dtype != x.dtype:
        return _linear_to(x, weight, bias, out_dtype)
    tile = tiled_config(x, weight, bias, defer)  # float32, 17..512 rows
    if tile is not None:
        return tiled_linear_triton(x, weight, bias, config=tile, defer=defer)
    if _cpu_skinny(x, weight):
        return cpu_skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _linear_to(x, weight, bias, out_dtype) -> torch.Tensor:
    """:func:`linear` off the Triton product, with an output dtype other than ``x``'s."""
    if x.is_cuda and out_dtype == torch.float32 and x.dtype in HALF_DTYPES:  # cuBLAS: float32 sums, kept
        y = torch.mm(x, weight.t(), out_dtype=out_dtype)
        return y if bias is None else y.add_(bias)
    return linear_reference(x, weight, bias, out_dtype)


def add_rms_norm_linear(
    x: torch.Tensor,  # [M, H]
    residual: torch.Tensor | None,  # [M, H] or None
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    weight: torch.Tensor,  # [N, H]
    bias: torch.Tensor | None = None,  # [N]
    *,
    defer: bool = False,
    static_weight: bool = False,
) -> tuple[torch.Tensor | SplitSum, torch.Tensor]:  # (y [M, N], summed [M, H])
    """``normed, summed = add_rms_norm(x, residual, norm_weight, eps)``; return
    ``(linear(normed, weight, bias), summed)`` (one Triton launch where the table fuses it).
    ``x`` may be a :class:`SplitSum` (the norm kernel sums it); ``defer`` and ``static_weight``
    as in :func:`linear`."""
    if isinstance(x, SplitSum):  # a deferred product: the norm kernel sums its slices
        normed, summed = add_rms_norm(x, residual, norm_weight, eps)
        return linear(normed, weight, bias, defer=defer, static_weight=static_weight), summed
    _check_norm_linear(x, residual, norm_weight, weight, bias)
    if _fits(x, weight, bias, True, residual, norm_weight):
        return add_rms_norm_linear_triton(x, residual, norm_weight, eps, weight, bias,
                                          static_weight=static_weight)
    normed, summed = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias, defer=defer, static_weight=static_weight), summed


def silu_mul_linear(
    gate_up: torch.Tensor,  # [M, 2I]
    weight: torch.Tensor,  # [N, I]
    bias: torch.Tensor | None = None,  # [N]
    *,
    defer: bool = False,
    static_weight: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | SplitSum:  # [M, N]
    """``linear(silu_mul(gate_up), weight, bias)`` (one Triton launch where the table fuses it).
    ``gate_up`` may be a :class:`SplitSum` (the SwiGLU kernel sums it); ``defer``,
    ``static_weight`` and ``out_dtype`` as in :func:`linear`."""
    if isinstance(gate_up, SplitSum):
        act = silu_mul(gate_up)
        return linear(act, weight, bias, defer=defer, static_weight=static_weight, out_dtype=out_dtype)
    _check_silu_linear(gate_up, weight, bias)
    if _fits(gate_up, weight, bias, True):
        return silu_mul_linear_triton(gate_up, weight, bias, defer=defer,
                                      static_weight=static_weight, out_dtype=out_dtype)
    return linear(silu_mul(gate_up), weight, bias, defer=defer, static_weight=static_weight,
                  out_dtype=out_dtype)
