"""The second half of a decoder layer and its output head, for few rows, in one launch.

A draft head's forward at batch 1 (an EAGLE-3 tree step: K beams, 4 rows; draft-extend: the
accepted path, 5 rows) ends with::

    s1     = attn @ Wo^T + h                        the attention's output projection, residual
    x      = rms_norm(s1) * w_post
    act    = silu(x @ Wg^T) * (x @ Wu^T)            SwiGLU (Shazeer, 2020)
    out    = act @ Wd^T + s1                        the next hidden state
    logits = (rms_norm(out) * w_final) @ Wlm^T      the head's vocabulary

In the skinny-product path (:mod:`~phasegraph.kernels.linear`) that is seven launches at 2..16
rows (o, add_rms_norm, gate_up, silu_mul, down, add_rms_norm, lm_head) of 1-6 µs each, most of
it launch and memory latency rather than bytes: the weights are ~26 MB in bfloat16 for the bench
pair's head, 9 µs of an H100's bandwidth, against ~27 µs for the seven kernels and their gaps
(bench/RESULTS.md §5).

Here one launch runs the four products as a dataflow. Its programs take *tickets* (an atomic
counter) in the order of the work items: every column block of ``o``, then of gate/up, of
``down``, of ``lm_head``. An item of a later product waits until every item of the product before
it has published its columns (a per-product counter, release/acquire), and normalises its
operand rows itself as it loads them (each item recomputes the row statistics over H, from L2);
the gate/up item computes matching gate and up columns and applies SiLU x up before it stores.
A program only ever waits for items with smaller tickets, which programs already running hold,
so the launch cannot deadlock whatever the GPU's scheduling order, and Triton's interpreter
(which runs programs one after another, in ticket order) runs it as it is. The last ``lm_head``
item to finish sets the counters back to zero for the next launch (a CUDA-graph replay
included); the counters are one buffer per device, so two launches must not run at once on
two streams of a device (the engine issues every kernel on one stream).

Each item's product has the form and tile of the skinny kernel's table for its shape
(:func:`~phasegraph.kernels.linear.pick_config`, without split-K), and every rounding is the
unfused sequence's: the products round to the model dtype, the residual adds round like the
torch add, the norms scale in float32 and cast before and after the weight, SiLU and the
product with ``up`` round as :func:`~phasegraph.kernels.activation.silu_mul_reference`. Only the
order of the float32 sums differs (the tiles, and the norm's statistics summed in chunks), so
the output is within the products' rounding of :func:`decoder_tail_reference`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from phasegraph.kernels._checks import expect_float, expect_shape
from phasegraph.kernels._dispatch import cdiv, jit, next_pow2, tl, use_triton
from phasegraph.kernels.activation import silu_mul_reference
from phasegraph.kernels.linear import (
    HALF_DTYPES,
    MAX_M,
    SkinnyConfig,
    _finish,
    _mac,
    add_rms_norm_linear,
    linear,
    pick_config,
    silu_mul_linear,
)
from phasegraph.kernels.rms_norm import add_rms_norm_reference

TRITON_DTYPES = (*HALF_DTYPES, torch.float32)
_COUNTERS = 5  # the ticket, then the items done of o, gate/up, down and lm_head
# Weights up to which the one launch pays: beyond, the products stream for long enough that
# their launches' latency no longer shows (an 8B head: ~0.5 GB), while a launch of tens of
# thousands of narrow items would queue on its ticket counter. The bench pair's head: 26 MB
# in bfloat16, 52 MB in float32.
MAX_WEIGHT_BYTES = 64 << 20
SLEEP_NS = 0  # a wait's back-off between polls, in a compiled kernel (bench_kernels --only tail)
_DOT_ROWS = 5  # the tiles of the table's rules from this many rows on (16-row tl.dot tiles)


def _check(attn, h, o_weight, post_norm, gate_up_weight, down_weight, final_norm, lm_weight,
           logits_index) -> None:
    expect_float(attn, "attn", 2)
    expect_float(h, "h", 2)
    rows, hidden = h.shape
    if attn.shape[0] != rows:
        raise ValueError(f"attn: expected {rows} rows like h, got {tuple(attn.shape)}")
    expect_shape(o_weight, "o_weight", (hidden, attn.shape[1]))
    expect_shape(post_norm, "post_norm", (hidden,))
    expect_float(gate_up_weight, "gate_up_weight", 2)
    if gate_up_weight.shape[1] != hidden or gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight: expected shape (2I, {hidden}), got "
                         f"{tuple(gate_up_weight.shape)}")
    expect_shape(down_weight, "down_weight", (hidden, gate_up_weight.shape[0] // 2))
    expect_shape(final_norm, "final_norm", (hidden,))
    expect_float(lm_weight, "lm_weight", 2)
    if lm_weight.shape[1] != hidden:
        raise ValueError(f"lm_weight: expected shape (V, {hidden}), got {tuple(lm_weight.shape)}")
    for name, t in (("attn", attn), ("o_weight", o_weight), ("post_norm", post_norm),
                    ("gate_up_weight", gate_up_weight), ("down_weight", down_weight),
                    ("final_norm", final_norm), ("lm_weight", lm_weight)):
        if t.dtype != h.dtype:
            raise ValueError(f"{name}: expected dtype {h.dtype}, got {t.dtype}")
    if logits_index is not None:
        if logits_index.ndim != 1 or logits_index.dtype != torch.int64:
            raise ValueError(f"logits_index: expected a 1-d int64 tensor, got "
                             f"{tuple(logits_index.shape)} {logits_index.dtype}")


def decoder_tail_reference(
    attn: torch.Tensor,  # [R, A] the attention's output, before its o projection
    h: torch.Tensor,  # [R, H] the residual stream entering the layer
    o_weight: torch.Tensor,  # [H, A]
    post_norm: torch.Tensor,  # [H]
    post_eps: float,
    gate_up_weight: torch.Tensor,  # [2I, H] gate rows, then up rows
    down_weight: torch.Tensor,  # [H, I]
    final_norm: torch.Tensor,  # [H]
    final_eps: float,
    lm_weight: torch.Tensor,  # [V, H]
    logits_index: torch.Tensor | None = None,  # [L] i64: rows of ``out`` that get logits
) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [L or R, V], out [R, H])
    """The unfused references in sequence: ``o`` product, ``add_rms_norm``, gate/up product,
    ``silu_mul``, ``down`` product, ``add_rms_norm`` (of the selected rows), ``lm_head``."""
    _check(attn, h, o_weight, post_norm, gate_up_weight, down_weight, final_norm, lm_weight,
           logits_index)
    normed, s1 = add_rms_norm_reference(F.linear(attn, o_weight), h, post_norm, post_eps)
    act = silu_mul_reference(F.linear(normed, gate_up_weight))
    _, out = add_rms_norm_reference(F.linear(act, down_weight), s1, final_norm, final_eps)
    rows = out if logits_index is None else out.index_select(0, logits_index)
    final, _ = add_rms_norm_reference(rows, None, final_norm, final_eps)
    return F.linear(final, lm_weight), out


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _wait(counter_ptr, target, SLEEP_NS: tl.constexpr, NO_WAIT: tl.constexpr):
    """Spin until ``counter >= target``, then acquire: the stores its producers released before
    counting are visible to this program's loads after it. ``SLEEP_NS`` > 0: each failed poll
    backs off that long (``nanosleep``), so hundreds of waiting programs do not crowd the
    counter's cache line while its producers count on it."""
    if not NO_WAIT:
        while tl.load(counter_ptr, volatile=True) < target:
            if SLEEP_NS > 0:
                tl.inline_asm_elementwise("nanosleep.u32 $1;\n\tmov.u32 $0, 0;", "=r,r",
                                          [target * 0 + SLEEP_NS], dtype=tl.int32,
                                          is_pure=False, pack=1)
    tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@jit
def _publish(counter_ptr):
    """Count this item done once every thread's stores are in (release); the old count."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@jit
def _prefetch_rows(w_ptr, row0, rows, N, stride_w, CHUNK: tl.constexpr):
    """Ask L2 for weight rows ``row0 .. row0 + rows`` (clamped to ``N``) of a row-major ``W``,
    in 128-byte lines, without waiting: ``prefetch.global.L2`` returns at once, so an item
    streams its weights while the product before it still runs. Needs the compiled kernel
    (inline PTX), never the interpreter."""
    per_line: tl.constexpr = 128 // (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    begin = row0.to(tl.int64) * stride_w
    end = tl.minimum(row0 + rows, N).to(tl.int64) * stride_w
    for start in range(begin, end, CHUNK * per_line):
        offs = tl.minimum(start + tl.arange(0, CHUNK).to(tl.int64) * per_line, end - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [w_ptr + offs], dtype=tl.int32, is_pure=False, pack=1)


@jit
def _row_rstd(s_ptr, src_rows, row_in, stride_s, H, eps, BLOCK_M: tl.constexpr,
              STATS_K: tl.constexpr):
    """``1 / sqrt(mean(s^2) + eps)`` of rows ``src_rows`` [BLOCK_M] of ``s``, in float32."""
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, H, STATS_K):
        cols = k0 + tl.arange(0, STATS_K)
        mask = row_in[:, None] & (cols[None, :] < H)
        s = tl.load(s_ptr + src_rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg")
        v = s.to(tl.float32)
        sq += tl.sum(v * v, axis=1)
    return 1.0 / tl.sqrt(sq / H + eps)


@jit
def _operand_tile(a_ptr, src_rows, row_in, stride_a, cols, K, nw_ptr, rstd, NORM: tl.constexpr):
    """Rows ``src_rows`` of ``a`` at ``cols`` [BLOCK_K], normalised as ``add_rms_norm`` rounds
    (float32 scale, cast, weight product in float32, cast) when ``NORM``."""
    k_in = cols < K
    a = tl.load(a_ptr + src_rows[:, None] * stride_a + cols[None, :],
                mask=row_in[:, None] & k_in[None, :], other=0.0, cache_modifier=".cg")
    if NORM:
        nw = tl.load(nw_ptr + cols, mask=k_in, other=0.0)
        n = (a.to(tl.float32) * rstd[:, None]).to(a.dtype)
        a = (nw.to(tl.float32)[None, :] * n.to(tl.float32)).to(a.dtype)
    return a


@jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              DOT: tl.constexpr, SWAP: tl.constexpr):
    """The empty accumulator of :func:`~phasegraph.kernels.linear._mac`'s form."""
    if DOT:
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    return acc


@jit
def _product(a_ptr, src_rows, row_in, stride_a, w_ptr, stride_w, col0, N, K, nw_ptr, rstd,
             NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, DOT: tl.constexpr, SWAP: tl.constexpr,
             PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` float32: the operand rows times columns ``col0 ..`` of ``W^T``."""
    cols_n = col0 + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + cols_n.to(tl.int64)[:, None] * stride_w
    n_in = cols_n < N
    acc = _zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, DOT, SWAP)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + cols[None, :], mask=n_in[:, None] & (cols[None, :] < K), other=0.0)
        a = _operand_tile(a_ptr, src_rows, row_in, stride_a, cols, K, nw_ptr, rstd, NORM)
        acc = _mac(acc, a, w, DOT, SWAP, BLOCK_M, PRECISION)
    return _finish(acc, DOT, SWAP, BLOCK_M)


@jit
def _gate_up_product(a_ptr, rows, row_in, stride_a, w_ptr, stride_w, col0, inner, K, nw_ptr,
                     rstd, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr,
                     STAGES: tl.constexpr):
    """``silu(gate) * up`` [BLOCK_M, BLOCK_N] in the model dtype for gate/up columns ``col0 ..``
    of the normalised operand: both products from one pass over it, each rounded to the model
    dtype, then rounded as :func:`~phasegraph.kernels.activation.silu_mul_reference`."""
    cols_n = col0 + tl.arange(0, BLOCK_N)
    n_in = cols_n < inner
    gate_rows = w_ptr + cols_n.to(tl.int64)[:, None] * stride_w
    up_rows = w_ptr + (inner + cols_n).to(tl.int64)[:, None] * stride_w
    acc_g = _zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, DOT, SWAP)
    acc_u = _zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, DOT, SWAP)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        w_mask = n_in[:, None] & (cols[None, :] < K)
        wg = tl.load(gate_rows + cols[None, :], mask=w_mask, other=0.0)
        wu = tl.load(up_rows + cols[None, :], mask=w_mask, other=0.0)
        a = _operand_tile(a_ptr, rows, row_in, stride_a, cols, K, nw_ptr, rstd, True)
        acc_g = _mac(acc_g, a, wg, DOT, SWAP, BLOCK_M, PRECISION)
        acc_u = _mac(acc_u, a, wu, DOT, SWAP, BLOCK_M, PRECISION)
    dtype = w_ptr.dtype.element_ty
    gate = _finish(acc_g, DOT, SWAP, BLOCK_M).to(dtype)
    up = _finish(acc_u, DOT, SWAP, BLOCK_M).to(dtype)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)  # rounded like F.silu
    return (act.to(tl.float32) * up.to(tl.float32)).to(dtype)


@jit
def _store_sum(y, res_ptr, out_ptr, rows, row_in, cols_n, n_in, stride_r, stride_out):
    """``out = round(y) + residual``, rounded like the torch add of two model-dtype tensors."""
    mask = row_in[:, None] & n_in[None, :]
    r = tl.load(res_ptr + rows[:, None] * stride_r + cols_n[None, :], mask=mask, other=0.0,
                cache_modifier=".cg")
    s = (y.to(r.dtype).to(tl.float32) + r.to(tl.float32)).to(r.dtype)
    tl.store(out_ptr + rows[:, None] * stride_out + cols_n[None, :], s, mask=mask)


@jit
def _o_item(block, attn_ptr, h_ptr, o_w_ptr, s1_ptr, M, H, A, stride_attn, stride_h,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
            SWAP: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr):
    """Columns ``block`` of ``s1 = attn @ Wo^T + h``."""
    rows = tl.arange(0, BM)
    row_in = rows < M
    col0 = block * BN
    y = _product(attn_ptr, rows, row_in, stride_attn, o_w_ptr, A, col0, H, A, attn_ptr,
                 tl.zeros((BM,), dtype=tl.float32), False, BM, BN, BK, DOT, SWAP, PREC, STAGES)
    cols_n = col0 + tl.arange(0, BN)
    _store_sum(y, h_ptr, s1_ptr, rows, row_in, cols_n, cols_n < H, stride_h, H)


@jit
def _gate_up_item(block, s1_ptr, post_w_ptr, gu_w_ptr, act_ptr, M, H, inner, post_eps,
                  STATS_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  DOT: tl.constexpr, SWAP: tl.constexpr, STAGES: tl.constexpr,
                  PREC: tl.constexpr):
    """Columns ``block`` of ``act = silu(x @ Wg^T) * (x @ Wu^T)``, ``x = rms_norm(s1) * w``."""
    rows = tl.arange(0, BM)
    row_in = rows < M
    col0 = block * BN
    rstd = _row_rstd(s1_ptr, rows, row_in, H, H, post_eps, BM, STATS_K)
    act = _gate_up_product(s1_ptr, rows, row_in, H, gu_w_ptr, H, col0, inner, H, post_w_ptr,
                           rstd, BM, BN, BK, DOT, SWAP, PREC, STAGES)
    cols_n = col0 + tl.arange(0, BN)
    tl.store(act_ptr + rows[:, None] * inner + cols_n[None, :], act,
             mask=row_in[:, None] & (cols_n < inner)[None, :])


@jit
def _down_item(block, act_ptr, down_w_ptr, s1_ptr, out_ptr, M, H, inner,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
               SWAP: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr):
    """Columns ``block`` of ``out = act @ Wd^T + s1``."""
    rows = tl.arange(0, BM)
    row_in = rows < M
    col0 = block * BN
    y = _product(act_ptr, rows, row_in, inner, down_w_ptr, inner, col0, H, inner, act_ptr,
                 tl.zeros((BM,), dtype=tl.float32), False, BM, BN, BK, DOT, SWAP, PREC, STAGES)
    cols_n = col0 + tl.arange(0, BN)
    _store_sum(y, s1_ptr, out_ptr, rows, row_in, cols_n, cols_n < H, H, H)


@jit
def _lm_item(block, out_ptr, final_w_ptr, lm_w_ptr, index_ptr, logits_ptr, L, H, V, final_eps,
             HAS_INDEX: tl.constexpr, STATS_K: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, SWAP: tl.constexpr,
             STAGES: tl.constexpr, PREC: tl.constexpr):
    """Columns ``block`` of ``logits = (rms_norm(out[index]) * w_final) @ Wlm^T``."""
    rows = tl.arange(0, BM)
    row_in = rows < L
    src = rows.to(tl.int64)
    if HAS_INDEX:
        src = tl.load(index_ptr + rows, mask=row_in, other=0)
    col0 = block * BN
    rstd = _row_rstd(out_ptr, src, row_in, H, H, final_eps, BM, STATS_K)
    y = _product(out_ptr, src, row_in, H, lm_w_ptr, H, col0, V, H, final_w_ptr, rstd, True,
                 BM, BN, BK, DOT, SWAP, PREC, STAGES)
    cols_n = col0 + tl.arange(0, BN)
    tl.store(logits_ptr + rows[:, None] * V + cols_n[None, :],
             y.to(logits_ptr.dtype.element_ty), mask=row_in[:, None] & (cols_n < V)[None, :])


@jit(do_not_specialize=["M", "L"])
def _decoder_tail_kernel(
    sync_ptr,  # [5] int32: ticket, items done of o, gate/up, down, lm_head; zero between launches
    attn_ptr,  # [M, A]
    h_ptr,  # [M, H]
    o_w_ptr,  # [H, A]
    post_w_ptr,  # [H]
    gu_w_ptr,  # [2I, H]
    down_w_ptr,  # [H, I]
    final_w_ptr,  # [H]
    lm_w_ptr,  # [V, H]
    index_ptr,  # [L] i64 rows of out that get logits (HAS_INDEX)
    s1_ptr,  # [M, H] scratch: o + h
    act_ptr,  # [M, I] scratch: silu(gate) * up
    out_ptr,  # [M, H] out: act @ down^T + s1
    logits_ptr,  # [L, V] out
    M,
    L,
    H,
    A,
    inner,
    V,
    stride_attn,
    stride_h,
    post_eps,
    final_eps,
    HAS_INDEX: tl.constexpr,
    STATS_K: tl.constexpr,
    PREFETCH: tl.constexpr,  # items that wait first ask L2 for their weight rows
    SLEEP_NS: tl.constexpr,  # back-off between polls of a wait (0: none)
    NO_WAIT: tl.constexpr,  # timing diagnostic only: items never wait (the output is garbage)
    # per product (O, G gate/up, D down, L lm_head): rows, columns and K per tile, form,
    # W as the left operand, pipeline depth, a float32 dot's input precision
    BM_O: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr, DOT_O: tl.constexpr,
    SWAP_O: tl.constexpr, STAGES_O: tl.constexpr, PREC_O: tl.constexpr,
    BM_G: tl.constexpr, BN_G: tl.constexpr, BK_G: tl.constexpr, DOT_G: tl.constexpr,
    SWAP_G: tl.constexpr, STAGES_G: tl.constexpr, PREC_G: tl.constexpr,
    BM_D: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr, DOT_D: tl.constexpr,
    SWAP_D: tl.constexpr, STAGES_D: tl.constexpr, PREC_D: tl.constexpr,
    BM_L: tl.constexpr, BN_L: tl.constexpr, BK_L: tl.constexpr, DOT_L: tl.constexpr,
    SWAP_L: tl.constexpr, STAGES_L: tl.constexpr, PREC_L: tl.constexpr,
):
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")  # this program's ticket
    n_o = tl.cdiv(H, BN_O)
    n_g = tl.cdiv(inner, BN_G)
    n_d = tl.cdiv(H, BN_D)
    n_l = tl.cdiv(V, BN_L)
    if item < n_o:
        _o_item(item, attn_ptr, h_ptr, o_w_ptr, s1_ptr, M, H, A, stride_attn, stride_h,
                BM_O, BN_O, BK_O, DOT_O, SWAP_O, STAGES_O, PREC_O)
        _publish(sync_ptr + 1)
    elif item < n_o + n_g:
        if PREFETCH:  # this item's gate and up rows, while the o items still run
            _prefetch_rows(gu_w_ptr, (item - n_o) * BN_G, BN_G, inner, H, 128)
            _prefetch_rows(gu_w_ptr, inner + (item - n_o) * BN_G, BN_G, 2 * inner, H, 128)
        _wait(sync_ptr + 1, n_o, SLEEP_NS, NO_WAIT)
        _gate_up_item(item - n_o, s1_ptr, post_w_ptr, gu_w_ptr, act_ptr, M, H, inner, post_eps,
                      STATS_K, BM_G, BN_G, BK_G, DOT_G, SWAP_G, STAGES_G, PREC_G)
        _publish(sync_ptr + 2)
    elif item < n_o + n_g + n_d:
        if PREFETCH:
            _prefetch_rows(down_w_ptr, (item - n_o - n_g) * BN_D, BN_D, H, inner, 128)
        _wait(sync_ptr + 2, n_g, SLEEP_NS, NO_WAIT)
        _down_item(item - n_o - n_g, act_ptr, down_w_ptr, s1_ptr, out_ptr, M, H, inner,
                   BM_D, BN_D, BK_D, DOT_D, SWAP_D, STAGES_D, PREC_D)
        _publish(sync_ptr + 3)
    else:
        if PREFETCH:
            _prefetch_rows(lm_w_ptr, (item - n_o - n_g - n_d) * BN_L, BN_L, V, H, 128)
        _wait(sync_ptr + 3, n_d, SLEEP_NS, NO_WAIT)
        _lm_item(item - n_o - n_g - n_d, out_ptr, final_w_ptr, lm_w_ptr, index_ptr, logits_ptr,
                 L, H, V, final_eps, HAS_INDEX, STATS_K, BM_L, BN_L, BK_L, DOT_L, SWAP_L,
                 STAGES_L, PREC_L)
        if _publish(sync_ptr + 4) == n_l - 1:  # the last item: every program is past its waits
            for c in tl.static_range(5):
                tl.atomic_xchg(sync_ptr + c, 0, sem="relaxed", scope="gpu")


_SYNC: dict[torch.device, torch.Tensor] = {}  # per device: the launch's counters, all zero


def _sync_counters(device: torch.device) -> torch.Tensor | None:
    """The device's zeroed counters (every launch leaves them zero); None if they do not exist
    yet and the stream is capturing a CUDA graph (a zeroing recorded in a capture would run only
    at replay), so the caller takes the unfused path instead."""
    counters = _SYNC.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _SYNC[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counters


def _stage_meta(prefix: str, m: int, n: int, k: int, dtype: torch.dtype,
                config: SkinnyConfig | None = None) -> dict:
    """The launch constants of one product: ``config``, or the skinny table's tile for its shape
    at ``max(m, 5)`` rows (16-row ``tl.dot`` tiles 16-64 columns wide: the table's 1-4-row
    multiply-sum tiles take 1-8 columns, and so many narrow items would each pay a ticket and a
    wait); whole K per item (no split-K: an item's columns are final when it publishes them)."""
    cfg = config or pick_config(max(m, _DOT_ROWS), n, k, dtype)
    return {
        f"BM_{prefix}": 16 if cfg.dot else next_pow2(m),
        f"BN_{prefix}": cfg.block_n,
        f"BK_{prefix}": min(cfg.block_k, max(next_pow2(k), 16)),
        f"DOT_{prefix}": cfg.dot,
        f"SWAP_{prefix}": cfg.dot and cfg.swap,
        f"STAGES_{prefix}": cfg.num_stages,
        f"PREC_{prefix}": cfg.precision if dtype == torch.float32 else "default",
    }


def decoder_tail_fits(attn: torch.Tensor, h: torch.Tensor, weights: tuple[torch.Tensor, ...],
                      biases: tuple[torch.Tensor | None, ...] = ()) -> bool:
    """Whether :func:`decoder_tail` takes the one launch: CUDA (or the interpreter), a supported
    dtype, 1..16 rows, contiguous tensors, the four product ``weights`` within
    :data:`MAX_WEIGHT_BYTES`, and no biases (any that is not None: the unfused path)."""
    if not use_triton(h) or h.dtype not in TRITON_DTYPES or not 1 <= h.shape[0] <= MAX_M:
        return False
    if sum(w.numel() * w.element_size() for w in weights) > MAX_WEIGHT_BYTES:
        return False
    tensors = (attn, h, *weights)
    return all(t.is_contiguous() for t in tensors) and all(b is None for b in biases)


def decoder_tail_triton(
    attn: torch.Tensor,  # [R, A], R <= 16
    h: torch.Tensor,  # [R, H]
    o_weight: torch.Tensor,  # [H, A]
    post_norm: torch.Tensor,  # [H]
    post_eps: float,
    gate_up_weight: torch.Tensor,  # [2I, H]
    down_weight: torch.Tensor,  # [H, I]
    final_norm: torch.Tensor,  # [H]
    final_eps: float,
    lm_weight: torch.Tensor,  # [V, H]
    logits_index: torch.Tensor | None = None,  # [L] i64
    *,
    counters: torch.Tensor | None = None,
    configs: dict[str, SkinnyConfig] | None = None,
    prefetch: bool | None = None,
    sleep_ns: int | None = None,
    no_wait_diagnostic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [L or R, V], out [R, H])
    """One launch of the dataflow kernel (grid: one program per column block of each product).
    ``counters``: the five zeroed int32 counters to use (default: the device's); ``configs``:
    tiles for some of the products ``"o"``, ``"gate_up"``, ``"down"``, ``"lm_head"`` (default:
    the skinny table's; ``bench/bench_kernels.py --only tail`` tries others); ``prefetch``: the
    items that wait on the product before them first ask L2 for their weight rows (default: in
    a compiled kernel, not in the interpreter)."""
    _check(attn, h, o_weight, post_norm, gate_up_weight, down_weight, final_norm, lm_weight,
           logits_index)
    rows, hidden = h.shape
    if not 1 <= rows <= MAX_M:
        raise ValueError(f"h: the one-launch decoder tail takes 1..{MAX_M} rows, got {rows}")
    for name, t in (("attn", attn), ("h", h), ("o_weight", o_weight),
                    ("gate_up_weight", gate_up_weight), ("down_weight", down_weight),
                    ("lm_weight", lm_weight)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: the one-launch decoder tail needs a contiguous tensor")
    inner = down_weight.shape[1]
    vocab = lm_weight.shape[0]
    width = attn.shape[1]
    dtype, device = h.dtype, h.device
    logit_rows = rows if logits_index is None else logits_index.shape[0]
    out = torch.empty((rows, hidden), dtype=dtype, device=device)
    logits = torch.empty((logit_rows, vocab), dtype=dtype, device=device)
    if logit_rows > rows:
        raise ValueError(f"logits_index: at most {rows} rows, got {logit_rows}")
    if counters is None:
        counters = _sync_counters(device)
        if counters is None:
            raise RuntimeError("decoder_tail_triton: the counters must exist before a CUDA-graph "
                               "capture (call it once outside the capture)")
    s1 = torch.empty((rows, hidden), dtype=dtype, device=device)
    act = torch.empty((rows, inner), dtype=dtype, device=device)
    configs = configs or {}
    compiled = os.environ.get("TRITON_INTERPRET", "0") != "1"  # inline PTX: compiled only
    prefetch = compiled if prefetch is None else prefetch and compiled
    sleep_ns = (SLEEP_NS if sleep_ns is None else sleep_ns) if compiled else 0
    meta = {
        **_stage_meta("O", rows, hidden, width, dtype, configs.get("o")),
        **_stage_meta("G", rows, 2 * inner, hidden, dtype, configs.get("gate_up")),
        **_stage_meta("D", rows, hidden, inner, dtype, configs.get("down")),
        **_stage_meta("L", max(logit_rows, 1), vocab, hidden, dtype, configs.get("lm_head")),
    }
    if logit_rows == 0:  # no logits wanted: the lm_head items still run (on no rows)
        meta["BM_L"] = 1 if not meta["DOT_L"] else 16
    items = (cdiv(hidden, meta["BN_O"]) + cdiv(inner, meta["BN_G"]) + cdiv(hidden, meta["BN_D"])
             + cdiv(vocab, meta["BN_L"]))
    stats_k = min(max(next_pow2(hidden), 16), max(16, 8192 // 16))
    _decoder_tail_kernel[(items,)](
        counters, attn, h, o_weight, post_norm, gate_up_weight, down_weight, final_norm,
        lm_weight, logits_index if logits_index is not None else counters, s1, act, out, logits,
        rows, logit_rows, hidden, width, inner, vocab, attn.stride(0), h.stride(0),
        float(post_eps), float(final_eps),
        HAS_INDEX=logits_index is not None, STATS_K=stats_k, PREFETCH=prefetch, SLEEP_NS=sleep_ns,
        NO_WAIT=no_wait_diagnostic,
        num_warps=4,
        **meta,
    )
    return logits, out


def decoder_tail_unfused(
    attn: torch.Tensor,  # [R, A]
    h: torch.Tensor,  # [R, H]
    o_weight: torch.Tensor,  # [H, A]
    post_norm: torch.Tensor,  # [H]
    post_eps: float,
    gate_up_weight: torch.Tensor,  # [2I, H]
    down_weight: torch.Tensor,  # [H, I]
    final_norm: torch.Tensor,  # [H]
    final_eps: float,
    lm_weight: torch.Tensor,  # [V, H]
    logits_index: torch.Tensor | None = None,  # [L] i64
    *,
    biases: tuple[torch.Tensor | None, ...] = (),  # o, gate_up, down, lm_head
) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [L or R, V], out [R, H])
    """The same function as the public kernels of :mod:`~phasegraph.kernels.linear` in sequence
    (each dispatching on its own; on the CPU exactly the reference's ops)."""
    _check(attn, h, o_weight, post_norm, gate_up_weight, down_weight, final_norm, lm_weight,
           logits_index)
    o_b, gu_b, down_b, lm_b = (*biases, None, None, None, None)[:4]
    gate_up, s1 = add_rms_norm_linear(linear(attn, o_weight, o_b), h, post_norm, post_eps,
                                      gate_up_weight, gu_b)
    mlp = silu_mul_linear(gate_up, down_weight, down_b)
    if logits_index is None:
        return add_rms_norm_linear(mlp, s1, final_norm, final_eps, lm_weight, lm_b)
    out = s1 + mlp
    # advanced indexing: torch's fast gather for a few rows (index_select's is slow from two)
    logits, _ = add_rms_norm_linear(out[logits_index], None, final_norm, final_eps, lm_weight,
                                    lm_b)
    return logits, out


def decoder_tail(
    attn: torch.Tensor,  # [R, A]
    h: torch.Tensor,  # [R, H]
    o_weight: torch.Tensor,  # [H, A]
    post_norm: torch.Tensor,  # [H]
    post_eps: float,
    gate_up_weight: torch.Tensor,  # [2I, H]
    down_weight: torch.Tensor,  # [H, I]
    final_norm: torch.Tensor,  # [H]
    final_eps: float,
    lm_weight: torch.Tensor,  # [V, H]
    logits_index: torch.Tensor | None = None,  # [L] i64
    *,
    biases: tuple[torch.Tensor | None, ...] = (),  # o, gate_up, down, lm_head
) -> tuple[torch.Tensor, torch.Tensor]:  # (logits [L or R, V], out [R, H])
    """``decoder_tail_reference``'s function: one Triton launch on CUDA where
    :func:`decoder_tail_fits` (and the counters exist), else :func:`decoder_tail_unfused`."""
    args = (attn, h, o_weight, post_norm, post_eps, gate_up_weight, down_weight, final_norm,
            final_eps, lm_weight, logits_index)
    weights = (o_weight, gate_up_weight, down_weight, lm_weight)
    if decoder_tail_fits(attn, h, weights, biases) and _sync_counters(h.device) is not None:
        return decoder_tail_triton(*args)
    return decoder_tail_unfused(*args, biases=biases)
