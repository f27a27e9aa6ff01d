"""Is GPU training reproducible? Train the bench pair's recipe (shortened) several times and
compare the saved weights byte for byte, under strict or warn-only deterministic mode.

    python benchmarks/train_repro.py --out DIR [--runs 2] [--warn-only] [--set key=value ...]

Writes ``DIR/train_repro.json``: each run's SHA-256 of each model's weights (the digests
``phasegraph bench`` reports), whether every run matches the first, and each stage's steps,
wall time and tokens/s (the cost of strict determinism).
The default ``--set`` list shortens every stage to a few dozen steps; later ``--set`` win.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from pathlib import Path
from unittest import mock

SHORT = [
    "eval.max_prompts=0",
    "target_train.steps=60", "target_train.warmup_steps=10", "target_train.eval_every=30",
    "head.selfgen_seqs=64", "head.selfgen_batch=64",
    "head_train.steps=40", "head_train.warmup_steps=10", "head_train.eval_every=20",
    "draft_train.steps=40", "draft_train.warmup_steps=10", "draft_train.eval_every=20",
]


def stage_speed(report: dict) -> dict[str, dict]:
    speed = {}
    for key, value in report.items():
        train = value.get("train") if isinstance(value, dict) else None
        if isinstance(train, dict) and "tokens_per_s" in train:
            speed[key] = {k: train.get(k) for k in ("steps", "wall_s", "tokens_per_s", "stopped_early")}
    return speed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--warn-only", action="store_true",
                    help="deterministic mode as before 2026-11-26: warn, don't raise, on nondeterministic ops")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--keep", action="store_true", help="keep the trained pairs under --out")
    args = ap.parse_args(argv)

    import torch

    from phasegraph.bench.common import pair_weight_digests
    from phasegraph.train import loop, recipe
    from phasegraph.train.presets import PRESETS, apply_overrides

    preset = apply_overrides(PRESETS["bench-pair"], [*SHORT, *args.set])
    mode = functools.partial(loop.deterministic_mode, warn_only=args.warn_only)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(args.runs):
        pair = args.out / f"run{i}"
        shutil.rmtree(pair, ignore_errors=True)
        with mock.patch.object(recipe, "deterministic_mode", mode):
            report = recipe.run_recipe(preset, pair, progress=False, log=lambda s: None)
        runs.append({"hashes": pair_weight_digests(pair), "stages": stage_speed(report)})
        print(f"run {i}: {json.dumps(runs[-1]['stages'])}", flush=True)
        if not args.keep:
            shutil.rmtree(pair)
    same = [r["hashes"] == runs[0]["hashes"] for r in runs]
    differing = sorted({k for r in runs for k, v in r["hashes"].items() if runs[0]["hashes"].get(k) != v})
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "warn_only": args.warn_only,
        "overrides": [*SHORT, *args.set],
        "runs": runs,
        "identical_to_run0": same,
        "differing_models": differing,
    }
    (args.out / "train_repro.json").write_text(json.dumps(result, indent=1))
    print(f"{'warn-only' if args.warn_only else 'strict'}: {args.runs} runs, weights identical to run 0: "
          f"{same}; differing models: {differing or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
