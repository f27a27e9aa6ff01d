"""paged_attention / write_kv against a naive per-query loop over many random layouts."""

from __future__ import annotations

import math

import pytest
import torch

from phasegraph.kernels.attention import AttentionMetadata, paged_attention, write_kv


def naive_paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale):
    """Per query: gather the prefix + selected tree positions, softmax in float64."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    P = meta.page_size
    for t in range(num_tokens):
        row = int(meta.query_row[t])
        kv_len = int(meta.kv_len[t])
        positions = list(range(kv_len))
        if meta.extra_mask is not None:
            positions += [
                kv_len + e for e in range(meta.extra_mask.shape[1]) if meta.extra_mask[t, e]
            ]
        if not positions:
            continue
        slots = [int(meta.page_table[row, p // P]) * P + p % P for p in positions]
        k = k_cache[slots].double()  # [n, Hkv, D]
        v = v_cache[slots].double()
        for h in range(num_heads):
            s = (k[:, h // group] @ q[t, h].double()) * scale
            out[t, h] = s.softmax(0) @ v[:, h // group]
    return out


def random_layout(
    gen,
    *,
    page_size,
    num_rows,
    max_pages,
    num_tokens,
    kv_heads,
    group,
    head_dim,
    tree_width,
    pad_rows,
):
    """A random pool + page table + queries (some of them padding rows on row 0)."""
    num_pages = 1 + num_rows * max_pages + 3
    num_slots = num_pages * page_size
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    # Distinct, shuffled pages for every real row; row 0 stays all zeros (the sink).
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1)[: (num_rows - 1) * max_pages]
    page_table = torch.zeros(num_rows, max_pages, dtype=torch.int64)
    page_table[1:] = perm.view(num_rows - 1, max_pages)
    capacity = max_pages * page_size
    query_row = torch.randint(1, num_rows, (num_tokens,), generator=gen)
    kv_len = torch.randint(0, capacity - tree_width + 1, (num_tokens,), generator=gen)
    extra = None
    if tree_width:
        extra = torch.rand(num_tokens, tree_width, generator=gen) < 0.5
    pad = torch.rand(num_tokens, generator=gen) < pad_rows
    query_row = torch.where(pad, 0, query_row)
    kv_len = torch.where(pad, 0, kv_len)
    if extra is not None:
        extra = extra & ~pad[:, None]
    write_slots = torch.randint(0, num_slots, (num_tokens,), generator=gen)
    write_slots = torch.where(
        pad, torch.randint(0, page_size, (num_tokens,), generator=gen), write_slots
    )
    meta = AttentionMetadata(
        write_slots=write_slots,
        page_table=page_table,
        query_row=query_row,
        kv_len=kv_len,
        extra_mask=extra,
        page_size=page_size,
    )
    q = torch.randn(num_tokens, kv_heads * group, head_dim, generator=gen)
    return q, k_cache, v_cache, meta


CASES = [
    # page_size, kv_heads, group, tree_width
    (1, 2, 1, 0),
    (1, 1, 4, 5),
    (4, 2, 2, 0),
    (4, 2, 2, 8),
    (4, 4, 1, 3),
    (16, 1, 2, 0),
    (16, 2, 4, 6),
    (16, 2, 1, 16),
]


@pytest.mark.parametrize(("page_size", "kv_heads", "group", "tree_width"), CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_attention_matches_naive(page_size, kv_heads, group, tree_width, seed):
    gen = torch.Generator().manual_seed(seed * 100 + page_size)
    max_pages = max(2, math.ceil(40 / page_size))
    q, k_cache, v_cache, meta = random_layout(
        gen,
        page_size=page_size,
        num_rows=5,
        max_pages=max_pages,
        num_tokens=23,
        kv_heads=kv_heads,
        group=group,
        head_dim=8,
        tree_width=tree_width,
        pad_rows=0.2,
    )
    scale = 8**-0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    ref = naive_paged_attention(q, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_padded_rows_attend_nothing_and_give_zeros():
    gen = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, meta = random_layout(
        gen,
        page_size=4,
        num_rows=3,
        max_pages=4,
        num_tokens=6,
        kv_heads=2,
        group=2,
        head_dim=8,
        tree_width=4,
        pad_rows=1.0,
    )
    out = paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert torch.isfinite(out).all()
    assert (out == 0).all()


def test_small_chunks_match_one_chunk(monkeypatch):
    """The query chunking (sized from shapes) leaves every query's result within float32
    rounding of one chunk: a chunk's products round with its query count, nothing more."""
    import phasegraph.kernels.attention as attention

    gen = torch.Generator().manual_seed(3)
    q, k_cache, v_cache, meta = random_layout(
        gen,
        page_size=4,
        num_rows=4,
        max_pages=6,
        num_tokens=17,
        kv_heads=2,
        group=2,
        head_dim=8,
        tree_width=5,
        pad_rows=0.1,
    )
    whole = paged_attention(q, k_cache, v_cache, meta, 0.35)
    calls = []
    attend = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda q, *a: calls.append(len(q)) or attend(q, *a))
    monkeypatch.setattr(attention, "_GATHER_BUDGET", 4 * 6 * 4 * 2)  # 2 queries per chunk
    chunked = paged_attention(q, k_cache, v_cache, meta, 0.35)
    assert max(calls) == 2 and sum(calls) == len(q)
    torch.testing.assert_close(whole, chunked, atol=1e-6, rtol=1e-5)
    ref = naive_paged_attention(q, k_cache, v_cache, meta, 0.35)
    torch.testing.assert_close(chunked.double(), ref, atol=1e-6, rtol=1e-5)


def test_bf16_inputs_accumulate_in_fp32():
    gen = torch.Generator().manual_seed(11)
    q, k_cache, v_cache, meta = random_layout(
        gen,
        page_size=16,
        num_rows=3,
        max_pages=3,
        num_tokens=9,
        kv_heads=2,
        group=2,
        head_dim=16,
        tree_width=4,
        pad_rows=0.0,
    )
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    ref = naive_paged_attention(q, k_cache, v_cache, meta, 0.25)  # float64
    assert out.dtype == torch.bfloat16
    # float32 sums leave the float64 result's one rounding to bfloat16 (bit for bit at this seed);
    # scores, softmax or sums in bfloat16 are 1-2 bfloat16 ulps off it
    torch.testing.assert_close(out, ref.bfloat16(), atol=0, rtol=0)


def test_runs_on_meta_tensors_so_it_never_reads_values_on_the_host():
    """Meta tensors have no data: any .item()/.tolist()/nonzero/bool-mask indexing would raise."""
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, meta = random_layout(
        gen,
        page_size=4,
        num_rows=3,
        max_pages=4,
        num_tokens=5,
        kv_heads=2,
        group=2,
        head_dim=8,
        tree_width=3,
        pad_rows=0.2,
    )
    to_meta = lambda t: t.to("meta")  # noqa: E731
    meta_m = AttentionMetadata(
        write_slots=to_meta(meta.write_slots),
        page_table=to_meta(meta.page_table),
        query_row=to_meta(meta.query_row),
        kv_len=to_meta(meta.kv_len),
        extra_mask=to_meta(meta.extra_mask),
        page_size=meta.page_size,
    )
    kc, vc = to_meta(k_cache), to_meta(v_cache)
    write_kv(kc, vc, meta_m.write_slots, to_meta(q[:, :2]), to_meta(q[:, :2]))
    out = paged_attention(to_meta(q), kc, vc, meta_m, 0.5)
    assert out.shape == q.shape and out.device.type == "meta"


def test_write_kv_in_place_and_padding_goes_to_page_zero():
    P = 4
    k_cache = torch.zeros(5 * P, 2, 3)
    v_cache = torch.zeros(5 * P, 2, 3)
    slots = torch.tensor([5, 9, -1, 2, 13])  # -1 and 2: padding rows, both inside page 0
    k = torch.randn(5, 2, 3)
    v = torch.randn(5, 2, 3)
    k_ptr = k_cache.data_ptr()
    write_kv(k_cache, v_cache, slots, k, v)
    assert k_cache.data_ptr() == k_ptr
    for i, s in [(0, 5), (1, 9), (4, 13)]:
        assert torch.equal(k_cache[s], k[i]) and torch.equal(v_cache[s], v[i])
    assert torch.equal(k_cache[2], k[3])
    untouched = [s for s in range(P, 5 * P) if s not in (5, 9, 13)]
    assert (k_cache[untouched] == 0).all() and (v_cache[untouched] == 0).all()


def test_write_then_attend_is_causal_self_attention():
    """Writing a sequence and attending causally equals plain causal SDPA."""
    P, T, Hkv, G, D = 4, 10, 2, 2, 8
    page_table = torch.tensor([[0, 0, 0], [3, 1, 2]])
    k_cache = torch.zeros(4 * P, Hkv, D)
    v_cache = torch.zeros(4 * P, Hkv, D)
    pos = torch.arange(T)
    slots = page_table[1, pos // P] * P + pos % P
    meta = AttentionMetadata(
        write_slots=slots,
        page_table=page_table,
        query_row=torch.ones(T, dtype=torch.int64),
        kv_len=pos + 1,
        extra_mask=None,
        page_size=P,
    )
    q = torch.randn(T, Hkv * G, D)
    k = torch.randn(T, Hkv, D)
    v = torch.randn(T, Hkv, D)
    write_kv(k_cache, v_cache, meta.write_slots, k, v)
    out = paged_attention(q, k_cache, v_cache, meta, D**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(G, 1).transpose(0, 1),
        v.repeat_interleave(G, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_one_query_per_row_beside_a_tree_block_is_refused():
    """The one-launch kernel reads no tree block, so metadata that promises one query per row and
    also holds one is a ValueError when it is made (shapes only: meta tensors suffice), not keys
    dropped in the kernel; an empty block keeps the promise."""
    meta = dict(write_slots=torch.zeros(2, dtype=torch.int64, device="meta"),
                page_table=torch.zeros(2, 4, dtype=torch.int64, device="meta"),
                query_row=torch.zeros(2, dtype=torch.int64, device="meta"),
                kv_len=torch.zeros(2, dtype=torch.int64, device="meta"), page_size=4)
    with pytest.raises(ValueError, match="one_query_per_row promises .* a tree block of 3 nodes"):
        AttentionMetadata(**meta, extra_mask=torch.zeros(2, 3, dtype=torch.bool, device="meta"),
                          one_query_per_row=True)
    for extra in (None, torch.zeros(2, 0, dtype=torch.bool, device="meta")):
        assert AttentionMetadata(**meta, extra_mask=extra, one_query_per_row=True).one_query_per_row
    assert AttentionMetadata(**meta, extra_mask=torch.zeros(2, 3, dtype=torch.bool, device="meta")).extra_mask.shape == (2, 3)
