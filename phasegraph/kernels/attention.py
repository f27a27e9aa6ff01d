"""Attention over the paged KV pool, with an optional tree block (verify, draft, extend).

See ``docs/internals.md`` ("Attention metadata"). ``paged_attention_reference`` and
``write_kv_reference`` are the CPU path and the oracle; ``paged_attention_triton`` and
``write_kv_triton`` run on the GPU; the public ``paged_attention`` and ``write_kv`` dispatch
(``phasegraph/kernels/_dispatch.py``).
"""

from __future__ import annotations

import math

import attrs
import torch

from phasegraph.kernels._dispatch import (
    as_bytes,
    cdiv,
    jit,
    next_pow2,
    num_sms,
    pdl_enter,
    pdl_options,
    prev_pow2,
    tl,
    use_triton,
)


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Where the T query tokens of one forward write their KV and what each of them reads.

    Query t writes its key/value into ``write_slots[t]`` and attends logical positions
    ``[0, kv_len[t])`` of page-table row ``query_row[t]``, plus ``kv_len[t] + e`` for every
    ``e`` with ``extra_mask[t, e]`` (the tree block behind the prefix).
    """

    write_slots: torch.Tensor  # [T] int64
    page_table: torch.Tensor  # [R, max_pages] int64
    query_row: torch.Tensor  # [T] int64, row of page_table
    kv_len: torch.Tensor  # [T] int64
    extra_mask: torch.Tensor | None  # [T, E] bool, or None
    page_size: int
    # A promise of the caller (decode, draft steps): no two query tokens share a page-table row
    # and no token reads a slot another token writes. Then rotary + KV write + attention may run
    # as one kernel (kernels/rope_attention.py); tests/engine/test_one_query_per_row.py checks it.
    one_query_per_row: bool = False
    # A promise of the caller (verify): the query tokens of a row are E = extra_mask.shape[1]
    # consecutive tokens of the call, starting at a multiple of E, with one kv_len, and token j
    # of them writes logical position kv_len + j (node j of the row's tree block). Then rotary +
    # KV write + attention may run as one kernel that writes, in every program, the tree-block
    # keys it reads (kernels/rope_attention.py); tests/engine/test_one_query_per_row.py checks it.
    tree_block_writes: bool = False
    # Sliding-window attention (Mistral, Qwen2): query t reads prefix positions from
    # window_lo[t] on, i.e. the window's tokens ending at its own position (window_of builds
    # it from the query positions). The tree block is not windowed: the engine keeps every
    # draft path shorter than the window, so a node's ancestors always lie inside it.
    window_lo: torch.Tensor | None = None  # [T] int64, or None: the whole prefix

    def __attrs_post_init__(self) -> None:
        # The one-launch kernel reads no tree block and takes each token's own key at kv_len - 1:
        # a promise beside a tree block would drop keys silently, so it is refused (shapes only).
        if self.one_query_per_row and self.extra_mask is not None and self.extra_mask.shape[1] > 0:
            raise ValueError("AttentionMetadata: one_query_per_row promises that each token reads its row's "
                             f"prefix only, but extra_mask holds a tree block of {self.extra_mask.shape[1]} "
                             "nodes; drop the promise or the block")


def window_of(meta: AttentionMetadata, positions: torch.Tensor, window: int) -> AttentionMetadata:
    """``meta`` for a sliding-window layer: the query at position ``p`` reads the prefix
    positions ``> p - window`` (transformers' ``sliding_window_overlay``: ``window`` tokens, its
    own included). Positions are logical positions of the row: the target's KV row ``p`` and a
    standalone draft's hold the token at position ``p``. Computed on the device from the
    positions, so a CUDA graph captures it."""
    if window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    return attrs.evolve(meta, window_lo=positions.to(torch.int64) - (window - 1))


# Upper bound on gathered key elements per chunk of queries (keeps the reference's memory bounded
# while every shape stays a function of tensor shapes only).
_GATHER_BUDGET = 1 << 24


def write_kv_reference(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    slots: torch.Tensor,  # [T] int64; negative entries go to the sink slot 0
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """Write one layer's key/value of T tokens into the pool, in place."""
    slots = slots.clamp(min=0)  # [T]
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def attention_allowed_mask(meta: AttentionMetadata, length: int) -> torch.Tensor:
    """``[T, length]`` bool: which logical positions of its row each query attends.

    Position ``l`` is allowed when ``window_lo[t] <= l < kv_len[t]`` (the prefix, the whole of
    it without a window) or when
    ``0 <= l - kv_len[t] < E`` and ``extra_mask[t, l - kv_len[t]]`` (the tree block).
    """
    device = meta.kv_len.device
    pos = torch.arange(length, device=device, dtype=torch.int64)  # [L]
    kv_len = meta.kv_len[:, None]  # [T, 1]
    allowed = pos[None, :] < kv_len  # [T, L]
    if meta.window_lo is not None:
        allowed = allowed & (pos[None, :] >= meta.window_lo[:, None])
    extra = meta.extra_mask
    if extra is not None and extra.shape[1] > 0:
        num_extra = extra.shape[1]
        rel = pos[None, :] - kv_len  # [T, L] offset into the tree block
        in_block = (rel >= 0) & (rel < num_extra)  # [T, L]
        tree = torch.gather(extra, 1, rel.clamp(0, num_extra - 1))  # [T, L]
        allowed = allowed | (in_block & tree)
    return allowed


def paged_attention_reference(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D], dtype of q
    """Reference paged attention with an optional tree block (see ``docs/internals.md``).

    Every query gathers the whole logical range of its page-table row,
    ``L = page_table.shape[1] * page_size`` positions (the tree block ``[kv_len, kv_len + E)``
    lies inside the row, so it needs no separate gather), and masks it with
    :func:`attention_allowed_mask`. Scores, softmax and the weighted sum run in float32. A query
    that attends nothing (a padded row with ``kv_len == 0`` and no tree bits) returns zeros.
    On a GPU, shapes depend only on tensor shapes (no host syncs; the Triton kernel is the
    fast path there). On the CPU, where reading a value costs nothing, the gather stops at the
    longest range any query needs instead of the full row. Queries are processed in chunks sized
    from the shapes so the gathered keys stay below ``_GATHER_BUDGET`` elements.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    page_size = meta.page_size
    length = meta.page_table.shape[1] * page_size
    device = q.device
    if device.type == "cpu" and num_tokens > 0:
        extra = 0 if meta.extra_mask is None else meta.extra_mask.shape[1]
        needed = int(meta.kv_len.max()) + extra  # the CPU reads values for free
        length = min(length, max(page_size, -(-needed // page_size) * page_size))

    pos = torch.arange(length, device=device, dtype=torch.int64)  # [L]
    page_of = pos // page_size  # [L]
    offset_of = pos % page_size  # [L]
    allowed = attention_allowed_mask(meta, length)  # [T, L]

    out = torch.empty_like(q)  # [T, H, D]
    if device.type == "cpu":
        # each row's keys and values gathered once and shared by all the queries that read it
        # (a verify's tree nodes, a prefill's tokens): no per-query copy of the row
        row_chunk = max(1, _GATHER_BUDGET // max(1, length * num_heads))  # scores per chunk
        for row, queries in _queries_by_row(meta.query_row).items():
            slots = meta.page_table[row].index_select(0, page_of) * page_size + offset_of  # [L]
            k = k_cache.index_select(0, slots).float()  # [L, Hkv, D]
            v = v_cache.index_select(0, slots).float()  # [L, Hkv, D]
            for start in range(0, len(queries), row_chunk):
                index = queries[start : start + row_chunk]  # [c]
                out[index] = _attend(q.index_select(0, index), k, v, allowed.index_select(0, index), scale, group)
        return out
    chunk = max(1, _GATHER_BUDGET // max(1, length * num_kv_heads * head_dim))
    for start in range(0, num_tokens, chunk):
        end = min(num_tokens, start + chunk)
        rows = meta.query_row[start:end]  # [c]
        pages = meta.page_table.index_select(0, rows)  # [c, max_pages]
        slots = pages[:, page_of] * page_size + offset_of  # [c, L]
        k = k_cache[slots].float()  # [c, L, Hkv, D]
        v = v_cache[slots].float()  # [c, L, Hkv, D]
        out[start:end] = _attend(q[start:end], k, v, allowed[start:end], scale, group)
    return out


def _queries_by_row(query_row: torch.Tensor) -> dict[int, torch.Tensor]:
    """The queries of each page-table row, in order: {row: [c] int64 query indices}."""
    rows, inverse = torch.unique(query_row, return_inverse=True)
    order = torch.argsort(inverse, stable=True)
    counts = torch.bincount(inverse, minlength=rows.numel()).tolist()
    return dict(zip(rows.tolist(), torch.split(order, counts), strict=True))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            group: int) -> torch.Tensor:
    """Masked softmax attention in float32 of queries ``q`` [c, H, D] under ``allowed`` [c, L]
    over keys and values, each query's own [c, L, Hkv, D] or one row's [L, Hkv, D] that all the
    queries share (then one product per kv head over them); a query that attends nothing gets
    zeros."""
    c, num_heads, head_dim = q.shape
    kv = "clhd" if k.dim() == 4 else "lhd"
    qc = q.float().view(c, num_heads // group, group, head_dim)  # [c, Hkv, G, D]
    scores = torch.einsum(f"chgd,{kv}->chgl", qc, k) * scale  # [c, Hkv, G, L]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    # a query that attends nothing: max 0 (not -inf, whose difference is nan), denominator 1
    row_max = scores.amax(dim=-1, keepdim=True).nan_to_num_(0.0, 0.0, 0.0)  # [c, Hkv, G, 1]
    probs = torch.exp(scores - row_max)  # [c, Hkv, G, L], 0 where masked
    denom = probs.sum(dim=-1, keepdim=True)  # [c, Hkv, G, 1]
    denom = denom.masked_fill_(denom == 0, 1.0)
    ctx = torch.einsum(f"chgl,{kv}->chgd", probs, v) / denom  # [c, Hkv, G, D]
    return ctx.reshape(c, num_heads, head_dim).to(q.dtype)


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _write_kv_kernel(
    k_cache_ptr,  # [slots, Hkv, D]
    v_cache_ptr,  # [slots, Hkv, D]
    slots_ptr,  # [T] i64, negative -> slot 0
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.maximum(tl.load(slots_ptr + t), 0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    tl.store(
        k_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_triton(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    slots: torch.Tensor,  # [T] int64; negative entries go to the sink slot 0
    k: torch.Tensor,  # [T, Hkv, D], any strides
    v: torch.Tensor,  # [T, Hkv, D], any strides
) -> None:
    """Triton ``write_kv``: one launch writes both caches (the reference needs a clamp and two
    ``index_copy_``), reading ``k``/``v`` through their strides (the attention backend passes
    transposed views) and casting to the cache dtype on the fly.

    Launch: one program per token, each copying its ``Hkv x D`` key and value rows. Pure copy:
    ``2 * T * Hkv * D`` elements read and written once. Tokens that share a slot (padding rows
    on the sink) race exactly as they do in ``index_copy_``.
    """
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    slots = slots.contiguous()
    _write_kv_kernel[(num_tokens,)](
        k_cache, v_cache, slots, k, v,
        *k_cache.stride(), *v_cache.stride(), *k.stride(), *v.stride(),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim),
        num_warps=4, **pdl_options(),
    )


@jit
def _attend_tiles(
    lo, hi, m_i, l_i, acc, q, kv_len_m, lo_m, tree_word, member_m, valid_m, tok_m, offs_d, d_ok,
    table_row, max_pages, k_ptr, v_ptr, extra_ptr, kv_head, scale_log2,
    stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, stride_pp, stride_et, stride_ee,
    NUM_EXTRA: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_EXTRA: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr,
):
    """Online softmax over the positions [lo, hi) of one run, BLOCK_N at a time, continuing
    from (m_i, l_i, acc): returns the updated running max, denominator and unnormalised P.V."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # [N] logical positions of the row
        col_ok = pos < hi
        page_col = pos // PAGE_SIZE
        page = tl.load(table_row + page_col * stride_pp, mask=col_ok & (page_col < max_pages),
                       other=0)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE  # [N]

        k = tl.load(
            k_ptr + slot[None, :] * stride_ks + kv_head * stride_kh
            + offs_d[:, None] * stride_kd,
            mask=col_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [BLOCK_D, N]
        if UPCAST:
            qk = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, k)  # [M, N] f32

        # the prefix [lo_m, kv_len): lo_m is each query's window start (0 without a window)
        allowed = (pos[None, :] < kv_len_m[:, None]) & (pos[None, :] >= lo_m[:, None])
        if HAS_EXTRA:
            rel = pos[None, :] - kv_len_m[:, None]  # [M, N] offset into the tree block
            in_tree = member_m[:, None] & (rel >= 0) & (rel < NUM_EXTRA)
            if NUM_EXTRA <= 64:
                shift = tl.where(in_tree, rel, 0)
                bit = ((tree_word[:, None] >> shift) & 1) != 0
                allowed = allowed | (in_tree & bit)
            else:
                bit = tl.load(extra_ptr + tok_m[:, None] * stride_et + rel * stride_ee,
                              mask=in_tree, other=0)
                allowed = allowed | (bit != 0)
        allowed = allowed & valid_m[:, None] & col_ok[None, :]

        # Online softmax in the log2 domain; rows with nothing allowed yet keep m = -inf and
        # use 0 as their shift, so no inf - inf appears.
        s = tl.where(allowed, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])  # 0 where not allowed
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]

        # Values of positions nobody in the run attends are never loaded (stay 0), so garbage
        # there (the sink page, unwritten slots) cannot turn 0 * NaN into NaN.
        used = tl.max(allowed.to(tl.int32), axis=0) > 0  # [N]
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=used[:, None] & d_ok[None, :],
            other=0.0,
        )  # [N, BLOCK_D]
        if UPCAST:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        elif SPLIT_P:
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            acc = tl.dot(p_hi, v, acc)
            acc = tl.dot(p_lo, v, acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return m_i, l_i, acc


@jit
def _merge_partial(run_m, run_l, run_acc, m, denom, acc):
    """Fold one chunk's partial softmax (max m, denominator denom, unnormalised P.V acc) into the
    running one. A chunk a row attends nothing of (m = -inf, denom = 0, acc = 0) leaves it exactly
    as it was, so chunks past a query's end change no bit."""
    m_new = tl.maximum(run_m, m)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(run_m - m_use)
    b = tl.exp2(m - m_use)
    return m_new, run_l * a + denom * b, run_acc * a[:, None] + acc * b[:, None]


@jit
def _attend_run(
    lo, hi, run_end, q, kv_len_m, lo_m, tree_word, member_m, valid_m, tok_m, offs_d, d_ok, table_row,
    max_pages, k_ptr, v_ptr, extra_ptr, kv_head, scale_log2,
    stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, stride_pp, stride_et, stride_ee,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_EXTRA: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr,
    CHUNK: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """(running max, denominator, unnormalised P.V) of a run's query rows over this program's
    positions: ``[lo, hi)``, or with float32 chunks and one split every chunk of ``[0, run_end)``
    from a fresh state, folded in order (the same arithmetic as one program per chunk plus the
    combine kernel, so splitting never changes a bit)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CHUNK > 0 and NUM_SPLITS == 1:
        run_m = m_i
        run_l = l_i
        run_acc = acc
        for c in range(0, tl.cdiv(run_end, CHUNK)):
            m_c, l_c, acc_c = _attend_tiles(
                c * CHUNK, tl.minimum(c * CHUNK + CHUNK, run_end), m_i, l_i, acc, q, kv_len_m, lo_m,
                tree_word, member_m, valid_m, tok_m, offs_d, d_ok, table_row, max_pages, k_ptr,
                v_ptr, extra_ptr, kv_head, scale_log2, stride_ks, stride_kh, stride_kd,
                stride_vs, stride_vh, stride_vd, stride_pp, stride_et, stride_ee,
                NUM_EXTRA, PAGE_SIZE, BLOCK_N, HAS_EXTRA, UPCAST, SPLIT_P,
            )
            run_m, run_l, run_acc = _merge_partial(run_m, run_l, run_acc, m_c, l_c, acc_c)
        m_i, l_i, acc = run_m, run_l, run_acc
    else:
        m_i, l_i, acc = _attend_tiles(
            lo, hi, m_i, l_i, acc, q, kv_len_m, lo_m, tree_word, member_m, valid_m, tok_m, offs_d,
            d_ok, table_row, max_pages, k_ptr, v_ptr, extra_ptr, kv_head, scale_log2,
            stride_ks, stride_kh, stride_kd, stride_vs, stride_vh, stride_vd, stride_pp,
            stride_et, stride_ee, NUM_EXTRA, PAGE_SIZE, BLOCK_N, HAS_EXTRA, UPCAST, SPLIT_P,
        )
    return m_i, l_i, acc


@jit
def _store_run(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, tok_m, head_m, valid_m,
    offs_d, d_ok, split, num_heads, stride_ot, stride_oh, stride_od,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """The run's output rows (one split), or its partial softmax for the combine kernel."""
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows that attend nothing: 0
        tl.store(
            out_ptr + tok_m[:, None] * stride_ot + head_m[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=valid_m[:, None] & d_ok[None, :],
        )
    else:
        part = (tok_m * num_heads + head_m) * NUM_SPLITS + split  # [M]
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc,
                 mask=valid_m[:, None])
        tl.store(part_max_ptr + part, m_i, mask=valid_m)
        tl.store(part_sum_ptr + part, l_i, mask=valid_m)


@jit
def window_starts(window_lo_ptr, tok_m, member_m, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each query row's first prefix position (``AttentionMetadata.window_lo``; 0 without a
    window): positions below it are masked as positions past kv_len are."""
    if HAS_WINDOW:
        lo_m = tl.load(window_lo_ptr + tok_m, mask=member_m, other=0).to(tl.int64)
    else:
        lo_m = tl.zeros([BLOCK_M], tl.int64)
    return lo_m


@jit
def run_leader(t, query_row_ptr, num_tokens, BLOCK_T: tl.constexpr):
    """``(row, block_start, leader)`` of query token ``t``: the tokens of t's aligned block of
    ``BLOCK_T`` that share its page-table row form one "run"; its first token (the leader) does
    the whole run, so the run's keys and values are read once, and every other program of the
    run returns at once."""
    row = tl.load(query_row_ptr + t)
    block_start = (t // BLOCK_T) * BLOCK_T
    offs_bt = block_start + tl.arange(0, BLOCK_T)
    rows_bt = tl.load(query_row_ptr + offs_bt, mask=offs_bt < num_tokens, other=-1)
    same_bt = (offs_bt < num_tokens) & (rows_bt == row)
    leader = tl.min(tl.where(same_bt, offs_bt, num_tokens), axis=0)
    return row, block_start, leader


@jit
def run_queries(
    row, block_start, kv_head, query_row_ptr, kv_len_ptr, extra_ptr, num_tokens, stride_et,
    stride_ee, NUM_EXTRA: tl.constexpr, BLOCK_E: tl.constexpr, GROUP: tl.constexpr,
    GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, HAS_EXTRA: tl.constexpr,
):
    """The query rows of a run: tile row m is token ``block_start + m // GROUP_P``, head
    ``kv_head * GROUP + m % GROUP_P``. Returns ``(tok_m, member_m, valid_m, head_m, kv_len_m,
    tree_word, run_end)``: the rows' tokens, whether each belongs to the run (and is a real
    head), their heads and prefix lengths, their tree bits packed into one int64 (bit e:
    position kv_len + e, when NUM_EXTRA <= 64) and the end of the run's positions."""
    offs_m = tl.arange(0, BLOCK_M)
    tok_m = (block_start + offs_m // GROUP_P).to(tl.int64)  # [M]
    g_m = offs_m % GROUP_P
    in_range_m = tok_m < num_tokens
    row_m = tl.load(query_row_ptr + tok_m, mask=in_range_m, other=-1)
    member_m = in_range_m & (row_m == row)
    valid_m = member_m & (g_m < GROUP)
    head_m = kv_head * GROUP + g_m
    kv_len_m = tl.maximum(tl.load(kv_len_ptr + tok_m, mask=member_m, other=0), 0)  # [M]
    end_m = kv_len_m
    tree_word = tl.zeros([BLOCK_M], tl.int64)
    if HAS_EXTRA:
        # A query reads nothing past its last tree bit: [0, kv_len + last set bit + 1).
        offs_e = tl.arange(0, BLOCK_E)
        bits = tl.load(
            extra_ptr + tok_m[:, None] * stride_et + offs_e[None, :] * stride_ee,
            mask=member_m[:, None] & (offs_e[None, :] < NUM_EXTRA),
            other=0,
        )
        end_m = kv_len_m + tl.max(tl.where(bits != 0, offs_e[None, :] + 1, 0), axis=1)
        if NUM_EXTRA <= 64:
            # Tree bits of each query row packed into one int64 (bit e = position kv_len + e),
            # so the loop tests them with shifts instead of gathering bytes.
            tree_word = tl.sum(
                tl.where(bits != 0, tl.full([1], 1, tl.int64) << offs_e[None, :].to(tl.int64), 0),
                axis=1,
            )  # [M] i64
    run_end = tl.max(tl.where(member_m, end_m, 0), axis=0)
    return tok_m, member_m, valid_m, head_m, kv_len_m, tree_word, run_end


@jit
def split_range(split, run_end, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                CHUNK: tl.constexpr):
    """``[lo, hi)``: the positions of ``[0, run_end)`` split ``split`` attends: with float32
    chunks, chunk ``split``; else its share of whole ``BLOCK_N`` tiles."""
    if CHUNK > 0:  # split s is chunk s: [s * CHUNK, (s + 1) * CHUNK)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, run_end)
    else:
        per_split = tl.cdiv(tl.cdiv(run_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, run_end)
    return lo, hi


@jit
def chunk_unread(lo, kv_len_m, member_m, NUM_EXTRA: tl.constexpr, CHUNK: tl.constexpr,
                 NUM_SPLITS: tl.constexpr):
    """Whether this program's float32 chunk (from ``lo``) lies past every position the combine
    kernel reads for the run's tokens (``[0, kv_len + E)``): its partial is never read and it
    attends nothing, so it may return before loading anything. Chunks the combine reads, live or
    not, still run, so the bits never change; grids are sized by the page table, and at short
    contexts most of their chunk programs are such."""
    if CHUNK > 0 and NUM_SPLITS > 1:
        return lo >= tl.max(tl.where(member_m, kv_len_m, 0), axis=0) + NUM_EXTRA
    return lo < 0  # never


@jit(do_not_specialize=["num_tokens", "max_pages"])
def _paged_attention_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [slots, Hkv, D]
    v_ptr,  # [slots, Hkv, D]
    out_ptr,  # [T, H, D], written when NUM_SPLITS == 1
    part_acc_ptr,  # [T, H, NUM_SPLITS, BLOCK_D] f32, unnormalised P.V (NUM_SPLITS > 1)
    part_max_ptr,  # [T, H, NUM_SPLITS] f32, running max of the log2-domain scores
    part_sum_ptr,  # [T, H, NUM_SPLITS] f32, softmax denominator
    page_table_ptr,  # [R, max_pages] i64
    query_row_ptr,  # [T] i64
    kv_len_ptr,  # [T] i64
    extra_ptr,  # [T, E] u8 tree block (any tensor when HAS_EXTRA is false)
    window_lo_ptr,  # [T] i64 window starts (any tensor when HAS_WINDOW is false)
    num_tokens,
    max_pages,
    scale_log2,  # f32, softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_qd,
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
    NUM_EXTRA: tl.constexpr,  # E
    BLOCK_E: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_T: tl.constexpr,  # query tokens of one aligned block (BLOCK_T * GROUP_P query rows)
    BLOCK_N: tl.constexpr,  # kv positions per iteration
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 or mixed dtypes: fp32 tiles and full-precision products
    SPLIT_P: tl.constexpr,  # bf16: P.V as (P_hi + P_lo).V, two bf16 products
    CHUNK: tl.constexpr,  # > 0: fixed chunks of CHUNK positions merged in order (fp32)
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP_P
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    row, block_start, leader = run_leader(t, query_row_ptr, num_tokens, BLOCK_T)
    if leader != t:
        return
    tok_m, member_m, valid_m, head_m, kv_len_m, tree_word, run_end = run_queries(
        row, block_start, kv_head, query_row_ptr, kv_len_ptr, extra_ptr, num_tokens, stride_et,
        stride_ee, NUM_EXTRA, BLOCK_E, GROUP, GROUP_P, BLOCK_M, HAS_EXTRA,
    )
    lo, hi = split_range(split, run_end, NUM_SPLITS, BLOCK_N, CHUNK)
    if chunk_unread(lo, kv_len_m, member_m, NUM_EXTRA, CHUNK, NUM_SPLITS):
        return

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok_m[:, None] * stride_qt + head_m[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=valid_m[:, None] & d_ok[None, :],
        other=0.0,
    )  # [M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    table_row = page_table_ptr + row * stride_pr
    lo_m = window_starts(window_lo_ptr, tok_m, member_m, HAS_WINDOW, BLOCK_M)
    m_i, l_i, acc = _attend_run(
        lo, hi, run_end, q, kv_len_m, lo_m, tree_word, member_m, valid_m, tok_m, offs_d, d_ok, table_row,
        max_pages, k_ptr, v_ptr, extra_ptr, kv_head, scale_log2, stride_ks, stride_kh, stride_kd,
        stride_vs, stride_vh, stride_vd, stride_pp, stride_et, stride_ee, BLOCK_M, BLOCK_D,
        NUM_EXTRA, PAGE_SIZE, BLOCK_N, HAS_EXTRA, UPCAST, SPLIT_P, CHUNK, NUM_SPLITS,
    )
    _store_run(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, tok_m, head_m,
               valid_m, offs_d, d_ok, split, num_heads, stride_ot, stride_oh, stride_od, BLOCK_D,
               NUM_SPLITS)


@jit
def _combine_splits_kernel(
    part_acc_ptr,  # [T, H, NUM_SPLITS, BLOCK_D] f32
    part_max_ptr,  # [T, H, NUM_SPLITS] f32
    part_sum_ptr,  # [T, H, NUM_SPLITS] f32
    out_ptr,  # [T, H, D]
    kv_len_ptr,  # [T] i64 (read when CHUNK > 0)
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,  # > 0: split s is chunk s; merge in order as the kernel's own loop does
    NUM_EXTRA: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_d = tl.arange(0, BLOCK_D)
    base = (t * num_heads + head) * NUM_SPLITS
    if CHUNK > 0:
        # Chunks past kv_len + E hold nothing of this query (exact no-ops): skip them.
        kv_len = tl.maximum(tl.load(kv_len_ptr + t), 0)
        n_live = tl.minimum(tl.cdiv(kv_len + NUM_EXTRA, CHUNK), NUM_SPLITS)
        one = tl.arange(0, 1)
        run_m = tl.full([1], float("-inf"), tl.float32)
        run_l = tl.zeros([1], tl.float32)
        run_acc = tl.zeros([1, BLOCK_D], tl.float32)
        for split in range(0, n_live):
            part = base + split + one  # [1]
            run_m, run_l, run_acc = _merge_partial(
                run_m, run_l, run_acc, tl.load(part_max_ptr + part), tl.load(part_sum_ptr + part),
                tl.load(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :]),
            )
        o = run_acc / tl.where(run_l > 0, run_l, 1.0)[:, None]  # [1, BLOCK_D]
        tl.store(out_ptr + t * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM)
    else:
        offs_s = tl.arange(0, NUM_SPLITS)
        m = tl.load(part_max_ptr + base + offs_s)
        l_s = tl.load(part_sum_ptr + base + offs_s)
        live = l_s > 0
        m_max = tl.max(tl.where(live, m, float("-inf")), axis=0)
        m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.where(live, tl.exp2(m - m_use), 0.0)  # [S]
        denom = tl.sum(w * l_s, axis=0)
        acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                      mask=live[:, None], other=0.0)
        o = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom > 0, denom, 1.0)
        tl.store(out_ptr + t * stride_ot + head * stride_oh + offs_d * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


_MAX_SPLITS = 32
_FP32_CHUNK = 32  # positions per fp32 chunk (grown for long tables, see _fp32_chunk)
_MAX_FP32_CHUNKS = 256


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:  # [T, H, D], dtype of q
    """Triton paged attention with the tree block: same semantics as the reference.

    **Cost.** Each query t reads keys and values of ``[0, kv_len[t] + e_t)`` (``e_t`` = last
    tree bit + 1) of one kv head per group: ``2 * n * D`` elements, and does ``4 * G * n * D``
    FLOPs (G query heads per kv head). In bf16 that is G FLOPs per byte for one query, and
    ``r * G`` for a run of r queries that share the KV (verify with N = 17: 68), far under the
    ~300 FLOP/byte ridge of an H100/H200: attention here is bound by moving KV bytes, and the
    floor is (KV bytes read once) / bandwidth. E.g. Llama-3-8B (Hkv = 8, D = 128, bf16) at
    kv_len 2048 moves 8 MiB per request and layer: 2.8 us at 3 TB/s. Two things decide whether
    we get near it:

    - *Read each KV byte once.* Queries of one request share the prefix (verify: N tree nodes;
      draft-extend and prefill: consecutive tokens), so reading the prefix once per query would
      multiply the bytes by N. The grid is ``(T, Hkv, splits)``; tokens of an aligned block of
      ``BLOCK_T`` consecutive tokens that share a page-table row form a *run*, processed by the
      program of its first token (the others return at once) with all ``BLOCK_T * G`` query rows
      in one ``tl.dot`` tile, so the run's KV is read once. Decode and draft steps (one token
      per row) get one program per token and kv head, each doing its G query heads; the
      unused rows of its tile cost tensor-core arithmetic, not bytes (``block_m=16`` trims
      them at the price of shorter runs; ``benchmarks/bench_kernels.py`` times both).
    - *Enough programs in flight.* At batch 1 there are only Hkv runs; split-K divides each
      run's range into ``splits`` equal whole tiles (computed on the device from kv_len, so the
      grid depends on shapes only) and a second kernel merges the partial softmaxes. ``splits``
      is the largest power of two (<= 32) that brings ``cdiv(T, BLOCK_T) * Hkv * splits`` to
      about two programs per SM; large batches and prefill get 1 (no partials, no merge).

    The loop over a run's range reads page ids from the page table (page size >= 1, a
    compile-time constant), gathers ``BLOCK_N`` key/value rows, and runs an online softmax in
    fp32 (log2 domain). Only positions below ``kv_len + e`` are visited; values of positions no
    query of the run attends are not loaded, and a query that attends nothing (padding: row 0,
    kv_len 0) gets zeros, never NaN. Q.K^T uses bf16/fp16 tensor-core products with fp32
    accumulation (exact products); P.V in bf16 is computed as ``P_hi.V + P_lo.V`` with P split
    into two bf16 parts, so the only rounding left is the final cast to bf16 (a single bf16
    product of P would add ~1e-3 relative error by itself). fp32 inputs use full fp32 products.

    **Batch invariance.** A query's result depends only on its own positions and values, the
    fixed ``BLOCK_N`` tiling of its row and the split count: other queries of its run add exact
    zeros. fp32 (the exactness path) cuts every row into fixed chunks of ``chunk`` positions
    (32, doubled while a table row has more than 256 of them), computes each chunk's partial
    softmax from a fresh state and folds the chunks in order (``_merge_partial``); a chunk a
    query attends nothing of is an exact no-op. Whether one program folds its chunks itself
    (many queries) or each chunk gets its own program and the combine kernel folds them (few
    queries: a batch-1 decode would otherwise run Hkv programs, ~50 us per layer at 256
    positions) does not change a bit, so fp32 outputs are bitwise the same whatever batch a
    request sits in (an eager batch equals the replay of a larger, padded CUDA-graph bucket).
    bf16/fp16 choose ``splits`` from T, so they may differ in the last bit between batch
    sizes.

    Tiles: ``BLOCK_M = 64`` query rows (``BLOCK_T = 64 / G`` tokens), ``BLOCK_N = 32`` positions,
    4 warps, 2 stages (about 220 registers per thread on sm_90 and no spills, by
    ``tests/gpu/compile_sm90.py``; ``BLOCK_N = 64`` reaches 255 and spills). fp32 uses 16 x 16
    tiles and 1 stage (its full-precision products need many more registers). The keyword
    arguments override these for ``benchmarks/bench_kernels.py``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out

    upcast = full_precision(q, k_cache, v_cache)
    split_p = not upcast and q.dtype == torch.bfloat16
    num_extra = 0 if meta.extra_mask is None else meta.extra_mask.shape[1]
    default_m, default_n, default_stages = default_tiles(upcast, num_extra)
    block_m = default_m if block_m is None else block_m
    block_n = default_n if block_n is None else block_n
    num_stages = default_stages if num_stages is None else num_stages

    group_p, block_t = tile_tokens(group, block_m)
    block_d = max(16, next_pow2(head_dim))
    page_size = meta.page_size
    page_table = meta.page_table
    max_pages = page_table.shape[1]
    query_row = meta.query_row.contiguous()
    kv_len = meta.kv_len.contiguous()
    extra = meta.extra_mask
    has_extra = extra is not None and extra.shape[1] > 0
    extra_arg = as_bytes(extra) if has_extra else kv_len

    positions = max_pages * page_size
    if chunk is None:
        chunk = _fp32_chunk(positions, block_n) if upcast else 0
    if chunk and chunk % block_n:
        raise ValueError(f"chunk ({chunk}) must be a multiple of block_n ({block_n})")
    num_splits = launch_splits(positions, block_n, chunk, num_splits,
                               cdiv(num_tokens, block_t) * num_kv_heads, q.device)

    part_acc, part_max, part_sum = split_buffers(out, num_splits, block_d)
    _paged_attention_kernel[(num_tokens, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum,
        page_table, query_row, kv_len, extra_arg,
        kv_len if meta.window_lo is None else meta.window_lo.contiguous(),
        num_tokens, max_pages, float(scale) * math.log2(math.e),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *page_table.stride(),
        *(extra_arg.stride() if has_extra else (0, 0)),
        NUM_EXTRA=num_extra,
        BLOCK_E=next_pow2(num_extra),
        PAGE_SIZE=page_size,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        HAS_EXTRA=has_extra,
        HAS_WINDOW=meta.window_lo is not None,
        UPCAST=upcast,
        SPLIT_P=split_p,
        CHUNK=chunk,
        num_warps=num_warps,
        num_stages=num_stages, **pdl_options(),
    )
    combine_splits(out, part_acc, part_max, part_sum, kv_len, block_d, chunk, num_extra)
    return out


def full_precision(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the attention kernels run float32 tiles and full-precision products (UPCAST):
    float32 queries, or mixed dtypes."""
    return len({q.dtype, k_cache.dtype, v_cache.dtype}) > 1 or q.dtype == torch.float32


def launch_splits(positions: int, block_n: int, chunk: int, num_splits: int | None, runs: int,
                  device: torch.device) -> int:
    """The split count of a launch over rows of ``positions``: ``num_splits`` as asked (> 1 with
    float32 chunks: one split per chunk; else a power of two), or :func:`auto_splits` for
    ``runs`` runs."""
    if num_splits is None:
        return auto_splits(positions, block_n, chunk, runs, device)
    if chunk and num_splits > 1:
        return cdiv(positions, chunk)  # split s is chunk s
    if num_splits < 1 or (not chunk and num_splits & (num_splits - 1)):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    return num_splits


def default_tiles(upcast: bool, num_extra: int) -> tuple[int, int, int]:
    """``(block_m, block_n, num_stages)`` of the attention kernels: 64 query rows, 32 positions
    and 2 stages in bf16/fp16; float32 products (``upcast``) and the byte-gather tree path
    (``num_extra`` > 64) need 16 positions, and float32 16 rows and 1 stage."""
    block_n = 16 if upcast or num_extra > 64 else 32
    return (16, block_n, 1) if upcast else (64, block_n, 2)


def tile_tokens(group: int, block_m: int) -> tuple[int, int]:
    """``(GROUP_P, BLOCK_T)`` of the attention kernels' query tile: ``BLOCK_T`` tokens of
    ``GROUP_P`` rows each (the group rounded up to a power of two), ``block_m`` rows or the
    fewest tokens that make 16 (``tl.dot`` needs at least 16 rows)."""
    group_p = next_pow2(group)
    block_t = max(1, block_m // group_p)
    if block_t * group_p < 16:
        block_t = cdiv(16, group_p)
    return group_p, block_t


def auto_splits(positions: int, block_n: int, chunk: int, runs: int, device: torch.device) -> int:
    """How many programs share a run's ``positions`` when the caller does not say: with float32
    chunks, one per chunk where the ``runs`` alone leave most SMs idle, else 1; otherwise the
    largest power of two (<= 32 and <= the ``block_n`` tiles) that brings ``runs * splits`` to
    about two programs per SM."""
    if chunk:
        return cdiv(positions, chunk) if runs < num_sms(device) else 1
    return prev_pow2(min(_MAX_SPLITS, cdiv(positions, block_n), max(1, 2 * num_sms(device) // runs)))


def split_buffers(out: torch.Tensor, num_splits: int, block_d: int):
    """``(acc [T, H, S, BLOCK_D], max [T, H, S], sum [T, H, S])`` float32 partials of ``out``'s
    rows over ``num_splits`` splits; with one split, ``out`` three times (never touched)."""
    if num_splits == 1:
        return out, out, out
    num_tokens, num_heads = out.shape[:2]
    part_acc = torch.empty((num_tokens, num_heads, num_splits, block_d), dtype=torch.float32, device=out.device)
    part_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=out.device)
    return part_acc, part_max, torch.empty_like(part_max)


def combine_splits(out, part_acc, part_max, part_sum, kv_len, block_d: int, chunk: int, num_extra: int) -> None:
    """Merge the partials of :func:`split_buffers` into ``out`` [T, H, D] (nothing with one split)."""
    if part_max is out:  # one split: the kernel wrote ``out`` itself
        return
    num_splits = part_max.shape[2]
    _combine_splits_kernel[tuple(out.shape[:2])](
        part_acc, part_max, part_sum, out, kv_len, *out.stride(),
        HEAD_DIM=out.shape[2],
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        CHUNK=chunk,
        NUM_EXTRA=num_extra,
        num_warps=1 if chunk or block_d * num_splits <= 1024 else 4, **pdl_options(),
    )


def _fp32_chunk(positions: int, block_n: int) -> int:
    """Chunk length of the fp32 path for a page table of ``positions`` per row: a function of
    the table only (never of the batch), so every batch cuts a row the same way."""
    chunk = max(_FP32_CHUNK, block_n)
    while cdiv(positions, chunk) > _MAX_FP32_CHUNKS:
        chunk *= 2
    return chunk


# --------------------------------------------------------------------------------------------
# Public entry points


def write_kv(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    slots: torch.Tensor,  # [T] int64; negative entries go to the sink slot 0
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """Write one layer's key/value of T tokens into the pool, in place (Triton on CUDA)."""
    if use_triton(k_cache):
        write_kv_triton(k_cache, v_cache, slots, k, v)
    else:
        write_kv_reference(k_cache, v_cache, slots, k, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D], dtype of q
    """Paged attention with an optional tree block (see ``docs/internals.md``): Triton on
    CUDA tensors, else :func:`paged_attention_reference`."""
    if use_triton(q):
        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    return paged_attention_reference(q, k_cache, v_cache, meta, scale)
