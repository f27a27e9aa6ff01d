"""Experiment: the float32 attention chunk length (``attention._FP32_CHUNK``, positions per split
program) on whole steps of the bench pair (random weights, SIMULATED acceptance), variants
interleaved. A longer chunk means fewer programs per run, each attending more positions; the
bits change with it (the combine kernel folds chunks), so this measures time only, to learn
whether the programs' fixed cost (tree-node writes, query load and rotation, partial stores)
or their number bounds the tree attention at batch 8 and 32. ``--warps`` adds variants with the
shipped chunk and the verify's tree kernel at other warps per program
(``rope_attention.TREE_NUM_WARPS``).

    python bench/attention_chunk_ab.py [--out DIR] [--chunks 32 64 128] [--warps 2 8] [--batches 1 8 32]

GPU only. Prints and writes ``attention_chunk_ab.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_ab import add_step_arguments, run_and_write  # noqa: E402

from phasegraph.kernels import attention, rope_attention  # noqa: E402

SHIPPED = attention._FP32_CHUNK
SHIPPED_WARPS = rope_attention.TREE_NUM_WARPS


def use(chunk: int, warps: int) -> None:
    attention._FP32_CHUNK = chunk
    rope_attention.TREE_NUM_WARPS = warps


def main() -> int:
    ap = argparse.ArgumentParser()
    add_step_arguments(ap, rounds=1)
    ap.add_argument("--chunks", type=int, nargs="+", default=[SHIPPED, 64, 128])
    ap.add_argument("--warps", type=int, nargs="*", default=[2, 8],
                    help="also the shipped chunk with the verify kernel at these warps per program")
    args = ap.parse_args()
    variants = {f"chunk {c}": (lambda c=c: use(c, SHIPPED_WARPS)) for c in args.chunks}
    variants.update({f"warps {w}": (lambda w=w: use(SHIPPED, w)) for w in args.warps})
    return run_and_write(variants, lambda: use(SHIPPED, SHIPPED_WARPS), args, f"chunk {args.chunks[0]}",
                         "attention_chunk_ab")


if __name__ == "__main__":
    sys.exit(main())
