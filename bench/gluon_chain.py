"""Experiment: the chain of bench/weight_stationary_chain.py as a persistent Gluon kernel whose
waiting items hold their weights in shared memory.

``bench/weight_stationary_chain.py`` found that Triton's ``tl`` language cannot keep an item's
weights on chip across its wait (ptxas spills, waiting programs crowd the SMs). Gluon
(``triton.experimental.gluon``, Triton 3.6) allocates shared memory explicitly. Here one CTA of
8 warps per item group runs for the whole chain (128 CTAs, one per SM of an H100, all resident),
with a static assignment:

- CTAs 0..47: cp.async their 16 ``o`` rows, x, and their 16 ``down`` rows (whole K = 2560,
  80 KB) into shared memory. They compute ``o`` as soon as its rows are in, publish it, then
  wait for gate/up (the down rows keep streaming meanwhile);
- CTAs 48..127: cp.async their 32 gate and 32 up rows (K = 768, 96 KB), wait for ``o``, copy
  y1 in and compute SwiGLU from shared memory.

Three forms of the products (:data:`FORMS`):
- a broadcast multiply-sum in float32 over [4 rows, columns, K chunk];
- ``mma.sync`` on operands padded to 16 rows, the columns over the warps (``MMA``);
- ``mma.sync`` with K split over the 8 warps (``_gluon_chain_ksplit_kernel``): warp b owns a
  contiguous slice of K, a batched [8, 16, columns] accumulator, and the slices are added across
  warps at the end. Its options: the cross-warp sum by ``gl.sum`` or through a padded
  shared buffer ("own sum"), rows swizzled for ``ldmatrix`` ("swizzle"), two accumulators, and
  two timing probes (down's rows copied after o is published; the gate product repeated 11 times).
Waits: a done-counter per product (release / acquire). ``%globaltimer`` probes give each CTA
group's timeline.

    python bench/gluon_chain.py [--out DIR]      # GPU only; every form, timed
    OUT=DIR bash bench/ncu_gluon_chain.sh "FORM"  # Nsight Compute on one form

Measured (H100, 2026-11-25; bench/results/gluon-chain-h100-2026-11-25/): correct, and in µs per
chain (cold / warm):
- four launches: 14.9 / 11.3;
- multiply-sum: 16.3 / 14.2;
- mma: 19.9 / 18.2, its operands in ``NVMMASharedLayout`` and loaded by ``ldmatrix`` (19.5 / 18.1
  with a swizzled layout and plain shared loads).

The timeline (multiply-sum) shows where the time goes:
- o's weights are in at 1.0 µs;
- o is published at 2.5 µs;
- gate/up sees it at 3.5 µs and has y1 at 4.1 µs;
- gate/up is published at 8.2 µs;
- down sees it at 8.6 µs and has its operand at 9.6 µs;
- the last down is published at 13.1 µs.

So a wait costs ~0.7 µs and a weight stream hides entirely. The products computed from shared
memory take 1.5–4 µs each (with mma.sync no less: o takes 2.1 µs for six
chunks): that is what is left to make fast.

Measured again with K split over the warps (H100, 2026-11-26;
bench/results/gluon-chain-ksplit-h100-2026-11-26/), µs per chain, cold / warm:
- four launches 13.3 / 11.2; multiply-sum 16.5 / 14.4; mma 19.4 / 18.0 (this machine);
- K split, ``gl.sum`` across the warps: 17.8 / 16.2, one gate product 2.7 µs. ncu: the sum's
  scratch stores conflict 16-way (75 % of the kernel's shared wavefronts are excess);
- K split, own padded sum: 13.3 / 10.7, one gate product 0.81 µs;
- and rows swizzled for ``ldmatrix`` (a 2-way conflict before): **12.0 / 9.4, 10 % / 16 % under
  the four launches**, one gate product 0.52 µs; a second accumulator changes nothing.
Every K-split form equals the reference exactly. Its timeline (warm): o's weights in 1.09 µs,
o done 1.63, published 2.37; gate/up sees it 3.17, y1 in 3.65, published 5.34; down sees it
5.73, act in 6.46, last down published 8.29. What is left is the handoffs (publish ~0.5–0.7 µs,
the wait's acquire ~0.4–0.8, the operand's copy from L2 ~0.5–0.7), not the products.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_stationary_chain import INNER, H, chain_launches, chain_reference  # noqa: E402

ROWS = 4
N_O, N_G = 48, 80  # o / down items (16 columns each), gate/up items (32 + 32 columns)
CTAS = N_O + N_G


@gluon.jit
def _wait(counter_ptr, target):
    while gl.load(counter_ptr, volatile=True) < target:
        pass
    gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@gluon.jit
def _publish(counter_ptr):
    gl.thread_barrier()
    return gl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _stamp(times_ptr, c, slot, STAMP: gl.constexpr):
    """With STAMP: the GPU's global nanosecond timer into times[c, slot] (a timeline probe)."""
    if STAMP:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [c], dtype=gl.int64,
                                      is_pure=False, pack=1)
        gl.store(times_ptr + c * 8 + slot, t)


@gluon.jit
def _publish_down(sync_ptr, N_O: gl.constexpr, times_ptr, c, STAMP: gl.constexpr):
    """Publish a down item (probe 5); the last of the N_O resets the four counters for the next
    chain (every CTA is past its waits by then)."""
    last = _publish(sync_ptr + 3) == N_O - 1
    _stamp(times_ptr, c, 5, STAMP)
    if last:
        for j in gl.static_range(4):
            gl.atomic_xchg(sync_ptr + j, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _copy_rows(smem, ptr, row0, stride, NCHUNK: gl.constexpr, NC: gl.constexpr, KC: gl.constexpr,
               layout: gl.constexpr):
    """cp.async rows row0..row0+NC-1 (whole K = NCHUNK * KC) of a row-major matrix into
    ``smem`` [NCHUNK, NC, KC], chunk i = columns i*KC.. ; returns at once (commit, then wait)."""
    n = row0 + gl.arange(0, NC, layout=gl.SliceLayout(1, layout))
    k = gl.arange(0, KC, layout=gl.SliceLayout(0, layout))
    for i in gl.static_range(NCHUNK):
        async_copy.async_copy_global_to_shared(
            smem.index(i), ptr + n[:, None] * stride + (i * KC + k)[None, :])


@gluon.jit
def _copy_padded_rows(smem, ptr, stride, R: gl.constexpr, NCHUNK: gl.constexpr, KC: gl.constexpr,
                      layout: gl.constexpr):
    """cp.async rows 0..R-1 of a row-major matrix into ``smem`` [NCHUNK, 16, KC]; rows R..15
    are masked off, which cp.async fills with zeros (the padding of an mma operand)."""
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
    k = gl.arange(0, KC, layout=gl.SliceLayout(0, layout))
    real = (r < R)[:, None] & (k < KC)[None, :]
    rows = gl.where(r < R, r, 0)
    for i in gl.static_range(NCHUNK):
        async_copy.async_copy_global_to_shared(
            smem.index(i), ptr + rows[:, None] * stride + (i * KC + k)[None, :], mask=real)


@gluon.jit
def _product(a_s, w_s, NCHUNK: gl.constexpr, R: gl.constexpr, NC: gl.constexpr,
             KC: gl.constexpr, L3: gl.constexpr):
    """[R, NC] float32: sum over the chunks of a_s [NCHUNK, R, KC] x w_s [NCHUNK, NC, KC]^T."""
    acc = gl.zeros([R, NC, KC], gl.float32, L3)
    for i0 in range(0, NCHUNK, 2):  # 2 chunks unrolled: their shared-memory loads overlap
        for j in gl.static_range(2):
            a = a_s.index(i0 + j).load(gl.SliceLayout(1, L3)).to(gl.float32)
            w = w_s.index(i0 + j).load(gl.SliceLayout(0, L3)).to(gl.float32)
            acc += gl.expand_dims(a, 1) * gl.expand_dims(w, 0)
    return gl.sum(acc, axis=2)


@gluon.jit
def _product_mma(a_s, w_s, NCHUNK: gl.constexpr, NC: gl.constexpr, MMA: gl.constexpr):
    """[16, NC] float32 on tensor cores (mma.sync m16n8k16): a_s [NCHUNK, 16, KC] (rows past the
    real ones are zero) times w_s [NCHUNK, NC, KC]^T."""
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    acc = gl.zeros([16, NC], gl.float32, MMA)
    for i in range(NCHUNK):
        acc = mma_v2(a_s.index(i).load(A_L), w_s.index(i).permute([1, 0]).load(B_L), acc)
    return acc


@gluon.jit
def _store_rows(ptr, stride, col0, y, R: gl.constexpr, NC: gl.constexpr, YL: gl.constexpr):
    """Rows 0..R-1 of y [16, NC] (layout YL: an MMA layout, or a slice of one) into columns
    col0.. of a row-major matrix."""
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, YL))
    n = col0 + gl.arange(0, NC, layout=gl.SliceLayout(0, YL))
    gl.store(ptr + r[:, None] * stride + n[None, :], y.to(ptr.dtype.element_ty),
             mask=(r < R)[:, None])


@gluon.jit
def _store_cols(ptr, stride, col0, y, R: gl.constexpr, NC: gl.constexpr, L3: gl.constexpr):
    """y [R, NC] (SliceLayout(2, L3)) into columns col0.. of a row-major matrix."""
    YL: gl.constexpr = gl.SliceLayout(2, L3)
    r = gl.arange(0, R, layout=gl.SliceLayout(1, YL))
    n = col0 + gl.arange(0, NC, layout=gl.SliceLayout(0, YL))
    gl.store(ptr + r[:, None] * stride + n[None, :], y.to(ptr.dtype.element_ty))


@gluon.constexpr_function
def _operand_rows(rows, mma):
    """Rows of an operand buffer: the real ones, or 16 (padded with zeros) for ``mma``."""
    return 16 if mma else rows


@gluon.jit
def _copy_operand(smem, ptr, stride, R: gl.constexpr, NCHUNK: gl.constexpr, KC: gl.constexpr,
                  layout: gl.constexpr, MMA: gl.constexpr):
    """cp.async the R real rows of an operand into ``smem`` (zero-padded to 16 for ``mma``)."""
    if MMA:
        _copy_padded_rows(smem, ptr, stride, R, NCHUNK, KC, layout)
    else:
        _copy_rows(smem, ptr, 0, stride, NCHUNK, R, KC, layout)


@gluon.jit
def _product_of(a_s, w_s, NCHUNK: gl.constexpr, R: gl.constexpr, NC: gl.constexpr,
                KC: gl.constexpr, L3: gl.constexpr, MMA_L: gl.constexpr, MMA: gl.constexpr):
    """a_s times w_s^T: [16, NC] in ``MMA_L`` (``mma.sync``), or [R, NC] in SliceLayout(2, L3)."""
    if MMA:
        y = _product_mma(a_s, w_s, NCHUNK, NC, MMA_L)
    else:
        y = _product(a_s, w_s, NCHUNK, R, NC, KC, L3)
    return y


@gluon.jit
def _store_product(ptr, stride, col0, y, R: gl.constexpr, NC: gl.constexpr, L3: gl.constexpr,
                   MMA_L: gl.constexpr, MMA: gl.constexpr):
    """The R real rows of a :func:`_product_of` result into columns col0.. of ``ptr``."""
    if MMA:
        _store_rows(ptr, stride, col0, y, R, NC, MMA_L)
    else:
        _store_cols(ptr, stride, col0, y, R, NC, L3)


@gluon.jit
def _gluon_chain_kernel(sync_ptr, x_ptr, wo_ptr, wgu_ptr, wd_ptr, y1_ptr, act_ptr, y3_ptr,
                        times_ptr, H: gl.constexpr, INNER: gl.constexpr, R: gl.constexpr,
                        N_O: gl.constexpr, N_G: gl.constexpr, STAMP: gl.constexpr,
                        MMA: gl.constexpr):
    c = gl.program_id(0)
    _stamp(times_ptr, c, 0, STAMP)
    # [rows, columns, K chunk] over 8 warps (two along K): o and down items 16 columns x 128,
    # gate/up items 32 x 64
    L16: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, 4, 2], [2, 1, 0])
    L32: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 8, 4], [1, 4, 2], [2, 1, 0])
    MMA_L: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 8],
                                                    instr_shape=[16, 8])
    if MMA:  # every buffer ldmatrix-ready
        SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                  rank=2)
        OPERAND: gl.constexpr = SMEM
    else:
        # per [columns, K chunk] slice; weight rows swizzled in 16-byte vectors (no bank
        # conflicts when 8 threads read 8 rows of one chunk), operand rows (read broadcast) plain
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
        OPERAND: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    RA: gl.constexpr = _operand_rows(R, MMA)
    if c < N_O:
        col0 = c * 16
        wo_s = gl.allocate_shared_memory(gl.bfloat16, [H // 128, 16, 128], SMEM)
        x_s = gl.allocate_shared_memory(gl.bfloat16, [H // 128, RA, 128], OPERAND)
        wd_s = gl.allocate_shared_memory(gl.bfloat16, [INNER // 128, 16, 128], SMEM)
        a_s = gl.allocate_shared_memory(gl.bfloat16, [INNER // 128, RA, 128], OPERAND)
        _copy_rows(wo_s, wo_ptr, col0, H, H // 128, 16, 128, gl.SliceLayout(0, L16))
        _copy_operand(x_s, x_ptr, H, R, H // 128, 128, gl.SliceLayout(1, L16), MMA)
        async_copy.commit_group()
        _copy_rows(wd_s, wd_ptr, col0, INNER, INNER // 128, 16, 128, gl.SliceLayout(0, L16))
        async_copy.commit_group()
        async_copy.wait_group(1)  # o's weights and x are in; down's keep streaming
        gl.thread_barrier()
        _stamp(times_ptr, c, 1, STAMP)
        y1 = _product_of(x_s, wo_s, H // 128, R, 16, 128, L16, MMA_L, MMA)
        _store_product(y1_ptr, H, col0, y1, R, 16, L16, MMA_L, MMA)
        _publish(sync_ptr + 1)
        _stamp(times_ptr, c, 2, STAMP)
        _wait(sync_ptr + 2, N_G)
        _stamp(times_ptr, c, 3, STAMP)
        _copy_operand(a_s, act_ptr, INNER, R, INNER // 128, 128, gl.SliceLayout(1, L16), MMA)
        async_copy.commit_group()
        async_copy.wait_group(0)
        gl.thread_barrier()
        _stamp(times_ptr, c, 4, STAMP)
        y3 = _product_of(a_s, wd_s, INNER // 128, R, 16, 128, L16, MMA_L, MMA)
        _store_product(y3_ptr, H, col0, y3, R, 16, L16, MMA_L, MMA)
        _publish_down(sync_ptr, N_O, times_ptr, c, STAMP)
    else:
        col0 = (c - N_O) * 32
        g_s = gl.allocate_shared_memory(gl.bfloat16, [H // 64, 32, 64], SMEM)
        u_s = gl.allocate_shared_memory(gl.bfloat16, [H // 64, 32, 64], SMEM)
        y_s = gl.allocate_shared_memory(gl.bfloat16, [H // 64, RA, 64], OPERAND)
        _copy_rows(g_s, wgu_ptr, col0, H, H // 64, 32, 64, gl.SliceLayout(0, L32))
        _copy_rows(u_s, wgu_ptr, INNER + col0, H, H // 64, 32, 64, gl.SliceLayout(0, L32))
        async_copy.commit_group()
        _wait(sync_ptr + 1, N_O)
        _stamp(times_ptr, c, 1, STAMP)
        _copy_operand(y_s, y1_ptr, H, R, H // 64, 64, gl.SliceLayout(1, L32), MMA)
        async_copy.commit_group()
        async_copy.wait_group(0)
        gl.thread_barrier()
        _stamp(times_ptr, c, 2, STAMP)
        gate = _product_of(y_s, g_s, H // 64, R, 32, 64, L32, MMA_L, MMA).to(gl.bfloat16).to(gl.float32)
        up = _product_of(y_s, u_s, H // 64, R, 32, 64, L32, MMA_L, MMA).to(gl.bfloat16).to(gl.float32)
        act = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        _store_product(act_ptr, INNER, col0, act * up, R, 32, L32, MMA_L, MMA)
        _publish(sync_ptr + 2)
        _stamp(times_ptr, c, 3, STAMP)


# --- the products with K split over the warps (a batched mma.sync: warp b owns K slice b) ----

KSPLIT = gl.constexpr(8)  # warps, each a contiguous slice of K
KC = gl.constexpr(32)  # K per step of a warp's slice (two m16n8k16 per column tile)


@gluon.jit
def _copy_ksplit(smem, ptr, row0, stride, rows_real, NSTEP: gl.constexpr, NROW: gl.constexpr,
                 layout: gl.constexpr):
    """cp.async rows row0..row0+NROW-1 of a row-major [*, KSPLIT * NSTEP * KC] matrix into
    ``smem`` [NSTEP, KSPLIT, NROW, KC]: element (s, b, r, kk) is column (b * NSTEP + s) * KC + kk.
    Rows at or past ``rows_real`` are zero-filled (an operand padded to the 16 rows of an mma)."""
    b = gl.arange(0, KSPLIT, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    r = gl.arange(0, NROW, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    kk = gl.arange(0, KC, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    real = gl.expand_dims(gl.expand_dims(r < rows_real, 0), 2) & gl.expand_dims(gl.expand_dims(kk < KC, 0), 1)
    rows = gl.where(r < rows_real, row0 + r, row0)
    base = (gl.expand_dims(gl.expand_dims(rows, 0), 2) * stride
            + gl.expand_dims(gl.expand_dims(b * (NSTEP * KC), 1), 2)
            + gl.expand_dims(gl.expand_dims(kk, 0), 1))
    for s in gl.static_range(NSTEP):
        async_copy.async_copy_global_to_shared(smem.index(s), ptr + base + s * KC, mask=real)


@gluon.jit
def _allocate_sum(NC: gl.constexpr):
    """The cross-warp sum's buffer [KSPLIT, 16, NC] float32, each row padded by 8 floats so that
    the accumulator's stores and the parts' loads do not conflict on banks."""
    return gl.allocate_shared_memory(
        gl.float32, [KSPLIT, 16, NC],
        gl.PaddedSharedLayout.with_identity_for([[NC, 8]], [KSPLIT, 16, NC], [2, 1, 0]))


@gluon.jit
def _product_ksplit(a_s, w_s, sum_s, NSTEP: gl.constexpr, NC: gl.constexpr, MMA3: gl.constexpr,
                    RED: gl.constexpr, OWN_SUM: gl.constexpr, TWO_ACC: gl.constexpr):
    """[16, NC] float32 = a [16, K] x w [NC, K]^T, K split over the warps: a_s [NSTEP, KSPLIT,
    16, KC], w_s [NSTEP, KSPLIT, NC, KC]; each warp sums its slice on tensor cores, then the
    slices are added across warps: by ``gl.sum`` (whose scratch stores conflict 16-way, ncu), or
    with OWN_SUM through ``sum_s`` [KSPLIT, 16, NC] (rows padded against bank conflicts), each
    thread adding the KSPLIT parts of its elements. Returns the layout of :func:`_sum_layout`."""
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2)
    acc = gl.zeros([KSPLIT, 16, NC], gl.float32, MMA3)
    acc_odd = gl.zeros([KSPLIT, 16, NC], gl.float32, MMA3)  # TWO_ACC: the odd steps' chain
    for s in gl.static_range(NSTEP):
        a = a_s.index(s).load(A_L)
        w = w_s.index(s).permute([0, 2, 1]).load(B_L)
        if TWO_ACC and s % 2 == 1:
            acc_odd = mma_v2(a, w, acc_odd)
        else:
            acc = mma_v2(a, w, acc)
    if TWO_ACC:
        acc = acc + acc_odd
    if OWN_SUM:
        sum_s.store(acc)
        gl.thread_barrier()
        y = gl.sum(sum_s.load(RED), axis=0)
        gl.thread_barrier()  # sum_s is free again
    else:
        y = gl.sum(acc, axis=0)
    return y


@gluon.constexpr_function
def _sum_layout(own_sum, red, mma3):
    """The layout of :func:`_product_ksplit`'s result."""
    return gl.SliceLayout(0, red if own_sum else mma3)


@gluon.jit
def _wait_for_operand(counter_ptr, target, op_s, op_ptr, stride, R: gl.constexpr,
                      NSTEP: gl.constexpr, CP: gl.constexpr, times_ptr, c, SEEN: gl.constexpr,
                      IN: gl.constexpr, STAMP: gl.constexpr):
    """Wait until ``target`` items have published into ``counter_ptr``, then copy the operand's R
    rows into ``op_s`` (and wait for every copy in flight); probes SEEN and IN."""
    _wait(counter_ptr, target)
    _stamp(times_ptr, c, SEEN, STAMP)
    _copy_ksplit(op_s, op_ptr, 0, stride, R, NSTEP, 16, CP)
    async_copy.commit_group()
    async_copy.wait_group(0)
    gl.thread_barrier()
    _stamp(times_ptr, c, IN, STAMP)


@gluon.jit
def _gluon_chain_ksplit_kernel(sync_ptr, x_ptr, wo_ptr, wgu_ptr, wd_ptr, y1_ptr, act_ptr, y3_ptr,
                               times_ptr, H: gl.constexpr, INNER: gl.constexpr, R: gl.constexpr,
                               N_O: gl.constexpr, N_G: gl.constexpr, STAMP: gl.constexpr,
                               EARLY_DOWN: gl.constexpr, GATE_REPEAT: gl.constexpr,
                               OWN_SUM: gl.constexpr, TWO_ACC: gl.constexpr, SWIZZLE_ROWS: gl.constexpr):
    c = gl.program_id(0)
    _stamp(times_ptr, c, 0, STAMP)
    MMA3: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[KSPLIT, 1, 1],
                                                   instr_shape=[1, 16, 8])
    CP: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 8, 4], [KSPLIT, 1, 1], [2, 1, 0])
    # 64-byte rows of KC bfloat16; with SWIZZLE_ROWS the phase moves every second row, so the 8
    # rows an ldmatrix reads fall in 8 different 16-byte bank groups (else two share, ncu)
    SMEM: gl.constexpr = gl.SwizzledSharedLayout(8, 2 if SWIZZLE_ROWS else 1, 4, [2, 1, 0])
    # the cross-warp sums: each thread holds the KSPLIT parts of 1 (16 columns) or 2 elements
    RED16: gl.constexpr = gl.BlockedLayout([KSPLIT, 1, 1], [1, 2, 16], [1, 8, 1], [2, 1, 0])
    RED32: gl.constexpr = gl.BlockedLayout([KSPLIT, 1, 2], [1, 2, 16], [1, 8, 1], [2, 1, 0])
    Y16: gl.constexpr = _sum_layout(OWN_SUM, RED16, MMA3)
    Y32: gl.constexpr = _sum_layout(OWN_SUM, RED32, MMA3)
    SH: gl.constexpr = H // (KSPLIT * KC)  # steps per warp over K = H
    SI: gl.constexpr = INNER // (KSPLIT * KC)  # over K = INNER
    if c < N_O:
        col0 = c * 16
        wo_s = gl.allocate_shared_memory(gl.bfloat16, [SH, KSPLIT, 16, KC], SMEM)
        osum_s = _allocate_sum(16)
        x_s = gl.allocate_shared_memory(gl.bfloat16, [SH, KSPLIT, 16, KC], SMEM)
        wd_s = gl.allocate_shared_memory(gl.bfloat16, [SI, KSPLIT, 16, KC], SMEM)
        a_s = gl.allocate_shared_memory(gl.bfloat16, [SI, KSPLIT, 16, KC], SMEM)
        _copy_ksplit(wo_s, wo_ptr, col0, H, 16, SH, 16, CP)
        _copy_ksplit(x_s, x_ptr, 0, H, R, SH, 16, CP)
        async_copy.commit_group()
        if EARLY_DOWN:
            _copy_ksplit(wd_s, wd_ptr, col0, INNER, 16, SI, 16, CP)
        async_copy.commit_group()
        async_copy.wait_group(1)  # o's weights and x are in; down's keep streaming
        gl.thread_barrier()
        _stamp(times_ptr, c, 1, STAMP)
        y1 = _product_ksplit(x_s, wo_s, osum_s, SH, 16, MMA3, RED16, OWN_SUM, TWO_ACC)
        _stamp(times_ptr, c, 6, STAMP)
        _store_rows(y1_ptr, H, col0, y1, R, 16, Y16)
        _stamp(times_ptr, c, 7, STAMP)
        _publish(sync_ptr + 1)
        if not EARLY_DOWN:  # (probe: does the release wait for the down rows' copies?)
            _copy_ksplit(wd_s, wd_ptr, col0, INNER, 16, SI, 16, CP)
            async_copy.commit_group()
        _stamp(times_ptr, c, 2, STAMP)
        _wait_for_operand(sync_ptr + 2, N_G, a_s, act_ptr, INNER, R, SI, CP, times_ptr, c, 3, 4,
                          STAMP)
        y3 = _product_ksplit(a_s, wd_s, osum_s, SI, 16, MMA3, RED16, OWN_SUM, TWO_ACC)
        _store_rows(y3_ptr, H, col0, y3, R, 16, Y16)
        _publish_down(sync_ptr, N_O, times_ptr, c, STAMP)
    else:
        col0 = (c - N_O) * 32
        g_s = gl.allocate_shared_memory(gl.bfloat16, [SH, KSPLIT, 32, KC], SMEM)
        gsum_s = _allocate_sum(32)
        u_s = gl.allocate_shared_memory(gl.bfloat16, [SH, KSPLIT, 32, KC], SMEM)
        y_s = gl.allocate_shared_memory(gl.bfloat16, [SH, KSPLIT, 16, KC], SMEM)
        _copy_ksplit(g_s, wgu_ptr, col0, H, 32, SH, 32, CP)
        _copy_ksplit(u_s, wgu_ptr, INNER + col0, H, 32, SH, 32, CP)
        async_copy.commit_group()
        _wait_for_operand(sync_ptr + 1, N_O, y_s, y1_ptr, H, R, SH, CP, times_ptr, c, 1, 2, STAMP)
        gate = _product_ksplit(y_s, g_s, gsum_s, SH, 32, MMA3, RED32, OWN_SUM, TWO_ACC)
        for _ in range(GATE_REPEAT - 1):  # (probe: the product's own cost, repeated)
            gate += _product_ksplit(y_s, g_s, gsum_s, SH, 32, MMA3, RED32, OWN_SUM, TWO_ACC)
        gate = gate.to(gl.bfloat16).to(gl.float32)
        _stamp(times_ptr, c, 4, STAMP)
        up = _product_ksplit(y_s, u_s, gsum_s, SH, 32, MMA3, RED32, OWN_SUM, TWO_ACC).to(gl.bfloat16).to(gl.float32)
        _stamp(times_ptr, c, 5, STAMP)
        act = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
        _store_rows(act_ptr, INNER, col0, act * up, R, 32, Y32)
        _stamp(times_ptr, c, 6, STAMP)
        _publish(sync_ptr + 2)
        _stamp(times_ptr, c, 3, STAMP)


_KSPLIT = dict(EARLY_DOWN=True, GATE_REPEAT=1, OWN_SUM=False, TWO_ACC=False, SWIZZLE_ROWS=False)
_BEST = {**_KSPLIT, "OWN_SUM": True, "SWIZZLE_ROWS": True}
# every form: its kernel and that kernel's options. "gate x11" forms are for timing only (the
# gate comes out 11 times too large); "down rows after o" probes whether the release waits for
# the copies in flight
FORMS = {
    "multiply-sum": (_gluon_chain_kernel, dict(MMA=False)),
    "mma": (_gluon_chain_kernel, dict(MMA=True)),
    "mma K-split": (_gluon_chain_ksplit_kernel, _KSPLIT),
    "mma K-split, own sum": (_gluon_chain_ksplit_kernel, {**_KSPLIT, "OWN_SUM": True}),
    "mma K-split, own sum, swizzle": (_gluon_chain_ksplit_kernel, _BEST),
    "mma K-split, own sum, swizzle, two accumulators":
        (_gluon_chain_ksplit_kernel, {**_BEST, "TWO_ACC": True}),
    "mma K-split, down rows after o": (_gluon_chain_ksplit_kernel, {**_KSPLIT, "EARLY_DOWN": False}),
    "mma K-split, gate x11": (_gluon_chain_ksplit_kernel, {**_KSPLIT, "GATE_REPEAT": 11}),
    "mma K-split, own sum, gate x11":
        (_gluon_chain_ksplit_kernel, {**_KSPLIT, "OWN_SUM": True, "GATE_REPEAT": 11}),
    "mma K-split, own sum, swizzle, two accumulators, gate x11":
        (_gluon_chain_ksplit_kernel, {**_BEST, "TWO_ACC": True, "GATE_REPEAT": 11}),
}


def chain_gluon(x, wo, wgu, wd, sync, times=None, form="multiply-sum"):
    """One launch of the chain in one of :data:`FORMS`."""
    y1 = torch.empty((ROWS, H), dtype=x.dtype, device=x.device)
    act = torch.empty((ROWS, INNER), dtype=x.dtype, device=x.device)
    y3 = torch.empty((ROWS, H), dtype=x.dtype, device=x.device)
    kernel, options = FORMS[form]
    kernel[(CTAS,)](sync, x, wo, wgu, wd, y1, act, y3, sync if times is None else times, H=H,
                    INNER=INNER, R=ROWS, N_O=N_O, N_G=N_G, STAMP=times is not None, num_warps=8,
                    **options)
    return y3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--form", choices=FORMS, default=None,
                    help="only launch this form --launches times (for a profiler), no timing")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gluon_chain: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench_cudagraph

    dev, dtype = "cuda", torch.bfloat16
    sets = []
    for seed in range(4):  # four weight sets (52 MB): rotated, they do not stay in L2 ("cold")
        g = torch.Generator().manual_seed(seed)
        sets.append(tuple((torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype).to(dev)
                          for shape in ((ROWS, H), (H, H), (2 * INNER, H), (H, INNER))))
    sync = torch.zeros(4, dtype=torch.int32, device=dev)
    if args.form is not None:
        for _ in range(args.launches):
            chain_gluon(*sets[0], sync, form=args.form)
        torch.cuda.synchronize()
        return 0
    ref = chain_reference(*sets[0])
    result = {"rows": ROWS, "dtype": "bfloat16", "ctas": CTAS}
    for form in FORMS:
        out = chain_gluon(*sets[0], sync, form=form)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        result[f"max_rel_err {form}"] = err
        print(f"gluon chain ({form}): max error {err:.2e} of the reference's largest value")
    chain_launches(*sets[0])
    runs = [("four launches", lambda s: chain_launches(*s))]
    runs += [(f"gluon one launch {form}", lambda s, form=form: chain_gluon(*s, sync, form=form))
             for form in FORMS]
    for name, fn in runs:
        for label, used in (("cold", sets), ("warm", sets[:1])):
            def run(used=used, fn=fn):
                for s in used:
                    fn(s)
            us = do_bench_cudagraph(run, rep=200) * 1e3 / len(used)
            result[f"{name} {label}"] = us
            print(f"{name:<32} {label}: {us:6.1f} us per chain")
    # timeline of one warm call: per CTA group, the median time of each probe after the first start
    for form in FORMS:
        times = torch.zeros((CTAS, 8), dtype=torch.int64, device=dev)
        for _ in range(3):
            chain_gluon(*sets[0], sync, times, form=form)
        torch.cuda.synchronize()
        t = (times - times[:, 0].min()).cpu().double() / 1e3  # us
        o_probes = ["start", "o weights in", "o published", "gate/up done seen", "act in",
                    "down published"]
        g_probes = ["start", "o done seen", "y1 in", "gate/up published"]
        if FORMS[form][0] is _gluon_chain_ksplit_kernel:  # its finer probes
            o_probes += ["o product done", "o stored"]
            g_probes += ["gate product done", "up product done", "act stored"]
        timeline = {"o/down CTAs": {n: float(t[:N_O, i].median()) for i, n in enumerate(o_probes)},
                    "gate/up CTAs": {n: float(t[N_O:, i].median()) for i, n in enumerate(g_probes)},
                    "last down published": float(t[:N_O, 5].max())}
        result[f"timeline_us {form}"] = timeline
        print(form + " " + json.dumps(timeline))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gluon_chain.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
