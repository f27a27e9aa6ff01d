"""RotaryTable on the GPU: gathered rows equal the rotary module's own output bit for bit
(default and llama3 rope, fp32 and bf16), and a capture that would need a new table records the
module instead of an unfilled table.

    python -m pytest -m gpu tests/gpu/test_rotary_table_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.runtime.models.rotary_table import RotaryTable

pytestmark = pytest.mark.gpu

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def _meta(pages: int, page_size: int) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")
    return AttentionMetadata(write_slots=empty, page_table=torch.zeros(2, pages, dtype=torch.int64, device="cuda"),
                             query_row=empty, kv_len=empty, extra_mask=None, page_size=page_size)


def _rotary(rope: str) -> LlamaRotaryEmbedding:
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=8192,
                      rope_parameters=ROPES[rope])
    return LlamaRotaryEmbedding(cfg).cuda()


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_rows_are_the_modules_bit_for_bit(rope, dtype):
    table = RotaryTable(_rotary(rope))
    positions = torch.randint(0, 4096, (300,), device="cuda")
    like = torch.zeros(1, dtype=dtype, device="cuda")
    cos, sin = table(like, positions, _meta(pages=260, page_size=16))
    want_cos, want_sin = table.module(like, positions)
    assert table.cos is not None and table.cos.shape[0] == 5120
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_a_capture_never_builds_the_table():
    table = RotaryTable(_rotary("default"))
    positions = torch.arange(8, device="cuda")
    like = torch.zeros(1, device="cuda")
    meta = _meta(pages=4, page_size=16)
    table(like, positions, meta)  # warm-up (builds)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    wider = _meta(pages=100, page_size=16)
    with torch.cuda.graph(graph):
        cos, sin = table(like, positions, wider)
    assert table.builds == 1  # the module was recorded instead
    graph.replay()
    torch.cuda.synchronize()
    want_cos, want_sin = table.module(like, positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
