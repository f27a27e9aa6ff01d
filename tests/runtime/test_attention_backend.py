"""The "phasegraph" attention implementation and its forward context."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from phasegraph.runtime.errors import NoForwardContext
from phasegraph.runtime.kv_pool import KVCacheManager
from phasegraph.runtime.models.attention_backend import (
    ATTN_IMPLEMENTATION,
    current_forward_context,
    forward_context,
    phasegraph_attention,
)
from phasegraph.runtime.models.target import HFTarget
from phasegraph.testing.checkpoints import write_hf_target
from tests.runtime.pg_runtime_helpers import causal_meta


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = write_hf_target(tmp_path_factory.mktemp("t"), "qwen2", num_hidden_layers=2)
    return HFTarget.from_pretrained(d)


def test_registered_with_transformers():
    assert AttentionInterface._global_mapping[ATTN_IMPLEMENTATION] is phasegraph_attention
    mask_fn = AttentionMaskInterface._global_mapping[ATTN_IMPLEMENTATION]
    assert mask_fn(batch_size=1, q_length=3, kv_length=3) is None


def test_attention_outside_a_context_raises(target):
    m = KVCacheManager(
        num_pages=4, page_size=4, max_reqs=2, max_pages_per_req=2, target=target.kv_spec
    )
    with pytest.raises(NoForwardContext, match="outside forward_context"):
        target.model(torch.tensor([[1, 2, 3]]), use_cache=False)
    with pytest.raises(NoForwardContext):
        current_forward_context()
    meta = causal_meta(m.req_to_page, 4, [1, 1], [0, 1])
    with forward_context(meta, m.target_pool, layer_map=[1, 0]) as ctx:
        assert current_forward_context() is ctx and ctx.pool_layer(0) == 1
        with forward_context(meta, m.target_pool) as inner:
            assert current_forward_context() is inner
        assert current_forward_context() is ctx
    with pytest.raises(NoForwardContext):
        current_forward_context()


def test_full_model_call_under_a_context_matches_the_adapter(target):
    """transformers' own forward (mask built by our no-op mask function) over the pool."""
    m = KVCacheManager(
        num_pages=6, page_size=4, max_reqs=2, max_pages_per_req=4, target=target.kv_spec
    )
    target.attach_kv(m.target_pool)
    row = m.admit(9)
    ids = torch.randint(0, 128, (9,))
    meta = causal_meta(m.req_to_page, 4, [row] * 9, range(9))
    ours = target.forward(ids, torch.arange(9), meta).logits
    k_before = m.target_pool.k[1].clone()
    m.target_pool.k[1].zero_()
    with forward_context(meta, m.target_pool), torch.no_grad():
        full = target.model(
            input_ids=ids[None], position_ids=torch.arange(9)[None], use_cache=False
        ).logits[0]
    torch.testing.assert_close(full.float(), ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(m.target_pool.k[1], k_before)  # rewrote the same KV


def test_layer_map_out_of_range_is_an_error(target):
    """The context's own range check names the layer, the pool layer and the pool's depth (not
    a bare IndexError from indexing the pool's per-layer list)."""
    m = KVCacheManager(
        num_pages=4, page_size=4, max_reqs=2, max_pages_per_req=2, target=target.kv_spec
    )
    meta = causal_meta(m.req_to_page, 4, [1], [0])
    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 2, 1, 16)
    module = target.model.model.layers[1].self_attn
    assert m.target_pool.num_layers == 2
    with forward_context(meta, m.target_pool, layer_map=[0, 5]), pytest.raises(
        IndexError, match=r"^attention layer 1 maps to pool layer 5, but the pool has 2 layers$"
    ):
        phasegraph_attention(module, q, k, k, None)
