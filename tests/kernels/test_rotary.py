"""phasegraph.kernels.rotary on the CPU: with ``rows`` the cos/sin arguments are tables and each
token reads its own row (what the runtime's rotary table hands over), exactly as if the rows had
been gathered first; shapes that cannot work fail with a message naming the argument. The Triton
kernel is compared in tests/gpu/test_triton_layer_kernels.py."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels import rotary


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
