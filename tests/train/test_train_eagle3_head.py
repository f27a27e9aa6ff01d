"""EAGLE-3 head: TTT mask structure, TTT attention, TTT == step-by-step inference, layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from phasegraph.train.eagle3_head import (
    Eagle3Config,
    Eagle3Head,
    apply_rope,
    eagle3_aux_layers,
    load_eagle3_head,
    rope_cos_sin,
    save_eagle3_head,
    shift_rows,
    ttt_attention,
    ttt_attention_mask,
    ttt_attention_reference,
)


def _cfg(**kw) -> Eagle3Config:
    base = dict(
        hidden_size=32, target_hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=50, draft_vocab_size=50,
        eagle_aux_layers=(2, 2, 1), rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=64,
    )
    base.update(kw)
    return Eagle3Config(**base)


def _head(seed: int = 0, **kw) -> Eagle3Head:
    head = Eagle3Head(_cfg(**kw))
    g = torch.Generator().manual_seed(seed)
    head.init_weights(g, std=0.2)
    with torch.no_grad():  # non-trivial norm weights
        for p in head.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return head.eval()


def test_aux_layers():
    assert eagle3_aux_layers(8) == (2, 4, 5)
    assert eagle3_aux_layers(32) == (2, 16, 29)
    assert eagle3_aux_layers(6) == (2, 3, 3)
    assert eagle3_aux_layers(4) == (2, 2, 1)
    assert eagle3_aux_layers(2) == (1, 1, 0)


def test_ttt_mask_matches_the_documented_example():
    x = True
    o = False
    expected = torch.tensor([
        # block 0       block 1       block 2
        [o, o, o, o, o, o, o, o, x, o, o, o],
        [o, o, o, o, x, o, o, o, o, x, o, o],
        [x, o, o, o, o, x, o, o, o, o, x, o],
        [x, x, o, o, o, o, x, o, o, o, o, x],
    ])
    assert torch.equal(ttt_attention_mask(4, 2), expected)


@pytest.mark.parametrize("step", [0, 1, 2, 3, 4])
def test_ttt_mask_structure(step):
    t = 9
    m = ttt_attention_mask(t, step)
    assert m.shape == (t, (step + 1) * t) and m.dtype == torch.bool
    for p in range(t):
        b = p - step  # the chain's base row
        # block 0: step-0 keys of rows 0..b
        assert m[p, :t].nonzero().flatten().tolist() == list(range(max(b + 1, 0)))
        for i in range(1, step + 1):
            cols = m[p, i * t : (i + 1) * t].nonzero().flatten().tolist()
            assert cols == ([b + i] if b + i >= 0 else [])  # its step-i ancestor (or itself)
        assert m[p].any()  # never fully masked: the query's own key
        if b >= 0:
            assert int(m[p].sum()) == b + 1 + step
    if step == 0:
        assert torch.equal(m, torch.ones(t, t, dtype=torch.bool).tril())


@pytest.mark.parametrize("step", [0, 1, 2, 3])
def test_ttt_attention_equals_the_dense_masked_form(step):
    g = torch.Generator().manual_seed(step)
    b, h, t, d = 2, 3, 7, 4
    q = torch.randn(b, h, t, d, generator=g)
    keys = [torch.randn(b, h, t, d, generator=g) for _ in range(step + 1)]
    values = [torch.randn(b, h, t, d, generator=g) for _ in range(step + 1)]
    got = ttt_attention(q, keys, values, 0.5)
    ref = ttt_attention_reference(q, keys, values, 0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_shift_rows():
    x = torch.arange(12.0).view(1, 4, 3)
    y = shift_rows(x, 1, dim=1)
    assert torch.equal(y[0, 0], torch.zeros(3))
    assert torch.equal(y[0, 1:], x[0, :3])
    assert torch.equal(shift_rows(x, 5, dim=1), torch.zeros_like(x))


def test_rope_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    rot = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 3, 7, 100]])
    x = torch.randn(1, 4, 4, 8)
    cos_hf, sin_hf = rot(x, pos)
    q_hf, _ = apply_rotary_pos_emb(x, x, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(pos, 8, 5000.0)
    torch.testing.assert_close(apply_rope(x, cos, sin), q_hf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_ttt_forward_equals_step_by_step_chain_drafting(kv_heads):
    """Row b+j of unroll step j == draft step j of a chain based at row b, run the way
    inference runs it: draft-extend over rows 0..b, then one query per step attending the
    prefix keys and the chain's own keys."""
    head = _head(num_key_value_heads=kv_heads)
    g = torch.Generator().manual_seed(1)
    t, unroll = 10, 4
    feats = torch.randn(1, t, 96, generator=g)
    emb = torch.randn(1, t, 32, generator=g)  # row q: embedding of t_{q+1}
    with torch.no_grad():
        outs = head.ttt_forward(feats, emb, unroll)
        out0, k0, v0 = head.extend(feats, emb)
        torch.testing.assert_close(outs[0], out0)
        for base in range(0, t - unroll + 1):
            hidden = out0[:, base : base + 1]
            ck, cv = k0[:, :, : base + 1], v0[:, :, : base + 1]
            for j in range(1, unroll):
                row = base + j
                mask = torch.ones(1, 1, ck.shape[2], dtype=torch.bool)
                out, k, v = head.step(hidden, emb[:, row : row + 1],
                                      torch.tensor([[row]]), ck, cv, mask)
                torch.testing.assert_close(out[:, 0], outs[j][:, row], rtol=1e-4, atol=1e-5)
                ck, cv = torch.cat([ck, k], 2), torch.cat([cv, v], 2)
                hidden = out


def test_ttt_forward_later_embeddings_only_change_later_steps():
    head = _head()
    feats, emb = torch.randn(1, 6, 96), torch.randn(1, 6, 32)
    with torch.no_grad():
        a = head.ttt_forward(feats, emb, 3)
        b = head.ttt_forward(feats, emb, 3, emb_later=torch.randn(1, 6, 32))
    torch.testing.assert_close(a[0], b[0])
    assert not torch.allclose(a[1][:, 1:], b[1][:, 1:])


@pytest.mark.parametrize("draft_vocab", [50, 20])
def test_checkpoint_layout_round_trip(tmp_path, draft_vocab):
    ids = torch.tensor(sorted(torch.randperm(50)[:draft_vocab].tolist())) if draft_vocab < 50 \
        else None
    head = Eagle3Head(_cfg(draft_vocab_size=draft_vocab), draft_to_target=ids)
    head.init_weights(torch.Generator().manual_seed(0))
    save_eagle3_head(head, tmp_path, torch.bfloat16)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    expected = {
        "fc.weight": (32, 96),
        "midlayer.self_attn.q_proj.weight": (32, 64),
        "midlayer.self_attn.k_proj.weight": (16, 64),
        "midlayer.self_attn.v_proj.weight": (16, 64),
        "midlayer.self_attn.o_proj.weight": (32, 32),
        "midlayer.mlp.gate_proj.weight": (48, 32),
        "midlayer.mlp.up_proj.weight": (48, 32),
        "midlayer.mlp.down_proj.weight": (32, 48),
        "midlayer.hidden_norm.weight": (32,),
        "midlayer.input_layernorm.weight": (32,),
        "midlayer.post_attention_layernorm.weight": (32,),
        "norm.weight": (32,),
        "lm_head.weight": (draft_vocab, 32),
    }
    if draft_vocab < 50:
        expected["d2t"] = (draft_vocab,)
        expected["t2d"] = (50,)
    assert keys == set(expected)
    for k, shape in expected.items():
        assert tuple(tensors[k].shape) == shape, k
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(k, torch.bfloat16)
        assert tensors[k].dtype == want, k
    if draft_vocab < 50:
        d2t, t2d = tensors["d2t"], tensors["t2d"]
        assert torch.equal(torch.arange(draft_vocab) + d2t, ids)
        assert int(t2d.sum()) == draft_vocab and bool(t2d[ids].all())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == draft_vocab and cfg["vocab_size"] == 50
    assert cfg["target_hidden_size"] == 32 and cfg["eagle_aux_layers"] == [2, 2, 1]
    loaded = load_eagle3_head(tmp_path, dtype=torch.float32)
    for k, v in head.state_dict().items():
        ref = v.to(torch.bfloat16).float() if v.is_floating_point() else v
        torch.testing.assert_close(loaded.state_dict()[k], ref)
    if draft_vocab < 50:
        assert torch.equal(loaded.to_target_ids(torch.arange(draft_vocab)), ids)
