"""Experiment: the float32 attention chunk length (``attention._FP32_CHUNK``, positions per split
program) on whole steps of the bench pair (random weights, SIMULATED acceptance), variants
interleaved. A longer chunk means fewer programs per run, each attending more positions; the
bits change with it (the combine kernel folds chunks), so this measures time only, to learn
whether the programs' fixed cost (tree-node writes, query load and rotation, partial stores)
or their number bounds the tree attention at batch 8 and 32. ``--warps`` adds variants with the
shipped chunk and the verify's tree kernel at other warps per program
(``rope_attention.TREE_NUM_WARPS``); ``--maxnreg`` variants with its registers per thread capped
(``rope_attention.TREE_MAXNREG``: 224 uncapped, so two programs per multiprocessor).

    python bench/attention_chunk_ab.py [--out DIR] [--chunks 32 64 128] [--warps 2 8] [--maxnreg 128 96] [--batches 1 8 32]

GPU only. Prints and writes ``attention_chunk_ab.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_ab  # noqa: E402
from step_ab import add_step_arguments, run_and_write  # noqa: E402

from phasegraph.kernels import attention, rope_attention  # noqa: E402

SHIPPED = attention._FP32_CHUNK
SHIPPED_WARPS = rope_attention.TREE_NUM_WARPS
SHIPPED_MAXNREG = rope_attention.TREE_MAXNREG
SHIPPED_CONTEXT = step_ab.ENGINE_KW["max_context"]


def use(chunk: int, warps: int, maxnreg: int | None = SHIPPED_MAXNREG, context: int = SHIPPED_CONTEXT) -> None:
    attention._FP32_CHUNK = chunk
    rope_attention.TREE_NUM_WARPS = warps
    rope_attention.TREE_MAXNREG = maxnreg
    step_ab.ENGINE_KW["max_context"] = context


def main() -> int:
    ap = argparse.ArgumentParser()
    add_step_arguments(ap, rounds=1)
    ap.add_argument("--chunks", type=int, nargs="+", default=[SHIPPED, 64, 128])
    ap.add_argument("--warps", type=int, nargs="*", default=[2, 8],
                    help="also the shipped chunk with the verify kernel at these warps per program")
    ap.add_argument("--maxnreg", type=int, nargs="*", default=[],
                    help="also the shipped chunk and warps with the verify kernel's registers per thread "
                         "capped at these (rope_attention.TREE_MAXNREG; the bits stay)")
    ap.add_argument("--max-contexts", type=int, nargs="*", default=[],
                    help=f"also engines whose max_context is each of these (default {SHIPPED_CONTEXT}): the page "
                         "table, and so every attention grid's chunk axis, spans max_context positions; the "
                         "timed requests reach 256 + 448 tokens")
    args = ap.parse_args()
    variants = {f"chunk {c}": (lambda c=c: use(c, SHIPPED_WARPS)) for c in args.chunks}
    variants.update({f"warps {w}": (lambda w=w: use(SHIPPED, w)) for w in args.warps})
    variants.update({f"maxnreg {r}": (lambda r=r: use(SHIPPED, SHIPPED_WARPS, r)) for r in args.maxnreg})
    variants.update({f"context {c}": (lambda c=c: use(SHIPPED, SHIPPED_WARPS, context=c)) for c in args.max_contexts})
    return run_and_write(variants, lambda: use(SHIPPED, SHIPPED_WARPS), args, f"chunk {args.chunks[0]}",
                         "attention_chunk_ab")


if __name__ == "__main__":
    sys.exit(main())
