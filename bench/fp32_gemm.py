"""The sweep behind ``phasegraph.kernels.tiled_linear.FP32_TILE_CONFIGS``: float32 products of
17-512 rows as three-pass TF32 tiles against cuBLAS (``F.linear`` with TF32 off: FFMA kernels),
at the bench pair's shapes.

Per shape and row count it times cuBLAS and every candidate tile of the library's kernel
(``tiled_linear_triton``), summed (a caller that needs the product) and, for the target layer's
``o``, ``gate_up`` and ``down`` products whose next kernel takes a ``SplitSum``, deferred (the
partials handed on unsummed); then it prints the table rules it would pick: per row range, the
tile with the least time summed over the measured row counts of the range, where it beats
cuBLAS at every one of them.

    python bench/fp32_gemm.py [--out DIR] [--ms 32,40,64,128,160,256,512] [--quick]   # GPU
    python bench/fp32_gemm.py --ms 16 --out DIR   # 16-row tiles against the skinny kernel's table
    PHASEGRAPH_TRITON_INTERPRET=1 python bench/fp32_gemm.py --check                 # any machine:
        the kernel against float64 under Triton's interpreter, small shapes, every split
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if os.environ.get("PHASEGRAPH_TRITON_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("PHASEGRAPH_KERNELS", "triton")

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter fix the GPU tests use
    from tests.gpu.conftest import _fix_interpreter_scalar_index

    _fix_interpreter_scalar_index()

from phasegraph.kernels import linear as lin  # noqa: E402
from phasegraph.kernels.split_sum import SplitSum  # noqa: E402
from phasegraph.kernels.tiled_linear import MAX_M, MIN_M, TileConfig, tiled_linear_triton  # noqa: E402

# (name, N, K, deferred): the bench pair's target (hidden 768, qkv 1280, MLP 2560, vocabulary
# 8192; o, gate_up and down feed a norm or SwiGLU that takes a SplitSum) and its EAGLE-3 head
# (fc 768 x 2304, qkv 1280 x 1536)
SHAPES = [("qkv", 1280, 768, False), ("o", 768, 768, True), ("gate_up", 5120, 768, True),
          ("down", 768, 2560, True), ("lm_head", 8192, 768, False), ("head_fc", 768, 2304, False),
          ("head_qkv", 1280, 1536, False)]
_BLOCKS = [(32, 64), (64, 32), (64, 64), (32, 128), (64, 128), (128, 64), (128, 128)]
TILES = [TileConfig(bm, bn, bk, 8 if bm * bn >= 8192 else 4, 3, split)
         for (bm, bn), bk, split in itertools.product(_BLOCKS, (32, 64), (1, 2, 4, 8))]
# 16-row blocks, for --ms 16: the tiles against the skinny kernel's table at its largest row count
TILES_16 = [TileConfig(16, bn, bk, 4, 3, split) for bn, bk, split in itertools.product((32, 64, 128), (32, 64), (1, 2, 4, 8))]
QUICK_TILES = [TileConfig(64, 64, 32, 4, 3, s) for s in (1, 2, 4)] + [TileConfig(64, 128, 32, 8, 3, 1)]
# (first row, last row, row counts timed for it): the rules' row ranges above the skinny kernel's
RANGES = [(17, 32, (32,)), (33, 64, (40, 64)), (65, 128, (128,)), (129, 256, (160, 256)), (257, MAX_M, (512,))]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def check(device: str) -> list[str]:
    """The kernel against float64 on small shapes (every split, ragged M, N and K, a bias), and
    the deferred partials summed by ``SplitSum.total`` equal to the summed product bit for bit."""
    gen = torch.Generator().manual_seed(0)
    lines = []
    tiles = [TileConfig(32, 64, 32, 4, 3, s) for s in (1, 2, 4)] + [TileConfig(64, 32, 64, 4, 2, 2)]
    for (m, n, k), tile, bias in itertools.product([(17, 40, 72), (33, 96, 160)], tiles, (False, True)):
        x = torch.randn(m, k, generator=gen).to(device)
        w = torch.randn(n, k, generator=gen).to(device)
        b = torch.randn(n, generator=gen).to(device) if bias else None
        want = x.double() @ w.double().T + (0 if b is None else b.double())
        got = tiled_linear_triton(x, w, b, config=tile)
        err = rel_err(got, want)
        lines.append(f"M={m} N={n} K={k} tile={tuple(tile)} bias={bias}: rel err {err:.2e}")
        if err > 5e-6:
            raise AssertionError(lines[-1])
        deferred = tiled_linear_triton(x, w, b, config=tile, defer=True)
        if isinstance(deferred, SplitSum) and not torch.equal(deferred.total(), got):
            raise AssertionError(f"{lines[-1]}: the deferred partials sum to other bits")
    return lines


def _time_tile(x, ws, tile, defer, copies, time_graph) -> float | None:
    try:
        return time_graph(lambda i: tiled_linear_triton(x, ws[i], config=tile, defer=defer), copies)
    except Exception as exc:  # noqa: BLE001 - a tile that does not fit this GPU (shared memory)
        if "OutOfResources" in type(exc).__name__ or "out of resource" in str(exc):
            return None
        raise


def sweep(ms: list[int], tiles: list[TileConfig]) -> list[dict]:
    """Per shape and row count: cuBLAS and every tile, summed and (where the model defers)
    deferred, timed as bench_linear.py times the skinny products (CUDA-graph replays over enough
    weight copies that L2 never serves them, as in a forward, where each product's weights come
    from memory)."""
    from bench_linear import time_graph

    torch.backends.cuda.matmul.allow_tf32 = False  # the library's setting: cuBLAS in FFMA
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, k, deferrable in SHAPES:
        copies = max(8, -(-64 * 2**20 // (n * k * 4)) + 1)  # > 64 MB of weights in the rotation
        ws = [torch.randn(n, k, device="cuda", generator=gen) / k**0.5 for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen)
            want = x.double() @ ws[0].double().T
            row = {"shape": name, "n": n, "k": k, "m": m,
                   "cublas_us": 1e6 * time_graph(lambda i, x=x, ws=ws: F.linear(x, ws[i]), copies),
                   "cublas_rel_err": rel_err(F.linear(x, ws[0]), want), "tiles": []}
            if m < MIN_M:  # the skinny kernel's rows: its table's product, summed and deferred
                row["skinny_us"] = 1e6 * time_graph(lambda i, x=x, ws=ws: lin.linear(x, ws[i]), copies)
                row["skinny_deferred_us"] = 1e6 * time_graph(
                    lambda i, x=x, ws=ws, d=deferrable: lin.linear(x, ws[i], defer=d), copies)
            for tile in (t for t in tiles if m >= MIN_M or t.block_m == 16):
                summed = _time_tile(x, ws, tile, False, copies, time_graph)
                if summed is None:
                    continue
                out = tiled_linear_triton(x, ws[0], config=tile)
                deferred = summed
                if deferrable and tile.split_k > 1:
                    deferred = _time_tile(x, ws, tile, True, copies, time_graph)
                    if not torch.equal(tiled_linear_triton(x, ws[0], config=tile, defer=True).total(), out):
                        raise AssertionError(f"{name} M={m} {tile}: deferred partials sum to other bits")
                row["tiles"].append({"tile": list(tile), "summed_us": 1e6 * summed,
                                     "deferred_us": 1e6 * deferred, "rel_err": rel_err(out, want)})
            rows.append(row)
            best = min(row["tiles"], key=lambda t: t["summed_us"])
            best_d = min(row["tiles"], key=lambda t: t["deferred_us"])
            skinny = (f"skinny {row['skinny_us']:6.1f} / deferred {row['skinny_deferred_us']:6.1f}; "
                      if m < MIN_M else "")
            print(f"{name:<9} M={m:>4}: {skinny}cuBLAS {row['cublas_us']:6.1f} us (err {row['cublas_rel_err']:.1e}); "
                  f"tiles summed {best['summed_us']:6.1f} {tuple(best['tile'])} (err {best['rel_err']:.1e}), "
                  f"deferred {best_d['deferred_us']:6.1f} {tuple(best_d['tile'])}", flush=True)
    return rows


def pick_rules(rows: list[dict]) -> list[str]:
    """The table rules the sweep supports above 16 rows, as source lines for FP32_TILE_CONFIGS
    (the 16-row rules are read off a ``--ms 16`` run by hand)."""
    lines = []
    for name, n, k, deferrable in SHAPES:
        for m_lo, m_hi, counts in RANGES:
            timed = [r for r in rows if r["shape"] == name and r["m"] in counts]
            if len(timed) != len(counts):
                continue
            picked = {}
            for form in ("summed", "deferred"):
                totals: dict[tuple, list[float]] = {}
                for r in timed:
                    for t in r["tiles"]:
                        totals.setdefault(tuple(t["tile"]), []).append(t[f"{form}_us"] - r["cublas_us"])
                wins = {tile: sum(d) for tile, d in totals.items() if len(d) == len(timed) and max(d) < 0}
                picked[form] = TileConfig(*min(wins, key=wins.get)) if wins else None
            if not deferrable:
                picked["deferred"] = picked["summed"]
            if picked["summed"] is None and picked["deferred"] is None:
                continue
            tiles = ", ".join("None" if t is None else f"_T{tuple(t)}" for t in (picked["summed"], picked["deferred"]))
            gain = "; ".join(f"{r['m']}: cuBLAS {r['cublas_us']:.1f}" for r in timed)
            lines.append(f"    _r({m_lo}, {m_hi}, {n}, {k}, {tiles}),  # {name}; {gain}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--ms", default="32,40,64,128,160,256,512")
    ap.add_argument("--quick", action="store_true", help=f"{len(QUICK_TILES)} tiles instead of {len(TILES)}")
    ap.add_argument("--check", action="store_true", help="only the correctness check (any device)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    for line in check(device):
        print(line, flush=True)
    if args.check:
        return 0
    if device != "cuda":
        print("the sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    ms = [int(m) for m in args.ms.split(",")]
    if any(not 16 <= m <= MAX_M for m in ms):
        print(f"--ms: row counts must lie in 16..{MAX_M} (16: against the skinny kernel)", file=sys.stderr)
        return 2
    rows = sweep(ms, (QUICK_TILES if args.quick else TILES) + (TILES_16 if 16 in ms else []))
    rules = pick_rules(rows)
    print("\n".join(rules))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp32_gemm.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "rules": rules}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
