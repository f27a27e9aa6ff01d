"""phasegraph.kernels.tiled_linear on the CPU: its table is well formed (per shape, row ranges
that do not overlap and cover 17..512 rows), its dispatch answers only for float32 rows it has a
rule for on a device Triton runs on, and bad operands fail with a clear message before any
launch. The kernel itself is compared in tests/gpu/test_tiled_linear_gpu.py (GPU, or the
interpreter with PHASEGRAPH_TRITON_INTERPRET=1)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from phasegraph.kernels import linear as lin
from phasegraph.kernels import tile_tables
from phasegraph.kernels import tiled_linear as tiled

PAIR_SHAPES = [(1280, 768), (768, 768), (5120, 768), (768, 2560), (8192, 768), (768, 2304), (1280, 1536)]
MEASURED = ("NVIDIA_H100_80GB_HBM3.json", "NVIDIA_H200.json")  # the files with tiled rules


@pytest.fixture(autouse=True)
def _h100_table(monkeypatch):
    """Every device reads the H100's tables, on any machine."""
    monkeypatch.setenv(tile_tables.ENV_VAR, str(tile_tables.shipped_file(MEASURED[0])))


@pytest.mark.parametrize("name", MEASURED)
def test_table_rows_cover_17_to_512_once_per_shape(name):
    ranges = defaultdict(list)
    for rule in tile_tables.read_tables(tile_tables.shipped_file(name)).tiled_float32:
        assert rule.n_range[0] == rule.n_range[1] and rule.k_range[0] == rule.k_range[1], rule
        ranges[(rule.n_range[0], rule.k_range[0])].append(rule.m_range)
        for cfg in (rule.summed, rule.deferred):
            if cfg is None:
                continue
            assert all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_n, cfg.block_k)), cfg
            assert cfg.block_m >= 16 and cfg.block_k >= 16 and cfg.split_k >= 1, cfg
            assert cfg.block_m <= max(16, 2 * rule.m_range[1]), f"{cfg}: a block of mostly padded rows"
        assert rule.deferred is not None, f"{rule}: a deferred caller must get a tile where a summed one does"
    assert sorted(ranges) == sorted(PAIR_SHAPES)
    for shape, rows in ranges.items():
        rows.sort()
        assert rows[0][0] == tiled.MIN_M == 17 and rows[-1][1] == tiled.MAX_M, shape
        for (_, hi), (lo, _) in zip(rows, rows[1:], strict=False):
            assert lo == hi + 1, f"{shape}: rows {hi + 1}..{lo - 1} have no rule, or rules overlap"


def test_pick_tile_by_rows_shape_and_form():
    assert tiled.pick_tile(16, 5120, 768) is None  # the skinny kernel's rows
    assert tiled.pick_tile(16, 768, 768, defer=True) is None
    assert tiled.pick_tile(513, 5120, 768) is None  # cuBLAS above 512 rows
    assert tiled.pick_tile(128, 1000, 768) is None  # a shape nobody measured
    assert tiled.pick_tile(128, 768, 768) != tiled.pick_tile(128, 768, 768, defer=True)
    for m in (17, 40, 128, 300, 512):
        for n, k in PAIR_SHAPES:
            assert tiled.pick_tile(m, n, k) is not None, (m, n, k)


def test_tiled_config_answers_only_for_float32_rows_triton_runs(monkeypatch):
    monkeypatch.delenv("PHASEGRAPH_KERNELS", raising=False)
    x, w = torch.randn(128, 768), torch.randn(768, 768)
    assert tiled.tiled_config(x, w, None) is None  # a CPU tensor: the reference
    monkeypatch.setattr(tiled, "use_triton", lambda t: True)  # as on CUDA (CI has no Triton)
    assert tiled.pick_tile(128, 768, 768) is not None
    assert tiled.tiled_config(x, w, None) == tiled.pick_tile(128, 768, 768)
    assert tiled.tiled_config(x, w, None, defer=True) == tiled.pick_tile(128, 768, 768, defer=True)
    assert tiled.tiled_config(x.bfloat16(), w.bfloat16(), None) is None
    assert tiled.tiled_config(torch.randn(768, 128).t(), w, None) is None  # not contiguous
    assert tiled.tiled_config(x, w, torch.randn(1536)[::2]) is None  # a strided bias
    assert tiled.tiled_config(x[:8], w, None) is None
    monkeypatch.setattr(tiled, "use_triton", lambda t: False)  # PHASEGRAPH_KERNELS=reference
    assert tiled.tiled_config(x, w, None) is None


def test_linear_on_cpu_is_f_linear_at_tiled_row_counts():
    g = torch.Generator().manual_seed(0)
    for m in (17, 128, 512):  # 2..16 rows run the CPU skinny product (test_linear.py)
        x, w, b = torch.randn(m, 768, generator=g), torch.randn(5120, 768, generator=g), torch.randn(5120, generator=g)
        assert torch.equal(lin.linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(lin.linear(x, w, b, defer=True), F.linear(x, w, b))
        assert torch.equal(tiled.tiled_linear_reference(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize(("make", "words"), [
    (lambda: (torch.randn(20, 8).bfloat16(), torch.randn(4, 8).bfloat16(), None), "float32 operands only"),
    (lambda: (torch.randn(20, 8), torch.randn(4, 9), None), "do not fit x (20, 8)"),
    (lambda: (torch.randn(20, 8), torch.randn(4, 8), torch.randn(5)), "do not fit x (20, 8)"),
    (lambda: (torch.randn(8, 20).t(), torch.randn(4, 8), None), "contiguous operands"),
    (lambda: (torch.randn(20, 0), torch.randn(4, 0), None), "K must be positive"),
])
def test_bad_operands_fail_before_any_launch(make, words):
    x, w, b = make()
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        tiled.tiled_linear_triton(x, w, b, config=tiled.TileConfig(32, 32, 32, 4, 3))
