"""The ``phasegraph bench`` subcommand: options, their defaults, the time estimate and the run
(what it measures: :mod:`phasegraph.bench`)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path

from phasegraph.bench.common import (
    PAIR_CONFIG_KEYS,
    SCALE_CONFIGS,
    STANDALONE,
    BenchRun,
    check_reused_pair,
    environment,
    free_memory,
    has_pair,
    no_pair_to_skip_to,
    pair_path,
    repeats_at,
    training_preset,
    untrainable_pair_dir,
)
from phasegraph.cli.common import CliError, add_command, require_at_least, require_name

# Training budget of the full run: a cap, not a target. The bench-pair preset trains in ~180 s
# on an H100; 280 s gives every stage ~1.4x its projected share, so none is cut on the clock and
# the pair comes out the same in every run, while a slower GPU gets stages cut short instead of
# a run past 9 minutes. The tiny preset of --quick runs unbudgeted.
DEFAULT_TRAIN_BUDGET_S = 280.0

FULL = {"batches": "1,8,32,64", "new_tokens": 256, "prompt_tokens": 256, "batch1_prompts": 3, "batch1_repeats": 3, "repeats": 3,
        "hf_batch1_prompts": 1,
        "scale_batches": "1,8,32,64", "scale_new_tokens": 256, "scale_prompt_tokens": 128}
QUICK = {"batches": "1,2", "new_tokens": 16, "prompt_tokens": 64, "batch1_prompts": 2, "batch1_repeats": 1, "repeats": 1,
         "hf_batch1_prompts": 1,
         "scale_batches": "1,2",
         "scale_new_tokens": 16, "scale_prompt_tokens": 32}

# Figures the time estimate uses. Measured (H200, 8B shape, graphs on):
# decode step by batch, chain and tree iteration by batch, eager iteration. Assumed (not measured):
# the host cost of a phasegraph step on a small model (the measured host issue of an 8B
# iteration is 1.6-3.1 ms), transformers' eager generate step, first Triton
# compilation and graph capture.
SCALE_STEP_S = {1: 4.94e-3, 8: 5.93e-3, 64: 8.17e-3}
SCALE_ITER_S = {"chain": {1: 6.74e-3, 8: 7.98e-3, 64: 12.34e-3}, "tree": {1: 7.70e-3, 8: 8.86e-3, 64: 31.73e-3}}
SCALE_EAGER_ITER_S = 62.5e-3
TRITON_COMPILE_S = 40.0
# Measured on the 96M pair (H100): one configuration at batches 1, 8 and 32 (engine, first
# compiles, captures, warm-ups, timed calls) takes ~40 s on a fresh machine and ~20 s where the
# kernels compiled while the pair trained; transformers' generate is host bound (20-37 ms per
# token plain, 60-217 ms assisted, whose heuristic drafts up to 20 tokens a round).
SMALL_STEP_S, SMALL_ITER_S, CAPTURE_S, CONFIG_SETUP_S, CONFIG_SETUP_WARM_S = 0.5e-3, 1.2e-3, 0.3, 40.0, 20.0
HF_STEP_S, HF_ASSISTED_STEP_S, TRAIN_ACCEPTANCE_S = 37e-3, 0.2, 30.0
TRAIN_STAGE_SHARE, TRAIN_EVAL_S = 0.9, 12.0
# The real model (SmolLM2-135M-Instruct, 30 layers), assumed: a decode step or an iteration of its
# small layers costs the host ~2 ms; the GGUF conversion of a fresh machine ~20 s
REAL_STEP_S, REAL_CONVERT_S = 2e-3, 20.0


# the kernel warm-up process part 1 starts while its pair trains (phasegraph.bench.warm)
WARM_WORKER = (sys.executable, "-m", "phasegraph.cli.bench_warmup")


def _say(text: str) -> None:
    """A line of the run's progress (above any progress bar) or its closing table, on stdout."""
    from tqdm.auto import tqdm  # here: every command imports this module, and tqdm takes ~0.1 s

    tqdm.write(text)
    sys.stdout.flush()


def _say_error(text: str) -> None:
    """The traceback of an error that cost the run some rows, on stderr."""
    print(text, file=sys.stderr)


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise CliError(f"expected comma-separated integers, got {text!r}") from exc
    if not vals or min(vals) < 1:
        raise CliError(f"expected comma-separated integers >= 1, got {text!r}")
    return vals


def _interp(table: dict[int, float], x: int) -> float:
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    for lo, hi in zip(keys, keys[1:], strict=False):
        if x <= hi:
            return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
    return table[keys[-1]] * x / keys[-1]


def estimate_seconds(run: BenchRun) -> dict[str, float]:
    """Seconds per part, from the figures above (measured 8B figures, assumed host costs)."""
    a = run.args
    est: dict[str, float] = {"startup": 5.0 if a.quick else 15.0}
    if 1 in a.parts_list:
        pair = run.pair_path()
        if not a.trained_pair or has_pair(pair) or a.skip_train:
            train = 0.0
        elif a.quick:
            train = 30.0
        else:
            from phasegraph.train.recipe import project

            preset = training_preset(a)[2]
            # the stages stop at their steps (projected H100 time) or at the budget's cut
            train = min((a.train_budget_s or math.inf) * TRAIN_STAGE_SHARE,
                        sum(p["s"] for p in project(preset).values())) + TRAIN_EVAL_S
            train += TRAIN_ACCEPTANCE_S if preset.eval.max_prompts > 0 else 0.0
        est["part 1: training"] = train
        steps = a.new_tokens
        nb = len(a.batch_list)
        b1 = a.batch1_prompts if 1 in a.batch_list else 1
        # each call: two warm-ups and --repeats timed runs (batch 1: --batch1-repeats)
        runs = sum((b1 if b == 1 else 1) * (2 + repeats_at(run, b)) for b in a.batch_list)
        spec_configs = len(a.pair_config_labels)
        if not a.trained_pair:
            est["part 1: measure"] = 0.0
        elif not a.quick:
            hf_b1 = a.hf_batch1_prompts if 1 in a.batch_list else 1
            calls = sum(hf_b1 if b == 1 else 1 for b in a.batch_list)  # batch 1: one call per prompt
            pg = runs * steps * SMALL_STEP_S  # baseline
            pg += runs * spec_configs * (steps / 2.5) * SMALL_ITER_S  # the drafting rows at tau ~2.5
            warm = train == 0.0 or a.warm_compile
            pg += nb * 3 * spec_configs * CAPTURE_S + (1 + spec_configs) * (CONFIG_SETUP_WARM_S if warm else CONFIG_SETUP_S)
            if a.features:  # baseline and chain, three features, each call three times
                pg += 2 * 3 * runs * (steps / 2) * SMALL_ITER_S + 2 * CONFIG_SETUP_WARM_S
            if a.mixed:  # baseline, chain, tree and adaptive twice, each call three times, at tau ~2
                pg += 5 * 3 * (steps / 2) * SMALL_ITER_S
            hf = 0.0 if a.no_hf else 1.1 * steps * (HF_STEP_S * calls + HF_ASSISTED_STEP_S * hf_b1)
            est["part 1: measure"] = pg + hf + 10.0  # + loading transformers' models
        else:
            est["part 1: measure"] = 30.0
        if a.real_model or (a.real_model is None and not a.quick):  # no standalone draft: one config fewer
            configs = 1 + len([c for c in a.pair_config_labels if c != STANDALONE])
            est["part 1: real model"] = (REAL_CONVERT_S + configs * CONFIG_SETUP_S
                                         + runs * steps * REAL_STEP_S * (1 + (configs - 1) / 2.5))
            if a.features:  # as the trained pair's: baseline and chain, three features, three times each
                est["part 1: real model"] += 2 * 3 * runs * (steps / 2) * REAL_STEP_S + 2 * CONFIG_SETUP_S
    if 2 in a.parts_list:
        if not a.quick:
            n, p = a.scale_new_tokens, a.scale_prompt_tokens
            t = 30.0  # build 16 GB of random weights + the head, bandwidth probe
            for b in a.scale_batch_list:
                prefill = b * p * 2 * 8e9 / 300e12
                calls = 1 + repeats_at(run, b)  # calibrated at one timed run
                t += calls * (n * _interp(SCALE_STEP_S, b) + prefill) + 3 * SCALE_EAGER_ITER_S
                for key in a.scale_config_list:
                    for tau in a.scale_tau_list:
                        iteration = SCALE_ITER_S["chain" if key == "adaptive" else key]
                        t += calls * (math.ceil(n / tau) * _interp(iteration, b) + prefill)
                        t += 3 * 3 * SCALE_EAGER_ITER_S
            t += 10.0 + TRITON_COMPILE_S / 2  # decode-step and per-phase probes; kernels for head dim 128
            if a.features:  # baseline and chain at batch 1: three features, JSON also at the same lengths
                t += 2 * 4 * 3 * (n * SCALE_STEP_S[1] + 1.0)
            est["part 2: scale"] = t
        else:
            est["part 2: scale"] = 15.0
    est["total"] = sum(est.values())
    return est


def _real_model(count: int):
    """Part 1's real model for :func:`~phasegraph.bench.pair.measure_real_model`: the demo's
    SmolLM2-135M-Instruct (converted once; the line saying so prints as the demo's does), its
    embedded head and up to ``count`` held-out HumanEval requests as chat-template token ids."""
    from phasegraph.cli.demo import smollm2_model
    from phasegraph.demo import smollm2_head_dir

    model, _, prompts = smollm2_model(smollm2_head_dir(), count)
    return model["target"], model["head"], prompts


def _real_model_dirs():
    """What ``--serve`` serves by default: the demo's SmolLM2-135M-Instruct (converted once) and
    its embedded head."""
    from phasegraph.demo import smollm2_head_dir, smollm2_target

    return smollm2_target(progress=True), smollm2_head_dir()


def _resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the full or --quick defaults and parse the comma-separated lists."""
    for option, path in (("--out", args.out), ("--pair", args.pair)):
        require_name(option, path, "directory")
    defaults = QUICK if args.quick else FULL
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    args.batch_list = _ints(args.batches)
    for key in ("batch1_repeats", "repeats", "batch1_prompts", "new_tokens", "prompt_tokens", "scale_new_tokens",
                "scale_prompt_tokens", "scale_layers", "threads"):
        require_at_least(f"--{key.replace('_', '-')}", getattr(args, key), 1)
    for key in ("time_limit_s", "train_budget_s"):  # 0 turns the limit off; a negative one is a typo
        value = getattr(args, key)  # (NaN compares False with everything: it would mean no limit)
        if value is not None and (math.isnan(value) or value < 0):
            raise CliError(f"--{key.replace('_', '-')} must be 0 (no limit) or more, got {value}")
    if not 1 <= args.hf_batch1_prompts <= args.batch1_prompts:
        raise CliError(f"--hf-batch1-prompts must be between 1 and --batch1-prompts ({args.batch1_prompts}), "
                       f"got {args.hf_batch1_prompts}")
    keys = [c.strip() for c in args.pair_configs.split(",") if c.strip()]
    if unknown := [c for c in keys if c not in PAIR_CONFIG_KEYS]:
        raise CliError(f"--pair-configs takes {', '.join(PAIR_CONFIG_KEYS)}; got {', '.join(unknown)}")
    args.pair_config_labels = [PAIR_CONFIG_KEYS[c] for c in keys]
    args.scale_batch_list = _ints(args.scale_batches)
    args.scale_tau_list = _ints(args.scale_taus)
    args.parts_list = _ints(args.parts)
    if set(args.parts_list) - {1, 2}:
        raise CliError(f"--parts takes 1 and/or 2, got {args.parts!r}")
    args.scale_config_list = [c.strip() for c in args.scale_configs.split(",") if c.strip()]
    unknown = [c for c in args.scale_config_list if c not in SCALE_CONFIGS]
    if unknown or not args.scale_config_list:
        raise CliError(f"--scale-configs takes {', '.join(SCALE_CONFIGS)}; got {args.scale_configs!r}")
    if 2 in args.parts_list:  # a simulated τ no selected draft reaches would only be skipped row by row
        longest = {SCALE_CONFIGS[c][0]: SCALE_CONFIGS[c][1]["num_steps"] + 1 for c in args.scale_config_list}
        if unreachable := [t for t in args.scale_tau_list if t > max(longest.values())]:
            raise CliError(f"--scale-taus {','.join(map(str, unreachable))}: "
                           + ", ".join(f"{name} accepts at most {n}" for name, n in longest.items()))
    if args.time_limit_s is None:
        args.time_limit_s = None if args.quick else 560.0
    elif args.time_limit_s == 0:
        args.time_limit_s = None
    if args.train_budget_s is None and not args.quick:
        args.train_budget_s = DEFAULT_TRAIN_BUDGET_S
    if args.train_budget_s is not None and (args.train_budget_s <= 0 or math.isinf(args.train_budget_s)):
        args.train_budget_s = None  # 0 or inf: no limit (the recipe takes None, not inf)
    try:  # a typo in --train-set fails here, not after part 2 has run
        training_preset(args)
    except ValueError as exc:
        raise CliError(f"--train-set: {exc}") from exc
    return args


def run_bench(args: argparse.Namespace) -> int:
    """The subcommand: estimate, run the parts asked for, write the outputs; the exit status."""
    import torch

    # here, not at the top: every command imports this module (phasegraph graph prints at once)
    from phasegraph.bench.pair import measure_real_model, measure_trained_pair
    from phasegraph.bench.report import write_outputs
    from phasegraph.bench.scale import measure_scale

    if args.serve:
        return run_serve_bench(args)
    if args.tp is not None:  # the tensor-parallel bench: its own runs (phasegraph/bench/tp.py)
        from phasegraph.bench.tp import run_tp_bench

        require_at_least("--tp", args.tp, 2)
        # as many new tokens as part 2's rows: speedups of decoding, the prompt's prefill a small share
        new_tokens = args.scale_new_tokens or FULL["scale_new_tokens"]
        return run_tp_bench(args.tp, Path(args.out), ["--new-tokens", str(new_tokens)], _say)
    args = _resolve_args(args)
    if 1 in args.parts_list and args.trained_pair:  # before anything runs or --out is made, --dry-run included
        pair = pair_path(args)
        if args.skip_train and not has_pair(pair):
            raise no_pair_to_skip_to(pair)
        if problem := untrainable_pair_dir(pair):
            raise CliError(problem)
        if has_pair(pair):  # a config the engine or transformers would refuse only after --out is written
            check_reused_pair(pair)
    run = BenchRun(args, log=_say, log_error=_say_error, warm_worker=WARM_WORKER)
    if not run.cuda:
        torch.set_num_threads(max(1, args.threads))
    a = args
    run.result["settings"] = {k: v for k, v in vars(a).items() if k not in ("func", "argv")}
    if 1 in a.parts_list and a.trained_pair and not has_pair(run.pair_path()):
        # the training recipe is deterministic only with this set before cuBLAS starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    est = estimate_seconds(run)
    run.result["estimate_s"] = {k: round(v, 1) for k, v in est.items()}
    print(f"phasegraph bench{' --quick' if a.quick else ''}: device {run.device}, parts {a.parts_list}; "
          f"estimated time: " + ", ".join(f"{k} ~{v:.0f} s" for k, v in est.items()), flush=True)
    if a.time_limit_s and est["total"] > a.time_limit_s:
        print(f"warning: the estimate ({est['total']:.0f} s) exceeds --time-limit-s {a.time_limit_s:.0f} s: rows past "
              "the limit are skipped (run again with the trained --pair, which is reused, or lower "
              "--train-budget-s, or run --parts 1 and --parts 2 apart)", flush=True)
    if a.dry_run:
        return 0

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    interrupted = None
    try:
        run.result["env"] = environment(run.device, a.validate)
        if 1 in a.parts_list:
            if a.trained_pair:
                run.guard("part 1", measure_trained_pair, run)
                free_memory()
                write_outputs(run)
            run.guard("part 1: real model", measure_real_model, run, _real_model)
            free_memory()
            write_outputs(run)
        if 2 in a.parts_list:
            run.guard("part 2", measure_scale, run)
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "interrupted"
        run.result["interrupted"] = interrupted
    finally:
        signal.signal(signal.SIGTERM, previous)
        write_outputs(run, final=True)
    if run.result.get("errors"):
        print("phasegraph bench: errors (the rows they hit are missing):\n  " + "\n  ".join(run.result["errors"]),
              file=sys.stderr)
    return 130 if interrupted else (1 if run.result.get("errors") else 0)


SERVE_BENCH_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "httpx")


def run_serve_bench(args: argparse.Namespace) -> int:
    """``--serve``: the server under Poisson arrivals, speculation on and off (phasegraph.bench.serve)."""
    import importlib.util
    from pathlib import Path

    import torch

    from phasegraph.bench.serve import (
        measure_serving,
        render_serve_markdown,
        settings_from,
        write_serve_outputs,
    )

    require_name("--out", args.out, "directory")
    missing = [name for name in SERVE_BENCH_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise CliError(f"phasegraph bench --serve needs {', '.join(missing)}: install the serve extra "
                       "(pip install 'phasegraph[serve]', or scripts/install.sh serve)")
    settings_from(args)  # bad options fail before anything loads
    if args.device == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(max(1, args.threads))
    if args.dry_run:
        print(f"phasegraph bench --serve: {settings_from(args)}")
        return 0
    result = measure_serving(args, log=_say, real_model=_real_model_dirs)
    write_serve_outputs(result, Path(args.out))
    _say(render_serve_markdown(result))
    return 0


def add_parser(sub) -> None:
    p = add_command(sub, "bench", "end-to-end speed: trained pair vs transformers, and the 8B shape "
                    "(simulated acceptance)", "phasegraph vs its own baseline and transformers' generate "
                    "on one GPU. Writes bench.json, bench.md, tokens_per_s.png and eta_vs_tau.png into --out.")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--tp", type=int, metavar="N",
                   help="instead of parts 1 and 2: tensor parallelism, the 8B shape at TP=1 and TP=N and the 70B "
                        "shape at TP=N under torchrun (benchmarks/bench_tp.py; N GPUs)")
    p.add_argument("--pair", metavar="DIR",
                   help="trained pair (target/, eagle3/ and, for the standalone and assisted rows, "
                        "draft/): reused if present, else trained into it when missing or empty "
                        "(default: OUT/pair)")
    p.add_argument("--skip-train", action="store_true", help="never train: --pair must hold a pair")
    p.add_argument("--train-budget-s", type=float, metavar="S",
                   help="wall-clock budget of the training recipe (stages stop early; default "
                        f"{DEFAULT_TRAIN_BUDGET_S:.0f}; none with --quick; 0 = none)")
    p.add_argument("--train-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the training preset (repeatable), e.g. target_train.steps=500")
    p.add_argument("--parts", default="1,2", help="which parts to run: 1 (trained pair), 2 (scale); default 1,2")
    p.add_argument("--quick", action="store_true",
                   help="the whole pipeline with tiny models (tiny preset pair, tiny scale model), ~1 minute on a CPU")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batches", metavar="B,B,...", help="part 1 batch sizes (default 1,8,32,64; quick 1,2)")
    p.add_argument("--new-tokens", type=int, metavar="N", help="part 1 new tokens (default 256; quick 16)")
    p.add_argument("--pair-configs", default=",".join(PAIR_CONFIG_KEYS), metavar="chain,tree,...",
                   help=f"part 1 drafting rows besides the baseline, of {', '.join(PAIR_CONFIG_KEYS)} (default all)")
    p.add_argument("--features", action=argparse.BooleanOptionalAction, default=True,
                   help="part 1: also the cost of structured output (a JSON schema) and of logprobs=20, "
                        "baseline and chain at each batch, for the trained pair and the real model, and "
                        "at batch 1 for the 8B shape")
    p.add_argument("--trained-pair", action=argparse.BooleanOptionalAction, default=True,
                   help="part 1: the trained pair's rows (--no-trained-pair: the real model's rows alone, "
                        "nothing trained)")
    p.add_argument("--real-model", action=argparse.BooleanOptionalAction, default=None,
                   help="part 1: also SmolLM2-135M-Instruct with its EAGLE-3 head on HumanEval's held-out "
                        "problems (baseline, chain, tree, adaptive; needs scripts/install.sh's packages); "
                        "--serve: serve it (without --pair); default on where its packages are installed, "
                        "off with --quick")
    p.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True,
                   help="part 1: also the mixed workload at the largest batch (half random-token prompts, where the "
                        "draft is poor; mixed lengths): baseline, chain, tree and adaptive per request vs per batch")
    p.add_argument("--batch1-prompts", type=int, metavar="N",
                   help="part 1 batch-1 rows: this many prompts, one call each (default 3; quick 2)")
    p.add_argument("--hf-batch1-prompts", type=int, metavar="N",
                   help="part 1 transformers rows at batch 1 (plain and assisted): the first N of those "
                        "prompts (default 1: its speed per step does not move with the prompt, and assisted "
                        "generation at ~10 tok/s took 83 s for three)")
    p.add_argument("--batch1-repeats", type=int, metavar="N",
                   help="batch-1 phasegraph rows: time the calls N times and keep the median (default 3; quick 1)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="phasegraph rows at batch > 1 (the mixed workload's too): time each call N times and "
                        "keep the median "
                        "(default 3: a lent host now and then runs a call 5-10 %% slower; quick 1)")
    p.add_argument("--prompt-tokens", type=int, metavar="N", help="keep each prompt's last N tokens (default 256; quick 64)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    p.add_argument("--pair-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="part 1 dtype (default float32: the identity check is exact; bf16 flips near-ties)")
    p.add_argument("--draft-dtype", choices=("float32", "bfloat16"),
                   help="part 1 drafts' dtype (EAGLE-3 head, standalone draft, transformers' assistant; "
                        "default bfloat16 on a GPU, --pair-dtype on the CPU): it moves τ, never the output")
    p.add_argument("--scale-batches", metavar="B,B,...", help="part 2 batch sizes (default 1,8,32,64; quick 1,2)")
    p.add_argument("--scale-taus", default="2,3,4", metavar="T,T,...", help="simulated acceptance lengths (default 2,3,4)")
    p.add_argument("--scale-configs", default="chain", metavar="chain,tree,adaptive",
                   help="part 2 drafts: chain (S=3, default: reaches τ=4), tree (K=4 S=4 N=16: with random "
                        "weights the tree keeps depth-1 and depth-2 nodes only, so τ ≤ 3), adaptive (off or "
                        "chains of 1 and 3, chosen per iteration)")
    p.add_argument("--scale-new-tokens", type=int, metavar="N", help="part 2 new tokens (default 256: decode dominates as in serving; quick 16)")
    p.add_argument("--scale-prompt-tokens", type=int, metavar="N", help="part 2 prompt tokens (default 128; quick 32)")
    p.add_argument("--scale-layers", type=int, default=32, metavar="L", help="layers of the 8B shape (default 32)")
    p.add_argument("--validate", choices=["strict", "boundary", "off"],
                   help="phase validation mode of the engines (default: the library default, boundary)")
    p.add_argument("--time-limit-s", type=float, metavar="S",
                   help="skip the rows that would start after S seconds and write what was measured "
                        "(default 560; none with --quick; 0 = none)")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay prefill from CUDA graphs per request and token bucket (Engine(prefill_graphs=True); "
                        "on by default: an eager 128-token prefill of the 8B shape takes 29-44 ms of host time "
                        "against 10-11 ms replayed)")
    p.add_argument("--warm-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, while the pair trains, compile part 1's kernels in a second process "
                        "(random weights, the preset's shapes) so that part 1 finds them compiled "
                        "(default on; it changes the bench's wall time only)")
    p.add_argument("--gc", choices=["freeze", "default"], default="freeze",
                   help="freeze the Python heap before each timed call, as serving engines do after "
                        "warm-up (default), or leave the garbage collector as it is")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, run nothing")
    p.add_argument("--serve", action="store_true",
                   help="instead of parts 1 and 2: the OpenAI-compatible server (in this process, on 127.0.0.1) "
                        "under Poisson arrivals, EAGLE-3 chain against the target alone, on --pair where it "
                        "holds a pair, else the embedded pair; writes serve_bench.json, serve_bench.md and "
                        "serve_latency.png (--new-tokens, --prompt-tokens default 128 here; quick 12, 32)")
    p.add_argument("--serve-rates", metavar="R,R,...", help="--serve: request rates per second (default 1,4,16,64; quick 2,8)")
    p.add_argument("--serve-requests", type=int, metavar="N", help="--serve: requests per rate (default 64; quick 4)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="--serve: the engine in a process of its own, as phasegraph serve runs it (default: on "
                        "where the device is CUDA, off otherwise)")
    p.add_argument("--serve-max-batch", type=int, metavar="N", help="--serve: the engine's max batch (default 32; quick 4)")
    p.set_defaults(func=run_bench, argv=_argv())


def _argv() -> list[str]:
    """The command line after ``bench`` (for the record), when run from the command line."""
    argv = sys.argv[1:]
    return argv[argv.index("bench") + 1:] if "bench" in argv else []
