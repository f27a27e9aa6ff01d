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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_ab import add_step_arguments, run_and_write  # noqa: E402

from phasegraph.kernels import tiled_linear  # noqa: E402

SHIPPED = tiled_linear.FP32_TILE_CONFIGS


def use_tiles(table: tuple) -> None:
    tiled_linear.FP32_TILE_CONFIGS = table


def main() -> int:
    ap = argparse.ArgumentParser()
    add_step_arguments(ap)
    args = ap.parse_args()
    variants = {"cuBLAS": lambda: use_tiles(()), "tiles": lambda: use_tiles(SHIPPED)}
    return run_and_write(variants, lambda: use_tiles(SHIPPED), args, "cuBLAS", "tiled_linear_ab")


if __name__ == "__main__":
    sys.exit(main())
