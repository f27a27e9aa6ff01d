"""The layer kernels on the CPU. rms_norm_concat: the EAGLE-3 head's input, both halves normed
as add_rms_norm normalises them and placed side by side. rotary: with ``rows`` the cos/sin
arguments are tables and each token reads its own row (what the runtime's rotary table hands
over), exactly as if the rows had been gathered first. Bad shapes fail with a message naming the
argument. The Triton kernels are compared in tests/gpu/test_triton_layer_kernels.py."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels import rms_norm, rotary


def test_halves_are_the_two_norms_side_by_side():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 16, generator=g), 5 * torch.randn(3, 8, generator=g)
    a_w, b_w = torch.rand(16, generator=g), torch.rand(8, generator=g)
    out = rms_norm.rms_norm_concat(a, a_w, 1e-5, b, b_w, 1e-6)
    assert out.shape == (3, 24)
    assert torch.equal(out[:, :16], rms_norm.add_rms_norm(a, None, a_w, 1e-5)[0])
    assert torch.equal(out[:, 16:], rms_norm.add_rms_norm(b, None, b_w, 1e-6)[0])
    rms = out[:, 16:] / b_w  # each half is normalised on its own: unit root mean square
    assert torch.allclose(rms.pow(2).mean(-1), torch.ones(3), atol=1e-4)


def test_bad_shapes_fail_with_a_message():
    a, b = torch.randn(3, 16), torch.randn(3, 8)
    with pytest.raises(ValueError, match="b: expected 3 rows"):
        rms_norm.rms_norm_concat(a, torch.ones(16), 1e-5, b[:2], torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="b_weight"):
        rms_norm.rms_norm_concat(a, torch.ones(16), 1e-5, b, torch.ones(16), 1e-5)
    with pytest.raises(ValueError, match="b: expected 3 rows of torch.float32"):
        rms_norm.rms_norm_concat(a, torch.ones(16), 1e-5, b.double(), torch.ones(8), 1e-5)


def test_rows_of_a_table_are_looked_up_and_cast_first():
    """With a_rows the first half normalises the gathered rows of a (the embedding table, in
    the target's dtype) cast to b's dtype: the same bits as gathering and casting first."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(50, 16, generator=g)  # float32, like the bench pair's target
    b = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    a_w, b_w = torch.rand(16, generator=g).to(torch.bfloat16), torch.rand(8, generator=g).to(torch.bfloat16)
    ids = torch.tensor([7, 0, 49, 7])
    out = rms_norm.rms_norm_concat(table, a_w, 1e-5, b, b_w, 1e-6, a_rows=ids)
    want = rms_norm.rms_norm_concat(table[ids].to(torch.bfloat16), a_w, 1e-5, b, b_w, 1e-6)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 24)
    assert torch.equal(out, want)
    assert torch.equal(out[0, :16], out[3, :16])  # the same row looked up twice


def test_bad_rows_fail_with_a_message():
    table, b = torch.randn(50, 16), torch.randn(3, 8)
    with pytest.raises(ValueError, match="a_rows: expected dtype torch.int64"):
        rms_norm.rms_norm_concat(table, torch.ones(16), 1e-5, b, torch.ones(8), 1e-5,
                                 a_rows=torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="a_rows"):
        rms_norm.rms_norm_concat(table, torch.ones(16), 1e-5, b, torch.ones(8), 1e-5,
                                 a_rows=torch.tensor([1, 2]))


def _inputs(tokens=5, hq=4, hkv=2, d=8, table_rows=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hq, d, generator=g)
    k = torch.randn(tokens, hkv, d, generator=g)
    v = torch.randn(tokens, hkv, d, generator=g)
    angles = torch.rand(table_rows, d // 2, generator=g) * 10
    angles = torch.cat([angles, angles], dim=-1)
    return q, k, v, angles.cos(), angles.sin()


def test_rows_of_tables_equal_gathered_rows():
    q, k, v, cos, sin = _inputs()
    rows = torch.tensor([11, 0, 3, 3, 7])
    slots = torch.tensor([1, 2, 3, -1, 5])
    caches = [torch.zeros(8, 2, 8) for _ in range(4)]
    want = rotary.rotary_write_kv(q, k, v, cos[rows], sin[rows], caches[0], caches[1], slots)
    got = rotary.rotary_write_kv(q, k, v, cos, sin, caches[2], caches[3], slots, rows)
    assert torch.equal(want, got)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    # the rows matter: row t of the table is another angle
    other = rotary.rotary_write_kv(q, k, v, cos[:5], sin[:5], torch.zeros(8, 2, 8),
                                   torch.zeros(8, 2, 8), slots)
    assert not torch.equal(other, got)


def test_bad_rows_and_tables_fail_with_a_message():
    q, k, v, cos, sin = _inputs()
    cache = torch.zeros(8, 2, 8)
    slots = torch.arange(5)
    with pytest.raises(ValueError, match="rows"):
        rotary.rotary_write_kv(q, k, v, cos, sin, cache, cache.clone(), slots, torch.arange(4))
    with pytest.raises(ValueError, match="rows"):
        rotary.rotary_write_kv(q, k, v, cos, sin, cache, cache.clone(), slots, torch.arange(5.0))
    with pytest.raises(ValueError, match="sin"):
        rotary.rotary_write_kv(q, k, v, cos, sin[:6], cache, cache.clone(), slots, torch.arange(5))
    with pytest.raises(ValueError, match="cos"):  # without rows: one row per token
        rotary.rotary_write_kv(q, k, v, cos, sin, cache, cache.clone(), slots)
