"""The three-pass TF32 tiled product (float32, 17-512 rows) and the split-sum kernel, against
float64 and their torch references, on poisoned allocations with no host sync.

Products: within 5e-6 relative error (max-norm) of float64, as cuBLAS's FFMA is; deferred
partials summed by their consumers equal the product summed by ``total_triton`` bit for bit; a
graph replay equals the eager call bit for bit. Same modes as test_triton_kernels.py (GPU with
``-m gpu``; CPU through the interpreter with ``PHASEGRAPH_TRITON_INTERPRET=1``, small shapes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from phasegraph.kernels import linear as lin
from phasegraph.kernels import tile_tables
from phasegraph.kernels import tiled_linear as tiled
from phasegraph.kernels.split_sum import SplitSum, total_triton
from tests.gpu.test_triton_kernels import INTERPRET, ON_GPU, assert_equal, run_triton

pytestmark = [] if INTERPRET else [pytest.mark.gpu]
T = tiled.TileConfig
# (N, K): the bench pair's qkv and down shapes and a ragged one on the GPU; small in the interpreter
SHAPES = [(1280, 768), (768, 2560), (200, 312)] if ON_GPU else [(40, 72), (96, 160)]
ROWS = (17, 40, 128, 512) if ON_GPU else (17, 33)
TILES = [T(32, 64, 32, 4, 3), T(64, 64, 32, 4, 3, 4), T(64, 32, 64, 4, 2, 2)]
if ON_GPU:  # + the widest blocks of the sweep
    TILES += [T(128, 128, 32, 8, 3, 2), T(64, 128, 64, 8, 3, 8)]


def _max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want.cpu()).abs().max() / want.abs().max())


def _inputs(gen, device, m, n, k, bias):
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    return x.to(device), w.to(device), None if b is None else b.to(device), want


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tiled_product_is_float32_exact(device, gen, rows, shape):
    n, k = shape
    for tile in TILES:
        for bias in (False, True):
            x, w, b, want = _inputs(gen, device, rows, n, k, bias)
            got = run_triton(device, tiled.tiled_linear_triton, x, w, b, config=tile)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            assert torch.isfinite(got).all(), f"{tile}: unwritten elements"
            err = _max_rel_err(got, want)
            assert err <= 5e-6, f"{tile} bias={bias}: relative error {err:.2e}"


@pytest.mark.parametrize("rows", ROWS[:2])
def test_deferred_partials_give_the_consumers_the_same_bits(device, gen, rows):
    """``defer=True`` hands the slices on (SplitSum); ``SplitSum.total``, ``total_triton``, the
    norm and SwiGLU kernels summing them as they load all give the bits of the summed product."""
    from phasegraph.kernels.activation import silu_mul_triton
    from phasegraph.kernels.rms_norm import add_rms_norm_triton

    n, k = SHAPES[0]
    for tile in (t for t in TILES if t.split_k > 1):
        for bias in (False, True):
            x, w, b, _ = _inputs(gen, device, rows, n, k, bias)
            summed = run_triton(device, tiled.tiled_linear_triton, x, w, b, config=tile)
            deferred = run_triton(device, tiled.tiled_linear_triton, x, w, b, config=tile, defer=True)
            assert isinstance(deferred, SplitSum) and 1 < deferred.slices <= tile.split_k
            assert_equal(deferred.total(), summed, f"total {tile}")
            assert_equal(run_triton(device, total_triton, deferred), summed, f"total_triton {tile}")
            norm_w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device)
            residual = torch.randn(rows, n, generator=gen).to(device)
            want = add_rms_norm_triton(summed, residual, norm_w, 1e-5)
            got = add_rms_norm_triton(deferred, residual, norm_w, 1e-5)
            assert_equal(got[0], want[0], f"normed {tile}")
            assert_equal(got[1], want[1], f"residual {tile}")
            if n % 2 == 0:  # as a [rows, 2I] gate/up product
                assert_equal(silu_mul_triton(deferred), silu_mul_triton(summed), f"silu {tile}")


def test_total_triton_equals_the_reference(device, gen):
    """Padded partials (R > rows), a bias, several slice counts: the same bits as the torch sum."""
    for slices, bias in ((2, False), (3, True), (8, True)):
        partials = torch.randn(slices, 37, 200, generator=gen).to(device)
        b = torch.randn(200, generator=gen).to(device) if bias else None
        x = SplitSum(partials, 29, b, torch.float32)
        assert_equal(x.total(), run_triton(device, total_triton, x), f"{slices} slices")


def test_linear_dispatches_float32_rows_to_the_table(device, gen, monkeypatch, tmp_path):
    """``linear`` runs the tile where the table has a rule (17-512 float32 rows), F.linear
    elsewhere; ``defer`` picks the rule's deferred tile."""
    n, k = SHAPES[0]
    summed, deferred = T(32, 64, 32, 4, 3, 1), T(64, 64, 32, 4, 3, 2)
    rule = tile_tables.TileRule((tiled.MIN_M, tiled.MAX_M), (n, n), (k, k), summed, deferred)
    path = tmp_path / "table.json"  # the device's skinny rules, this one tiled rule
    own = tile_tables.tables_for(torch.device(device))
    tile_tables.write_tables(path, dataclasses.replace(own, tiled_float32=(rule,)))
    monkeypatch.setenv(tile_tables.ENV_VAR, str(path))
    monkeypatch.setenv("PHASEGRAPH_KERNELS", "triton")  # CPU tensors too, in the interpreter
    launched = []
    real = tiled.tiled_linear_triton
    monkeypatch.setattr(lin, "tiled_linear_triton",
                        lambda *a, config, **kw: launched.append(config) or real(*a, config=config, **kw))
    x, w, _, want = _inputs(gen, device, ROWS[0], n, k, False)
    got = lin.linear(x, w)
    assert launched == [summed] and _max_rel_err(got, want) <= 5e-6
    assert isinstance(lin.linear(x, w, defer=True), SplitSum) and launched[-1] == deferred
    launched.clear()
    lin.linear(x[:16], w)  # the skinny kernel's rows
    lin.linear(x.to(torch.bfloat16), w.to(torch.bfloat16))  # not float32
    lin.linear(x, torch.randn(n + 1, k, generator=gen).to(device))  # no rule for this N
    assert launched == []


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_graph_replay_equals_eager(device, gen):
    n, k = SHAPES[0]
    x, w, b, _ = _inputs(gen, device, 128, n, k, True)
    tiles = [T(64, 64, 32, 4, 3, 1), T(64, 32, 32, 4, 3, 4)]

    def step():
        y = [tiled.tiled_linear_triton(x, w, b, config=t) for t in tiles]
        return [*y, tiled.tiled_linear_triton(y[0][:, :k].contiguous(), w, config=tiles[1])]

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        x.copy_(torch.randn(128, k, generator=gen))
        graph.replay()
        for got, want in zip(captured, step(), strict=True):
            assert_equal(want, got, "replay")
