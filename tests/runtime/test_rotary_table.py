"""RotaryTable: cos/sin gathered from a table of the rotary module's own rows (CUDA), sized from
the page table; the module itself off CUDA, for dynamic rope types and inside a capture that
would have to build the table."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.runtime.models.rotary_table import RotaryTable


def _rotary(**rope):
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **rope})
    return LlamaRotaryEmbedding(cfg)


def _meta(pages: int, page_size: int) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int64)
    return AttentionMetadata(write_slots=empty, page_table=torch.zeros(3, pages, dtype=torch.int64),
                             query_row=empty, kv_len=empty, extra_mask=None, page_size=page_size)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(RotaryTable, "devices", ("cuda", "cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_the_modules_rows(on_cpu, dtype):
    rotary = _rotary()
    table = RotaryTable.of(rotary)
    assert RotaryTable.of(rotary) is table  # cached on the module
    positions = torch.tensor([0, 5, 1023, 77, 5])
    like = torch.zeros(2, dtype=dtype)
    cos, sin = table(like, positions, _meta(pages=64, page_size=16))
    want_cos, want_sin = table.module(like, positions)
    assert cos.shape == (5, 16) and cos.dtype == dtype
    # the CPU's vectorised cos may round a tail element differently: within one rounding here,
    # bit for bit on CUDA (tests/gpu/test_rotary_table_gpu.py)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(cos.float(), want_cos.float(), atol=tol) and torch.allclose(sin.float(), want_sin.float(), atol=tol)
    assert table.cos.shape[0] == 1024 and table.builds == 1


def test_grows_with_the_page_table_and_the_dtype(on_cpu):
    table = RotaryTable(_rotary())
    table(torch.zeros(1), torch.tensor([3]), _meta(pages=10, page_size=16))  # 160 positions
    assert (table.builds, table.cos.shape[0]) == (1, 1024)
    table(torch.zeros(1), torch.tensor([3]), _meta(pages=64, page_size=16))  # 1024: fits
    assert table.builds == 1
    table(torch.zeros(1), torch.tensor([1500]), _meta(pages=65, page_size=32))  # 2080
    assert (table.builds, table.cos.shape[0]) == (2, 3072)
    table(torch.zeros(1, dtype=torch.bfloat16), torch.tensor([3]), _meta(pages=1, page_size=16))
    assert table.builds == 3 and table.cos.dtype == torch.bfloat16


def test_off_cuda_and_for_dynamic_rope_the_module_runs(monkeypatch):
    """Off the table's devices, and for a dynamic rope type even where the table is used, the
    rows are exactly the module's own for those positions (no table built)."""
    table = RotaryTable(_rotary())  # default devices: CUDA only
    like, positions = torch.zeros(1), torch.tensor([3, 4])
    cos, sin = table(like, positions, _meta(pages=4, page_size=16))
    want_cos, want_sin = table.module(like, positions)
    assert table.cos is None and cos.shape == (2, 16)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    monkeypatch.setattr(RotaryTable, "devices", ("cuda", "cpu"))  # only the rope type sends it to the module
    dynamic = RotaryTable(_rotary(rope_type="dynamic", factor=2.0))
    assert not dynamic.static
    # 600 > max_position_embeddings (512): the dynamic module rescales its frequencies for the
    # longest position it has seen, so rows of a table built over 0..1023 would differ (the
    # module's rows are taken first: a table build would leave the module rescaled for 1024)
    positions = torch.tensor([600, 3, 4])
    want_cos, want_sin = dynamic.module(like, positions)
    cos, sin = dynamic(like, positions, _meta(pages=64, page_size=16))
    assert dynamic.cos is None and cos.shape == (3, 16)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_lookup_hands_the_tables_and_positions_to_the_kernel(on_cpu):
    """Where the table serves the rows, ``lookup`` returns the tables and the positions as the
    rows ``rotary_write_kv`` reads itself (no gather launched); the module's rows and None where
    it does not (off the table's devices, dynamic rope)."""
    table = RotaryTable(_rotary())
    positions = torch.tensor([4, 0, 9])
    cos, sin, rows = table.lookup(torch.zeros(1), positions, _meta(pages=4, page_size=16))
    assert rows is positions and cos is table.cos and sin is table.sin
    assert cos.shape == (1024, 16)
    gathered_cos, _ = table(torch.zeros(1), positions, _meta(pages=4, page_size=16))
    assert torch.equal(gathered_cos, cos[positions])
    dynamic = RotaryTable(_rotary(rope_type="dynamic", factor=2.0))
    positions = torch.tensor([4, 600, 9])
    want_cos, want_sin = dynamic.module(torch.zeros(1), positions)  # first, as above
    cos, sin, rows = dynamic.lookup(torch.zeros(1), positions, _meta(pages=64, page_size=16))
    assert rows is None and cos.shape == (3, 16) and dynamic.cos is None
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
