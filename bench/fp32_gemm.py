"""Experiment: float32 products of 17-512 rows as a tiled three-pass TF32 ``tl.dot``, against
cuBLAS (``F.linear``), at the bench pair's shapes.

Why: above 16 rows ``phasegraph.kernels.linear`` hands float32 products to ``F.linear``, and
with TF32 off (the exactness path) cuBLAS runs FFMA kernels. At batch 8 the tree's verify
(128 rows) spends ~1050 µs of a 2.46 ms iteration in them (bench/RESULTS.md §5, "Attention
programs that return at once"). ``input_precision="tf32x3"`` (hi*hi + hi*lo + lo*hi on tensor
cores) keeps float32-level error, as the 2-16-row table's tf32x3 tiles do. This script is the
sweep that decides whether and where ``linear.py`` should take such a tile: per shape and row
count, the best tile's time against cuBLAS's and its error against float64. Not wired into the
library.

The kernel: one program per ``BLOCK_M x BLOCK_N`` output tile and K slice (``SPLIT_K`` slices,
partials summed in slice order by ``torch.sum`` over a fixed shape, so the result is
deterministic); the row-block index varies fastest, so the programs that share a weight tile
run together and read it from L2.

    python bench/fp32_gemm.py [--out DIR] [--ms 32,64,128,256,512] [--quick]     # GPU
    PHASEGRAPH_TRITON_INTERPRET=1 python bench/fp32_gemm.py --check               # any machine:
        the kernel against float64 under Triton's interpreter, small shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

if os.environ.get("PHASEGRAPH_TRITON_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter fix the GPU tests use
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.gpu.conftest import _fix_interpreter_scalar_index

    _fix_interpreter_scalar_index()

# (name, N, K) of the bench pair (hidden 768, qkv 1280, MLP 2560, vocabulary 8192) and its EAGLE-3
# head (fc 768 x 2304, qkv 1280 x 1536)
SHAPES = [("qkv", 1280, 768), ("o", 768, 768), ("gate_up", 5120, 768), ("down", 768, 2560),
          ("lm_head", 8192, 768), ("head_fc", 768, 2304), ("head_qkv", 1280, 1536)]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)
TILES = [(bm, bn, 32, 4, 3, s) for bm, bn, s in itertools.product((32, 64), (32, 64, 128), (1, 2, 4))]
QUICK_TILES = [(32, 64, 32, 4, 3, 1), (64, 64, 32, 4, 3, 1), (32, 64, 32, 4, 3, 2), (64, 128, 32, 4, 3, 2)]


@triton.jit
def _tiled_product_kernel(
    x_ptr,  # [M, K] f32
    w_ptr,  # [N, K] f32
    part_ptr,  # [SPLIT_K, M, N] f32
    M, N, K,
    stride_xm, stride_wn, stride_pk, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < k_hi
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BM, BK]
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)  # [BK, BN]
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(part_ptr + pid_k * stride_pk + offs_m[:, None] * stride_pm + offs_n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


def tiled_product(x: torch.Tensor, w: torch.Tensor, tile: tuple, precision: str = "tf32x3") -> torch.Tensor:
    """``x @ w.T`` (``x`` [M, K], ``w`` [N, K], float32, contiguous) with one tile of ``TILES``."""
    bm, bn, bk, warps, stages, split = tile
    m, k = x.shape
    n = w.shape[0]
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _tiled_product_kernel[grid](
        x, w, part, m, n, k, x.stride(0), w.stride(0), part.stride(0), part.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, PRECISION=precision,
        num_warps=warps, num_stages=stages,
    )
    return part[0] if split == 1 else part.sum(0)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def check(device: str) -> list[str]:
    """The kernel against float64 on small shapes (every split, ragged M, N and K)."""
    gen = torch.Generator().manual_seed(0)
    lines = []
    precision = "ieee" if os.environ.get("TRITON_INTERPRET") == "1" else "tf32x3"
    for (m, n, k), tile in itertools.product([(17, 40, 72), (33, 96, 160)], QUICK_TILES):
        x = torch.randn(m, k, generator=gen).to(device)
        w = torch.randn(n, k, generator=gen).to(device)
        err = rel_err(tiled_product(x, w, tile, precision), x.double() @ w.double().T)
        lines.append(f"M={m} N={n} K={k} tile={tile}: rel err {err:.2e}")
        if err > 5e-6:
            raise AssertionError(lines[-1])
    return lines


def sweep(ms: list[int], tiles: list[tuple]) -> list[dict]:
    """Per shape and row count: cuBLAS and the best tile, timed as bench_linear.py times the
    skinny products (CUDA-graph replays over enough weight copies that L2 never serves them, as
    in a forward, where each product's weights come from memory)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_linear import time_graph

    torch.backends.cuda.matmul.allow_tf32 = False  # the library's setting: cuBLAS in FFMA
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        copies = max(8, -(-64 * 2**20 // (n * k * 4)) + 1)  # > 64 MB of weights in the rotation
        ws = [torch.randn(n, k, device="cuda", generator=gen) for _ in range(copies)]
        w = ws[0]
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen)
            want = x.double() @ w.double().T
            cublas_us = 1e6 * time_graph(lambda i, x=x, ws=ws: F.linear(x, ws[i]), copies)
            best = None
            for tile in tiles:
                err = rel_err(tiled_product(x, w, tile), want)
                us = 1e6 * time_graph(lambda i, x=x, ws=ws, tile=tile: tiled_product(x, ws[i], tile), copies)
                if best is None or us < best["us"]:
                    best = {"tile": tile, "us": us, "rel_err": err}
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_us": cublas_us,
                   "cublas_rel_err": rel_err(F.linear(x, w), want), **{f"best_{key}": v for key, v in best.items()}}
            rows.append(row)
            print(f"{name:<9} M={m:>4}: cuBLAS {cublas_us:7.1f} us (err {row['cublas_rel_err']:.1e}); "
                  f"tf32x3 {best['us']:7.1f} us (err {best['rel_err']:.1e}) tile {best['tile']}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--ms", default="32,64,128,256,512")
    ap.add_argument("--quick", action="store_true", help="four tiles instead of eighteen")
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
    rows = sweep([int(m) for m in args.ms.split(",")], QUICK_TILES if args.quick else TILES)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp32_gemm.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
