"""``python -m phasegraph.train {demo-pair,bench-pair,tiny} --out DIR [options]``."""

from __future__ import annotations

import os

# cuBLAS reads this when it creates its first handle: set it before torch touches CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from phasegraph.train.presets import (  # noqa: E402
    PRESETS,
    apply_overrides,
    head_param_count,
    lm_param_count,
    mib,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m phasegraph.train",
        description="Train a target + EAGLE-3 head (+ standalone draft) on the stdlib sources.",
    )
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--out", type=Path, help="output directory (required unless --plan)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when available")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-clock safety: stages stop early (recorded) to fit it")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a preset field, e.g. --set target_train.steps=500")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--overwrite", action="store_true",
                   help="train into a non-empty --out (its target/, eagle3/, draft/ are replaced)")
    p.add_argument("--plan", action="store_true",
                   help="print sizes and the projected H100 time, then exit")
    return p


def _plan(preset) -> str:
    from phasegraph.train.recipe import _format_projection, project

    v = preset.vocab_size
    t = lm_param_count(preset.target, v)
    h = head_param_count(preset.head, preset.target, v)
    lines = [
        f"target {t / 1e6:.2f}M params = {mib(2 * t):.2f} MiB bf16; "
        f"eagle3 head {h / 1e6:.2f}M params = {mib(2 * h):.2f} MiB bf16",
    ]
    if preset.draft is not None:
        d = lm_param_count(preset.draft, v)
        lines.append(f"standalone draft {d / 1e6:.2f}M params = {mib(2 * d):.2f} MiB bf16")
    lines.append(_format_projection(preset, project(preset)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    preset = apply_overrides(PRESETS[args.preset], args.overrides)
    if args.plan:
        print(_plan(preset))
        return 0
    if args.out is None:
        _parser().error("--out is required")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from phasegraph.train.recipe import run_recipe

    try:
        run_recipe(
            preset, args.out, seed=args.seed, device=args.device, time_budget_s=args.time_budget_s,
            progress=not args.no_progress, overwrite=args.overwrite,
        )
    except FileExistsError as exc:
        _parser().error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
