"""The skinny Triton products (linear, add_rms_norm_linear, silu_mul_linear) against their torch
references, on fresh random inputs and poisoned allocations, with no host sync on CUDA.

Products: within 1e-2 relative error of the reference in bf16 (2e-3 in fp16; the kernel sums in
another order than cuBLAS); the prologue's ``summed`` output is one rounded add and must be
equal. Every launch config the table may pick (and the sweep of benchmarks/bench_linear.py tries)
must compute the same function, so the tests run several. On the GPU a graph replay must equal
the eager call bit for bit (no atomics, no split-K). Same modes as test_triton_kernels.py (GPU
with ``-m gpu``; CPU through the interpreter with ``PHASEGRAPH_TRITON_INTERPRET=1``, tiny shapes).
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels import _dispatch, tile_tables
from phasegraph.kernels import linear as lin
from tests.gpu.test_triton_kernels import INTERPRET, ON_GPU, assert_equal, rel_err, run_triton

pytestmark = [] if INTERPRET else [pytest.mark.gpu]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.bfloat16,)
ROWS = (1, 7, 16)
C = lin.SkinnyConfig
# (N, K): an 8B qkv shape and a ragged one on the GPU; tiny in the interpreter
SHAPES = [(6144, 4096), (200, 312)] if ON_GPU else [(40, 96)]
CONFIGS = [None, C(32, 128, 4, 3, True), C(64, 64, 4, 2, True, True)]
if ON_GPU:  # + a wide wgmma tile, and programmatic dependent launch
    CONFIGS += [C(128, 128, 8, 3, True, True), C(32, 128, 4, 3, True, pdl=True)]
GEMV_CONFIGS = [C(8, 64, 4, 1, False), C(4, 512, 4, 1, False)]  # M <= 4
GEMV16_CONFIGS = [C(8, 64, 4, 1, False), C(4, 128, 4, 3, False)]  # M <= 16: [16, N, K] sums


def _configs(m: int):
    if m > 4:
        return CONFIGS + GEMV16_CONFIGS
    # K in one tile; two weight rows per program: the H200's 8B qkv and gate_up (its table)
    whole_k = [C(4, 4096, 4, 1, False), C(2, 4096, 4, 1, False)] if m == 1 and ON_GPU else []
    return CONFIGS + GEMV_CONFIGS + whole_k


def _ids(cfg):
    return "table" if cfg is None else "-".join(
        v if isinstance(v, str) else str(int(v)) for v in cfg)


def _close(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (name, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{name}: non-finite (unwritten) elements"
    err = rel_err(out.float(), ref.float())
    assert err <= TOL[ref.dtype], f"{name}: relative error {err:.2e}"


def _inputs(gen, device, dtype, m, n, k, bias):
    x = torch.randn(m, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS + ((3,) if ON_GPU else ()))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear(device, gen, dtype, rows, shape):
    n, k = shape
    for cfg in _configs(rows) if dtype == torch.bfloat16 else [None]:
        for bias in (False, True) if cfg is None else (False,):
            x, w, b = _inputs(gen, device, dtype, rows, n, k, bias)
            got = run_triton(device, lin.linear_triton, x, w, b, config=cfg)
            _close(got, lin.linear_reference(x, w, b), f"linear {_ids(cfg)} bias={bias}")


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_float32_outputs_keep_the_sums_unrounded(device, gen, rows):
    """``out_dtype=float32`` (a tensor-parallel rank's partial sums): linear and silu_mul_linear of
    bfloat16 operands, one config per form and the H200's split-K down rule, come back in
    float32 within float32 rounding of the float64 product, far closer than a bfloat16 output."""
    n, k = (768, 2560) if ON_GPU else (64, 520)
    configs = [None, C(32, 128, 4, 3, True), C(8, 64, 4, 1, False)] + ([H200_DOWN_4ROWS] if rows <= 4 else [])
    for cfg in configs:
        x, w, b = _inputs(gen, device, torch.bfloat16, rows, n, k, True)
        want = lin.linear_reference(x.double(), w.double(), b.double())
        got = run_triton(device, lin.linear_triton, x, w, b, config=cfg, out_dtype=torch.float32)
        assert got.dtype == torch.float32
        assert rel_err(got.double(), want) < 1e-5, f"linear {_ids(cfg)}: {rel_err(got.double(), want):.1e}"
        gate_up = torch.randn(rows, 2 * k, generator=gen).to(torch.bfloat16).to(device)
        want = lin.silu_mul_linear_reference(gate_up, w, b, out_dtype=torch.float32)
        got = run_triton(device, lin.silu_mul_linear_triton, gate_up, w, b, config=cfg, out_dtype=torch.float32)
        assert got.dtype == torch.float32 and rel_err(got, want) < 1e-4, f"silu_mul_linear {_ids(cfg)}"


@pytest.mark.parametrize("rows", [1, 4, 7, 16])
def test_linear_float32_on_both_forms(device, gen, rows):
    """float32: IEEE tl.dot and the multiply-sum form (up to 16 rows) within 1e-6 of float64;
    the three-pass TF32 tl.dot (hi*hi + hi*lo + lo*hi) within 1e-5."""
    n, k = (1280, 768) if ON_GPU else (40, 96)
    configs = [None, C(16, 256, 4, 4, True), C(8, 64, 4, 1, False), C(4, 128, 4, 3, False),
               C(32, 64, 4, 3, True, precision="tf32x3"),
               C(64, 64, 4, 3, True, True, precision="tf32x3")]
    for cfg in configs + ([C(2, 4096, 4, 1, False)] if rows == 1 else []):
        x, w, b = _inputs(gen, device, torch.float32, rows, n, k, bias=cfg is None)
        got = run_triton(device, lin.linear_triton, x, w, b, config=cfg)
        want = lin.linear_reference(x.double(), w.double(), None if b is None else b.double())
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        tol = 1e-5 if cfg is not None and cfg.precision == "tf32x3" else 1e-6
        assert rel_err(got.double(), want) <= tol, (_ids(cfg), rel_err(got.double(), want))


# split-K configs whose slices are one K tile each (every K of these tests): the one-tile form
ONE_TILE_SLICES = [C(32, 128, 4, 1, True, precision="tf32x3", split_k=64),
                   C(8, 64, 4, 1, False, split_k=64)]


def _record_early_decisions(monkeypatch) -> list[tuple[bool, bool]]:
    """Every launch's early-weight decision, in launch order: (its ``one_tile`` argument, whether
    it loads its weights early)."""
    seen, rule = [], lin.early_weight_load

    def recorded(*args):
        seen.append((args[0], rule(*args)))
        return seen[-1][1]

    monkeypatch.setattr(lin, "early_weight_load", recorded)
    return seen


@pytest.mark.parametrize("rows", [1, 4, 7, 16])
def test_split_k_sums_the_slices_in_order(device, gen, monkeypatch, rows):
    """split_k > 1: every slice of K publishes its partial and the last to arrive sums them in
    slice order, so the result is the same function (float32: within 1e-6 of float64; tf32x3
    1e-5), a second launch finds the arrival counters zero again, and on the GPU a graph replay
    equals the eager call bit for bit whatever order the slices arrive in. Slices of one K tile
    each run the one-tile form (no K loop), and slices of several tiles the loop."""
    n, k = (1280, 2560) if ON_GPU else (40, 520)  # 9 tiles of 64: slices of 2-3 tiles
    configs = [C(32, 64, 4, 3, True, precision="tf32x3", split_k=4),
               C(64, 64, 4, 3, True, True, precision="tf32x3", split_k=2),
               C(8, 64, 4, 3, False, split_k=3), *ONE_TILE_SLICES]
    decisions = _record_early_decisions(monkeypatch)
    for cfg in configs:
        x, w, b = _inputs(gen, device, torch.float32, rows, n, k, bias=True)
        want = lin.linear_reference(x.double(), w.double(), b.double())
        first = run_triton(device, lin.linear_triton, x, w, b, config=cfg)
        assert decisions[-1][0] == (cfg in ONE_TILE_SLICES), _ids(cfg)
        assert_equal(first, lin.linear_triton(x, w, b, config=cfg), f"second launch {_ids(cfg)}")
        _check_split_product(first, want, cfg, lin.linear_triton, x, w, b)


def _check_split_product(got, want, cfg, product, *args):
    """A split-K product's result: within float32 error of the float64 ``want`` (tf32x3 1e-5,
    IEEE 1e-6; half dtypes within ``TOL``), the arrival counters left at zero, and on the GPU
    every replay of a graph that captured ``product(*args, config=cfg)`` equal to ``got`` bit for
    bit."""
    tol = TOL.get(got.dtype) or (1e-5 if cfg.precision == "tf32x3" else 1e-6)
    assert rel_err(got.double(), want) <= tol, (_ids(cfg), rel_err(got.double(), want))
    assert int(lin._ARRIVED[got.device].abs().sum()) == 0  # counters left at zero
    if ON_GPU:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = product(*args, config=cfg)
        for _ in range(3):
            graph.replay()
            assert_equal(got, captured, f"replay {_ids(cfg)}")


H200_DOWN_4ROWS = next(  # the only split-K rule of the H200's half-precision table
    r.config for r in tile_tables.read_tables(tile_tables.shipped_file("NVIDIA_H200.json")).skinny_half
    if r.config.split_k > 1)


@pytest.mark.parametrize("rows", [2, 4])
def test_split_k_in_bfloat16_the_h200_four_row_down_rule(device, gen, rows):
    """The H200 table's 8B down product at 2..4 rows: wgmma tiles with W on the left and K in two
    slices of several tiles, float32 partials. Summed by the last slice, it is the product within
    bfloat16's tolerance; the counters go back to zero; on the GPU a graph replay equals the eager
    call bit for bit; deferred, the norm and SwiGLU kernels get the same bits."""
    n, k = (768, 2560) if ON_GPU else (64, 520)  # 10 tiles of 256 (3 in the interpreter): 2 slices
    cfg = H200_DOWN_4ROWS
    for bias in (False, True):
        x, w, b = _inputs(gen, device, torch.bfloat16, rows, n, k, bias)
        got = run_triton(device, lin.linear_triton, x, w, b, config=cfg)
        want = lin.linear_reference(x.double(), w.double(), None if b is None else b.double())
        _check_split_product(got, want, cfg, lin.linear_triton, x, w, b)
        assert_equal(got, lin.linear_triton(x, w, b, config=cfg), "second launch")
        assert _check_deferred_consumers(device, gen, x, w, b, cfg, got).slices == 2


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_split_k_takes_the_silu_prologue(device, gen, rows):
    """silu(gate) * up is elementwise, so each slice of K applies it to its own columns: the
    split-K product with the prologue is the same function as silu_mul then the product (float32
    within 1e-6 of float64, tf32x3 1e-5), and a graph replay equals the eager call bit for bit."""
    n, k = (768, 2560) if ON_GPU else (40, 200)
    configs = [C(32, 64, 4, 3, True, precision="tf32x3", split_k=8),
               C(8, 64, 4, 3, False, split_k=3), *ONE_TILE_SLICES]
    for cfg in configs:
        gate_up = 2 * torch.randn(rows, 2 * k, generator=gen).to(device)
        _, w, b = _inputs(gen, device, torch.float32, rows, n, k, bias=True)
        want = lin.silu_mul_linear_reference(gate_up.double(), w.double(), b.double())
        got = run_triton(device, lin.silu_mul_linear_triton, gate_up, w, b, config=cfg)
        _check_split_product(got, want, cfg, lin.silu_mul_linear_triton, gate_up, w, b)


def test_split_k_refuses_the_norm_prologue(device, gen):
    x, w, _ = _inputs(gen, device, torch.float32, 4, 40, 96, bias=False)
    with pytest.raises(ValueError, match="split_k > 1 takes no norm prologue"):
        lin.add_rms_norm_linear_triton(x, None, torch.ones(96, device=device), 1e-5, w,
                                       config=C(8, 32, 4, 1, False, split_k=2))
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        lin.linear_triton(x, w, config=C(8, 32, 4, 1, False, split_k=0))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_rms_norm_linear(device, gen, rows, with_residual, shape):
    dtype = torch.bfloat16
    n, k = shape
    for cfg in _configs(rows) if with_residual else [None]:
        x, w, b = _inputs(gen, device, dtype, rows, n, k, bias=cfg is None)
        residual = torch.randn(rows, k, generator=gen).to(dtype).to(device) if with_residual else None
        norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(device)
        want_y, want_s = lin.add_rms_norm_linear_reference(x, residual, norm_w, 1e-5, w, b)
        got_y, got_s = run_triton(device, lin.add_rms_norm_linear_triton, x, residual, norm_w,
                                  1e-5, w, b, config=cfg)
        assert_equal(want_s, got_s, f"summed {_ids(cfg)}")  # one rounded add: exact
        _close(got_y, want_y, f"y {_ids(cfg)}")


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", [(4096, 14336), (96, 200)] if ON_GPU else [(24, 80)], ids=str)
def test_silu_mul_linear(device, gen, rows, shape):
    dtype = torch.bfloat16
    n, inner = shape
    for cfg in _configs(rows):
        gate_up = (2 * torch.randn(rows, 2 * inner, generator=gen)).to(dtype).to(device)
        _, w, b = _inputs(gen, device, dtype, rows, n, inner, bias=cfg is None)
        want = lin.silu_mul_linear_reference(gate_up, w, b)
        got = run_triton(device, lin.silu_mul_linear_triton, gate_up, w, b, config=cfg)
        _close(got, want, f"silu_mul_linear {_ids(cfg)}")


def test_dispatch(device, gen, monkeypatch):
    """Triton for few half-precision contiguous rows on CUDA; the replaced ops otherwise."""
    calls = []
    for name in ("linear_triton", "add_rms_norm_linear_triton", "silu_mul_linear_triton"):
        monkeypatch.setattr(lin, name, lambda *a, name=name, **k: calls.append(name))
    w = torch.randn(8, 16, generator=gen).to(device)
    nw = torch.ones(16, device=device)

    def dispatched(x, weight, mode="auto"):
        monkeypatch.setenv(_dispatch.ENV_VAR, mode)
        calls.clear()
        lin.linear(x, weight)
        lin.add_rms_norm_linear(x, None, nw.to(x.dtype), 1e-5, weight)
        gate_up = torch.cat([x, x], dim=1)
        if not x.is_contiguous():
            gate_up = gate_up.t().contiguous().t()
        lin.silu_mul_linear(gate_up, weight)
        return list(calls)

    bf = torch.bfloat16
    x = torch.randn(1, 16, generator=gen).to(device)
    fused = ["linear_triton", "add_rms_norm_linear_triton", "silu_mul_linear_triton"]
    # float32: Triton at 1 row (fused too), at 2..4 rows (fused too, but the wide products of
    # 4096..8191 columns stay with cuBLAS) and 5..16 rows (norm / silu kernel, then Triton);
    # cuBLAS for K > 4096
    assert dispatched(x, w) == (fused if ON_GPU else [])
    assert dispatched(torch.randn(4, 16, generator=gen).to(device), w, "triton") == fused
    wide = torch.randn(4096, 16, generator=gen).to(device)
    assert dispatched(torch.randn(4, 16, generator=gen).to(device), wide, "triton") == []
    assert dispatched(torch.randn(8, 16, generator=gen).to(device), w, "triton") == ["linear_triton"] * 3
    long_k = torch.randn(8, 4097, generator=gen).to(device)
    assert not lin._fits(long_k[:1], long_k, None, False)  # (mode "triton" still set)
    assert lin._fits(long_k[:1, :4096], long_k[:, :4096].contiguous(), None, False)
    assert dispatched(x.to(bf), w.to(bf)) == (fused if ON_GPU else [])
    assert dispatched(x.to(bf), w.to(bf), "reference") == []
    assert dispatched(x.to(bf), w.to(bf), "triton") == fused
    # M > 1: the table keeps the norm / silu kernel, then the Triton product
    x4 = torch.randn(4, 16, generator=gen).to(bf).to(device)
    assert dispatched(x4, w.to(bf), "triton") == ["linear_triton"] * 3
    many = torch.randn(lin.MAX_M + 1, 16, generator=gen).to(bf).to(device)
    assert dispatched(many, w.to(bf), "triton") == []  # too many rows
    strided = torch.randn(16, 4, generator=gen).to(bf).to(device).t()
    assert dispatched(strided, w.to(bf), "triton") == []  # not contiguous


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_graph_replay_equals_eager(device, gen, pdl):
    dtype = torch.bfloat16
    cfg = lin.pick_config(7, 4096, 4096)._replace(pdl=pdl)
    x, w, _ = _inputs(gen, device, dtype, 7, 4096, 4096, False)
    residual = torch.randn(7, 4096, generator=gen).to(dtype).to(device)
    norm_w = (1 + 0.1 * torch.randn(4096, generator=gen)).to(dtype).to(device)
    gate_up = torch.randn(7, 8192, generator=gen).to(dtype).to(device)

    def step():
        y, s = lin.add_rms_norm_linear_triton(x, residual, norm_w, 1e-5, w, config=cfg)
        dependent = lin.linear_triton(y, w, config=cfg)  # reads y: a dependent launch
        return y, s, dependent, lin.silu_mul_linear_triton(gate_up, w, config=cfg)

    eager = step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        x.copy_(torch.randn(7, 4096, generator=gen).to(dtype))
        graph.replay()
        eager = step()
        for a, b in zip(eager, captured, strict=True):
            assert torch.equal(a, b)
        want = lin.add_rms_norm_linear_reference(x, residual, norm_w, 1e-5, w)
        _close(captured[0], want[0], "graph y")
        assert_equal(want[1], captured[1], "graph summed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [5, 16])
def test_deferred_split_k_gives_the_consumers_the_same_bits(device, gen, dtype, rows):
    """``defer=True``: a split-K product hands its slices on unsummed (SplitSum), and the norm and
    SwiGLU kernels that sum them as they load produce exactly the bits of the product summed by
    its own last program (same slice order, bias, rounding); SplitSum.total() equals it too."""
    n, k = (768, 2560) if ON_GPU else (48, 200)
    precision = "tf32x3" if dtype == torch.float32 else "ieee"
    configs = [C(32, 64, 4, 3, True, precision=precision, split_k=8),
               C(8, 64, 4, 3, False, split_k=3)]
    for cfg in configs:
        for bias in (False, True):
            x, w, b = _inputs(gen, device, dtype, rows, n, k, bias)
            summed_here = run_triton(device, lin.linear_triton, x, w, b, config=cfg)
            _check_deferred_consumers(device, gen, x, w, b, cfg, summed_here)
    assert int(lin._ARRIVED[x.device].abs().sum()) == 0


def _check_deferred_consumers(device, gen, x, w, b, cfg, summed_here):
    """``linear_triton(x, w, b, config=cfg, defer=True)`` is a SplitSum of several slices whose
    total, norm (with and without a residual) and SwiGLU (of a [rows, 2n] product) equal those of
    ``summed_here``, the product its last program summed, bit for bit. Returns the SplitSum."""
    from phasegraph.kernels.activation import silu_mul_triton
    from phasegraph.kernels.rms_norm import add_rms_norm_triton
    from phasegraph.kernels.split_sum import SplitSum

    (rows, n), dtype, where = summed_here.shape, summed_here.dtype, f"{_ids(cfg)} bias={b is not None}"
    deferred = lin.linear_triton(x, w, b, config=cfg, defer=True)
    assert isinstance(deferred, SplitSum) and deferred.slices > 1
    assert tuple(deferred.shape) == (rows, n) and deferred.dtype == dtype
    assert_equal(deferred.total(), summed_here, f"total {where}")
    residual = torch.randn(rows, n, generator=gen).to(dtype).to(device)
    norm_w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype).to(device)
    for res in (residual, None):
        want = add_rms_norm_triton(summed_here, res, norm_w, 1e-5)
        got = add_rms_norm_triton(deferred, res, norm_w, 1e-5)
        assert_equal(got[0], want[0], f"normed {where}")
        assert_equal(got[1], want[1], f"summed {where}")
    # SwiGLU of a [rows, 2I] split product
    w2 = torch.cat([w, w.flip(0)])  # [2n, k]
    b2 = None if b is None else torch.cat([b, -b])
    gate_up = run_triton(device, lin.linear_triton, x, w2, b2, config=cfg)
    gate_up_deferred = lin.linear_triton(x, w2, b2, config=cfg, defer=True)
    assert_equal(silu_mul_triton(gate_up_deferred), silu_mul_triton(gate_up), f"silu {where}")
    return deferred


@pytest.mark.gpu
def test_deferred_products_of_a_pair_verify_layer_equal_the_summed_ones(monkeypatch):
    """The float32 table splits K for the bench pair's 16-row verify products; through the public
    dispatchers (o -> norm -> gate_up -> SwiGLU -> down -> norm, as run_fused_decoder runs them)
    the deferred chain equals the one whose products sum their own slices, bit for bit. The
    H100's table, on whatever GPU runs it (a GPU without a file of its own has no split-K rules)."""
    h100 = tile_tables.shipped_file("NVIDIA_H100_80GB_HBM3.json")
    monkeypatch.setenv(tile_tables.ENV_VAR, str(h100))
    from phasegraph.kernels.rms_norm import add_rms_norm
    from phasegraph.kernels.split_sum import SplitSum

    dev, g = torch.device("cuda"), torch.Generator().manual_seed(7)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dev)

    attn, residual = rand(16, 768), rand(16, 768)
    w_o, w_gu, w_down = rand(768, 768, scale=0.03), rand(5120, 768, scale=0.03), rand(768, 2560, scale=0.02)
    norm1, norm2 = 1 + rand(768, scale=0.1), 1 + rand(768, scale=0.1)

    def chain(defer: bool):
        o = lin.linear(attn, w_o, defer=defer)
        gate_up, res = lin.add_rms_norm_linear(o, residual, norm1, 1e-5, w_gu, defer=defer)
        down = lin.silu_mul_linear(gate_up, w_down, defer=defer)
        return (o, gate_up, down), add_rms_norm(down, res, norm2, 1e-5)

    (o, gate_up, down), deferred = chain(True)
    assert all(isinstance(p, SplitSum) for p in (o, gate_up, down))  # the table splits all three
    _, summed = chain(False)
    for got, want, name in zip(deferred, summed, ("normed", "residual"), strict=True):
        assert_equal(want, got, name)


EARLY_CASES = [  # (rows, dtype, config): one-tile products, the forms that load weights early
    (1, torch.float32, C(2, 4096, 4, 1, False)),
    (1, torch.bfloat16, C(1, 4096, 4, 1, False)),
    (4, torch.bfloat16, C(4, 4096, 4, 1, False)),
    (16, torch.float32, ONE_TILE_SLICES[0]),  # split-K, one tile per slice (no norm prologue)
    (5, torch.float32, ONE_TILE_SLICES[1]),
]


@pytest.mark.skipif(not ON_GPU, reason="programmatic dependent launch")
@pytest.mark.parametrize(("rows", "dtype", "cfg"), EARLY_CASES,
                         ids=[f"{r}-{str(d)[6:]}-{_ids(c)}" for r, d, c in EARLY_CASES])
def test_early_weights_give_the_same_bits(device, gen, monkeypatch, rows, dtype, cfg):
    """A one-tile product that loads its static weights before the PDL wait computes the same
    bits as the plain kernel, for all three prologues, eager and as a chain of dependent
    launches (each reading the one before's output), and the early form did run."""
    n, k = 768, 2560
    x, w, _ = _inputs(gen, device, dtype, rows, n, k, False)
    residual = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(device)
    gate_up = torch.randn(rows, 2 * k, generator=gen).to(dtype).to(device)
    w_in = (torch.randn(k, k, generator=gen) / k**0.5).to(dtype).to(device)
    decisions = _record_early_decisions(monkeypatch)

    def products():
        kw = dict(config=cfg, static_weight=True)
        normed = () if cfg.split_k > 1 else (  # split-K takes no norm prologue
            lin.add_rms_norm_linear_triton(x, residual, norm_w, 1e-5, w, **kw)[0],)
        return (lin.linear_triton(x, w, **kw),
                lin.linear_triton(lin.linear_triton(x, w_in, **kw), w, **kw),
                lin.silu_mul_linear_triton(gate_up, w, **kw), *normed)

    monkeypatch.setenv(_dispatch.EARLY_WEIGHTS_ENV_VAR, "off")
    plain = products()
    assert not any(early for _, early in decisions)
    monkeypatch.setenv(_dispatch.EARLY_WEIGHTS_ENV_VAR, "auto")
    early = products()
    torch.cuda.synchronize()
    assert any(early for _, early in decisions), "no launch loaded its weights early"
    for name, a, b in zip(("linear", "chained", "silu_mul", "add_rms_norm")[:len(plain)], plain,
                          early, strict=True):
        assert torch.equal(a, b), f"{name}: early weights changed the bits"
