"""The fused decoder-layer kernels (add + RMSNorm, rotary + KV write, SiLU x up) against their
torch references, on fresh random inputs, poisoned allocations and (on CUDA) no host sync.

Float results: within 1e-6 (fp32) or 1e-2 (bf16, a few elements one rounding apart) relative
error of the reference; the value cache is a pure copy and must be equal; no NaN (poison) may
survive. Same modes as test_triton_kernels.py (GPU with ``-m gpu``; CPU through the interpreter
with ``PHASEGRAPH_TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from phasegraph.kernels import activation, logprobs, rms_norm, rotary, softmax_top1, softmax_topk
from tests.gpu.test_triton_kernels import INTERPRET, ON_GPU, assert_equal, rel_err, run_triton

pytestmark = [] if INTERPRET else [pytest.mark.gpu]
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = (torch.float32, torch.bfloat16)
TOKENS = (1, 7, 64) if ON_GPU else (1, 7)


def _close(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (name, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{name}: non-finite (unwritten) elements"
    err = rel_err(out.float(), ref.float())
    assert err <= TOL[ref.dtype], f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(device, gen, dtype, tokens, with_residual):
    hidden = 4096 if ON_GPU else 96
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    want_n, want_s = rms_norm.add_rms_norm_reference(x, residual, weight, 1e-5)
    got_n, got_s = run_triton(device, rms_norm.add_rms_norm_triton, x, residual, weight, 1e-5)
    assert_equal(want_s, got_s, "summed")  # one rounded add: exact
    _close(got_n, want_n, "normed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_concat(device, gen, dtype, tokens):
    """Both halves as add_rms_norm computes them (the same rounding steps, so within one
    rounding of the reference), written side by side; a strided ``b`` as the head passes it."""
    a_hidden, b_hidden = (4096, 4096) if ON_GPU else (96, 40)
    a = torch.randn(tokens, a_hidden, generator=gen).to(dtype).to(device)
    b = torch.randn(tokens, 2 * b_hidden, generator=gen).to(dtype).to(device)[:, :b_hidden]
    a_w = (1 + 0.1 * torch.randn(a_hidden, generator=gen)).to(dtype).to(device)
    b_w = (1 + 0.1 * torch.randn(b_hidden, generator=gen)).to(dtype).to(device)
    want = rms_norm.rms_norm_concat_reference(a, a_w, 1e-5, b, b_w, 1e-6)
    got = run_triton(device, rms_norm.rms_norm_concat_triton, a, a_w, 1e-5, b, b_w, 1e-6)
    _close(got, want, "rms_norm_concat")
    first, _ = rms_norm.add_rms_norm_triton(a, None, a_w, 1e-5)
    second, _ = rms_norm.add_rms_norm_triton(b.contiguous(), None, b_w, 1e-6)
    assert_equal(torch.cat([first, second], dim=-1), got, "halves")  # the same kernel math


@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_concat_looks_up_table_rows(device, gen, tokens):
    """With ``a_rows`` the kernel reads rows of a float32 table (the target's embedding) and casts
    them to b's bfloat16 before the norm: bit for bit the kernel on the gathered, cast rows."""
    hidden = 4096 if ON_GPU else 96
    table = torch.randn(300, hidden, generator=gen).to(device)
    rows = torch.randint(0, 300, (tokens,), generator=gen).to(device)
    b = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    a_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(device)
    b_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(device)
    got = run_triton(device, rms_norm.rms_norm_concat_triton, table, a_w, 1e-5, b, b_w, 1e-6, rows)
    gathered = table[rows].to(torch.bfloat16)
    want = run_triton(device, rms_norm.rms_norm_concat_triton, gathered, a_w, 1e-5, b, b_w, 1e-6)
    assert_equal(want, got, "looked-up rows")
    _close(got, rms_norm.rms_norm_concat_reference(table, a_w, 1e-5, b, b_w, 1e-6, rows), "reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_mul(device, gen, dtype, tokens):
    inner = 14336 if ON_GPU else 200
    gate_up = (2 * torch.randn(tokens, 2 * inner, generator=gen)).to(dtype).to(device)
    want = activation.silu_mul_reference(gate_up)
    _close(run_triton(device, activation.silu_mul_triton, gate_up), want, "silu_mul")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads", [(32, 8, 128), (4, 4, 24)], ids=["gqa-128", "mha-24"])
def test_rotary_write_kv(device, gen, dtype, tokens, heads):
    hq, hkv, d = heads
    num_slots = 2 * tokens + 8
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)
    q = qkv[:, : hq * d].view(tokens, hq, d)  # strided views, as the fused layer passes them
    k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
    angles = torch.rand(tokens, d // 2, generator=gen) * 100
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    slots = (torch.randperm(num_slots - 1, generator=gen)[:tokens] + 1).to(device)
    slots[0] = -1  # a padding token -> the sink slot 0
    k_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype).to(device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want_q = rotary.rotary_write_kv_reference(q, k, v, cos, sin, ref_k, ref_v, slots)
    got_q = run_triton(device, rotary.rotary_write_kv_triton, q, k, v, cos, sin, k_cache, v_cache, slots)
    _close(got_q, want_q, "q")
    _close(k_cache, ref_k, "k_cache")
    assert_equal(ref_v, v_cache, "v_cache")
    untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
    untouched[slots.clamp(min=0)] = False
    assert torch.equal(k_cache[untouched], ref_k[untouched])  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_write_kv_reads_rows_of_tables(device, gen, dtype, tokens):
    """With ``rows`` the kernel reads token t's cos/sin at row rows[t] of [P, D] tables: the same
    bits as passing the gathered rows (repeated, unordered and last-row positions included)."""
    hq, hkv, d, table_rows = 4, 2, 64, 50
    num_slots = 2 * tokens + 8
    q = torch.randn(tokens, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(tokens, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(tokens, hkv, d, generator=gen).to(dtype).to(device)
    angles = torch.rand(table_rows, d // 2, generator=gen) * 100
    angles = torch.cat([angles, angles], dim=-1)
    cos_table, sin_table = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    rows = torch.randint(0, table_rows, (tokens,), generator=gen)
    rows[0] = table_rows - 1
    rows = rows.to(device)
    slots = (torch.randperm(num_slots - 1, generator=gen)[:tokens] + 1).to(device)
    k_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen).to(dtype).to(device)
    gathered_k, gathered_v = k_cache.clone(), v_cache.clone()
    want_q = rotary.rotary_write_kv_triton(q, k, v, cos_table[rows], sin_table[rows], gathered_k,
                                           gathered_v, slots)
    got_q = run_triton(device, rotary.rotary_write_kv_triton, q, k, v, cos_table, sin_table,
                       k_cache, v_cache, slots, rows)
    assert_equal(want_q, got_q, "q")
    assert_equal(gathered_k, k_cache, "k_cache")
    assert_equal(gathered_v, v_cache, "v_cache")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 3, 64) if ON_GPU else (1, 3))
@pytest.mark.parametrize("vocab", (32000, 4096, 5) if ON_GPU else (9000, 5))
def test_softmax_top1(device, gen, dtype, rows, vocab):
    logits = (4 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(device)
    logits[0, vocab // 2] = 30.0  # a clear winner in a middle block of the first row
    if rows > 1:  # the winner in the last, partial block of the second row
        logits[1, vocab - 1] = 30.0
    want_p, want_id = softmax_top1.softmax_top1_reference(logits)
    got_p, got_id = run_triton(device, softmax_top1.softmax_top1_triton, logits)
    assert_equal(want_id, got_id, "id")
    assert got_p.dtype == torch.float32 and got_p.shape == (rows, 1)
    assert rel_err(got_p, want_p) <= 1e-6, rel_err(got_p, want_p)
    # ids mapped through a draft-to-target offset table (an EAGLE-3 head's d2t)
    offsets = torch.randint(0, 1000, (vocab,), generator=gen).to(device)
    _, mapped = run_triton(device, softmax_top1.softmax_top1_triton, logits, offsets)
    assert_equal(want_id + offsets[want_id], mapped, "mapped id")
    assert_equal(want_id + offsets[want_id], softmax_top1.softmax_top1_reference(logits, offsets)[1])


def test_softmax_top1_takes_the_first_of_tied_logits(device):
    logits = torch.zeros(2, 9000, device=device)
    logits[0, [7, 5000, 8999]] = 2.0  # tied maxima in three blocks
    logits[1, [4100, 4097]] = 2.0  # tied in one block
    _, ids = run_triton(device, softmax_top1.softmax_top1_triton, logits)
    assert ids[:, 0].tolist() == [7, 4097]


def test_softmax_top1_of_rows_that_start_with_minus_infinity(device):
    logits = torch.full((2, 9000), float("-inf"), device=device)
    logits[0, 8500:] = torch.linspace(-1.0, 1.0, 500)  # finite only in the last block
    want_p, want_id = softmax_top1.softmax_top1_reference(logits)
    got_p, got_id = run_triton(device, softmax_top1.softmax_top1_triton, logits)
    assert_equal(want_id[:1], got_id[:1], "id")
    assert rel_err(got_p[:1], want_p[:1]) <= 1e-6
    assert torch.isnan(want_p[1]).all() and torch.isnan(got_p[1]).all()  # all -inf: NaN, as softmax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (1, 4, 256) if ON_GPU else (1, 4))
@pytest.mark.parametrize("vocab", (32000, 128256, 9) if ON_GPU else (9000, 9))
@pytest.mark.parametrize("k", [2, 4, 8])
def test_softmax_topk(device, gen, dtype, rows, vocab, k):
    # distinct logits (a permutation scaled apart), so the order is unique in any dtype
    logits = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)]).float()
    logits = (logits * (8.0 / vocab)).to(dtype).to(device)
    if dtype == torch.bfloat16:  # bf16 rounds nearby values together: make the top k distinct
        top = torch.topk(logits.float(), k, dim=-1).indices
        logits.scatter_(1, top, (torch.arange(k, 0, -1, device=device) * 0.5 + 9.0).to(dtype).expand(rows, k))
    want_p, want_id = softmax_topk.softmax_topk_reference(logits, k)
    got_p, got_id = run_triton(device, softmax_topk.softmax_topk_triton, logits, k)
    assert_equal(want_id, got_id, "ids")
    assert got_p.dtype == torch.float32 and got_p.shape == (rows, k)
    assert rel_err(got_p, want_p) <= 1e-6, rel_err(got_p, want_p)
    # ids mapped through a draft-to-target offset table (an EAGLE-3 head's d2t)
    offsets = torch.randint(0, 1000, (vocab,), generator=gen).to(device)
    _, mapped = run_triton(device, softmax_topk.softmax_topk_triton, logits, k, offsets)
    assert_equal(want_id + offsets[want_id], mapped, "mapped ids")
    assert_equal(want_id + offsets[want_id], softmax_topk.softmax_topk_reference(logits, k, offsets)[1])


def test_softmax_topk_orders_ties_and_minus_infinity_like_topk(device):
    """Equal logits come smallest id first; -inf logits fill the top k with probability 0,
    each id once; a chunk of -inf adds nothing to the normaliser."""
    logits = torch.full((3, 9000), float("-inf"), device=device)
    logits[0, [8999, 7, 5000, 4100]] = 2.0  # tied across chunks
    logits[0, 3] = 1.0
    logits[1, 6000] = 0.5  # one finite logit: k - 1 of probability 0 follow
    logits[2] = 0.0
    logits[2, [4097, 4099]] = 3.0  # tied within one chunk
    got_p, got_id = run_triton(device, softmax_topk.softmax_topk_triton, logits, 4)
    assert got_id[0].tolist() == [7, 4100, 5000, 8999]
    assert got_id[2].tolist()[:2] == [4097, 4099]
    assert got_id[1, 0].item() == 6000 and got_p[1, 0].item() == 1.0
    assert torch.equal(got_p[1, 1:], torch.zeros(3, device=device))
    assert len(set(got_id[1].tolist())) == 4 and all(0 <= i < 9000 for i in got_id[1].tolist())
    want_p, _ = softmax_topk.softmax_topk_reference(logits, 4)
    assert rel_err(got_p, want_p) <= 1e-6


def test_softmax_topk_of_an_all_minus_infinity_row_is_nan_like_softmax(device):
    logits = torch.full((1, 5000), float("-inf"), device=device)
    got_p, got_id = run_triton(device, softmax_topk.softmax_topk_triton, logits, 3)
    assert torch.isnan(got_p).all() and torch.isnan(softmax_topk.softmax_topk_reference(logits, 3)[0]).all()
    assert all(0 <= i < 5000 for i in got_id[0].tolist())


LP_TOL = 1e-5  # float32 logprobs against the reference (another order of the logsumexp's sum)


def _assert_logprobs(logits, tokens, top, got, want):
    """``got`` equals ``want`` (the reference) within LP_TOL, NaN where it is NaN; the top ids
    are checked through the logits they name, so equal logits may come in either order."""
    torch.testing.assert_close(got.chosen, want.chosen, rtol=0, atol=LP_TOL, equal_nan=True)
    if top == 0:
        assert got.top is None and got.top_ids is None
        return
    assert got.top.dtype == torch.float32 and got.top_ids.dtype == torch.int64
    assert got.top.shape == got.top_ids.shape == want.top.shape
    torch.testing.assert_close(got.top, want.top, rtol=0, atol=LP_TOL, equal_nan=True)
    ids = got.top_ids.cpu()
    assert all(len(set(r)) == len(r) for r in ids.tolist()) and bool(((ids >= 0) & (ids < logits.shape[1])).all())
    x = logits.float().cpu()
    # the logit each id names is the one the reference ranks at that place
    torch.testing.assert_close(x.gather(1, ids), want.top.cpu() + torch.logsumexp(x, -1, keepdim=True),
                               rtol=0, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", (1, 5, 1000, 32000, 128256) if ON_GPU else (1, 5, 1000, 4100))
@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_token_logprobs(device, gen, dtype, rows, vocab, top):
    """Random logits (ties only where bf16 rounds them together): the chosen and top logprobs
    within LP_TOL of the reference, ids equal where the logits are distinct; k > V gives V."""
    logits = (4 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(device)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    tokens[0] = -1 if vocab > 1 else 0  # out of range: clamped, as the reference does
    tokens = tokens.to(device)
    want = logprobs.token_logprobs_reference(logits, tokens, top)
    got = run_triton(device, logprobs.token_logprobs_triton, logits, tokens, top)
    _assert_logprobs(logits, tokens, top, got, want)
    distinct = all(len(set(r)) == len(r) for r in logits.float().cpu().tolist())
    if top and dtype == torch.float32 and distinct:
        assert_equal(want.top_ids, got.top_ids, "ids")


def test_token_logprobs_of_minus_infinity_ties_and_strided_tokens(device):
    """Masked (-inf) logits, an all -inf row (NaN, as the reference), a +inf logit (logsumexp
    +inf), equal logits across and within chunks (smaller id first), tokens read with a stride."""
    logits = torch.full((5, 9000), float("-inf"), device=device)
    logits[0, [8999, 7, 5000, 4100]] = 2.0  # tied across chunks
    logits[0, 3] = 1.0
    logits[1, 6000] = 0.5  # one finite logit: the rest of the top k are -inf
    logits[2] = 0.0
    logits[2, [4097, 4099]] = 3.0  # tied within one chunk
    logits[3, 10] = float("inf")
    logits[3, 11] = 1.0
    tokens = torch.tensor([[7, 0], [6000, 0], [4099, 0], [11, 0], [5, 0]], device=device)[:, 0]
    assert tokens.stride(0) == 2
    want = logprobs.token_logprobs_reference(logits, tokens, 20)
    got = run_triton(device, logprobs.token_logprobs_triton, logits, tokens, 20)
    torch.testing.assert_close(got.chosen, want.chosen, rtol=0, atol=LP_TOL, equal_nan=True)
    torch.testing.assert_close(got.top, want.top, rtol=0, atol=LP_TOL, equal_nan=True)
    assert got.top_ids[0, :5].tolist() == [7, 4100, 5000, 8999, 3]
    assert got.top_ids[1, 0].item() == 6000 and got.top[1, 0].item() == 0.0
    assert got.top_ids[2, :2].tolist() == [4097, 4099]
    assert got.top_ids[3, :2].tolist() == [10, 11]
    ids = got.top_ids.cpu()
    assert all(len(set(r)) == 20 for r in ids.tolist()) and bool(((ids >= 0) & (ids < 9000)).all())
    assert torch.isnan(got.chosen[4]) and torch.isnan(got.top[4]).all()


def _private_tails(meta, k_cache, v_cache, page_size: int):
    """Draft-step layout: each token's row keeps the shared prefix pages but gets private copies
    of the pages from its own position on (the draft's branch regions), so no token reads a slot
    another one writes. Returns ``(page_table, k_cache, v_cache)`` with the copies appended."""
    table = meta.page_table.clone()
    num_pages = k_cache.shape[0] // page_size
    copied = []
    for t in range(meta.query_row.shape[0]):
        if int(meta.kv_len[t]) == 0:
            continue
        r = int(meta.query_row[t])
        for col in range((int(meta.kv_len[t]) - 1) // page_size, table.shape[1]):
            copied.append(int(table[r, col]))
            table[r, col] = num_pages + len(copied) - 1

    def grow(cache):
        pages = cache.view(num_pages, page_size, *cache.shape[1:])
        return torch.cat([pages, pages[torch.tensor(copied, device=cache.device)]]).flatten(0, 1)

    return table, grow(k_cache), grow(v_cache)


def _rope_inputs(gen, device, dtype, meta, heads: int, kv_heads: int, head_dim: int,
                 rows: torch.Tensor, tables: bool):
    """``(qkv, cos, sin, rope_rows)`` of a rotary + attention call: a random qkv product, random
    cos/sin tables over the page table's positions, and each token's table row ``rows``; with
    ``tables`` False, the per-token rows of the tables and no ``rope_rows``."""
    tokens = meta.query_row.shape[0]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(device)
    angles = torch.rand(meta.page_table.shape[1] * meta.page_size, head_dim // 2, generator=gen) * 100
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    if not tables:
        return qkv, cos[rows], sin[rows], None
    return qkv, cos, sin, rows


def _one_launch_and_two(device, one_launch, qkv, heads, cos, sin, k_cache, v_cache, meta, scale,
                        rows, two_kw: dict, one_kw: dict):
    """Run ``one_launch`` (rotary + KV write + attention) and the two kernels it replaces
    (``rotary_write_kv`` then ``paged_attention``, with ``two_kw``) on copies of the pool; check
    what both must share: finite outputs, zeros for padding tokens, and the same keys and values
    bit for bit outside the sink page (which takes the padding tokens' writes in any order).
    Returns ``(want, got, rotated q, (k_two, v_two, k_one))``."""
    from phasegraph.kernels import attention, rope_attention

    num_heads, num_kv_heads, head_dim = heads
    q, k, v = rope_attention._split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    k_two, v_two = k_cache.clone(), v_cache.clone()
    q_rot = rotary.rotary_write_kv_triton(q, k, v, cos, sin, k_two, v_two, meta.write_slots, rows)
    want = attention.paged_attention_triton(q_rot, k_two, v_two, meta, scale, **two_kw)
    k_one, v_one = k_cache.clone(), v_cache.clone()
    got = run_triton(device, one_launch, qkv, num_heads, num_kv_heads, head_dim, cos, sin, k_one,
                     v_one, meta, scale, rows, **one_kw)
    real = meta.kv_len > 0
    assert torch.isfinite(got[real]).all() and (got[~real] == 0).all()
    page_size = meta.page_size
    assert_equal(k_two[page_size:], k_one[page_size:], "k_cache")
    assert_equal(v_two[page_size:], v_one[page_size:], "v_cache")
    return want, got, q_rot, (k_two, v_two, k_one)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["decode", "draft"])
@pytest.mark.parametrize("batch", (1, 7, 48) if ON_GPU else (1, 5))
@pytest.mark.parametrize("tables", [True, False], ids=["tables", "rows"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
def test_rope_paged_attention_equals_rotary_then_attention(device, gen, dtype, layout, batch, tables, window):
    """One launch (rotary + KV write + attention, one query per row) against the two kernels it
    replaces: the same key and value in the pool, bit for bit; the same attention output bit for
    bit in float32 (its exactness path) and within bf16 rounding otherwise (the split count may
    differ); padding tokens (row 0, kv_len 0) give zeros; nothing outside the written slots
    changes."""
    from phasegraph.kernels import attention, rope_attention
    from tests.gpu import kernel_cases as cases

    kv_heads, group, head_dim = (8, 4, 128) if ON_GPU else (2, 3, 32)
    page_size = 16
    q, k_cache, v_cache, meta = cases.attention_case(
        gen, device, layout=layout, batch=batch, topk=4, page_size=page_size, kv_heads=kv_heads,
        group=group, head_dim=head_dim, max_kv=300 if ON_GPU else 40, dtype=dtype,
    )
    heads = kv_heads * group
    table = meta.page_table
    if layout == "draft":  # the case's branch rows share all pages; the draft's share the prefix
        table, k_cache, v_cache = _private_tails(meta, k_cache, v_cache, page_size)
    meta = attrs.evolve(meta, page_table=table)
    slots = cases.own_slots(meta)
    meta = attention.AttentionMetadata(
        write_slots=slots, page_table=meta.page_table, query_row=meta.query_row,
        kv_len=meta.kv_len, extra_mask=None, page_size=page_size, one_query_per_row=True,
        window_lo=None if window is None else meta.kv_len - window,  # the token's own key is in
    )
    qkv, cos, sin, rows = _rope_inputs(gen, device, dtype, meta, heads, kv_heads, head_dim,
                                       (meta.kv_len - 1).clamp(min=0), tables)
    scale = head_dim**-0.5

    want, got, q_rot, (k_two, v_two, k_one) = _one_launch_and_two(
        device, rope_attention.rope_paged_attention_triton, qkv, (heads, kv_heads, head_dim),
        cos, sin, k_cache, v_cache, meta, scale, rows, {} if ON_GPU else {"block_n": 16}, {},
    )
    real = meta.kv_len > 0
    written = torch.zeros(k_cache.shape[0], dtype=torch.bool, device=device)
    written[slots.clamp(min=0)] = True
    written[:page_size] = True
    assert torch.equal(k_one[~written], k_cache[~written]), "a slot outside write_slots changed"
    if dtype == torch.float32:
        assert_equal(want, got, "attention")
    else:
        assert rel_err(got[real].float(), want[real].float()) < 4e-3
    ref = attention.paged_attention_reference(
        q_rot.double(), cases.clean_sink(k_two, page_size).double(),
        cases.clean_sink(v_two, page_size).double(), meta, scale,
    )
    assert rel_err(got[real].double(), ref[real]) < (2e-6 if dtype == torch.float32 else 2.5e-3)


def test_rope_paged_attention_runs_two_kernels_without_the_promise(device, gen, monkeypatch):
    """Without ``one_query_per_row`` (prefill, draft-extend, verify: rows hold several queries)
    the public function runs rotary_write_kv and paged_attention, never the one-launch kernel."""
    from phasegraph.kernels import rope_attention
    from tests.gpu import kernel_cases as cases

    q, k_cache, v_cache, meta = cases.attention_case(
        gen, device, layout="extend", batch=2, topk=2, page_size=16, kv_heads=2, group=2,
        head_dim=32, max_kv=30, dtype=torch.float32,
    )
    qkv = torch.randn(q.shape[0], 8 * 32, generator=gen).to(device)
    cos = torch.ones(q.shape[0], 32, device=device)
    calls = []
    monkeypatch.setattr(rope_attention, "rope_paged_attention_triton",
                        lambda *a, **k: calls.append("one") or None)
    monkeypatch.setenv("PHASEGRAPH_KERNELS", "triton")  # the Triton side of the dispatch
    out = rope_attention.rope_paged_attention(qkv, 4, 2, 32, cos, cos * 0, k_cache, v_cache, meta, 0.2)
    assert calls == [] and out.shape == (q.shape[0], 4, 32)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_paged_attention_cuda_graph_replay(gen, dtype):
    """Captured once; new queries, keys and lengths written in place and replayed, many times:
    equal to eager calls bit for bit."""
    from phasegraph.kernels import attention, rope_attention
    from tests.gpu import kernel_cases as cases

    device = torch.device("cuda")
    kv_heads, group, head_dim, page_size = 8, 4, 128, 16
    _, k_cache, v_cache, meta = cases.attention_case(
        gen, device, layout="decode", batch=3, topk=1, page_size=page_size, kv_heads=kv_heads,
        group=group, head_dim=head_dim, dtype=dtype, sink_poison=0.0,
    )
    kv_len = meta.kv_len.clone()
    slots = cases.own_slots(meta)
    static = attention.AttentionMetadata(
        write_slots=slots, page_table=meta.page_table, query_row=meta.query_row, kv_len=kv_len,
        extra_mask=None, page_size=page_size, one_query_per_row=True,
    )
    heads = kv_heads * group
    qkv = torch.randn(kv_len.shape[0], (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    angles = torch.rand(meta.page_table.shape[1] * page_size, head_dim, device=device) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rows = (kv_len - 1).clamp(min=0)

    def call():
        return rope_attention.rope_paged_attention_triton(
            qkv, heads, kv_heads, head_dim, cos, sin, k_cache, v_cache, static, 0.1, rows)

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(5):
        qkv.copy_(torch.randn_like(qkv))
        kv_len.copy_((meta.kv_len - torch.randint(0, 30, kv_len.shape, generator=gen).to(device))
                     .clamp(min=1) * (meta.query_row != 0))
        static.write_slots.copy_(cases.own_slots(static))
        rows.copy_((kv_len - 1).clamp(min=0))
        graph.replay()
        replayed = out.clone()
        assert torch.equal(replayed, call())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", (128256, 8192, 5000, 1) if ON_GPU else (20000, 4099, 1))
def test_argmax_equals_torch(device, gen, dtype, vocab):
    """The first maximum of each row, as torch.argmax: random rows, a maximum repeated in later
    blocks (the first must win), NaN (the first NaN wins), +inf, and rows of -inf only."""
    from phasegraph.kernels import argmax

    rows = 9
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    if vocab > 1:
        top = float(logits.float().max()) + 1
        logits[1, vocab // 3] = top  # tie: the same maximum at three places, two blocks apart
        logits[1, vocab - 1] = top
        logits[1, 2 * vocab // 3] = top
        logits[2, vocab // 2] = float("nan")
        logits[2, vocab - 1] = float("nan")
        logits[2, 0] = float("inf")
        logits[3, vocab - 1] = float("inf")
    logits[4] = float("-inf")
    logits[5, -1] = float("nan")
    logits = logits.to(device)
    got = run_triton(device, argmax.argmax_triton, logits)
    assert_equal(logits.cpu().argmax(dim=-1), got.cpu(), "argmax")
    assert_equal(logits[:, : max(1, vocab // 2)].cpu().argmax(dim=-1),
                 run_triton(device, argmax.argmax_triton, logits[:, : max(1, vocab // 2)]).cpu(),
                 "argmax of a strided view")
    # argmax_finite: the same index, and the row maximum's finiteness (rows 2-5 are not finite)
    pick = run_triton(device, argmax.argmax_finite_triton, logits)
    ref = argmax.argmax_finite_reference(logits.cpu())
    assert_equal(ref.tokens, pick.tokens, "argmax_finite tokens")
    assert_equal(ref.finite, pick.finite, "argmax_finite finite")
    assert_equal(ref.emitted, pick.emitted, "argmax_finite emitted")
    assert ref.finite.tolist()[4:6] == [False, False] and ref.finite[[0, 6, 7, 8]].all()


def _tree_block_slots(meta, nodes: int) -> torch.Tensor:
    """[T] i64: node j of each row at logical position kv_len + j (a verify's write slots), -1 for
    padding."""
    j = torch.arange(meta.kv_len.shape[0], device=meta.kv_len.device) % nodes
    pos = meta.kv_len + j
    pages = meta.page_table[meta.query_row, pos // meta.page_size]
    return torch.where(meta.kv_len > 0, pages * meta.page_size + pos % meta.page_size, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", (1, 3, 33) if ON_GPU else (1, 3))
@pytest.mark.parametrize(("topk", "nodes"), [(1, 3), (4, 9), (4, 16), (40, 81)],
                         ids=["k1n3", "k4n9", "k4n16", "k40n81"])  # 81 > 64: the byte-gather path
@pytest.mark.parametrize("tables", [True, False], ids=["tables", "rows"])
@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
def test_rope_tree_attention_equals_rotary_then_attention(device, gen, dtype, batch, topk, nodes, tables,
                                                          window):
    """A verify in one launch (rotary + tree-block KV write + attention) against the two kernels
    it replaces, bit for bit: the pool's keys and values and the attention output, in both
    dtypes (the same tiles and splits), with a padded request as a CUDA-graph bucket adds, the
    first request's tree block straddling a float32 chunk (its nodes are read by two splits) and
    NaN in the nodes' slots before the call (a node read before it is written would leak it).
    16 nodes (the bench pair's tree) is a multiple of the token tile, so with several splits the
    kernel runs one program per run rather than per token; the page table holds up to ~300
    positions, so most requests' chunk programs past their tree block return at once."""
    from phasegraph.kernels import attention, rope_attention
    from tests.gpu import kernel_cases as cases

    kv_heads, group, head_dim = (8, 4, 128) if ON_GPU else (2, 3, 32)
    page_size = 16
    q, k_cache, v_cache, meta = cases.attention_case(
        gen, device, layout="verify", batch=batch, topk=topk, page_size=page_size,
        kv_heads=kv_heads, group=group, head_dim=head_dim, max_kv=300 if ON_GPU else 40,
        dtype=dtype, pad_tokens=nodes, num_nodes=nodes,
    )
    kv_len = meta.kv_len.clone()
    kv_len[:nodes] = 30  # nodes at positions 30.. cross the float32 chunk boundary at 32
    meta = attention.AttentionMetadata(
        write_slots=torch.zeros_like(kv_len), page_table=meta.page_table,
        query_row=meta.query_row, kv_len=kv_len, extra_mask=meta.extra_mask, page_size=page_size,
        tree_block_writes=True,
    )
    slots = _tree_block_slots(meta, nodes)
    meta = attrs.evolve(meta, write_slots=slots,
                        window_lo=None if window is None else meta.kv_len - window)
    # NaN in every node's slot: a program that read a node before writing it would show it
    k_cache[slots[slots >= 0]] = float("nan")
    v_cache[slots[slots >= 0]] = float("nan")
    tokens, heads = q.shape[0], kv_heads * group
    table_rows = meta.page_table.shape[1] * page_size
    qkv, cos, sin, rows = _rope_inputs(gen, device, dtype, meta, heads, kv_heads, head_dim,
                                       torch.randint(0, table_rows, (tokens,), generator=gen).to(device),
                                       tables)
    scale = head_dim**-0.5

    # the interpreter's 4 "SMs" would give one split: ask for several (the GPU picks its own)
    kw = {} if ON_GPU else {"num_splits": 2}
    want, got, q_rot, (k_two, v_two, _) = _one_launch_and_two(
        device, rope_attention.rope_tree_attention_triton, qkv, (heads, kv_heads, head_dim),
        cos, sin, k_cache, v_cache, meta, scale, rows, kw, kw,
    )
    real = meta.kv_len > 0
    assert_equal(want[real], got[real], "attention")
    ref = attention.paged_attention_reference(
        q_rot.double(), cases.clean_sink(k_two, page_size).double(),
        cases.clean_sink(v_two, page_size).double(), meta, scale,
    )
    assert rel_err(got[real].double(), ref[real]) < (2e-6 if dtype == torch.float32 else 2.5e-3)


def test_rope_paged_attention_runs_the_tree_kernel_only_with_the_promise(device, gen, monkeypatch):
    """A tree block alone is not enough: only ``tree_block_writes`` (verify) takes the one-launch
    tree kernel; without it the public function runs rotary_write_kv and paged_attention."""
    from phasegraph.kernels import rope_attention
    from tests.gpu import kernel_cases as cases

    q, k_cache, v_cache, meta = cases.attention_case(
        gen, device, layout="verify", batch=2, topk=1, page_size=16, kv_heads=2, group=2,
        head_dim=32, max_kv=30, dtype=torch.float32, pad_tokens=3,
    )
    qkv = torch.randn(q.shape[0], 8 * 32, generator=gen).to(device)
    cos = torch.ones(q.shape[0], 32, device=device)
    calls = []
    monkeypatch.setattr(rope_attention, "rope_tree_attention_triton",
                        lambda *a, **k: calls.append("one") or torch.zeros(q.shape[0], 4, 32))
    monkeypatch.setenv("PHASEGRAPH_KERNELS", "triton")
    out = rope_attention.rope_paged_attention(qkv, 4, 2, 32, cos, cos * 0, k_cache, v_cache, meta, 0.2)
    assert calls == [] and out.shape == (q.shape[0], 4, 32)
    rope_attention.rope_paged_attention(qkv[:6], 4, 2, 32, cos[:6], cos[:6] * 0, k_cache, v_cache,
                                        attrs.evolve(meta, tree_block_writes=True, write_slots=meta.write_slots[:6],
                                                     query_row=meta.query_row[:6], kv_len=meta.kv_len[:6],
                                                     extra_mask=meta.extra_mask[:6]), 0.2)
    assert calls == ["one"]
