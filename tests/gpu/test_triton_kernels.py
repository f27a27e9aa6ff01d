"""Every Triton kernel against its torch reference, on fresh random inputs.

Integer and bool outputs must be equal; attention is compared with an fp32 reference on upcast
inputs. Every tensor a Triton wrapper allocates is poisoned first (NaN, a sentinel integer, the
byte 2 for bools), so an element the kernel forgets to write shows.

GPU (the lead's machine): ``python -m pytest -q -m gpu tests/gpu/test_triton_kernels.py``.
CPU, Triton interpreter: ``PHASEGRAPH_TRITON_INTERPRET=1 python -m pytest -q
tests/gpu/test_triton_kernels.py`` (see ``conftest.py``; smaller sizes, same checks; the
interpreter runs programs one after another, so it cannot show races or measure speed).
"""

from __future__ import annotations

import contextlib
import importlib
import os

import attrs
import pytest
import torch

from phasegraph.kernels import _dispatch
from phasegraph.kernels import attention as attn_mod
from tests.gpu import kernel_cases as cases

INTERPRET = os.environ.get("PHASEGRAPH_TRITON_INTERPRET", "") == "1"
# On the GPU (and in normal CPU runs, where the plugin then skips them) these are `gpu` tests;
# in interpreter mode the marker is left off so that the plugin's CUDA check does not skip them.
pytestmark = [] if INTERPRET else [pytest.mark.gpu]

ON_GPU = torch.cuda.is_available() and not INTERPRET
BATCHES = (1, 7, 64) if ON_GPU else (1, 7)
TOPKS = (1, 4, 8) if ON_GPU else (1, 4)
PAGE_SIZES = (1, 16)
INT_POISON = -(2**40) - 7


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return t
    if t.dtype == torch.bool:
        t.view(torch.uint8).fill_(2)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(INT_POISON if t.dtype == torch.int64 else -7)
    return t


@contextlib.contextmanager
def poisoned_allocations():
    """Every ``torch.empty``/``torch.empty_like`` inside comes back filled with poison."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: _poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: _poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


@contextlib.contextmanager
def no_sync(device):
    """On CUDA: any host synchronisation inside raises."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run_triton(device, fn, *args, **kwargs):
    with poisoned_allocations(), no_sync(device):
        return fn(*args, **kwargs)


def assert_equal(ref, out, name=""):
    """Exact equality of tensors (bools compared as bytes, so poison 2 never passes); None
    equals only None."""
    if ref is None or out is None:
        assert ref is None and out is None, (name, type(ref), type(out))
        return
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    assert out.dtype == ref.dtype, (name, out.dtype, ref.dtype)
    out, ref = out.cpu(), ref.cpu()
    if ref.dtype == torch.bool:
        out, ref = out.view(torch.uint8), ref.view(torch.uint8)
    if not torch.equal(out, ref):
        bad = (out != ref).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: {int((out != ref).sum())} elements differ, e.g. at {bad}")


def assert_same_fields(ref, out):
    """Field-by-field equality of two attrs results (or tuples) of tensors."""
    if isinstance(ref, torch.Tensor):
        assert_equal(ref, out)
        return
    if isinstance(ref, tuple | list):
        for i, (a, b) in enumerate(zip(ref, out, strict=True)):
            assert_equal(a, b, f"[{i}]")
        return
    for field in type(ref).__attrs_attrs__:
        assert_equal(getattr(ref, field.name), getattr(out, field.name), field.name)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


# ------------------------------------------------------------------------------- attention

ATTN_DTYPES = (torch.bfloat16, torch.float32)


def _attention_sizes():
    if ON_GPU:
        return dict(kv_heads=8, group=4, head_dim=128, max_kv=300)
    return dict(kv_heads=2, group=4, head_dim=32, max_kv=40)


def check_attention(device, gen, *, layout, batch, topk, page_size, dtype, window=None, **kernel_kw):
    sizes = _attention_sizes()
    q, k, v, meta = cases.attention_case(
        gen, device, layout=layout, batch=batch, topk=topk, page_size=page_size, dtype=dtype,
        **sizes,
    )
    if window is not None:  # each query reads its prefix from kv_len - window on (sliding window)
        meta = attrs.evolve(meta, window_lo=meta.kv_len - window)
    scale = sizes["head_dim"] ** -0.5
    if not ON_GPU:
        kernel_kw.setdefault("block_n", 16)  # several tiles per row in the small interpreter case
    out = run_triton(device, attn_mod.paged_attention_triton, q, k, v, meta, scale, **kernel_kw)
    # float64 on upcast inputs: immune to TF32 settings of the matmuls in the reference
    ref = attn_mod.paged_attention_reference(
        q.double(),
        cases.clean_sink(k, page_size).double(),
        cases.clean_sink(v, page_size).double(),
        meta,
        scale,
    )
    assert out.dtype == dtype and out.shape == q.shape
    real = meta.query_row != 0
    assert torch.isfinite(out).all(), "NaN/inf in the output (unwritten rows or sink reads)"
    assert (out[~real] == 0).all(), "padding tokens must give zeros"
    err = rel_err(out[real], ref[real])
    if dtype == torch.float32:
        assert err < 2e-6, err
    elif dtype == torch.float16:
        assert err < 1e-3, err
    else:
        # The bf16 output's own rounding is ~1.7e-3 of ||ref||, so the 1e-3 bound is checked
        # against the reference rounded to bf16 (what the torch reference returns on bf16
        # inputs), and the distance to the unrounded reference must stay at that floor.
        err_rounded = rel_err(out[real], ref[real].to(dtype))
        assert err_rounded < 1e-3, err_rounded
        assert err < 2.5e-3, err
    return q, k, v, meta, out


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("topk", TOPKS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("layout", cases.ATTENTION_LAYOUTS)
@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=lambda d: str(d)[6:])
def test_paged_attention(device, gen, dtype, layout, batch, topk, page_size):
    check_attention(
        device, gen, layout=layout, batch=batch, topk=topk, page_size=page_size, dtype=dtype
    )


@pytest.mark.parametrize("window", [1, 5])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", cases.ATTENTION_LAYOUTS)
@pytest.mark.parametrize("dtype", ATTN_DTYPES, ids=lambda d: str(d)[6:])
def test_paged_attention_sliding_window(device, gen, dtype, layout, page_size, window):
    """A window start per query (AttentionMetadata.window_lo) masks the prefix below it as the
    reference does; the tree block stays visible; window 1 leaves one prefix key (or none)."""
    check_attention(device, gen, layout=layout, batch=3, topk=2, page_size=page_size, dtype=dtype,
                    window=window)
    check_attention(device, gen, layout=layout, batch=3, topk=2, page_size=page_size, dtype=dtype,
                    window=window, num_splits=2)


@pytest.mark.parametrize("layout", cases.ATTENTION_LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_attention_fp16(device, gen, layout, page_size):
    """fp16 (one P.V product in fp16; the 1e-3 bound holds against the fp32 reference)."""
    check_attention(
        device, gen, layout=layout, batch=7, topk=4, page_size=page_size, dtype=torch.float16
    )


@pytest.mark.parametrize("num_splits", [1, 2, 8])
@pytest.mark.parametrize("layout", ["decode", "verify"])
def test_paged_attention_split_k(device, gen, layout, num_splits):
    """Forced split counts (the automatic choice depends on the SM count)."""
    for dtype in (torch.bfloat16, torch.float32):
        check_attention(
            device, gen, layout=layout, batch=7, topk=4, page_size=16, dtype=dtype,
            num_splits=num_splits,
        )


@pytest.mark.parametrize(
    "tiles",
    [dict(block_m=16, block_n=16), dict(block_m=32, block_n=64), dict(block_m=128, num_warps=8)],
    ids=str,
)
def test_paged_attention_tile_shapes(device, gen, tiles):
    check_attention(
        device, gen, layout="verify", batch=7, topk=4, page_size=16, dtype=torch.bfloat16,
        **tiles,
    )


@pytest.mark.parametrize(("full_splits", "part_splits"), [(None, None), (1, 2), (2, 1)],
                         ids=["auto", "merged-vs-split", "split-vs-merged"])
@pytest.mark.parametrize("layout", ["decode", "verify"])
def test_paged_attention_fp32_batch_invariant(device, gen, layout, full_splits, part_splits):
    """fp32: the first requests of a batch give bitwise the same output alone (plus padding
    tokens, as an eager run) as inside the full batch (as a padded CUDA-graph bucket), whether
    each run folds its 16-position chunks itself (1) or every chunk is its own program folded
    by the combine kernel (2: as many splits as chunks), and with the automatic choice."""
    q, k, v, meta = cases.attention_case(
        gen, device, layout=layout, batch=7, topk=4, page_size=16, kv_heads=2, group=4,
        head_dim=32, max_kv=60, dtype=torch.float32, pad_tokens=0,
    )
    kw = {"chunk": 16} if full_splits is not None else {}
    if not ON_GPU:
        kw["block_n"] = 16
    full = run_triton(device, attn_mod.paged_attention_triton, q, k, v, meta, 0.3,
                      num_splits=full_splits, **kw)
    per_req = q.shape[0] // 7
    keep, pad = 3 * per_req, 5
    zeros = torch.zeros(pad, dtype=torch.int64, device=device)
    sub = attn_mod.AttentionMetadata(
        write_slots=meta.write_slots[:keep],
        page_table=meta.page_table,
        query_row=torch.cat([meta.query_row[:keep], zeros]),
        kv_len=torch.cat([meta.kv_len[:keep], zeros]),
        extra_mask=None if meta.extra_mask is None else torch.cat(
            [meta.extra_mask[:keep], meta.extra_mask[:pad] & False]
        ),
        page_size=16,
    )
    q_sub = torch.cat([q[:keep], q[:pad]])
    part = run_triton(device, attn_mod.paged_attention_triton, q_sub, k, v, sub, 0.3,
                      num_splits=part_splits, **kw)
    assert torch.equal(part[:keep], full[:keep])
    assert (part[keep:] == 0).all()
    ref = attn_mod.paged_attention_reference(
        q.double(), cases.clean_sink(k, 16).double(), cases.clean_sink(v, 16).double(), meta, 0.3
    )
    assert rel_err(full[: keep].double(), ref[:keep]) < 1e-5


@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (8, 96), (3, 80)])
def test_paged_attention_head_shapes(device, gen, group, head_dim):
    """MHA, a large group, and sizes that are not powers of two."""
    q, k, v, meta = cases.attention_case(
        gen, device, layout="verify", batch=3, topk=2, page_size=16, kv_heads=2, group=group,
        head_dim=head_dim, max_kv=40, dtype=torch.float32,
    )
    kw = {} if ON_GPU else {"block_n": 16}
    out = run_triton(device, attn_mod.paged_attention_triton, q, k, v, meta, 0.1, **kw)
    ref = attn_mod.paged_attention_reference(
        q.double(), cases.clean_sink(k, 16).double(), cases.clean_sink(v, 16).double(), meta, 0.1
    )
    real = meta.query_row != 0
    assert rel_err(out[real], ref[real]) < 2e-6
    assert (out[~real] == 0).all()


def test_paged_attention_long_tree_block(device, gen):
    """E > 64 tree positions take the byte-gather path instead of the packed bit words."""
    q, k, v, meta = cases.attention_case(
        gen, device, layout="verify", batch=2, topk=40, page_size=16, kv_heads=1, group=2,
        head_dim=16, max_kv=30, dtype=torch.float32,
    )
    assert meta.extra_mask.shape[1] > 64
    out = run_triton(device, attn_mod.paged_attention_triton, q, k, v, meta, 0.2)
    ref = attn_mod.paged_attention_reference(
        q.double(), cases.clean_sink(k, 16).double(), cases.clean_sink(v, 16).double(), meta, 0.2
    )
    assert rel_err(out, ref) < 2e-6


def test_paged_attention_strided_query(device, gen):
    """q as the attention backend passes it: a transposed view of [1, H, T, D]."""
    q, k, v, meta = cases.attention_case(
        gen, device, layout="extend", batch=3, topk=1, page_size=16, kv_heads=2, group=2,
        head_dim=32, max_kv=40, dtype=torch.float32,
    )
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, strides (D, T*D, 1)
    assert not q_t.is_contiguous()
    out = run_triton(device, attn_mod.paged_attention_triton, q_t, k, v, meta, 0.2)
    ref = attn_mod.paged_attention_reference(
        q.double(), cases.clean_sink(k, 16).double(), cases.clean_sink(v, 16).double(), meta, 0.2
    )
    assert rel_err(out, ref) < 2e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_write_kv(device, gen, dtype):
    num_slots, num_tokens, heads, dim = 64, 20, 3, 24
    k_cache = torch.randn(num_slots, heads, dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_slots, heads, dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_slots - 1, generator=gen)[:num_tokens] + 1
    slots[5] = -1  # one padding token -> the sink slot 0
    k = torch.randn(heads, num_tokens, dim, generator=gen).to(device).transpose(0, 1)  # fp32
    v = torch.randn(num_tokens, heads, dim, generator=gen).to(device)
    slots = slots.to(device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    attn_mod.write_kv_reference(ref_k, ref_v, slots, k, v)
    ptr = k_cache.data_ptr()
    run_triton(device, attn_mod.write_kv_triton, k_cache, v_cache, slots, k, v)
    assert k_cache.data_ptr() == ptr
    assert_equal(ref_k, k_cache, "k_cache")
    assert_equal(ref_v, v_cache, "v_cache")


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_paged_attention_cuda_graph_replay(gen):
    """Captured once; refilling kv_len / extra_mask in place and replaying equals eager."""
    device = torch.device("cuda")
    q, k, v, meta = cases.attention_case(
        gen, device, layout="verify", batch=7, topk=4, page_size=16, dtype=torch.bfloat16
    )
    kv_len, extra = meta.kv_len.clone(), meta.extra_mask.clone()
    static = attn_mod.AttentionMetadata(
        write_slots=meta.write_slots, page_table=meta.page_table, query_row=meta.query_row,
        kv_len=kv_len, extra_mask=extra, page_size=16,
    )
    attn_mod.paged_attention_triton(q, k, v, static, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn_mod.paged_attention_triton(q, k, v, static, 0.1)
    for _ in range(3):
        kv_len.copy_((meta.kv_len - torch.randint(0, 20, kv_len.shape, generator=gen).to(device))
                     .clamp(min=0) * (meta.query_row != 0))
        extra.copy_(meta.extra_mask & (torch.rand(extra.shape, generator=gen) < 0.8).to(device))
        graph.replay()
        eager = attn_mod.paged_attention_triton(q, k, v, static, 0.1)
        assert torch.equal(out, eager)


def test_dispatch_switch(device, monkeypatch):
    """PHASEGRAPH_KERNELS picks the implementation; auto means Triton exactly on CUDA."""
    calls = []
    monkeypatch.setattr(attn_mod, "paged_attention_triton", lambda *a, **k: calls.append("t"))
    monkeypatch.setattr(attn_mod, "paged_attention_reference", lambda *a, **k: calls.append("r"))
    x = torch.zeros(1, device=device)
    for mode, expected in [("reference", "r"), ("triton", "t"), ("auto", "t" if ON_GPU else "r")]:
        monkeypatch.setenv(_dispatch.ENV_VAR, mode)
        attn_mod.paged_attention(x, x, x, None, 1.0)
        assert calls[-1] == expected, mode
    monkeypatch.setenv(_dispatch.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="PHASEGRAPH_KERNELS"):
        attn_mod.paged_attention(x, x, x, None, 1.0)


# ------------------------------------------------------------------ verification and bonus

# (modules by path: phasegraph.kernels re-exports functions named like some of its modules)
bonus_mod = importlib.import_module("phasegraph.kernels.bonus")
tree_mod = importlib.import_module("phasegraph.kernels.build_tree")
expand_mod = importlib.import_module("phasegraph.kernels.draft_expand")
sampling_mod = importlib.import_module("phasegraph.kernels.tree_sampling")
greedy_mod = importlib.import_module("phasegraph.kernels.verify_greedy")

STEPS = 4
VOCAB = 32000 if ON_GPU else 64
GRID = [(b, k) for b in BATCHES for k in TOPKS]


def _verify_inputs(gen, device, batch, topk, **kw):
    return cases.verify_case(
        gen, device, batch=batch, topk=topk, num_steps=kw.pop("num_steps", STEPS),
        vocab=kw.pop("vocab", VOCAB), **kw,
    )


@pytest.mark.parametrize(("batch", "topk"), GRID)
def test_verify_tree_greedy(device, gen, batch, topk):
    d = _verify_inputs(gen, device, batch, topk)
    args = (d["draft_tokens"], d["next_token"], d["next_sibling"], d["target_predict"],
            d["num_steps"])
    ref = greedy_mod.verify_tree_greedy_reference(*args)
    out = run_triton(device, greedy_mod.verify_tree_greedy_triton, *args)
    assert_same_fields(ref, out)
    if batch > 1:
        assert float(ref.accept_lens.float().mean()) > 1.3  # the paths are not trivial


simulated_mod = importlib.import_module("phasegraph.kernels.simulated_accept")


@pytest.mark.parametrize(("batch", "topk"), GRID)
@pytest.mark.parametrize("accept_drafts", [0, 1, 3, 9])
def test_verify_tree_simulated(device, gen, batch, topk, accept_drafts):
    """Benchmark mode's simulated acceptance: the one-launch walk equals the reference, also
    where the first-child chain is shorter than the drafts asked for (a leaf ends it)."""
    d = _verify_inputs(gen, device, batch, topk)
    args = (d["draft_tokens"], d["next_token"], d["target_predict"], d["num_steps"], accept_drafts)
    ref = simulated_mod.verify_tree_simulated_reference(*args)
    out = run_triton(device, simulated_mod.verify_tree_simulated_triton, *args)
    assert_same_fields(ref, out)
    if accept_drafts == 0:
        assert (ref.accept_lens == 1).all()


@pytest.mark.parametrize(("batch", "topk"), GRID)
def test_verify_tree_sampling(device, gen, batch, topk):
    d = _verify_inputs(gen, device, batch, topk)
    args = (d["draft_tokens"], d["next_token"], d["next_sibling"], d["probs"], d["coins"],
            d["bonus_coins"], d["num_steps"])
    ref = sampling_mod.verify_tree_sampling_reference(*args)
    out = run_triton(device, sampling_mod.verify_tree_sampling_triton, *args)
    assert_same_fields(ref, out)


def test_verify_edge_cases(device, gen):
    """S = 0 (bonus only), a single-node tree, hand-written sibling lists with a repeated token,
    a one-hot row whose only mass is on a tried child, and coins at 0 and just below 1."""
    # one request, root -> 1, 2, 3 with tokens 5, 5, 7 (sibling order 3, 1, 2)
    draft_tokens = torch.tensor([9, 5, 5, 7])
    next_token = torch.tensor([[3, -1, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, 1]])
    vocab = 12
    probs = torch.rand(4, vocab, generator=gen).softmax(-1)
    one_hot = torch.zeros(vocab)
    one_hot[5] = 1.0  # all mass on the repeated child token
    spread = torch.full((vocab,), 0.5 / (vocab - 2))
    spread[5], spread[7] = 0.3, 0.2  # tried in order 7, 5, 5: a coin in [0.5, 0.8) tells
    for root_p, coin in [(one_hot, 0.0), (one_hot, 0.5), (one_hot, 1.0 - 2**-24),
                         (spread, 0.1), (spread, 0.4), (spread, 0.6), (spread, 0.75),
                         (spread, 0.9)]:
        probs[0] = root_p
        coins = torch.full((1, 2), coin)
        args = [draft_tokens, next_token, next_sibling, probs, coins, coins.flip(1), 1]
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        ref = sampling_mod.verify_tree_sampling_reference(*args)
        out = run_triton(device, sampling_mod.verify_tree_sampling_triton, *args)
        assert_same_fields(ref, out)
        greedy = [args[0], args[1], args[2], probs.argmax(-1).to(device), 1]
        assert_same_fields(
            greedy_mod.verify_tree_greedy_reference(*greedy),
            run_triton(device, greedy_mod.verify_tree_greedy_triton, *greedy),
        )
    for num_steps in (0, 1):
        d = _verify_inputs(gen, device, 5, 2, num_steps=num_steps)
        args = (d["draft_tokens"], d["next_token"], d["next_sibling"], d["probs"], d["coins"],
                d["bonus_coins"], num_steps)
        assert_same_fields(
            sampling_mod.verify_tree_sampling_reference(*args),
            run_triton(device, sampling_mod.verify_tree_sampling_triton, *args),
        )
        args = (d["draft_tokens"], d["next_token"], d["next_sibling"], d["target_predict"],
                num_steps)
        assert_same_fields(
            greedy_mod.verify_tree_greedy_reference(*args),
            run_triton(device, greedy_mod.verify_tree_greedy_triton, *args),
        )


@pytest.mark.parametrize(("batch", "topk"), GRID)
def test_bonus_tokens(device, gen, batch, topk):
    d = _verify_inputs(gen, device, batch, topk)
    out = greedy_mod.verify_tree_greedy_reference(
        d["draft_tokens"], d["next_token"], d["next_sibling"], d["target_predict"], STEPS
    )
    assert_equal(
        bonus_mod.gather_accepted_tokens_reference(out.predict, out.accept_index),
        run_triton(device, bonus_mod.gather_accepted_tokens_triton, out.predict,
                   out.accept_index),
    )
    assert_equal(
        bonus_mod.fill_bonus_tokens_reference(out.predict, out.accept_index, out.accept_lens),
        run_triton(device, bonus_mod.fill_bonus_tokens_triton, out.predict, out.accept_index,
                   out.accept_lens),
    )


# ------------------------------------------------------------------------ draft tree kernels


@pytest.mark.parametrize(("batch", "topk"), GRID)
def test_expand_step(device, gen, batch, topk):
    vocab = 200
    draft = torch.rand(vocab, vocab, generator=gen).pow(4).softmax(-1)
    top_p, top_i = draft.topk(topk, dim=-1)
    beam_scores = torch.rand(batch, topk, generator=gen)
    beam_scores[:, 1::2] = beam_scores[:, :1]  # ties between beams
    beam_tokens = torch.randint(0, vocab, (batch, topk), generator=gen)
    beam_tokens[:, -1] = beam_tokens[:, 0]  # identical children -> equal scores
    beam_cand = torch.randint(0, 100, (batch, topk), generator=gen)
    args = [beam_scores, beam_cand, top_p[beam_tokens], top_i[beam_tokens]]
    args = [a.to(device) for a in args]
    for step in (1, 3):
        ref = expand_mod.expand_step_reference(*args, step, topk)
        out = run_triton(device, expand_mod.expand_step_triton, *args, step, topk)
        assert_same_fields(ref, out)
    # into a candidate table (3 steps), step 1 from the step-0 beams (beam_cand None)
    tables = [expand_mod.StepCandidates.empty(batch, topk, 4, device) for _ in range(2)]
    for t in tables:
        for name in ("tokens", "scores", "parents"):
            _poison(getattr(t, name))
    for step in (1, 2, 3):
        cand = None if step == 1 else args[1]
        ref = expand_mod.expand_step_reference(args[0], cand, *args[2:], step, topk, tables[0])
        out = run_triton(device, expand_mod.expand_step_triton, args[0], cand, *args[2:], step,
                         topk, tables[1])
        assert_same_fields(ref, out)
    assert_same_fields(tables[0], tables[1])
    plain = expand_mod.expand_step_reference(
        args[0], torch.arange(topk, device=device).expand(batch, topk), *args[2:], 1, topk
    )
    assert_same_fields(plain, expand_mod.expand_step_reference(args[0], None, *args[2:], 1, topk))


@pytest.mark.parametrize(("batch", "topk"), GRID)
@pytest.mark.parametrize("num_steps", [1, STEPS])
def test_select_tree_nodes_and_build_tree(device, gen, batch, topk, num_steps):
    roots, _, _, cand, _, _ = cases.draft_case(
        gen, batch=batch, topk=topk, num_steps=num_steps, vocab=300
    )
    cand = [c.to(device) for c in cand]
    num_cand = cand[0].shape[1]
    # the same candidates with the step-0 ones (parent -1) passed apart
    rest = [c[:, topk:] for c in cand]
    first = {"first_tokens": cand[0][:, :topk], "first_scores": cand[1][:, :topk]}
    for num_nodes in sorted({1, 2, cases.tree_nodes(topk, num_steps), num_cand + 1}):
        ref = tree_mod.select_tree_nodes_reference(*cand, num_nodes)
        out = run_triton(device, tree_mod.select_tree_nodes_triton, *cand, num_nodes)
        assert_same_fields(ref, out)
        assert_same_fields(ref, tree_mod.select_tree_nodes_reference(*rest, num_nodes, **first))
        assert_same_fields(
            ref, run_triton(device, tree_mod.select_tree_nodes_triton, *rest, num_nodes, **first)
        )
        node_tokens, node_parents, _ = ref
        seq_lens = torch.randint(0, 1000, (batch,), generator=gen).to(device)
        tree_args = (roots.to(device), node_tokens, node_parents, seq_lens)
        assert_same_fields(
            tree_mod.build_tree_reference(*tree_args),
            run_triton(device, tree_mod.build_tree_triton, *tree_args),
        )


def test_select_tree_nodes_ties_and_nan(device, gen):
    """Equal scores keep the lower id; NaN sorts above every number (as torch.sort); the rows
    with a NaN or infinite score, and only those, are not ``scores_finite``."""
    batch, num_cand = 6, 40
    scores = torch.randint(0, 4, (batch, num_cand), generator=gen).float() / 4
    scores[0, 7] = float("nan")
    scores[1, [3, 30]] = float("nan")
    scores[2] = 0.5
    scores[3, 39] = float("inf")
    scores[4, 0] = float("-inf")
    parents = torch.randint(-1, num_cand, (batch, num_cand), generator=gen)
    parents = torch.minimum(parents, torch.arange(num_cand) - 1)
    tokens = torch.randint(0, 1000, (batch, num_cand), generator=gen)
    for num_nodes in (1, 5, 17, num_cand + 1):
        ref = tree_mod.select_tree_nodes_reference(tokens, scores, parents, num_nodes)
        out = run_triton(
            device, tree_mod.select_tree_nodes_triton, tokens.to(device), scores.to(device),
            parents.to(device), num_nodes,
        )
        assert_same_fields(ref, out)
        assert out.scores_finite.tolist() == [False, False, True, False, False, True]


def test_build_tree_shapes(device, gen):
    """Chains (depth N-1), stars, and N up to 64."""
    for num_nodes in (1, 2, 17, 64):
        chain = torch.arange(-1, num_nodes - 1)[None].repeat(3, 1)
        star = torch.zeros(1, num_nodes, dtype=torch.int64)
        star[0, 0] = -1
        rand = cases.random_parents(gen, 4, num_nodes)
        parents = torch.cat([chain, star, rand])
        batch = parents.shape[0]
        args = (
            torch.randint(0, 99, (batch,), generator=gen),
            torch.randint(0, 99, (batch, num_nodes - 1), generator=gen),
            parents,
            torch.randint(0, 99, (batch,), generator=gen),
        )
        ref = tree_mod.build_tree_reference(*args)
        out = run_triton(device, tree_mod.build_tree_triton, *[a.to(device) for a in args])
        assert_same_fields(ref, out)


# ------------------------------------------------------------------ KV slots, moves, positions

compact_mod = importlib.import_module("phasegraph.kernels.compact")
slots_mod = importlib.import_module("phasegraph.kernels.cache_slots")
positions_mod = importlib.import_module("phasegraph.kernels.extend_positions")
random_mod = importlib.import_module("phasegraph.kernels.random")


def _accept_case(gen, batch, num_nodes, width):
    """accept_index [B, W] (root first, -1 padded) and accept_lens [B]."""
    accept_lens = torch.randint(1, width + 1, (batch,), generator=gen)
    accept_index = torch.full((batch, width), -1)
    for b in range(batch):
        n = int(accept_lens[b])
        nodes = torch.randperm(num_nodes - 1, generator=gen)[: n - 1].sort().values + 1
        accept_index[b, :n] = b * num_nodes + torch.cat([torch.zeros(1, dtype=torch.int64), nodes])
    return accept_index, accept_lens


@pytest.mark.parametrize(("batch", "topk"), GRID)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_slots_and_moves(device, gen, batch, topk, page_size):
    num_steps = STEPS
    width, num_nodes = num_steps + 1, cases.tree_nodes(topk, num_steps)
    region = slots_mod.draft_region_pages(page_size, num_steps)
    max_pages = 40 // page_size + 4
    pages = torch.randperm(batch * (max_pages + topk * region) + 8, generator=gen)[
        : batch * (max_pages + topk * region)
    ] + 1
    page_table = torch.zeros(batch + 3, max_pages, dtype=torch.int64)
    rows = torch.randperm(batch + 2, generator=gen)[:batch] + 1
    page_table[rows] = pages[: batch * max_pages].view(batch, max_pages)
    region_pages = pages[batch * max_pages :].view(batch, topk, region)
    seq_lens = torch.randint(0, max_pages * page_size - num_nodes, (batch,), generator=gen)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    page_table, rows, region_pages, seq_lens = to(page_table, rows, region_pages, seq_lens)

    positions = seq_lens[:, None] + torch.arange(num_nodes, device=device)
    for fn in ("row_slots",):
        ref = getattr(slots_mod, fn + "_reference")(page_table, rows, positions, page_size)
        out = run_triton(device, getattr(slots_mod, fn + "_triton"), page_table, rows,
                         positions, page_size)
        assert_equal(ref, out, fn)
    spans = run_triton(device, slots_mod.span_slots_triton, page_table, rows, seq_lens, num_nodes,
                       page_size)
    assert_equal(slots_mod.span_slots_reference(page_table, rows, seq_lens, num_nodes, page_size),
                 spans, "span_slots")
    span_args = (page_table, rows, seq_lens, num_nodes, page_size)
    assert_same_fields(slots_mod.span_slots_and_rows_reference(*span_args),
                       run_triton(device, slots_mod.span_slots_and_rows_triton, *span_args))
    # a causal extend: W tokens per request (token_req), and one token per request (None)
    token_req = torch.arange(batch, device=device).repeat_interleave(width)
    ext_pos = positions[:, :width].reshape(-1)
    for ext_args in [(page_table, rows, token_req, ext_pos, page_size),
                     (page_table, rows, None, seq_lens, page_size)]:
        assert_same_fields(slots_mod.extend_slots_reference(*ext_args),
                           run_triton(device, slots_mod.extend_slots_triton, *ext_args))
    node_slots = slots_mod.row_slots_reference(page_table, rows, positions, page_size)
    front_slots = node_slots[:, :width]

    for steps in (1, 2, num_steps):
        reg = slots_mod.draft_region_pages(page_size, steps)
        rp = region_pages[:, :, :reg].contiguous()
        args = (page_table, rows, seq_lens, rp, page_size, steps)
        ref = slots_mod.assign_draft_cache_locs_reference(*args)
        assert_same_fields(ref, run_triton(device, slots_mod.assign_draft_cache_locs_triton, *args))
        # the regions of the pool's table at rows, and the hidden rows repeated over the beams
        table = torch.zeros(page_table.shape[0], topk, reg, dtype=torch.int64, device=device)
        table[rows] = rp
        for hidden_size in (5, 1500):
            hidden = torch.randn(batch, hidden_size, generator=gen).to(torch.bfloat16).to(device)
            kw = {"region_table": True, "hidden": hidden}
            ref = slots_mod.assign_draft_cache_locs_reference(page_table, rows, seq_lens, table,
                                                              page_size, steps, **kw)
            assert_same_fields(ref, run_triton(device, slots_mod.assign_draft_cache_locs_triton,
                                               page_table, rows, seq_lens, table, page_size, steps,
                                               **kw))
            assert_equal(hidden.repeat_interleave(topk, dim=0), ref.beam_hidden, "beam_hidden")
    beam_parent = torch.randint(0, topk, (batch, topk), generator=gen).to(device)
    assert_same_fields(
        slots_mod.reorder_branches_reference(region_pages, beam_parent, page_size),
        run_triton(device, slots_mod.reorder_branches_triton, region_pages, beam_parent,
                   page_size),
    )
    for hidden_size in (7, 1500):
        hidden = torch.randn(batch * topk, hidden_size, generator=gen).to(device)
        args = (region_pages, beam_parent, page_size, hidden)
        assert_same_fields(slots_mod.reorder_branches_reference(*args),
                           run_triton(device, slots_mod.reorder_branches_triton, *args))

    accept_index, accept_lens = to(*_accept_case(gen, batch, num_nodes, width))
    args = (accept_index, accept_lens, node_slots.reshape(-1), front_slots.reshape(-1))
    moves = compact_mod.accepted_kv_moves_reference(*args)
    assert_same_fields(moves, run_triton(device, compact_mod.accepted_kv_moves_triton, *args))

    for dtype in (torch.bfloat16, torch.float32):
        hidden = torch.randn(batch * num_nodes, 3, 5, generator=gen).to(dtype).to(device)
        assert_equal(
            compact_mod.compact_to_front_reference(hidden, accept_index),
            run_triton(device, compact_mod.compact_to_front_triton, hidden, accept_index),
        )
    flags = (torch.rand(batch * num_nodes, generator=gen) < 0.5).to(device)
    assert_equal(
        compact_mod.compact_to_front_reference(flags, accept_index),
        run_triton(device, compact_mod.compact_to_front_triton, flags, accept_index),
    )

    # KV moves: the accepted-path moves, a branch reorder and the prefix tails, on 3 layers
    num_slots = int(pages.max()) * page_size + page_size
    layout = slots_mod.assign_draft_cache_locs_reference(
        page_table, rows, seq_lens, region_pages, page_size, num_steps
    )
    reordered = slots_mod.reorder_branches_reference(region_pages, beam_parent, page_size)
    reorder = (reordered.src, reordered.dst)
    for src, dst in [moves, reorder, (layout.tail_src, layout.tail_dst)]:
        pools = [torch.randn(num_slots, 2, 8, generator=gen).to(device) for _ in range(6)]
        expected = [p.clone() for p in pools]
        compact_mod.move_kv_reference(expected, src, dst)
        run_triton(device, compact_mod.move_kv_triton, pools, src, dst)
        for e, p in zip(expected, pools, strict=True):
            assert_equal(e, p, "cache after move_kv")


def test_move_kv_many_caches_and_permutations(device, gen, monkeypatch):
    """More caches than one launch takes, a pure permutation (every row moves), and caches of
    different dtypes (reference fallback)."""
    monkeypatch.setattr(compact_mod, "_CACHES_PER_LAUNCH", 4)
    num_slots = 50
    src = torch.randperm(num_slots, generator=gen).to(device)
    dst = torch.randperm(num_slots, generator=gen).to(device)
    pools = [torch.randn(num_slots, 3, 7, generator=gen).to(device) for _ in range(10)]
    expected = [p.clone() for p in pools]
    compact_mod.move_kv_reference(expected, src, dst)
    run_triton(device, compact_mod.move_kv_triton, pools, src, dst)
    for e, p in zip(expected, pools, strict=True):
        assert_equal(e, p)
    mixed = [torch.randn(num_slots, 4, generator=gen).to(device),
             torch.randn(num_slots, 4, generator=gen).to(torch.bfloat16).to(device)]
    expected = [p.clone() for p in mixed]
    compact_mod.move_kv_reference(expected, src, dst)
    run_triton(device, compact_mod.move_kv_triton, mixed, src, dst)
    for e, p in zip(expected, mixed, strict=True):
        assert_equal(e, p)


@pytest.mark.parametrize("batch", BATCHES)
def test_extend_positions(device, gen, batch):
    seq_lens = torch.randint(0, 5000, (batch,), generator=gen).to(device)
    for width in (1, 5, 17):
        assert_equal(
            positions_mod.extend_positions_reference(seq_lens, width),
            run_triton(device, positions_mod.extend_positions_triton, seq_lens, width),
        )
        assert_same_fields(
            positions_mod.extend_rows_reference(seq_lens, width),
            run_triton(device, positions_mod.extend_rows_triton, seq_lens, width),
        )
    lens = torch.randint(0, 9, (batch,), generator=gen)
    lens[::3] = 0  # empty requests
    lens = lens.to(device)
    for extra in (0, 3, 70):
        total = int(lens.sum()) + extra
        assert_same_fields(
            positions_mod.ragged_extend_positions_reference(seq_lens, lens, total),
            run_triton(device, positions_mod.ragged_extend_positions_triton, seq_lens, lens,
                       total),
        )


def test_ragged_extend_positions_many_requests(device, gen):
    """More requests than one chunk of the kernel's request loop, and B = 0."""
    batch = 150
    starts = torch.randint(0, 10**6, (batch,), generator=gen).to(device)
    lens = torch.randint(0, 4, (batch,), generator=gen).to(device)
    total = int(lens.sum()) + 5
    assert_same_fields(
        positions_mod.ragged_extend_positions_reference(starts, lens, total),
        run_triton(device, positions_mod.ragged_extend_positions_triton, starts, lens, total),
    )
    empty = starts[:0]
    assert_same_fields(
        positions_mod.ragged_extend_positions_reference(empty, empty, 4),
        run_triton(device, positions_mod.ragged_extend_positions_triton, empty, empty, 4),
    )


def test_counter_uniform(device, gen):
    seeds = torch.randint(-(2**62), 2**62, (9,), generator=gen).to(device)
    positions = torch.randint(0, 10**6, (9, 6), generator=gen).to(device)
    for counters in (
        random_mod.position_counter(positions, random_mod.PURPOSE_ACCEPT),
        random_mod.position_counter(positions[:, 0], random_mod.PURPOSE_SAMPLE),
        torch.randint(-(2**62), 2**62, (9, 300), generator=gen).to(device),
    ):
        ref = random_mod.counter_uniform_reference(seeds, counters)
        out = run_triton(device, random_mod.counter_uniform_triton, seeds, counters)
        assert_equal(ref, out)
        assert float(out.min()) >= 0 and float(out.max()) < 1
    one_seed = seeds[:1]
    assert_equal(
        random_mod.counter_uniform_reference(one_seed, positions),
        run_triton(device, random_mod.counter_uniform_triton, one_seed, positions),
    )


# ------------------------------------------------------------------------------- commit path

commit_mod = importlib.import_module("phasegraph.kernels.commit_path")


@pytest.mark.parametrize("lead", [0, 1])
@pytest.mark.parametrize(("batch", "width", "stops"), [(1, 1, 1), (7, 4, 3), (5, 9, 0), (64, 7, 5)])
def test_commit_path(device, gen, batch, width, stops, lead):
    from tests.kernels.commit_path_cases import commit_path_case, node_finite_case

    case = commit_path_case(gen, batch, width, nodes=width + 3, stops=stops, lead=lead, device=device)
    ref = commit_mod.commit_path_reference(*case)
    out = run_triton(device, commit_mod.commit_path_triton, *case)
    assert_same_fields(ref, out)
    if batch >= 7 and stops:  # stop tokens and budgets both cut some paths here
        cut = ref.lens < case[2]
        assert cut.any() and (~ref.finished).any()
    # with nodes whose logits were not finite: the emitted rows are cut at the first of them
    finite = node_finite_case(gen, batch, width + 3, device=device)
    ref = commit_mod.commit_path_reference(*case, node_finite=finite)
    out = run_triton(device, commit_mod.commit_path_triton, *case, node_finite=finite)
    assert_same_fields(ref, out)
    if batch >= 7:
        assert (ref.emitted == commit_mod.NONFINITE_LOGITS).any()
    # and with drafts that were not finite: their rows' padding is marked
    draft_finite = (torch.rand(batch, generator=gen) > 0.5).to(device)
    ref = commit_mod.commit_path_reference(*case, node_finite=finite, draft_finite=draft_finite)
    out = run_triton(device, commit_mod.commit_path_triton, *case, node_finite=finite,
                     draft_finite=draft_finite)
    assert_same_fields(ref, out)
    if batch >= 7:
        assert (ref.emitted == commit_mod.DRAFT_NONFINITE).any()
