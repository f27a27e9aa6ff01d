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
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_ab import interleaved_step_times, summary  # noqa: E402

from phasegraph.kernels import attention, rope_attention  # noqa: E402

SHIPPED = attention._FP32_CHUNK
SHIPPED_WARPS = rope_attention.TREE_NUM_WARPS


def use(chunk: int, warps: int) -> None:
    attention._FP32_CHUNK = chunk
    rope_attention.TREE_NUM_WARPS = warps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--chunks", type=int, nargs="+", default=[SHIPPED, 64, 128])
    ap.add_argument("--warps", type=int, nargs="*", default=[2, 8],
                    help="also the shipped chunk with the verify kernel at these warps per program")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--configs", nargs="+", default=["baseline", "chain", "tree"])
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = {f"chunk {c}": (lambda c=c: use(c, SHIPPED_WARPS)) for c in args.chunks}
    variants.update({f"warps {w}": (lambda w=w: use(SHIPPED, w)) for w in args.warps})
    try:
        rows = interleaved_step_times(variants, args.batches, args.configs, args.rounds)
    finally:
        use(SHIPPED, SHIPPED_WARPS)
    lines = summary(rows, f"chunk {args.chunks[0]}")
    print("\n".join(lines))
    (out / "attention_chunk_ab.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "rows": rows, "summary": lines}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
