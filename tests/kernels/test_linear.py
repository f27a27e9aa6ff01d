"""phasegraph.kernels.linear on the CPU: the references are the ops they replace, the public
names dispatch to those exact ops off CUDA (float32 products of 2..16 rows on the CPU to the same
product transposed), bad shapes fail with a clear message, and the config table answers every
row count it is asked for.
The Triton kernels themselves are compared in tests/gpu/test_linear_gpu.py (GPU, or the
interpreter with PHASEGRAPH_TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phasegraph.kernels import linear as lin
from phasegraph.kernels import tile_tables
from phasegraph.kernels._dispatch import ENV_VAR
from phasegraph.kernels.activation import silu_mul, silu_mul_reference
from phasegraph.kernels.rms_norm import add_rms_norm, add_rms_norm_reference

DTYPES = (torch.float32, torch.bfloat16)


def _case(dtype, m=5, k=24, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    residual = torch.randn(m, k, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    gate_up = torch.randn(m, 2 * k, generator=g).to(dtype)
    return x, residual, norm_w, w, b, gate_up


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_references_are_the_replaced_ops(dtype, bias):
    x, residual, norm_w, w, b, gate_up = _case(dtype)
    b = b if bias else None
    assert torch.equal(lin.linear_reference(x, w, b), F.linear(x, w, b))
    for res in (residual, None):
        y, summed = lin.add_rms_norm_linear_reference(x, res, norm_w, 1e-6, w, b)
        normed, want_summed = add_rms_norm_reference(x, res, norm_w, 1e-6)
        assert torch.equal(summed, want_summed)
        assert torch.equal(y, F.linear(normed, w, b))
    got = lin.silu_mul_linear_reference(gate_up, w, b)
    assert torch.equal(got, F.linear(silu_mul_reference(gate_up), w, b))


def _cpu_product(x, w, b=None):
    """The op the public names run on the CPU: the transposed product at 2..16 float32 rows."""
    low, high = lin.CPU_SKINNY_ROWS
    if x.dtype == torch.float32 and low <= x.shape[0] <= high:
        return lin.cpu_skinny_linear(x, w, b)
    return F.linear(x, w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 16, 40])
@pytest.mark.parametrize("mode", ["auto", "reference"])
def test_public_names_run_the_replaced_ops_on_cpu(monkeypatch, dtype, rows, mode):
    monkeypatch.setenv(ENV_VAR, mode)
    x, residual, norm_w, w, b, gate_up = _case(dtype, m=rows, seed=rows)
    assert torch.equal(lin.linear(x, w, b), _cpu_product(x, w, b))
    y, summed = lin.add_rms_norm_linear(x, residual, norm_w, 1e-5, w, b)
    normed, want_summed = add_rms_norm(x, residual, norm_w, 1e-5)
    assert torch.equal(summed, want_summed) and torch.equal(y, _cpu_product(normed, w, b))
    y, summed = lin.add_rms_norm_linear(x, None, norm_w, 1e-5, w)
    assert summed is x  # no residual: the sum is x itself, as add_rms_norm returns it
    assert torch.equal(lin.silu_mul_linear(gate_up, w, b), _cpu_product(silu_mul(gate_up), w, b))


@pytest.mark.parametrize("rows", [1, 7])
def test_float32_outputs_of_half_products_are_rounded_once(rows):
    """``out_dtype=float32``: a bfloat16 product (a tensor-parallel rank's partial sums) comes
    back as the float32 product of its operands, not rounded to bfloat16 on the way."""
    x, _, _, w, b, gate_up = _case(torch.bfloat16, m=rows, seed=rows)
    want = F.linear(x.float(), w.float(), b.float())
    for got in (lin.linear(x, w, b, out_dtype=torch.float32), lin.linear_reference(x, w, b, torch.float32)):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not torch.equal(want.to(torch.bfloat16).float(), want), "the case never rounds"
    act = silu_mul_reference(gate_up)
    want = F.linear(act.float(), w.float(), b.float())
    assert torch.equal(lin.silu_mul_linear(gate_up, w, b, out_dtype=torch.float32), want)
    assert torch.equal(lin.linear(x, w, b, out_dtype=torch.bfloat16), F.linear(x, w, b))  # its own dtype: as before


@pytest.mark.parametrize("rows", [2, 4, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_cpu_skinny_product_is_f_linear_transposed(rows, bias):
    x, _, _, w, b, _ = _case(torch.float32, m=rows, k=96, n=40, seed=rows)
    b = b if bias else None
    got = lin.cpu_skinny_linear(x, w, b)
    assert got.shape == (rows, 40) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-6, atol=1e-5)
    assert torch.equal(got, torch.mm(w, x.t()).t() + (0 if b is None else b))


def test_empty_rows():
    x, residual, norm_w, w, b, gate_up = _case(torch.float32, m=0)
    assert lin.linear(x, w, b).shape == (0, 10)
    y, summed = lin.add_rms_norm_linear(x, residual, norm_w, 1e-5, w, b)
    assert y.shape == (0, 10) and summed.shape == (0, 24)
    assert lin.silu_mul_linear(gate_up, w, b).shape == (0, 10)


def test_bad_shapes_fail_with_a_message():
    x, residual, norm_w, w, b, gate_up = _case(torch.float32)
    with pytest.raises(ValueError, match=r"x: expected 2-d tensor"):
        lin.linear(x[0], w)
    with pytest.raises(ValueError, match=r"weight: expected shape \(N, 24\) for x of shape \(5, 24\)"):
        lin.linear(x, w[:, :20])
    with pytest.raises(ValueError, match=r"weight: expected 2-d tensor"):
        lin.linear(x, w[0])
    with pytest.raises(ValueError, match=r"bias: expected shape \(10,\), got \(9,\)"):
        lin.linear(x, w, b[:9])
    with pytest.raises(ValueError, match=r"weight: expected dtype torch.float32"):
        lin.linear(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"bias: expected dtype torch.float32"):
        lin.linear(x, w, b.double())
    with pytest.raises(ValueError, match=r"x: expected a floating-point tensor"):
        lin.linear(x.long(), w)
    with pytest.raises(ValueError, match=r"residual: expected shape \(5, 24\)"):
        lin.add_rms_norm_linear(x, residual[:3], norm_w, 1e-5, w)
    with pytest.raises(ValueError, match=r"residual: expected dtype torch.float32"):
        lin.add_rms_norm_linear(x, residual.double(), norm_w, 1e-5, w)
    with pytest.raises(ValueError, match=r"norm_weight: expected shape \(24,\)"):
        lin.add_rms_norm_linear(x, residual, norm_w[:5], 1e-5, w)
    with pytest.raises(ValueError, match=r"weight: expected shape \(N, 24\)"):
        lin.add_rms_norm_linear(x, residual, norm_w, 1e-5, w.t())
    with pytest.raises(ValueError, match=r"gate_up: expected an even last dimension"):
        lin.silu_mul_linear(gate_up[:, :5], w)
    with pytest.raises(ValueError, match=r"weight: expected shape \(N, 24\) for gate_up of shape \(5, 48\)"):
        lin.silu_mul_linear(gate_up, w[:, :12])
    for ref in (lin.linear_reference, lin.linear_triton):
        with pytest.raises(ValueError, match="weight: expected shape"):
            ref(x, w[:, :3])


def test_triton_wrappers_refuse_what_the_kernel_cannot_take():
    """Checked on the host before any launch (so these run without a GPU or the interpreter)."""
    x, residual, norm_w, w, b, gate_up = _case(torch.bfloat16, m=lin.MAX_M + 1)
    with pytest.raises(ValueError, match=f"at most {lin.MAX_M} rows, got {lin.MAX_M + 1}"):
        lin.linear_triton(x, w, b)
    with pytest.raises(ValueError, match="x: the Triton product needs unit stride"):
        lin.linear_triton(x[:4, ::2], w[:, :12])
    with pytest.raises(ValueError, match="norm_weight: expected dtype torch.bfloat16"):
        lin.add_rms_norm_linear_triton(x[:4], residual[:4], norm_w.float(), 1e-5, w)


C = lin.SkinnyConfig
GEMV_WHOLE_K = C(1, 4096, 4, 1, dot=False)  # one weight row per program, K at once
DOT = C(32, 256, 4, 4, dot=True)
DOT_WIDE = C(64, 256, 4, 3, dot=True, swap=True)  # wgmma, W as the left operand
H100_FILE = str(tile_tables.shipped_file("NVIDIA_H100_80GB_HBM3.json"))


@pytest.fixture
def fresh_tables():
    tile_tables.clear_cache()
    yield
    tile_tables.clear_cache()


def test_an_h200_takes_its_own_tiles_for_the_8b_shapes(monkeypatch, fresh_tables):
    """The GPU's name picks the table: on an H200 the one-row qkv and gate_up products of the 8B
    shape (norm prologue fused) stream two weight rows per program, and at 2..4 rows qkv takes
    the 16-row dot tile, gate_up cuBLAS and down two K slices; every other product keeps the
    H100's tiles; float32 has one table on both; other devices read the generic file."""
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: names[index])
    h200, h100, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    bf = torch.bfloat16
    assert tile_tables.table_file(h200).name == "NVIDIA_H200.json"
    assert tile_tables.table_file(h100).name == "NVIDIA_H100_80GB_HBM3.json"
    assert tile_tables.table_file(cpu).name == tile_tables.GENERIC
    tables = {d: tile_tables.tables_for(d) for d in (h200, h100)}
    assert tables[h200].skinny(torch.float32) == tables[h100].skinny(torch.float32)
    for n in (6144, 28672):
        rule = lin._lookup(1, n, 4096, bf, h200)
        assert rule.config == lin.SkinnyConfig(2, 4096, 4, 1, dot=False) and rule.fused and rule.plain
        assert lin._lookup(1, n, 4096, bf, h100).config == GEMV_WHOLE_K
        assert lin._lookup(1, n, 4096, bf, cpu).config == GEMV_WHOLE_K
    for m in (2, 3, 4):
        qkv, gate_up, down = (lin._lookup(m, n, k, bf, h200)
                              for n, k in [(6144, 4096), (28672, 4096), (4096, 14336)])
        assert qkv.config == DOT and qkv.plain and not qkv.fused
        assert not gate_up.plain and not gate_up.fused  # cuBLAS after the norm kernel
        assert down.config == DOT_WIDE._replace(split_k=2) and down.plain and not down.fused
        assert lin._lookup(m, 6144, 4096, bf, h100).config == DOT_WIDE
        assert lin._lookup(m, 4096, 14336, bf, h100).config.split_k == 1
    for m, n, k in [(1, 4096, 4096), (1, 4096, 14336), (4, 4096, 4096), (5, 6144, 4096),
                    (16, 28672, 4096), (5, 4096, 14336), (1, 128256, 8192), (4, 128256, 4096),
                    (1, 40, 96), (4, 40, 96)]:
        assert lin._lookup(m, n, k, bf, h200) == lin._lookup(m, n, k, bf, h100), (m, n, k)
    h200_rules, h100_rules = tables[h200].skinny(bf), tables[h100].skinny(bf)
    h200_only = [r for r in h200_rules if r not in h100_rules]
    eight_b = {((6144, 6144), (4096, 4096)), ((28672, 28672), (4096, 4096)),
               ((4096, 4096), (14336, 14336))}
    assert len(h200_only) == 5 and all((r.n_range, r.k_range) in eight_b for r in h200_only)
    assert tuple(r for r in h200_rules if r not in h200_only) == h100_rules  # same order


def test_config_table_covers_every_row_count(monkeypatch, fresh_tables):
    monkeypatch.setenv(tile_tables.ENV_VAR, H100_FILE)  # the H100's rules, on any machine
    for m in range(1, lin.MAX_M + 1):
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (40, 96)]:
            cfg = lin.pick_config(m, n, k)
            assert isinstance(cfg, lin.SkinnyConfig)
            assert cfg.dot or m <= 4, (m, n, k, cfg)  # the multiply-sum form takes <= 4 rows
            assert cfg.block_n >= 1 and cfg.block_k >= 16 and cfg.num_warps in (1, 2, 4, 8, 16)
    assert lin._lookup(lin.MAX_M, 40, 96) is not None  # small unknown shapes: a default rule
    # a 128k-vocabulary lm_head: the whole-K multiply-sum at one row, the wgmma tile at 2..4
    # rows, cuBLAS at 5..16 rows and wherever K is longer
    assert lin._lookup(1, 128256, 4096).config == GEMV_WHOLE_K
    assert lin._lookup(4, 128256, 4096).config == DOT_WIDE
    assert lin._lookup(4, 128256, 4096).plain is True
    assert lin._lookup(16, 128256, 4096).plain is False
    assert lin._lookup(1, 128256, 8192).plain is False
    for m in range(1, lin.MAX_M + 1):  # the pair's float32 qkv: multiply-sums up to 4 rows,
        rule = lin._lookup(m, 1280, 768, torch.float32)  # then split-K three-pass TF32
        assert rule.plain and rule.config.dot == (m > 4), (m, rule)
        assert rule.config.split_k == (8 if m > 4 else 1) and rule.fused == (m <= 4)
    for m in range(2, lin.MAX_M + 1):  # float32 lm_head: three-pass TF32 on tensor cores
        rule = lin._lookup(m, 8192, 768, torch.float32)
        assert rule.config.dot and rule.config.precision == "tf32x3" and rule.plain
        assert not rule.fused  # the norm prologue on the dot form was slower
    assert lin._lookup(3, 5120, 768, torch.float32).plain is False  # gate_up, 2..4 rows: cuBLAS
    assert lin._lookup(8, 5120, 768, torch.float32).config.precision == "tf32x3"
    assert lin._lookup(8, 768, 2560, torch.float32).config.split_k == 8  # the pair's down
    # shapes outside the pair's keep the general rules
    assert lin._lookup(8, 1024, 768, torch.float32).config == lin._FP32_GEMV16
    assert lin._lookup(8, 768, 3072, torch.float32).config == C(4, 256, 8, 2, dot=False)
    assert lin._lookup(8, 4096, 14336, torch.float32) is None  # long K: cuBLAS


@pytest.mark.parametrize("name", ["NVIDIA_H100_80GB_HBM3.json", "NVIDIA_H200.json", tile_tables.GENERIC])
def test_every_shipped_table_keeps_split_k_off_the_fused_forms(name):
    tables = tile_tables.read_tables(tile_tables.shipped_file(name))
    for rule in tables.skinny_float32:  # half-precision tiles never leak into the float32 table
        assert rule.config.precision in ("ieee", "tf32x3")
    for rule in tables.skinny_half + tables.skinny_float32:  # split-K takes plain products only
        assert rule.config.split_k >= 1 and not (rule.config.split_k > 1 and rule.fused), rule


# ------------------------------------------------------------------------------------------
# Early weights: which launches load their weight tile before the PDL wait

MIB = 1 << 20


@pytest.mark.parametrize(("one_tile", "static", "nbytes", "pdl", "mode", "expected"), [
    (True, True, 25 * MIB, True, None, True),  # the bench pair's lm_head, the default
    (True, True, 32 * MIB, True, "auto", True),
    (True, True, 33 * MIB, True, "auto", False),  # the 8B shape's smallest product
    (True, True, 33 * MIB, True, "on", True),
    (True, True, 1 * MIB, True, "off", False),
    (True, False, 1 * MIB, True, "on", False),  # a weight some kernel may write: never
    (False, True, 1 * MIB, True, "on", False),  # a K loop: the first tile early lost
    (True, True, 1 * MIB, False, "on", False),  # a plain launch has nothing to overlap
])
def test_early_weight_load_rule(monkeypatch, one_tile, static, nbytes, pdl, mode, expected):
    if mode is None:
        monkeypatch.delenv("PHASEGRAPH_EARLY_WEIGHTS", raising=False)
    else:
        monkeypatch.setenv("PHASEGRAPH_EARLY_WEIGHTS", mode)
    assert lin.early_weight_load(one_tile, static, nbytes, pdl) is expected


def test_an_unknown_early_weights_setting_is_named(monkeypatch):
    monkeypatch.setenv("PHASEGRAPH_EARLY_WEIGHTS", "always")
    with pytest.raises(ValueError, match=r"PHASEGRAPH_EARLY_WEIGHTS='always': expected one of "
                                         r"auto, on, off"):
        lin.early_weight_load(True, True, MIB, True)


def test_the_models_promise_static_weights():
    """Every skinny product a model runs passes ``static_weight=True``: its weights are
    parameters no kernel writes, so its one-tile products may load them early."""
    import ast
    import inspect

    from phasegraph.runtime.models import eagle3, fused_decoder, target

    products = ("linear", "add_rms_norm_linear", "silu_mul_linear")
    for module in (eagle3, fused_decoder, target):
        calls = [node for node in ast.walk(ast.parse(inspect.getsource(module)))
                 if isinstance(node, ast.Call) and ast.unparse(node.func) in products]
        assert calls, module.__name__
        for call in calls:
            keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
            assert keywords.get("static_weight") == "True", \
                f"{module.__name__}: {ast.unparse(call)}"
