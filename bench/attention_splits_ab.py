"""A/B of the float32 attention split rule on whole steps of the bench pair (random weights,
SIMULATED acceptance): the shipped rule (one program per chunk of positions while the runs alone
leave SMs idle) against rules that keep one program per run once ``runs * chunks`` passes a
multiple of the SM count. Every rule gives the same bits (``attention.auto_splits``: float32
chunks fold in order whoever folds them), so only time moves.

    python bench/attention_splits_ab.py [--out DIR] [--batches 1 8 32] [--limits 0 2 4 8]

``--limits 0`` is the shipped rule; L > 0 splits only while ``runs * chunks <= L * SMs``. GPU only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_ab import add_step_arguments, run_and_write  # noqa: E402

from phasegraph.kernels import attention, rope_attention  # noqa: E402
from phasegraph.kernels._dispatch import cdiv, num_sms  # noqa: E402

SHIPPED = attention.auto_splits


def capped_rule(limit: int):
    """``auto_splits`` with float32 chunk splits only while ``runs * chunks <= limit * SMs``."""

    def auto_splits(positions, block_n, chunk, runs, device):
        if chunk:
            chunks = cdiv(positions, chunk)
            return chunks if runs < num_sms(device) and runs * chunks <= limit * num_sms(device) else 1
        return SHIPPED(positions, block_n, chunk, runs, device)

    return auto_splits


def use_rule(limit: int) -> None:
    rule = SHIPPED if limit == 0 else capped_rule(limit)
    attention.auto_splits = rule
    rope_attention.auto_splits = rule


def main() -> int:
    ap = argparse.ArgumentParser()
    add_step_arguments(ap)
    ap.add_argument("--limits", type=int, nargs="+", default=[0, 2, 4, 8])
    args = ap.parse_args()
    variants = {f"limit {limit}": (lambda limit=limit: use_rule(limit)) for limit in args.limits}
    return run_and_write(variants, lambda: use_rule(0), args, f"limit {args.limits[0]}",
                         "attention_splits_ab")


if __name__ == "__main__":
    sys.exit(main())
