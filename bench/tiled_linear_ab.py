"""A/B of the three-pass TF32 tiles for float32 products of 17-512 rows
(``phasegraph.kernels.tiled_linear.FP32_TILE_CONFIGS``) against cuBLAS (the table emptied), on
whole steps of the bench pair (random weights, SIMULATED acceptance), variants interleaved round
by round. The tiles give other bits than cuBLAS (both within float32 error), so this measures
time only; the bench's identity check covers the outputs.

    python bench/tiled_linear_ab.py [--out DIR] [--batches 1 8 32] [--rounds 2]

GPU only. Prints and writes ``tiled_linear_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_ab import interleaved_step_times, summary  # noqa: E402

from phasegraph.kernels import tiled_linear  # noqa: E402

SHIPPED = tiled_linear.FP32_TILE_CONFIGS


def use_tiles(table: tuple) -> None:
    tiled_linear.FP32_TILE_CONFIGS = table


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--configs", nargs="+", default=["baseline", "chain", "tree"])
    ap.add_argument("--rounds", type=int, default=2, help="rounds, variants interleaved (default 2)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = {"cuBLAS": lambda: use_tiles(()), "tiles": lambda: use_tiles(SHIPPED)}
    try:
        rows = interleaved_step_times(variants, args.batches, args.configs, args.rounds)
    finally:
        use_tiles(SHIPPED)
    lines = summary(rows, "cuBLAS")
    print("\n".join(lines))
    (out / "tiled_linear_ab.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "rows": rows, "summary": lines}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
