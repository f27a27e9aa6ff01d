"""Rotary embedding, KV write and paged attention in one launch: one query per row, or a verify.

A decode step (and every draft step) runs, per layer, ``rotary_write_kv`` (rotate q and k,
write k and v into the pool), ``paged_attention`` and, where it splits the positions, the
combine kernel: three launches of a few microseconds each whose cost is mostly launch and
memory latency, not bytes (docs/performance.md, "What limits"). When every query token
has its own page-table row (``AttentionMetadata.one_query_per_row``: decode, draft steps), the
first two fold into one kernel: each program (token, kv head, split) rotates its group's query
heads from the qkv product itself, and the program whose positions hold the token's own slot
(the last, ``kv_len - 1``) rotates the key and writes key and value into the pool before it reads
its positions, so no other program of the launch reads that slot.

Same arithmetic as the two kernels it replaces: the rotation is
:func:`~phasegraph.kernels.rotary._rotate` on the same halves, the positions are cut into the same
splits or float32 chunks and attended and stored by the same helpers as ``paged_attention``'s
kernel (:func:`~phasegraph.kernels.attention._attend_run`, ``_store_run``), and the combine
kernel is the same. So
float32 outputs are bitwise those of ``rotary_write_kv`` + ``paged_attention`` (the exactness
path), which the GPU tests check. The reference is exactly those two references.

Where a row holds several query tokens of one launch, a program would read slots another
program of the same launch writes. A verify (``AttentionMetadata.tree_block_writes``) still runs
as one launch, :func:`rope_tree_attention_triton`: its new keys are the row's tree block, E nodes
at positions ``[kv_len, kv_len + E)`` written by the row's E consecutive tokens, so every program
can rotate and write the nodes of the positions it owns itself before it reads them (several
programs write the same bits into a slot; none reads a slot it has not written). Prefill and
draft-extend run the two-kernel path.
"""

from __future__ import annotations

import math

import torch

from phasegraph.kernels import _dispatch
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels.attention import (
    AttentionMetadata,
    _attend_run,
    _fp32_chunk,
    _store_run,
    auto_splits,
    chunk_unread,
    combine_splits,
    default_tiles,
    full_precision,
    launch_splits,
    paged_attention,
    paged_attention_reference,
    run_leader,
    run_queries,
    split_buffers,
    split_range,
    tile_tokens,
    window_starts,
)
from phasegraph.kernels.rotary import _rotate, rotary_write_kv, rotary_write_kv_reference


def _split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views ``q [T, H, D]``, ``k``, ``v [T, Hkv, D]`` of a merged qkv product ``[T, (H + 2Hkv) D]``."""
    tokens = qkv.shape[0]
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :]
    return q, k.view(tokens, num_kv_heads, head_dim), v.view(tokens, num_kv_heads, head_dim)


def _check(qkv, num_heads, num_kv_heads, head_dim, k_cache) -> None:
    if qkv.ndim != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv: expected [T, {(num_heads + 2 * num_kv_heads) * head_dim}] for {num_heads} query "
            f"and {num_kv_heads} kv heads of {head_dim}, got {tuple(qkv.shape)}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if tuple(k_cache.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache: rows of shape {(num_kv_heads, head_dim)} expected, got {tuple(k_cache.shape)}")


def rope_paged_attention_reference(
    qkv: torch.Tensor,  # [T, (H + 2Hkv) D]
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,  # [T, D], or [P, D] tables with rope_rows
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    rope_rows: torch.Tensor | None = None,  # [T] i64
) -> torch.Tensor:  # [T, H, D]
    """``rotary_write_kv_reference`` then ``paged_attention_reference``."""
    _check(qkv, num_heads, num_kv_heads, head_dim, k_cache)
    q, k, v = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q = rotary_write_kv_reference(q, k, v, cos, sin, k_cache, v_cache, meta.write_slots, rope_rows)
    return paged_attention_reference(q, k_cache, v_cache, meta, scale)


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _rotated_rows(base, rows_ok, c1, c2, s1, s2, HALF: tl.constexpr):
    """Rows ``x * cos + rotate_half(x) * sin`` of the ``[R, 2 * HALF]`` block at ``base`` (row
    pointers, unit stride along D), rotated half by half as the rotary kernel does, and joined
    back into ``[R, 2 * HALF]`` (HALF a power of two). ``c1, c2, s1, s2``: the halves of cos and
    sin, ``[1, HALF]`` (one token) or ``[R, HALF]`` (a token per row), float32."""
    cols = tl.arange(0, HALF)
    x1 = tl.load(base[:, None] + cols[None, :], mask=rows_ok[:, None], other=0.0)
    x2 = tl.load(base[:, None] + HALF + cols[None, :], mask=rows_ok[:, None], other=0.0)
    y1, y2 = _rotate(x1, x2, c1, c2, s1, s2)
    both = tl.join(y1, y2)  # [R, HALF, 2]
    return tl.reshape(tl.permute(both, (0, 2, 1)), (base.shape[0], 2 * HALF))


@jit(do_not_specialize=["max_pages"])
def _rope_attention_kernel(
    qkv_ptr,  # [T, (H + 2Hkv) D], unit stride along the row
    cos_ptr,  # [T, D], or [P, D] tables (INDEXED)
    sin_ptr,
    rope_rows_ptr,  # [T] i64: token t's row of the tables (INDEXED)
    slots_ptr,  # [T] i64: where token t's key and value go (negative: the sink slot 0)
    k_ptr,  # [slots, Hkv, D]
    v_ptr,  # [slots, Hkv, D]
    out_ptr,  # [T, H, D], written when NUM_SPLITS == 1
    part_acc_ptr,  # [T, H, NUM_SPLITS, BLOCK_D] f32 (NUM_SPLITS > 1)
    part_max_ptr,  # [T, H, NUM_SPLITS] f32
    part_sum_ptr,  # [T, H, NUM_SPLITS] f32
    page_table_ptr,  # [R, max_pages] i64
    query_row_ptr,  # [T] i64, every token its own row
    kv_len_ptr,  # [T] i64, the token's own position + 1 (0: padding)
    window_lo_ptr,  # [T] i64 window starts (any tensor when HAS_WINDOW is false)
    max_pages,
    scale_log2,  # f32, softmax scale * log2(e)
    stride_qkv,
    stride_ct,
    stride_st,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pr,
    stride_pp,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_T: tl.constexpr,  # tokens per tile in paged_attention's layout (BLOCK_T * GROUP_P rows)
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # a power of two
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_P: tl.constexpr,
    CHUNK: tl.constexpr,  # > 0: fixed chunks of CHUNK positions merged in order (fp32)
    INDEXED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP_P
    t = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    row = tl.load(query_row_ptr + t)
    kv_len = tl.maximum(tl.load(kv_len_ptr + t), 0)
    if CHUNK > 0:  # split s is chunk s: [s * CHUNK, (s + 1) * CHUNK)
        per_split = CHUNK
    else:  # this split's share of [0, kv_len), whole BLOCK_N tiles
        per_split = tl.maximum(tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kv_len)
    if NUM_SPLITS == 1:
        lo = 0
        hi = kv_len

    cols = tl.arange(0, HALF)
    table_row = t
    if INDEXED:
        table_row = tl.load(rope_rows_ptr + t)
    c1 = tl.load(cos_ptr + table_row * stride_ct + cols).to(tl.float32)
    c2 = tl.load(cos_ptr + table_row * stride_ct + HALF + cols).to(tl.float32)
    s1 = tl.load(sin_ptr + table_row * stride_st + cols).to(tl.float32)
    s2 = tl.load(sin_ptr + table_row * stride_st + HALF + cols).to(tl.float32)
    qkv_row = qkv_ptr + t * stride_qkv

    # The owner of the token's own position (kv_len - 1; split 0 for padding) writes its key and
    # value, then reads its positions after a barrier: the only program that reads that slot.
    owner = split * 0
    if NUM_SPLITS > 1:
        owner = tl.maximum(kv_len - 1, 0) // per_split
    if split == owner:
        k_src = qkv_row + (NUM_HEADS + kv_head) * HEAD_DIM
        k1, k2 = _rotate(tl.load(k_src + cols), tl.load(k_src + HALF + cols), c1, c2, s1, s2)
        slot = tl.maximum(tl.load(slots_ptr + t), 0)
        k_dst = k_ptr + slot * stride_ks + kv_head * stride_kh
        tl.store(k_dst + cols * stride_kd, k1.to(k_ptr.dtype.element_ty))
        tl.store(k_dst + (HALF + cols) * stride_kd, k2.to(k_ptr.dtype.element_ty))
        v_src = qkv_row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
        v_dst = v_ptr + slot * stride_vs + kv_head * stride_vh
        tl.store(v_dst + cols * stride_vd, tl.load(v_src + cols).to(v_ptr.dtype.element_ty))
        tl.store(v_dst + (HALF + cols) * stride_vd,
                 tl.load(v_src + HALF + cols).to(v_ptr.dtype.element_ty))
        tl.debug_barrier()  # every thread's store is visible to the loads below

    # Query rows where paged_attention's kernel puts a one-token run of token t: tile rows
    # [(t % BLOCK_T) * GROUP_P, + GROUP), heads kv_head * GROUP + m % GROUP_P (same tile, same
    # row, so the same products bit for bit).
    offs_m = tl.arange(0, BLOCK_M)
    g_m = offs_m % GROUP_P
    valid_m = (offs_m // GROUP_P == t % BLOCK_T) & (g_m < GROUP)
    head_m = kv_head * GROUP + g_m
    q = _rotated_rows(qkv_row + head_m * HEAD_DIM, valid_m, c1[None, :], c2[None, :],
                      s1[None, :], s2[None, :], HALF)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)

    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < HEAD_DIM
    tok_m = tl.zeros([BLOCK_M], tl.int64) + t
    kv_len_m = tl.zeros([BLOCK_M], tl.int64) + kv_len
    lo_m = window_starts(window_lo_ptr, tok_m, valid_m, HAS_WINDOW, BLOCK_M)
    no_tree = tl.zeros([BLOCK_M], tl.int64)
    m_i, l_i, acc = _attend_run(
        lo, hi, kv_len, q, kv_len_m, lo_m, no_tree, valid_m, valid_m, tok_m, offs_d, d_ok,
        page_table_ptr + row * stride_pr, max_pages, k_ptr, v_ptr, k_ptr, kv_head, scale_log2,
        stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, stride_pp, 0, 0,
        BLOCK_M, HEAD_DIM, 0, PAGE_SIZE, BLOCK_N, False, UPCAST, SPLIT_P, CHUNK, NUM_SPLITS,
    )
    _store_run(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, tok_m, head_m,
               valid_m, offs_d, d_ok, split, NUM_HEADS, stride_ot, stride_oh, stride_od, HEAD_DIM,
               NUM_SPLITS)


@jit
def _table_halves(cos_ptr, sin_ptr, table_row, rows_ok, stride_ct, stride_st, HALF: tl.constexpr):
    """``(c1, c2, s1, s2)`` [R, HALF] float32: the halves of rows ``table_row`` [R] of the cos
    and sin tables (0 where not ``rows_ok``)."""
    cols = tl.arange(0, HALF)[None, :]
    ok = rows_ok[:, None]
    c_row = cos_ptr + table_row[:, None] * stride_ct
    s_row = sin_ptr + table_row[:, None] * stride_st
    c1 = tl.load(c_row + cols, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + HALF + cols, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + cols, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + HALF + cols, mask=ok, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@jit(do_not_specialize=["num_tokens", "max_pages"])
def _rope_tree_attention_kernel(
    qkv_ptr,  # [T, (H + 2Hkv) D], unit stride along the row
    cos_ptr,  # [T, D], or [P, D] tables (INDEXED)
    sin_ptr,
    rope_rows_ptr,  # [T] i64: token t's row of the tables (INDEXED)
    slots_ptr,  # [T] i64: where token t's key and value go (negative: the sink slot 0)
    k_ptr,  # [slots, Hkv, D]
    v_ptr,  # [slots, Hkv, D]
    out_ptr,  # [T, H, D], written when NUM_SPLITS == 1
    part_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM] f32 (NUM_SPLITS > 1)
    part_max_ptr,  # [T, H, NUM_SPLITS] f32
    part_sum_ptr,  # [T, H, NUM_SPLITS] f32
    page_table_ptr,  # [R, max_pages] i64
    query_row_ptr,  # [T] i64
    kv_len_ptr,  # [T] i64, the row's prefix (one value per row)
    extra_ptr,  # [T, E] u8 tree block
    window_lo_ptr,  # [T] i64 window starts (any tensor when HAS_WINDOW is false)
    num_tokens,
    max_pages,
    scale_log2,  # f32, softmax scale * log2(e)
    stride_qkv,
    stride_ct,
    stride_st,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pr,
    stride_pp,
    stride_et,
    stride_ee,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_EXTRA: tl.constexpr,  # E: tree nodes per row
    BLOCK_E: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # a power of two
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_P: tl.constexpr,
    CHUNK: tl.constexpr,
    INDEXED: tl.constexpr,
    RUN_GRID: tl.constexpr,  # grid axis 0 over aligned blocks of BLOCK_T tokens (E % BLOCK_T == 0)
    HAS_WINDOW: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP_P
    t = tl.program_id(0)
    if RUN_GRID:  # one program per aligned block of BLOCK_T tokens: every one leads its run
        t = t * BLOCK_T
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    row, block_start, leader = run_leader(t, query_row_ptr, num_tokens, BLOCK_T)
    if leader != t:
        return
    tok_m, member_m, valid_m, head_m, kv_len_m, tree_word, run_end = run_queries(
        row, block_start, kv_head, query_row_ptr, kv_len_ptr, extra_ptr, num_tokens, stride_et,
        stride_ee, NUM_EXTRA, BLOCK_E, GROUP, GROUP_P, BLOCK_M, True,
    )
    lo, hi = split_range(split, run_end, NUM_SPLITS, BLOCK_N, CHUNK)
    # the tree nodes lie in [kv_len, kv_len + E): a chunk past that writes and reads nothing
    if chunk_unread(lo, kv_len_m, member_m, NUM_EXTRA, CHUNK, NUM_SPLITS):
        return

    # The tree block of t's row: node e is token row_base + e at position kv_len + e. This program
    # writes the nodes of the positions it owns (every position it may read, and together with
    # the other splits every node), then reads them after a barrier: no program reads a slot
    # before it wrote it itself. Runs of one row in several blocks write the same bits.
    offs_e = tl.arange(0, BLOCK_E)
    pos_e = tl.maximum(tl.load(kv_len_ptr + t), 0) + offs_e  # [E]
    node_e = (t // NUM_EXTRA) * NUM_EXTRA + offs_e.to(tl.int64)  # [E]
    write_e = (offs_e < NUM_EXTRA) & (node_e < num_tokens)
    if NUM_SPLITS > 1:
        if CHUNK > 0:
            write_e = write_e & (pos_e // CHUNK == split)
        else:
            per_split = tl.maximum(tl.cdiv(tl.cdiv(run_end, NUM_SPLITS), BLOCK_N) * BLOCK_N, 1)
            write_e = write_e & (tl.minimum(pos_e // per_split, NUM_SPLITS - 1) == split)
    table_e = node_e
    if INDEXED:
        table_e = tl.load(rope_rows_ptr + node_e, mask=write_e, other=0)
    c1, c2, s1, s2 = _table_halves(cos_ptr, sin_ptr, table_e, write_e, stride_ct, stride_st, HALF)
    # key and value half by half ([E, HALF] tiles), as the rotary kernel writes them
    cols = tl.arange(0, HALF)[None, :]
    ok = write_e[:, None]
    k_src = (qkv_ptr + node_e * stride_qkv + (NUM_HEADS + kv_head) * HEAD_DIM)[:, None] + cols
    v_src = k_src + NUM_KV_HEADS * HEAD_DIM
    k1, k2 = _rotate(tl.load(k_src, mask=ok, other=0.0), tl.load(k_src + HALF, mask=ok, other=0.0),
                     c1, c2, s1, s2)
    slot_e = tl.maximum(tl.load(slots_ptr + node_e, mask=write_e, other=0), 0)
    k_dst = (k_ptr + slot_e * stride_ks + kv_head * stride_kh)[:, None] + cols * stride_kd
    v_dst = (v_ptr + slot_e * stride_vs + kv_head * stride_vh)[:, None] + cols * stride_vd
    tl.store(k_dst, k1.to(k_ptr.dtype.element_ty), mask=ok)
    tl.store(k_dst + HALF * stride_kd, k2.to(k_ptr.dtype.element_ty), mask=ok)
    tl.store(v_dst, tl.load(v_src, mask=ok, other=0.0).to(v_ptr.dtype.element_ty), mask=ok)
    tl.store(v_dst + HALF * stride_vd, tl.load(v_src + HALF, mask=ok, other=0.0).to(v_ptr.dtype.element_ty),
             mask=ok)
    tl.debug_barrier()  # every thread's store is visible to the loads below

    table_m = tok_m
    if INDEXED:
        table_m = tl.load(rope_rows_ptr + tok_m, mask=valid_m, other=0)
    c1, c2, s1, s2 = _table_halves(cos_ptr, sin_ptr, table_m, valid_m, stride_ct, stride_st, HALF)
    q = _rotated_rows(qkv_ptr + tok_m * stride_qkv + head_m * HEAD_DIM, valid_m, c1, c2, s1, s2,
                      HALF)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    d_ok = offs_d < HEAD_DIM
    lo_m = window_starts(window_lo_ptr, tok_m, member_m, HAS_WINDOW, BLOCK_M)
    m_i, l_i, acc = _attend_run(
        lo, hi, run_end, q, kv_len_m, lo_m, tree_word, member_m, valid_m, tok_m, offs_d, d_ok,
        page_table_ptr + row * stride_pr, max_pages, k_ptr, v_ptr, extra_ptr, kv_head, scale_log2,
        stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, stride_pp, stride_et,
        stride_ee, BLOCK_M, HEAD_DIM, NUM_EXTRA, PAGE_SIZE, BLOCK_N, True, UPCAST, SPLIT_P, CHUNK,
        NUM_SPLITS,
    )
    _store_run(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, tok_m, head_m,
               valid_m, offs_d, d_ok, split, NUM_HEADS, stride_ot, stride_oh, stride_od, HEAD_DIM,
               NUM_SPLITS)


TREE_NUM_WARPS = 4  # warps per program of the verify's kernel
# registers per thread the verify's kernel may use (None: the compiler's choice; ptxas .maxnreg).
# A cap changes register allocation only, never the arithmetic, so the bits stay.
TREE_MAXNREG: int | None = None


def rope_tree_attention_triton(
    qkv: torch.Tensor,  # [T, (H + 2Hkv) D], unit stride along the row
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,  # a power of two >= 16
    cos: torch.Tensor,  # [T, D], or [P, D] tables with rope_rows
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    meta: AttentionMetadata,  # with a tree block and ``tree_block_writes``
    scale: float,
    rope_rows: torch.Tensor | None = None,  # [T] i64
    *,
    num_splits: int | None = None,
) -> torch.Tensor:  # [T, H, D], dtype of qkv
    """Triton ``rope_paged_attention`` for a verify (``meta.tree_block_writes``): grid ``(T, Hkv,
    splits)`` with the tiles, runs and splits of
    :func:`~phasegraph.kernels.attention.paged_attention_triton`, so the output is bitwise that
    of ``rotary_write_kv`` + ``paged_attention``; each program first rotates and writes the tree
    nodes whose positions it owns (each node's key and value once per run that shares its split,
    all the same bits). Where the token tile divides E and there are several splits, axis 0
    runs over the runs (``T / BLOCK_T``), not the tokens, and float32 chunk programs past
    ``kv_len + E`` return at once (:func:`~phasegraph.kernels.attention.chunk_unread`): the
    bench pair's verify at batch 8 spent most of its attention time in programs that returned.
    ``num_splits`` overrides
    the split count as :func:`~phasegraph.kernels.attention.paged_attention_triton`'s does (> 1
    with float32 chunks: one split per chunk), for tests that need several splits where the grid
    would not choose them."""
    _check(qkv, num_heads, num_kv_heads, head_dim, k_cache)
    num_tokens = qkv.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return out
    extra = meta.extra_mask
    if extra is None or extra.shape[1] == 0 or num_tokens % extra.shape[1]:
        raise ValueError("rope_tree_attention_triton needs a tree block of E nodes per row and "
                         f"a multiple of E tokens, got {num_tokens} tokens and extra_mask "
                         f"{None if extra is None else tuple(extra.shape)}")
    num_extra = extra.shape[1]
    upcast = full_precision(qkv, k_cache, v_cache)
    block_m, block_n, num_stages = default_tiles(upcast, num_extra)
    group_p, block_t = tile_tokens(group, block_m)
    page_size = meta.page_size
    max_pages = meta.page_table.shape[1]
    positions = max_pages * page_size
    chunk = _fp32_chunk(positions, block_n) if upcast else 0
    num_splits = launch_splits(positions, block_n, chunk, num_splits,
                               _dispatch.cdiv(num_tokens, block_t) * num_kv_heads, qkv.device)
    part_acc, part_max, part_sum = split_buffers(out, num_splits, head_dim)
    indexed = rope_rows is not None
    slots = meta.write_slots.contiguous()
    kv_len = meta.kv_len.contiguous()
    extra_bytes = _dispatch.as_bytes(extra)
    # rows are E tokens from a multiple of E, so with BLOCK_T dividing E no block spans two rows
    # and each block is one run: one program per block and chunk, not per token and chunk (most
    # would return at once). With one split (many runs) the token grid measured faster.
    run_grid = num_extra % block_t == 0 and num_splits > 1
    grid = (num_tokens // block_t if run_grid else num_tokens, num_kv_heads, num_splits)
    _rope_tree_attention_kernel[grid](
        qkv, cos, sin, rope_rows.contiguous() if indexed else slots, slots, k_cache, v_cache,
        out, part_acc, part_max, part_sum, meta.page_table, meta.query_row.contiguous(), kv_len,
        extra_bytes, kv_len if meta.window_lo is None else meta.window_lo.contiguous(),
        num_tokens, max_pages, float(scale) * math.log2(math.e),
        qkv.stride(0), cos.stride(0), sin.stride(0),
        *k_cache.stride(), *v_cache.stride(), *out.stride(), *meta.page_table.stride(),
        *extra_bytes.stride(),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        NUM_EXTRA=num_extra,
        # whole 16-row tiles for the node writes: with 4-row tiles (E = 3, joined halves) the
        # bfloat16 keys came out wrong on an H100 (Triton 3.6; the GPU test caught it)
        BLOCK_E=max(16, next_pow2(num_extra)),
        PAGE_SIZE=page_size,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        UPCAST=upcast,
        SPLIT_P=not upcast and qkv.dtype == torch.bfloat16,
        CHUNK=chunk,
        INDEXED=indexed,
        RUN_GRID=run_grid,
        HAS_WINDOW=meta.window_lo is not None,
        num_warps=TREE_NUM_WARPS,
        num_stages=num_stages, **pdl_options(), **({"maxnreg": TREE_MAXNREG} if TREE_MAXNREG else {}),
    )
    combine_splits(out, part_acc, part_max, part_sum, kv_len, head_dim, chunk, num_extra)
    return out


def fits_triton(qkv: torch.Tensor, head_dim: int, k_cache: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the one-launch kernel takes these inputs (else the two-kernel path runs)."""
    return (
        head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and qkv.stride(1) == 1
        and cos.stride(-1) == 1
        and k_cache.stride(-1) == 1
    )


def rope_paged_attention_triton(
    qkv: torch.Tensor,  # [T, (H + 2Hkv) D], unit stride along the row
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,  # a power of two >= 16
    cos: torch.Tensor,  # [T, D], or [P, D] tables with rope_rows
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    meta: AttentionMetadata,  # one query token per page-table row
    scale: float,
    rope_rows: torch.Tensor | None = None,  # [T] i64
) -> torch.Tensor:  # [T, H, D], dtype of qkv
    """Triton ``rope_paged_attention``: grid ``(T, Hkv, splits)``. Tiles as
    :func:`~phasegraph.kernels.attention.paged_attention_triton` (64 query rows in bf16/fp16,
    16 in fp32; fp32 in fixed chunks of positions), with one token per program; ``splits``
    brings ``T * Hkv * splits`` to about two programs per SM (bf16/fp16), or is the number of
    float32 chunks while ``T * Hkv`` leaves most SMs idle.

    Launched plainly, never early (``pdl_options(early=False)``): placed early beside the qkv
    product it follows, its programs crowded onto the SMs that had room, and the bench pair's
    decode step took 0.483 instead of 0.415 ms of GPU time (H100)."""
    _check(qkv, num_heads, num_kv_heads, head_dim, k_cache)
    num_tokens = qkv.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return out
    upcast = full_precision(qkv, k_cache, v_cache)
    group_p, block_t = tile_tokens(group, 16 if upcast else 64)  # paged_attention_triton's tile
    block_n = 16 if upcast else 32
    page_size = meta.page_size
    max_pages = meta.page_table.shape[1]
    positions = max_pages * page_size
    chunk = _fp32_chunk(positions, block_n) if upcast else 0
    # every token is its own run here (paged_attention assumes runs of BLOCK_T tokens)
    num_splits = auto_splits(positions, block_n, chunk, num_tokens * num_kv_heads, qkv.device)
    part_acc, part_max, part_sum = split_buffers(out, num_splits, head_dim)
    indexed = rope_rows is not None
    slots = meta.write_slots.contiguous()
    _rope_attention_kernel[(num_tokens, num_kv_heads, num_splits)](
        qkv, cos, sin, rope_rows.contiguous() if indexed else slots, slots, k_cache, v_cache,
        out, part_acc, part_max, part_sum, meta.page_table, meta.query_row.contiguous(),
        meta.kv_len.contiguous(),
        meta.kv_len.contiguous() if meta.window_lo is None else meta.window_lo.contiguous(),
        max_pages, float(scale) * math.log2(math.e),
        qkv.stride(0), cos.stride(0), sin.stride(0),
        *k_cache.stride(), *v_cache.stride(), *out.stride(), *meta.page_table.stride(),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        PAGE_SIZE=page_size,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        UPCAST=upcast,
        SPLIT_P=not upcast and qkv.dtype == torch.bfloat16,
        CHUNK=chunk,
        INDEXED=indexed,
        HAS_WINDOW=meta.window_lo is not None,
        num_warps=4,
        num_stages=1 if upcast else 2,
        **pdl_options(early=False),  # one wave spread over the SMs (docstring)
    )
    combine_splits(out, part_acc, part_max, part_sum, meta.kv_len.contiguous(), head_dim, chunk, 0)
    return out


def rope_paged_attention(
    qkv: torch.Tensor,  # [T, (H + 2Hkv) D]
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,  # [T, D], or [P, D] tables with rope_rows
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    rope_rows: torch.Tensor | None = None,  # [T] i64: each token's row of the tables
) -> torch.Tensor:  # [T, H, D]
    """RoPE on the query and key heads of ``qkv``, key and value written at
    ``meta.write_slots``, then paged attention: one Triton launch (plus the combine kernel where
    it splits) on CUDA when ``meta.one_query_per_row``; else ``rotary_write_kv`` and
    ``paged_attention`` (their Triton kernels on CUDA, their references elsewhere)."""
    if use_triton(qkv) and fits_triton(qkv, head_dim, k_cache, cos):
        if meta.one_query_per_row:
            return rope_paged_attention_triton(qkv, num_heads, num_kv_heads, head_dim, cos, sin,
                                               k_cache, v_cache, meta, scale, rope_rows)
        extra = meta.extra_mask
        if meta.tree_block_writes and extra is not None and extra.shape[1] > 0 \
                and qkv.shape[0] % extra.shape[1] == 0:
            return rope_tree_attention_triton(qkv, num_heads, num_kv_heads, head_dim, cos, sin,
                                              k_cache, v_cache, meta, scale, rope_rows)
    _check(qkv, num_heads, num_kv_heads, head_dim, k_cache)
    q, k, v = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q = rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, meta.write_slots, rope_rows)
    return paged_attention(q, k_cache, v_cache, meta, scale)
