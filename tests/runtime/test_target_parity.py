"""HFTarget over the paged pool == transformers' own forward (full recompute), fp32.

Prefill of several prompts of mixed lengths in one flattened forward (plus a padding row), then
decode steps, then a tree-masked verify step, for llama / qwen2 / qwen3 / mistral, page sizes 1
and 16, and both execution paths (the fused decoder, transformers' modules). The MoE targets
(qwen3_moe, mixtral) run the modules only (the fused path refuses them by name), and the experts
they report for every prefill row are transformers' own routers' top-k.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from phasegraph.phases.protocols import TargetModel
from phasegraph.runtime.errors import UnsupportedModel
from phasegraph.runtime.kv_pool import KVCacheManager
from phasegraph.runtime.models.fused_decoder import fuse_decoder
from phasegraph.runtime.models.moe import capture_experts, experts_implementation, router_choice
from phasegraph.runtime.models.target import HFTarget, load_causal_lm
from phasegraph.testing.checkpoints import TARGET_MODEL_TYPES, write_hf_target
from tests.runtime.pg_runtime_helpers import assert_conforms, causal_meta, make_meta

ATOL = 1e-4
MOE_TYPES = ("qwen3_moe", "mixtral")


def hf_routed_experts(ref, tokens: list[int]) -> torch.Tensor:  # [len, M, k] int64
    """The experts transformers' routers choose for ``tokens``: top-k of the softmax of each MoE
    layer's router logits (``output_router_logits``), layer order."""
    with torch.no_grad():
        logits = ref(torch.tensor([tokens]), output_router_logits=True).router_logits
    k = ref.config.num_experts_per_tok
    return torch.stack([torch.softmax(x.float(), dim=-1).topk(k, dim=-1).indices for x in logits], dim=1)


@pytest.fixture(scope="module", params=TARGET_MODEL_TYPES)
def target_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"target-{request.param}")
    # qwen2 and mistral also exercise the sharded layout and tied embeddings
    shards = 3 if request.param in ("qwen2", "mistral") else 1
    tied = request.param == "qwen3"
    return write_hf_target(directory, request.param, shards=shards, tie_word_embeddings=tied)


def reference_logits(ref, tokens: list[int]) -> torch.Tensor:  # [len, V]
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].float()


def random_tree(gen, n: int) -> tuple[list[int], torch.Tensor, list[int]]:
    """parents (node 0 is the root), ancestor-or-self mask [n, n], depth."""
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for j in range(n):
        a = j
        while a >= 0:
            mask[j, a] = True
            a = parents[a]
        depth[j] = int(mask[j].sum()) - 1
    return parents, mask, depth


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "modules"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_decode_verify_match_transformers(target_dir, page_size, fused):
    gen = torch.Generator().manual_seed(page_size)
    ref = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    moe = ref.config.model_type in MOE_TYPES
    if moe and fused:  # the fused decoder says why not, and fused=True is refused with it
        assert "mixture of experts" in fuse_decoder(load_causal_lm(target_dir))
        with pytest.raises(UnsupportedModel, match="mixture of experts"):
            HFTarget.from_pretrained(target_dir, dtype=torch.float32, fused=True)
        return
    ours = HFTarget.from_pretrained(target_dir, dtype=torch.float32, feature_mode="eagle3", fused=fused)
    assert (ours.fused_layers is not None) == fused
    assert_conforms(ours, TargetModel)
    if page_size == 16:  # layers a head may declare in place of the default (2, L//2, L-3)
        ours.use_feature_layers((0, 3, 1))
    vocab = ours.vocab_size
    max_tokens = 48
    m = KVCacheManager(
        num_pages=3 * math.ceil(max_tokens / page_size) + 8,
        page_size=page_size,
        max_reqs=4,
        max_pages_per_req=math.ceil(max_tokens / page_size),
        target=ours.kv_spec,
    )
    ours.attach_kv(m.target_pool)

    prompt_lens = [5, 17, 11]
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    rows = [m.admit(n) for n in prompt_lens]
    rt = m.req_to_page

    # -- prefill: all prompts flattened into one forward, plus one padding row (row 0, page 0)
    ids = [t for s in seqs for t in s] + [3]
    row_of = [r for r, s in zip(rows, seqs, strict=True) for _ in s] + [0]
    pos = [p for s in seqs for p in range(len(s))] + [0]
    meta = causal_meta(rt, page_size, row_of, pos)
    kv_len = meta.kv_len.clone()
    kv_len[-1] = 0
    meta = make_meta(rt, page_size, row_of, pos, kv_len)
    out = ours.forward(torch.tensor(ids), torch.tensor(pos), meta, routed_experts=moe)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (len(ids), vocab)
    if moe:
        start = 0
        for s in seqs:
            want = hf_routed_experts(ref, s)  # [len, M, k]
            assert torch.equal(out.routed_experts[start : start + len(s)], want)
            start += len(s)
    assert out.features.shape == (len(ids), 3 * ours.hidden_size)
    start = 0
    for s in seqs:
        want = reference_logits(ref, s)
        torch.testing.assert_close(out.logits[start : start + len(s)], want, atol=ATOL, rtol=0)
        start += len(s)
    # EAGLE-3 features = residual inputs of the feature layers = HF hidden_states[i]
    with torch.no_grad():
        hs = ref(torch.tensor([seqs[1]]), output_hidden_states=True).hidden_states
    want_feat = torch.cat([hs[i][0] for i in ours.feature_layers], dim=-1)
    got_feat = out.features[len(seqs[0]) : len(seqs[0]) + len(seqs[1])]
    torch.testing.assert_close(got_feat, want_feat, atol=ATOL, rtol=0)

    # -- decode steps: one token per request; logits only for the requested rows
    for _ in range(3):
        new = torch.randint(0, vocab, (len(seqs),), generator=gen).tolist()
        pos = [len(s) for s in seqs]
        for r, s in zip(rows, seqs, strict=True):
            m.ensure_capacity(r, len(s) + 1)
        meta = causal_meta(rt, page_size, rows, pos)
        idx = torch.tensor([2, 0])
        out = ours.forward(torch.tensor(new), torch.tensor(pos), meta, logits_index=idx)
        assert out.logits.shape == (2, vocab)
        for s, t in zip(seqs, new, strict=True):
            s.append(t)
        for k, b in enumerate(idx.tolist()):
            want = reference_logits(ref, seqs[b])[-1]
            torch.testing.assert_close(out.logits[k], want, atol=ATOL, rtol=0)

    # -- tree verify: N nodes per request behind the prefix, tree-masked (+ a padding row)
    n = 6
    trees = [random_tree(gen, n) for _ in seqs]
    node_tokens = [torch.randint(0, vocab, (n,), generator=gen).tolist() for _ in seqs]
    ids, row_of, wpos, kvl, positions, extra = [], [], [], [], [], []
    for r, s, (_parents, mask, depth), toks in zip(rows, seqs, trees, node_tokens, strict=True):
        m.ensure_capacity(r, len(s) + n)
        for j in range(n):
            ids.append(toks[j])
            row_of.append(r)
            wpos.append(len(s) + j)
            kvl.append(len(s))
            positions.append(len(s) + depth[j])
            extra.append(mask[j])
    ids.append(0)
    row_of.append(0)
    wpos.append(1)
    kvl.append(0)
    positions.append(0)
    extra.append(torch.zeros(n, dtype=torch.bool))
    meta = make_meta(rt, page_size, row_of, wpos, kvl, torch.stack(extra))
    out = ours.forward(torch.tensor(ids), torch.tensor(positions), meta)
    for b, (s, (_parents, mask, _depth), toks) in enumerate(
        zip(seqs, trees, node_tokens, strict=True)
    ):
        for j in range(n):
            path = [toks[a] for a in range(n) if mask[j, a]]  # ancestors in node order = root..j
            want = reference_logits(ref, s + path)[-1]
            torch.testing.assert_close(out.logits[b * n + j], want, atol=ATOL, rtol=0)
    assert torch.isfinite(out.logits).all()
    m.check()


def test_last_and_none_feature_modes(tmp_path):
    directory = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=2)
    ref = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    toks = torch.randint(0, 128, (7,))
    for mode, width in [("last", 64), ("none", 0)]:
        ours = HFTarget.from_pretrained(directory, feature_mode=mode)
        m = KVCacheManager(
            num_pages=4, page_size=4, max_reqs=2, max_pages_per_req=2, target=ours.kv_spec
        )
        ours.attach_kv(m.target_pool)
        row = m.admit(7)
        out = ours.forward(
            toks, torch.arange(7), causal_meta(m.req_to_page, 4, [row] * 7, range(7))
        )
        assert out.features.shape == (7, width)
        if mode == "last":
            with torch.no_grad():
                want = ref.model(toks[None]).last_hidden_state[0]
            torch.testing.assert_close(out.features, want, atol=ATOL, rtol=0)
    assert ours.feature_layers == ()


def test_wrapping_a_loaded_model_switches_its_attention(tmp_path):
    directory = write_hf_target(tmp_path / "t", "llama", num_hidden_layers=6)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    target = HFTarget(model, feature_mode="eagle3")
    assert model.config._attn_implementation == "phasegraph"
    assert target.feature_layers == (2, 3, 3) and target.feature_size == 3 * 64
    assert target.kv_spec.num_layers == 6 and target.kv_spec.head_dim == 16


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_routes_of_plain_logits_and_of_the_capture_implementation(tmp_path, model_type):
    """An older router that returns plain logits gives the same expert ids as the
    (logits, scores, indices) router; the implementation a CUDA-graph capture switches to
    (fp32: batched_mm) computes the same logits and routes as transformers' default, and the
    switch is undone after the block."""
    directory = write_hf_target(tmp_path / "t", model_type, num_hidden_layers=2)
    target = HFTarget.from_pretrained(directory)
    assert target.capture_experts == "batched_mm" and target.capture_reason is None
    name, why = capture_experts(torch.nn.Linear(2, 2))  # no experts interface: no capture
    assert name is None and "synchronises with the host" in why
    router = target.routers[0]
    hidden = torch.randn(9, target.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = router(hidden)
    assert isinstance(full, tuple) and torch.equal(router_choice(full, 2), full[2])
    assert torch.equal(router_choice(full[0], 2), full[2])  # the plain-logits form
    m = KVCacheManager(num_pages=8, page_size=4, max_reqs=2, max_pages_per_req=4, target=target.kv_spec)
    target.attach_kv(m.target_pool)
    toks = torch.randint(0, target.vocab_size, (11,), generator=torch.Generator().manual_seed(4))
    row = m.admit(11)
    meta = causal_meta(m.req_to_page, 4, [row] * 11, range(11))
    default = target.forward(toks, torch.arange(11), meta, routed_experts=True)
    before = target.model.config._experts_implementation
    with experts_implementation(target.model, "batched_mm"):
        assert target.model.config._experts_implementation == "batched_mm"
        captured = target.forward(toks, torch.arange(11), meta, routed_experts=True)
    assert target.model.config._experts_implementation == before
    torch.testing.assert_close(captured.logits, default.logits, atol=ATOL, rtol=0)
    assert torch.equal(captured.routed_experts, default.routed_experts)
    assert torch.equal(default.routed_experts, hf_routed_experts(
        AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval(), toks.tolist()))


def test_mixtral_passes_its_sliding_window_to_every_layer(tmp_path):
    """Mixtral's attention passes ``config.sliding_window`` as Mistral's does: the target knows it
    (the engine keeps every tree inside it)."""
    target = HFTarget.from_pretrained(write_hf_target(tmp_path / "t", "mixtral", num_hidden_layers=2,
                                                      sliding_window=8))
    assert target.sliding_window == 8


def test_a_dense_target_refuses_to_route(tmp_path):
    target = HFTarget.from_pretrained(write_hf_target(tmp_path / "t", "llama", num_hidden_layers=2))
    assert target.num_moe_layers == 0 and target.capture_experts is None
    m = KVCacheManager(num_pages=4, page_size=4, max_reqs=2, max_pages_per_req=2, target=target.kv_spec)
    target.attach_kv(m.target_pool)
    row = m.admit(3)
    with pytest.raises(UnsupportedModel, match="no mixture-of-experts layers"):
        target.forward(torch.tensor([1, 2, 3]), torch.arange(3), causal_meta(m.req_to_page, 4, [row] * 3, range(3)),
                       routed_experts=True)
