"""The fused decoder path (merged projections, fused norm / rotary / activation kernels).

Parity with transformers' forward in fp32 is in test_target_parity.py (both paths, every
architecture). Here: the modules' parameters become views of the merged weights (no copy, and
transformers' own forward is unchanged), unsupported layers keep the module path with a reason,
and in bf16 the fused path stays within rounding of the module path. take_rows and embed (the
fused path's embedding lookup) on the CPU: index_select's rows, and a module call where the
module is not a plain embedding table (on CUDA, test_cuda_parity.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from phasegraph.runtime.errors import UnsupportedModel
from phasegraph.runtime.kv_pool import KVCacheManager
from phasegraph.runtime.models.fused_decoder import fuse_decoder
from phasegraph.runtime.models.take_rows import embed, take_rows
from phasegraph.runtime.models.target import HFTarget
from phasegraph.testing.checkpoints import write_hf_target
from tests.runtime.pg_runtime_helpers import causal_meta


def _model(tmp_path, model_type="llama", **kw):
    directory = write_hf_target(tmp_path / model_type, model_type, num_hidden_layers=2, **kw)
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def test_module_parameters_become_views_of_the_merged_weights(tmp_path):
    model = _model(tmp_path, "qwen2")  # q/k/v biases too
    toks = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        before = model(toks).logits
    layers = fuse_decoder(model)
    assert fuse_decoder(model) is layers  # built once per model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    fused = layers[0]
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == fused.qkv_weight.untyped_storage().data_ptr()
        assert proj.bias.untyped_storage().data_ptr() == fused.qkv_bias.untyped_storage().data_ptr()
    assert torch.equal(fused.qkv_weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(fused.gate_up_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == fused.gate_up_weight.untyped_storage().data_ptr()
    with torch.no_grad():
        after = model(toks).logits
    assert torch.equal(before, after)  # transformers' forward reads the same numbers


def test_unsupported_activation_keeps_the_modules_with_a_reason(tmp_path):
    model = _model(tmp_path, hidden_act="gelu")
    target = HFTarget(model)
    assert target.fused_layers is None and "gelu" in target.fused_reason
    with pytest.raises(UnsupportedModel, match="fused decoder path cannot run this model.*gelu"):
        HFTarget(model, fused=True)
    assert HFTarget(_model(tmp_path / "b")).fused_reason is None


def _logits(target, toks):
    m = KVCacheManager(num_pages=8, page_size=4, max_reqs=2, max_pages_per_req=6, target=target.kv_spec)
    target.attach_kv(m.target_pool)
    row = m.admit(len(toks))
    meta = causal_meta(m.req_to_page, 4, [row] * len(toks), range(len(toks)))
    return target.forward(toks, torch.arange(len(toks)), meta).logits


def test_bf16_fused_path_within_rounding_of_the_modules(tmp_path):
    model = _model(tmp_path).to(torch.bfloat16)
    toks = torch.randint(0, model.config.vocab_size, (13,))
    modules = _logits(HFTarget(model, fused=False), toks)
    fused = _logits(HFTarget(model, fused=True), toks)
    # the same ops in the same order: equal unless a merged product rounds differently
    rel = (fused - modules).norm() / modules.norm()
    assert rel < 1e-2, rel
    assert (fused.argmax(-1) == modules.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("rows", [0, 1, 2, 16, 64, 300])
def test_take_rows_is_index_select(rows):
    g = torch.Generator().manual_seed(rows)
    table = torch.randn(500, 24, generator=g)
    index = torch.randint(0, 500, (rows,), generator=g)
    assert torch.equal(take_rows(table, index), table.index_select(0, index))


def test_embed_gathers_plain_tables_and_calls_other_modules():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(100, 8, generator=g) * 10
    ids = torch.tensor([3, 7, 7, 99])
    plain = torch.nn.Embedding.from_pretrained(table)
    assert torch.equal(embed(plain, ids), plain(ids))
    renormed = torch.nn.Embedding.from_pretrained(table.clone(), max_norm=1.0)  # renormalises rows it reads
    got = embed(renormed, ids)
    assert torch.allclose(got.norm(dim=-1), torch.ones(4), atol=1e-4)

    class Scaled(torch.nn.Embedding):  # a subclass (e.g. a scaled embedding) keeps its forward
        def forward(self, input_ids):
            return 2 * super().forward(input_ids)

    scaled = Scaled.from_pretrained(table)
    assert torch.equal(embed(scaled, ids), 2 * table[ids])
