"""``phasegraph bench`` (issue 7): end-to-end speed against transformers and our own baseline.

One command, one process, one GPU::

    phasegraph bench --out DIR [--pair PAIR_DIR] [--train-budget-s 300] [--parts 1,2]
    phasegraph bench --quick --out DIR            # the whole pipeline on the CPU, tiny models

Part 1, trained pair: reuses ``--pair`` when it holds ``target/`` and ``eagle3/`` (and
``draft/``), else trains the ``bench-pair`` preset into it (``phasegraph.train``, stages cut to
``--train-budget-s``). Held-out stdlib prompts (last ``--prompt-tokens`` tokens), greedy,
``--new-tokens`` new tokens, ``ignore_eos``, at each batch size (B prompts at once): phasegraph
baseline (``method="none"``), EAGLE-3 chain and tree, standalone-draft chain; transformers'
``generate`` on the same target (sdpa attention), plain and with ``assistant_model`` (batch 1
only: transformers' assisted generation does not batch). Tokens/s (warm-up excluded), τ,
speedup over the phasegraph baseline at the same batch, η = speedup / τ, time share by phase
(from the engine's trace) and the share of outputs identical to the baseline's.

Part 2, scale: bench/bench_scale.py's Llama-3-8B-shaped target (random bf16 weights) and
EAGLE-3-shaped head (chain S=3 drafts by default), acceptance SIMULATED (verify accepts τ - 1
drafts whatever they are) at each τ and batch size, against the graphed baseline; the baseline's
share of the bandwidth bound, and bench_scale's GPU probes of a decode step and of each phase.

Writes ``bench.json`` (every figure and the environment), ``bench.md`` (the table, also
printed), ``tokens_per_s.png`` and ``eta_vs_tau.png`` into ``--out``; the JSON and the table
after every configuration too, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from phasegraph.cli import CliError, register

REPO_ROOT = Path(__file__).resolve().parent.parent

# (label, SpecConfig kwargs, which draft directory of the pair)
PG_CONFIGS = (
    ("baseline (autoregressive)", {"method": "none"}, None),
    ("EAGLE-3 chain S=3", {"method": "eagle3", "num_steps": 3, "topk": 1}, "eagle3"),
    ("EAGLE-3 tree K=4 S=4 N=16", {"method": "eagle3", "num_steps": 4, "topk": 4, "num_draft_tokens": 16}, "eagle3"),
    ("standalone draft chain S=3", {"method": "standalone", "num_steps": 3, "topk": 1}, "draft"),
)
BASELINE, CHAIN, TREE, STANDALONE = (c[0] for c in PG_CONFIGS)
HF_PLAIN = "transformers generate"
HF_ASSISTED = "transformers generate + assistant_model (batch 1 only: assisted generation does not batch)"
# Part 2 drafts: the chain is the default. Simulated acceptance takes the first-child path of the
# drafted tree; with random weights every draft probability is small (~1e-3 at the 8B shape, by
# estimate: logits of std ~1.3 over 32k tokens), so
# a tree's score (the product along the path) drops ~1000x per level, a K=4 S=4 N=16 tree keeps
# its 4 depth-1 and 11 depth-2 nodes, and τ stops at 3 (seen in --quick: measured τ 3.00 at a
# simulated 4); a chain with S=3 always holds a path of 3 drafts, so τ = 4 is reachable.
SCALE_CONFIGS = {
    "chain": ("chain S=3", {"method": "eagle3", "num_steps": 3, "topk": 1}),
    "tree": ("tree K=4 S=4 N=16", {"method": "eagle3", "num_steps": 4, "topk": 4, "num_draft_tokens": 16}),
}
# Training budget of the full run: with ~140 s of measurement and ~15 s of start-up the whole bench
# stays near 8 minutes on an H200 (the device machine stops a command at 10 minutes). The
# tiny preset of --quick runs unbudgeted (~15 s on a CPU): the recipe splits a budget by the
# stages' projected H100 time, which gives the tiny target almost nothing.
DEFAULT_TRAIN_BUDGET_S = 300.0
ETA_GOAL, HF_RATIO_GOAL, LARGE_BATCH_GOAL, BOUND_GOAL = 0.75, 5.0, 1.3, 0.85

FULL = {"batches": "1,8,32", "new_tokens": 256, "prompt_tokens": 256, "scale_batches": "1,8,32,64",
        "scale_new_tokens": 64, "scale_prompt_tokens": 128}
QUICK = {"batches": "1,2", "new_tokens": 16, "prompt_tokens": 64, "scale_batches": "1,2",
         "scale_new_tokens": 16, "scale_prompt_tokens": 32}
QUICK_SCALE_MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096}

# Figures the time estimate uses. Measured (bench/RESULTS.md §2, H200, 8B shape, graphs on):
# decode step by batch, chain and tree iteration by batch, eager iteration. Assumed (not measured):
# the host cost of a phasegraph step on a small model (the measured host issue of an 8B
# iteration is 2.5-4.4 ms, RESULTS.md §2), transformers' eager generate step, first Triton
# compilation and graph capture.
SCALE_STEP_S = {1: 7.23e-3, 8: 8.50e-3, 64: 11.33e-3}
SCALE_ITER_S = {"chain": {1: 9.20e-3, 8: 10.73e-3, 64: 15.88e-3}, "tree": {1: 10.67e-3, 8: 12.06e-3, 64: 37.45e-3}}
SCALE_EAGER_ITER_S = 62.5e-3
SMALL_STEP_S, SMALL_ITER_S, HF_STEP_S, TRITON_COMPILE_S, CAPTURE_S = 1.5e-3, 4.5e-3, 10e-3, 40.0, 0.3


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------


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


def _fmt(x, spec: str = ".2f", none: str = "–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def environment(device, validate: str | None) -> dict:
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = _git("rev-parse", "HEAD") or os.environ.get("PHASEGRAPH_GIT_COMMIT")
    status = _git("status", "--porcelain")
    cuda = torch.device(device).type == "cuda"
    env = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": commit,
        "git_dirty": (bool(status) if status is not None else None),
        "phasegraph_kernels": os.environ.get("PHASEGRAPH_KERNELS", "auto"),
        "validation": validate or os.environ.get("PHASEGRAPH_VALIDATE") or "library default (boundary)",
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    return env


def _load_bench_scale():
    """bench/bench_scale.py (the 8B builders, bandwidth and step-time probes) as a module."""
    import importlib.util

    path = REPO_ROOT / "bench" / "bench_scale.py"
    if not path.exists():
        raise CliError(f"{path} is missing: run `phasegraph bench` from a phasegraph checkout")
    spec = importlib.util.spec_from_file_location("phasegraph_bench_scale", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _has_pair(d: Path) -> bool:
    return (d / "target" / "config.json").exists() and (d / "eagle3" / "config.json").exists()


def _phase_share(trace, wall: float) -> dict[str, float]:
    """Share of the timed call's wall time spent inside each phase (host wall time: the GPU runs
    asynchronously, so a phase's GPU work shows up where the host next waits for it), plus
    ``outside phases`` (scheduler, host synchronisation, request bookkeeping)."""
    if trace is None or wall <= 0:
        return {}
    times = trace.phase_time()
    share = {k: v / wall for k, v in sorted(times.items(), key=lambda kv: -kv[1])}
    share["outside phases"] = max(0.0, 1.0 - sum(share.values()))
    return share


def _share_text(share: dict[str, float], top: int = 4) -> str:
    if not share:
        return "–"
    items = [(k, v) for k, v in share.items() if k != "outside phases" and v >= 0.005][:top]
    items.append(("other", 1.0 - sum(v for _, v in items)))
    return " · ".join(f"{k} {100 * v:.0f}%" for k, v in items)


def _count(trace, phase: str) -> int:
    return 0 if trace is None else sum(1 for t in trace if t.target == phase)


# ------------------------------------------------------------------------------------------------
# the bench
# ------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.t0 = time.perf_counter()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(args.device if args.device != "auto" else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available() and not args.dry_run:
            raise CliError("--device cuda: no CUDA GPU is available")
        if self.device.type != "cuda" and not args.quick and not args.dry_run:
            raise CliError("the full bench (a ~96M pair, the 8B shape) needs a CUDA GPU: use --quick on the CPU")
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.graphs = self.cuda
        self.result: dict = {
            "command": "phasegraph bench " + " ".join(args.argv),
            "quick": args.quick,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "settings": {},
            "parts_wall_s": {},
            "trained_pair": None,
            "scale": None,
            "goals": [],
            "skipped": [],
        }

    def guard(self, what: str, fn, *args, **kwargs):
        """Run ``fn``; an exception is recorded under ``errors`` (and printed) instead of ending
        the run, so one failing row leaves the others measured. Interrupts pass through."""
        try:
            return fn(*args, **kwargs)
        except CliError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded, reported, and the exit status says so
            import traceback

            traceback.print_exc()
            self.result.setdefault("errors", []).append(f"{what}: {type(exc).__name__}: {exc}")
            _free()
            return None

    # -- time -----------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out_of_time(self, what: str) -> bool:
        limit = self.args.time_limit_s
        if limit and self.elapsed() > limit:
            self.result["skipped"].append(f"{what}: skipped, --time-limit-s {limit:.0f} s reached")
            return True
        return False

    def estimate(self) -> dict[str, float]:
        """Seconds per part, from the figures above (measured 8B figures, assumed host costs)."""
        a = self.args
        est: dict[str, float] = {"startup": 5.0 if a.quick else 15.0}
        if 1 in a.parts_list:
            pair = Path(a.pair) if a.pair else self.out / "pair"
            train = 0.0 if (_has_pair(pair) or a.skip_train) else (30.0 if a.quick else (a.train_budget_s or 600.0) + 25.0)
            est["part 1: training"] = train
            if not a.quick:
                steps = a.new_tokens
                nb = len(a.batch_list)
                pg = nb * 2 * steps * SMALL_STEP_S  # baseline, warm-up + timed
                pg += nb * 3 * 2 * (steps / 2.5) * SMALL_ITER_S  # chain, tree, standalone at tau ~2.5
                pg += nb * 3 * 3 * CAPTURE_S
                hf = sum(1.1 * steps * HF_STEP_S for _ in a.batch_list) + 1.1 * steps / 3 * 2 * HF_STEP_S
                est["part 1: measure"] = pg + hf + TRITON_COMPILE_S + 15.0
            else:
                est["part 1: measure"] = 30.0
        if 2 in a.parts_list:
            if not a.quick:
                n, p = a.scale_new_tokens, a.scale_prompt_tokens
                t = 20.0  # build 16 GB of random weights + the head, bandwidth probe
                for b in a.scale_batch_list:
                    prefill = b * p * 2 * 8e9 / 300e12
                    t += 2 * (n * _interp(SCALE_STEP_S, b) + prefill) + 3 * SCALE_EAGER_ITER_S
                    for key in a.scale_config_list:
                        for tau in a.scale_tau_list:
                            t += 2 * (math.ceil(n / tau) * _interp(SCALE_ITER_S[key], b) + prefill)
                            t += 3 * 3 * SCALE_EAGER_ITER_S
                t += 10.0 + TRITON_COMPILE_S / 2  # decode-step and per-phase probes; kernels for head dim 128
                est["part 2: scale"] = t
            else:
                est["part 2: scale"] = 15.0
        est["total"] = sum(est.values())
        return est

    # -- output ---------------------------------------------------------------------------------
    def write(self, final: bool = False) -> None:
        """bench.json and bench.md (after every config, so a run cut short keeps what it
        measured); the plots and the printed table at the end."""
        self.result["wall_s"] = round(self.elapsed(), 1)
        self.result["goals"] = self.goals()
        if final:
            self.result["plots"] = self.guard("plots", self.plots) or {"files": []}
        md = self.markdown()
        (self.out / "bench.json").write_text(json.dumps(self.result, indent=2, default=str) + "\n")
        (self.out / "bench.md").write_text(md)
        if final:
            print("\n" + md, flush=True)
            print(f"wrote {self.out / 'bench.json'}, {self.out / 'bench.md'} and "
                  f"{', '.join(str(self.out / p) for p in self.result['plots'].get('files', []))}")

    # -- part 1 ---------------------------------------------------------------------------------
    def pair_dir(self) -> Path:
        a = self.args
        pair = Path(a.pair) if a.pair else self.out / "pair"
        if _has_pair(pair):
            print(f"part 1: reusing the trained pair in {pair}", flush=True)
            return pair
        if a.skip_train:
            raise CliError(f"--skip-train: {pair} holds no trained pair (target/ and eagle3/)")
        preset_name = "tiny" if a.quick else "bench-pair"
        from phasegraph.train.presets import PRESETS, apply_overrides

        overrides = list(a.train_set)
        if not a.quick:
            # the bench measures tau itself; the recipe's own simulated-acceptance report on 16
            # held-out prompts (instead of 64) saves ~a minute
            overrides = ["eval.max_prompts=16", *overrides]
        preset = apply_overrides(PRESETS[preset_name], overrides)
        print(f"part 1: training the {preset_name} pair into {pair} (budget "
              f"{_fmt(a.train_budget_s, '.0f')} s; overrides: {overrides or 'none'})", flush=True)
        from phasegraph.train.recipe import run_recipe

        t0 = time.perf_counter()
        report = run_recipe(preset, pair, seed=a.seed, device=self.device,
                            time_budget_s=a.train_budget_s, progress=not a.no_progress)
        self.result["training"] = {
            "preset": preset_name, "overrides": overrides, "budget_s": a.train_budget_s,
            "wall_s": round(time.perf_counter() - t0, 1), "stopped_early": report.get("stopped_early"),
            "report_wall_s": report.get("wall_s"), "acceptance": report.get("acceptance"),
        }
        _free()
        return pair

    def part1(self) -> None:
        from tqdm.auto import tqdm

        from phasegraph import SamplingParams
        from phasegraph.runtime.engine import _load_tokenizer
        from phasegraph.train.corpus import heldout_prompts

        a = self.args
        t_part = time.perf_counter()
        pair = self.pair_dir()
        if (pair / "train_report.json").exists() and pair.resolve() != self.out.resolve():
            shutil.copyfile(pair / "train_report.json", self.out / "train_report.json")
        drafts = {"eagle3": pair / "eagle3", "draft": pair / "draft" if (pair / "draft" / "config.json").exists() else None}
        draft_note = None
        if drafts["draft"] is None and a.quick:
            from phasegraph.runtime.models.testing_checkpoints import write_standalone_draft

            drafts["draft"] = write_standalone_draft(self.out / "random_draft", pair / "target")
            draft_note = ("quick mode: the tiny preset trains no standalone draft; the standalone rows "
                          "use a small RANDOM draft with the target's vocabulary (τ near 1)")
        elif drafts["draft"] is None:
            draft_note = f"{pair} has no draft/: the standalone and assisted-generation rows are not run"
        tok = _load_tokenizer(pair / "target")
        cfg = json.loads((pair / "target" / "config.json").read_text())
        context = int(cfg.get("max_position_embeddings", 4096))
        prompt_tokens = min(a.prompt_tokens, context - a.new_tokens - 32)
        if prompt_tokens < 8:
            raise CliError(f"the target's context ({context}) leaves no room for {a.new_tokens} new tokens")
        texts = [p.text for p in heldout_prompts(max_lines=40, min_lines=8)]
        ids = [tok(t)["input_ids"][-prompt_tokens:] for t in texts]
        max_b = max(a.batch_list)
        prompts = [ids[i % len(ids)] for i in range(max_b)]
        params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
        kv_tokens = max_b * (prompt_tokens + a.new_tokens + 64) + 1024
        part: dict = {
            "pair": str(pair), "draft_note": draft_note, "prompts_available": len(ids),
            "prompt_tokens_max": prompt_tokens,
            "prompt_tokens_mean": round(sum(len(p) for p in prompts) / len(prompts), 1),
            "new_tokens": a.new_tokens, "batches": a.batch_list, "dtype": str(self.dtype).removeprefix("torch."),
            "cuda_graphs": self.graphs, "greedy": True, "ignore_eos": True, "rows": [],
        }
        self.result["trained_pair"] = part
        rows = part["rows"]
        outputs: dict[tuple[str, int], list[list[int]]] = {}
        # the baseline first (every row is compared with it), then the rows the goals read
        order = (BASELINE, TREE, CHAIN, STANDALONE)
        configs = sorted((c for c in PG_CONFIGS if c[2] is None or drafts[c[2]] is not None),
                         key=lambda c: order.index(c[0]))
        n_rows = len(configs) * len(a.batch_list) + (0 if a.no_hf else len(a.batch_list) + (drafts["draft"] is not None))
        bar = tqdm(total=n_rows, desc="part 1: trained pair", unit="row", disable=a.no_progress, dynamic_ncols=True)

        for label, spec_kw, draft_key in configs:
            if self.out_of_time(label):
                bar.update(len(a.batch_list))
                continue
            self.guard(label, self._pg_config, label, spec_kw, pair / "target",
                       drafts[draft_key] if draft_key else None, prompts, params, kv_tokens, outputs, rows, bar,
                       draft_note if draft_key == "draft" else None)
            _free()
            self.write()

        hf_model = None
        if not a.no_hf and not self.out_of_time("transformers rows"):
            hf_model = self.guard("transformers rows", self._hf_rows, pair, drafts["draft"], prompts, outputs,
                                  rows, bar, draft_note)
        bar.close()
        self.guard("comparison with the baseline", self._compare, rows, outputs, prompts, hf_model)
        del hf_model
        _free()
        self.result["parts_wall_s"]["part 1"] = round(time.perf_counter() - t_part, 1)

    def _pg_config(self, label, spec_kw, target_dir, draft_dir, prompts, params, kv_tokens, outputs, rows,
                   bar, note) -> None:
        """One phasegraph configuration at every batch size (one engine, reused)."""
        from tqdm.auto import tqdm

        from phasegraph import Engine, SpecConfig

        a = self.args
        engine = Engine.from_pretrained(
            target_dir, draft_dir, spec=SpecConfig(**spec_kw), device=self.device, dtype=self.dtype,
            max_batch_size=max(a.batch_list), kv_pool_tokens=kv_tokens, cuda_graphs=self.graphs, trace=True,
            validate=a.validate,
        )
        for b in a.batch_list:
            bar.set_postfix_str(f"{label}, batch {b}")
            batch = prompts[:b]
            warm = engine.generate(batch, params)  # the same call: captures every bucket it uses
            engine.trace.clear()
            _sync(self.device)
            t0 = time.perf_counter()
            outs = engine.generate(batch, params)
            _sync(self.device)
            wall = time.perf_counter() - t0
            tokens = [o.token_ids for o in outs]
            lens = [n for o in outs for n in o.stats.accept_lengths]
            row = {
                "engine": "phasegraph", "config": label, "spec": spec_kw, "batch": b,
                "seconds": wall, "new_tokens": sum(len(t) for t in tokens),
                "tokens_per_s": sum(len(t) for t in tokens) / wall,
                "tau": (sum(lens) / len(lens)) if lens else None,
                "iterations": _count(engine.trace, "verify") or _count(engine.trace, "decode"),
                "prefill_s": sum(t.seconds for t in engine.trace if t.target == "prefill-extend"),
                "phase_share": _phase_share(engine.trace, wall),
                "warmup_identical": [w.token_ids for w in warm] == tokens,
                "graph_stats": engine.graph_runner.stats() if engine.graph_runner is not None else None,
            }
            if note:
                row["note"] = note
            outputs[(label, b)] = tokens
            rows.append(row)
            bar.update(1)
            tqdm.write(f"  {label:<28} batch {b:>3}: {row['tokens_per_s']:9.1f} tok/s  "
                       f"τ {_fmt(row['tau'])}  phases: {_share_text(row['phase_share'])}")

    def _hf_model(self, directory: Path):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(str(directory), dtype=self.dtype, attn_implementation="sdpa")
        model.to(self.device).eval()
        model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
        return model

    def _hf_generate(self, model, prompts, new_tokens: int, assistant=None) -> list[list[int]]:
        import torch
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen, assistant_model=assistant)
        return out[:, width:].tolist()

    def _hf_rows(self, pair, draft_dir, prompts, outputs, rows, bar, draft_note):
        import transformers

        a = self.args
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        model = self._hf_model(pair / "target")
        assistant = self._hf_model(draft_dir) if draft_dir is not None else None
        runs = [(HF_ASSISTED, 1, assistant)] if assistant is not None else []  # the goal's row first
        runs += [(HF_PLAIN, b, None) for b in a.batch_list]
        for label, b, asst in runs:
            if self.out_of_time(f"{label} batch {b}"):
                bar.update(1)
                continue
            bar.set_postfix_str(f"transformers, batch {b}{' assisted' if asst is not None else ''}")
            self.guard(f"{label}, batch {b}", self._hf_row, model, asst, label, prompts[:b], outputs, rows, draft_note)
            bar.update(1)
        del assistant
        return model

    def _hf_row(self, model, asst, label, batch, outputs, rows, draft_note) -> None:
        from tqdm.auto import tqdm

        a = self.args
        b = len(batch)
        self._hf_generate(model, batch, min(16, a.new_tokens), asst)  # warm-up
        _sync(self.device)
        t0 = time.perf_counter()
        tokens = self._hf_generate(model, batch, a.new_tokens, asst)
        _sync(self.device)
        wall = time.perf_counter() - t0
        n = sum(len(t) for t in tokens)
        row = {"engine": "transformers", "config": label, "batch": b, "seconds": wall, "new_tokens": n,
               "tokens_per_s": n / wall, "tau": None, "attn_implementation": "sdpa", "phase_share": {}}
        if asst is not None:
            gc_ = asst.generation_config
            row["assistant"] = {"num_assistant_tokens": getattr(gc_, "num_assistant_tokens", None),
                                "num_assistant_tokens_schedule": getattr(gc_, "num_assistant_tokens_schedule", None)}
            if draft_note:
                row["note"] = draft_note
        outputs[(label, b)] = tokens
        rows.append(row)
        tqdm.write(f"  {label[:28]:<28} batch {b:>3}: {row['tokens_per_s']:9.1f} tok/s")

    def _compare(self, rows, outputs, prompts, hf_model) -> None:
        """Speedup, η and identity against the phasegraph baseline at the same batch; for
        outputs that differ, the target's logit gap at the first difference (fp32 forward of
        transformers' model: a small gap means a near-tie that bf16 may break either way)."""
        import torch

        base_rows = {r["batch"]: r for r in rows if r["config"] == BASELINE}
        if hf_model is not None:
            hf_model.float()
        for r in rows:
            base = base_rows.get(r["batch"])
            if base is None:
                continue
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["eta"] = r["speedup"] / r["tau"] if r.get("tau") else None
            ref = outputs[(BASELINE, r["batch"])]
            mine = outputs[(r["config"], r["batch"])]
            same = [x == y for x, y in zip(mine, ref, strict=True)]
            r["identical"] = sum(same)
            r["identical_share"] = sum(same) / len(same)
            prefix = []
            gaps = []
            for i, (x, y) in enumerate(zip(mine, ref, strict=True)):
                k = next((j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
                prefix.append(k / max(1, len(y)))
                if x != y and hf_model is not None and len(gaps) < 8 and k < min(len(x), len(y)):
                    seq = torch.tensor([list(prompts[i]) + y[:k]], device=self.device)
                    with torch.no_grad():
                        logits = hf_model(input_ids=seq).logits[0, -1].float()
                    top2 = logits.topk(2).values
                    gaps.append({"request": i, "position": k,
                                 "baseline_minus_this_logit": float(logits[y[k]] - logits[x[k]]),
                                 "top1_minus_top2": float(top2[0] - top2[1])})
            r["matching_prefix_share"] = sum(prefix) / len(prefix)
            if gaps:
                r["first_difference_logit_gaps"] = gaps
            if r["engine"] == "phasegraph" and r["config"] != BASELINE and r.get("iterations") and base.get("iterations"):
                step = (base["seconds"] - base["prefill_s"]) / base["iterations"]
                it = (r["seconds"] - r["prefill_s"]) / r["iterations"]
                r["baseline_step_s"], r["iteration_s"] = step, it
                r["iteration_cost_in_steps"] = it / step

    # -- part 2 ---------------------------------------------------------------------------------
    def _small_scale_pair(self):
        """Quick mode: a tiny random Llama (QUICK_SCALE_MODEL) + EAGLE-3 head, initialised like
        bench_scale's 8B builders (normal(0, 0.02), norms 1, d2t zero)."""
        import torch
        from transformers import LlamaConfig

        from phasegraph.runtime.models.attention_backend import ATTN_IMPLEMENTATION
        from phasegraph.runtime.models.eagle3 import Eagle3Draft, Eagle3Head
        from phasegraph.runtime.models.target import HFTarget, build_causal_lm

        cfg = LlamaConfig(**QUICK_SCALE_MODEL, max_position_embeddings=1024, tie_word_embeddings=False)
        model = build_causal_lm(cfg, dtype=self.dtype, device=self.device, init=False)
        hcfg = LlamaConfig(**{**QUICK_SCALE_MODEL, "num_hidden_layers": 1}, max_position_embeddings=1024)
        hcfg.draft_vocab_size, hcfg.target_hidden_size = 1024, cfg.hidden_size
        hcfg._attn_implementation = ATTN_IMPLEMENTATION  # as draft_config() sets it for loaded heads
        with torch.device(self.device):
            head = Eagle3Head(hcfg, target_hidden_size=cfg.hidden_size, draft_vocab_size=1024,
                              with_d2t=True, with_t2d=False)
        with torch.no_grad():
            for p in (*model.parameters(), *head.parameters()):
                if p.ndim == 1:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
            head.d2t.zero_()
        head.to(self.dtype)
        target = HFTarget(model, feature_mode="eagle3")
        return target, Eagle3Draft(target, hcfg, head)

    def _host_copy_bandwidth(self, nbytes: int = 256 << 20) -> float:
        import torch

        src = torch.ones(nbytes // 4, dtype=torch.float32, device=self.device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(5):
            _sync(self.device)
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync(self.device)
            times.append(time.perf_counter() - t0)
        return 2 * nbytes / sorted(times)[len(times) // 2]

    def _timed_generate(self, engine, prompts, params) -> tuple[float, list]:
        engine.generate(prompts, params)  # warm-up: the same call (captures its buckets)
        if engine.trace is not None:
            engine.trace.clear()
        _sync(self.device)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        _sync(self.device)
        return time.perf_counter() - t0, outs

    def part2(self) -> None:
        import torch
        from tqdm.auto import tqdm

        from phasegraph import SamplingParams, SpecConfig

        a = self.args
        if not self.cuda and not a.quick:
            raise CliError("part 2 (8B shape) needs a CUDA GPU: use --quick on the CPU, or --parts 1")
        t_part = time.perf_counter()
        bs = _load_bench_scale()
        bw = bs.copy_bandwidth() if self.cuda else self._host_copy_bandwidth()
        if a.quick:
            target, head = self._small_scale_pair()
            model_label = "tiny Llama (QUICK MODE: " + ", ".join(f"{k}={v}" for k, v in QUICK_SCALE_MODEL.items()) + ")"
        else:
            target = bs.build_target(a.scale_layers)
            head = bs.build_eagle3_head(target)
            model_label = f"Llama-3-8B shape ({a.scale_layers} layers), random bf16 weights"
        wbytes = bs.weight_bytes(target.model)
        bound = wbytes / bw
        max_b = max(a.scale_batch_list)
        n, p = a.scale_new_tokens, a.scale_prompt_tokens
        kv_tokens = max_b * max(640, p + n + 96)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, target.vocab_size, (max_b, p), generator=g).tolist()
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        part: dict = {
            "model": model_label, "simulated_acceptance": True,
            "label": "SIMULATED acceptance: verify accepts tau-1 drafts whatever they are (benchmark mode); "
                     "outputs are not the target's",
            "copy_bandwidth_Bps": bw, "weight_bytes": wbytes, "bound_s": bound,
            "prompt_tokens": p, "new_tokens": n, "batches": a.scale_batch_list, "taus": a.scale_tau_list,
            "cuda_graphs": self.graphs, "baseline": [], "rows": [], "phase_gpu_s": [],
        }
        self.result["scale"] = part
        n_rows = len(a.scale_batch_list) * (1 + len(a.scale_tau_list) * len(a.scale_config_list))
        bar = tqdm(total=n_rows, desc="part 2: scale (simulated)", unit="row", disable=a.no_progress, dynamic_ncols=True)
        common = {"max_batch_size": max_b, "kv_pool_tokens": kv_tokens, "max_context": 1024,
                  "cuda_graphs": self.graphs, "validate": a.validate}

        base_tps: dict[int, float] = {}
        self.guard("scale baseline", self._scale_baseline, bs, target, prompts, params, common, base_tps, bar)
        _free()
        self.write()
        for key in a.scale_config_list:
            name, spec_kw = SCALE_CONFIGS[key]
            spec = SpecConfig(**spec_kw)
            for tau in sorted(a.scale_tau_list, reverse=True):  # τ = 4 (the goals' τ) first
                if tau > spec.num_steps + 1:
                    part["rows"].append({"config": name, "tau_simulated": tau, "skipped":
                                         f"{name} accepts at most {spec.num_steps + 1}"})
                    bar.update(len(a.scale_batch_list))
                    continue
                if self.out_of_time(f"scale {name} τ={tau}"):
                    bar.update(len(a.scale_batch_list))
                    continue
                self.guard(f"scale {name} τ={tau}", self._scale_spec, bs, target, head, name, spec, tau,
                           prompts, params, common, base_tps, bar)
                _free()
                self.write()
        bar.close()
        del head, target
        _free()
        self.result["parts_wall_s"]["part 2"] = round(time.perf_counter() - t_part, 1)

    def _scale_baseline(self, bs, target, prompts, params, common, base_tps, bar) -> None:
        from tqdm.auto import tqdm

        from phasegraph import Engine, SpecConfig
        from phasegraph.runtime.models.target import HFTarget

        part = self.result["scale"]
        bound = part["bound_s"]
        base_target = HFTarget(target.model, feature_mode="none")  # the same weights, no features
        engine = Engine(base_target, spec=SpecConfig(method="none"), trace=True, **common)
        for b in self.args.scale_batch_list:
            bar.set_postfix_str(f"baseline, batch {b}")
            if self.out_of_time(f"scale baseline batch {b}"):
                bar.update(1)
                continue
            wall, outs = self._timed_generate(engine, prompts[:b], params)
            tokens = sum(len(o.token_ids) for o in outs)
            steps = _count(engine.trace, "decode")
            prefill = sum(t.seconds for t in engine.trace if t.target == "prefill-extend")
            row = {"batch": b, "seconds": wall, "new_tokens": tokens, "tokens_per_s": tokens / wall,
                   "step_s_end_to_end": (wall - prefill) / max(1, steps),
                   "phase_share": _phase_share(engine.trace, wall)}
            row["share_of_bound_end_to_end"] = bound / row["step_s_end_to_end"]
            if self.cuda:  # GPU time of one graphed decode step (bench_scale's probe)
                t = bs.decode_step_time(engine, b, context=part["prompt_tokens"])
                row["decode_step_s"] = t
                row["share_of_bound"] = bound / t
            base_tps[b] = row["tokens_per_s"]
            part["baseline"].append(row)
            bar.update(1)
            tqdm.write(f"  scale baseline batch {b:>3}: {row['tokens_per_s']:9.1f} tok/s, step "
                       f"{1e3 * row.get('decode_step_s', row['step_s_end_to_end']):.2f} ms, bound {1e3 * bound:.2f} ms")

    def _scale_spec(self, bs, target, head, name, spec, tau, prompts, params, common, base_tps, bar) -> None:
        from tqdm.auto import tqdm

        from phasegraph import Engine

        a = self.args
        part = self.result["scale"]
        engine = Engine(target, head, spec=spec, simulate_accept_length=tau, trace=True, **common)
        for b in a.scale_batch_list:
            bar.set_postfix_str(f"{name}, SIMULATED τ={tau}, batch {b}")
            if b not in base_tps or self.out_of_time(f"scale {name} τ={tau} batch {b}"):
                bar.update(1)
                continue
            wall, outs = self._timed_generate(engine, prompts[:b], params)
            tokens = sum(len(o.token_ids) for o in outs)
            lens = [x for o in outs for x in o.stats.accept_lengths]
            speedup = (tokens / wall) / base_tps[b]
            measured = sum(lens) / len(lens)  # below tau by the budget's last, shorter iteration
            row = {"config": name, "tau_simulated": tau, "tau_measured": measured,
                   "reached": measured >= tau - 0.25,
                   "batch": b, "seconds": wall, "new_tokens": tokens, "tokens_per_s": tokens / wall,
                   "baseline_tokens_per_s": base_tps[b], "speedup": speedup, "eta": speedup / measured,
                   "iterations": _count(engine.trace, "verify"), "nodes": spec.num_draft_tokens,
                   "prefill_s": sum(t.seconds for t in engine.trace if t.target == "prefill-extend"),
                   "phase_share": _phase_share(engine.trace, wall)}
            part["rows"].append(row)
            bar.update(1)
            tqdm.write(f"  scale {name:<18} SIMULATED τ={tau} (measured {measured:.2f}) batch {b:>3}: "
                       f"{row['tokens_per_s']:9.1f} tok/s speedup {speedup:.2f} η {row['eta']:.2f}")
        if self.cuda and tau == max(a.scale_tau_list):
            # GPU time per phase at the smallest and largest batch (bench_scale's probe): what
            # limits η at batch 1 and the speedup at the largest batch, measured
            for b in sorted({min(a.scale_batch_list), max(a.scale_batch_list)}):
                r = bs.spec_iteration_times(engine, b, context=part["prompt_tokens"], repeats=5)
                part["phase_gpu_s"].append({"config": name, "tau_simulated": tau, **r})

    # -- goals and notes ------------------------------------------------------------------------
    def goals(self) -> list[dict]:
        goals: list[dict] = []
        tp = self.result.get("trained_pair") or {}
        rows = tp.get("rows", [])

        def find(config, batch, engine="phasegraph"):
            return next((r for r in rows if r["config"] == config and r["batch"] == batch and r["engine"] == engine), None)

        def add(goal, measured, met, note=None):
            goals.append({"goal": goal, "measured": measured, "met": met, **({"note": note} if note else {})})

        tree1 = find(TREE, 1)
        if tree1 and tree1.get("eta") is not None:
            cost = tree1.get("iteration_cost_in_steps")
            note = None
            if tree1["eta"] < ETA_GOAL and cost:
                shares = _share_text(tree1["phase_share"], top=5)
                note = (f"a tree iteration costs {cost:.2f} baseline steps ({1e3 * tree1['iteration_s']:.2f} ms vs "
                        f"{1e3 * tree1['baseline_step_s']:.2f} ms per decode step), so η ≈ 1/{cost:.2f} = {1 / cost:.2f}; "
                        f"wall time of the timed call by phase: {shares}")
            add(f"trained pair, batch 1: EAGLE-3 tree η ≥ {ETA_GOAL}",
                f"η = {tree1['eta']:.2f} (speedup {tree1['speedup']:.2f}×, τ = {tree1['tau']:.2f})",
                tree1["eta"] >= ETA_GOAL, note)
        else:
            add(f"trained pair, batch 1: EAGLE-3 tree η ≥ {ETA_GOAL}", "not measured", None)

        asst = find(HF_ASSISTED, 1, "transformers")
        eagle = [r for r in (find(CHAIN, 1), tree1) if r]
        if asst and eagle:
            best = max(eagle, key=lambda r: r["tokens_per_s"])
            ratio = best["tokens_per_s"] / asst["tokens_per_s"]
            add(f"trained pair, batch 1: phasegraph EAGLE-3 ≥ {HF_RATIO_GOAL:g}× transformers' assisted generation",
                f"{ratio:.2f}× ({best['config']} {best['tokens_per_s']:.0f} tok/s vs {asst['tokens_per_s']:.0f} tok/s)",
                ratio >= HF_RATIO_GOAL)
        else:
            add(f"trained pair, batch 1: phasegraph EAGLE-3 ≥ {HF_RATIO_GOAL:g}× transformers' assisted generation",
                "not measured", None)

        pg = [r for r in rows if r["engine"] == "phasegraph" and r["config"] != BASELINE and "identical" in r]
        if pg:
            same = sum(r["identical"] for r in pg)
            total = sum(r["batch"] for r in pg)
            bad = [f"{r['config']} b{r['batch']}: {r['identical']}/{r['batch']}" for r in pg if r["identical"] < r["batch"]]
            gaps = [abs(g["baseline_minus_this_logit"]) for r in pg for g in r.get("first_difference_logit_gaps", [])]
            note = None
            if bad:
                note = "rows with differences: " + "; ".join(bad)
                if gaps:
                    note += (f". Target logit gap between the two tokens at the first difference (fp32 forward): "
                             f"median {sorted(gaps)[len(gaps) // 2]:.3f}, max {max(gaps):.3f}")
                if tp.get("draft_note") and any(r["config"] == STANDALONE for r in pg if r["identical"] < r["batch"]):
                    note += f". {tp['draft_note']}"
            add("trained pair: greedy outputs identical to the baseline in every row",
                f"{same}/{total} outputs identical", same == total, note)
        else:
            add("trained pair: greedy outputs identical to the baseline in every row", "not measured", None)

        sc = self.result.get("scale") or {}
        srows = [r for r in sc.get("rows", []) if "eta" in r]
        taus = [r["tau_simulated"] for r in srows]
        top_tau = 4 if 4 in taus else (max(taus) if taus else 4)
        b_min = min((r["batch"] for r in srows), default=min(self.args.scale_batch_list))
        b_max = max((r["batch"] for r in srows), default=max(self.args.scale_batch_list))
        configs = list(dict.fromkeys(r["config"] for r in srows))
        for cname in configs or [SCALE_CONFIGS[k][0] for k in self.args.scale_config_list]:
            r1 = next((r for r in srows if r["config"] == cname and r["batch"] == b_min and r["tau_simulated"] == top_tau), None)
            goal = f"scale ({cname}), batch {b_min}, SIMULATED τ = {top_tau}: η ≥ {ETA_GOAL}"
            if r1:
                notes = []
                if not r1["reached"]:
                    notes.append(f"τ = {top_tau} was not reached (measured {r1['tau_measured']:.2f}): the drafted "
                                 f"path is shallower than {top_tau - 1} with random weights")
                gpu = next((x for x in sc.get("phase_gpu_s", []) if x["config"] == cname and x["batch"] == b_min), None)
                base = next((x for x in sc.get("baseline", []) if x["batch"] == b_min), None)
                if r1["eta"] < ETA_GOAL and base and r1.get("iterations"):
                    it = (r1["seconds"] - r1["prefill_s"]) / r1["iterations"]
                    notes.append(f"end to end an iteration takes {1e3 * it:.2f} ms = {it / base['step_s_end_to_end']:.2f} "
                                 f"baseline steps ({1e3 * base['step_s_end_to_end']:.2f} ms), so η ≈ "
                                 f"{base['step_s_end_to_end'] / it:.2f}")
                if r1["eta"] < ETA_GOAL and gpu and base and base.get("decode_step_s"):
                    ph = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in gpu["phase_s"].items())
                    notes.append(f"GPU probe: one iteration {1e3 * gpu['iteration_s']:.2f} ms = "
                                 f"{gpu['iteration_s'] / base['decode_step_s']:.2f} decode steps "
                                 f"({1e3 * base['decode_step_s']:.2f} ms); ms per phase: {ph}; host issue "
                                 f"{100 * gpu['host_share']:.0f}% of the iteration")
                add(goal, f"η = {r1['eta']:.2f} (speedup {r1['speedup']:.2f}×, measured τ {r1['tau_measured']:.2f})",
                    r1["eta"] >= ETA_GOAL and r1["reached"], "; ".join(notes) or None)
            else:
                add(goal, "not measured", None)
            rb = next((r for r in srows if r["config"] == cname and r["batch"] == b_max and r["tau_simulated"] == top_tau), None)
            goal = f"scale ({cname}), batch {b_max}, SIMULATED τ = {top_tau}: tokens/s ≥ {LARGE_BATCH_GOAL}× baseline"
            if rb:
                pays = [r for r in srows if r["config"] == cname and r["tau_simulated"] == top_tau]
                stop = next((r["batch"] for r in sorted(pays, key=lambda r: r["batch"]) if r["speedup"] < 1.0), None)
                note = None
                if rb["speedup"] < LARGE_BATCH_GOAL:
                    if stop == b_min:
                        note = f"speculation does not pay at any batch measured (speedup < 1 from batch {b_min} on)"
                    elif stop:
                        note = f"speculation stops paying (speedup < 1) at batch {stop}"
                    else:
                        note = f"speculation pays at every batch measured, but only {rb['speedup']:.2f}× at batch {b_max}"
                    gpu = next((x for x in sc.get("phase_gpu_s", []) if x["config"] == cname and x["batch"] == b_max), None)
                    base = next((x for x in sc.get("baseline", []) if x["batch"] == b_max), None)
                    if gpu and base and base.get("decode_step_s"):
                        note += (f"; at batch {b_max} verify takes {1e3 * gpu['phase_s']['verify']:.2f} ms of a "
                                 f"{1e3 * gpu['iteration_s']:.2f} ms iteration vs a {1e3 * base['decode_step_s']:.2f} ms decode "
                                 f"step (the verify forward carries {b_max}×{rb['nodes']} tokens)")
                if not rb["reached"]:
                    note = (note + "; " if note else "") + f"τ = {top_tau} not reached (measured {rb['tau_measured']:.2f})"
                add(goal, f"{rb['speedup']:.2f}×", rb["speedup"] >= LARGE_BATCH_GOAL and rb["reached"], note)
            else:
                add(goal, "not measured", None)
        b1 = next((r for r in sc.get("baseline", []) if r["batch"] == b_min), None)
        goal = f"scale: baseline at batch {b_min} ≥ {BOUND_GOAL:.0%} of the memory-bandwidth bound"
        if b1:
            share = b1.get("share_of_bound", b1["share_of_bound_end_to_end"])
            how = "graphed decode step, GPU time" if "share_of_bound" in b1 else "end-to-end step time (no CUDA)"
            step = b1.get("decode_step_s", b1["step_s_end_to_end"])
            add(goal, f"{100 * share:.1f}% ({1e3 * step:.2f} ms per step vs bound {1e3 * sc['bound_s']:.2f} ms; {how})",
                share >= BOUND_GOAL,
                None if share >= BOUND_GOAL else
                f"bound = {sc['weight_bytes'] / 1e9:.2f} GB of weights / {sc['copy_bandwidth_Bps'] / 1e12:.2f} TB/s measured copy bandwidth; "
                f"end-to-end step {1e3 * b1['step_s_end_to_end']:.2f} ms")
        else:
            add(goal, "not measured", None)
        return goals

    # -- markdown -------------------------------------------------------------------------------
    def markdown(self) -> str:
        r = self.result
        env = r.get("env", {})
        lines = [f"# phasegraph bench{' — QUICK MODE (tiny models; says nothing about GPU speed)' if r['quick'] else ''}", ""]
        lines.append(f"`{r['command']}` — {r['started']}, {r.get('wall_s', 0):.0f} s in all.")
        lines.append(f"Device: {env.get('gpu') or env.get('cpu')} ({env.get('device')}); torch {env.get('torch')}, "
                     f"triton {env.get('triton') or '–'}, transformers {env.get('transformers')}; commit "
                     f"{(env.get('git_commit') or 'unknown')[:12]}{' (dirty)' if env.get('git_dirty') else ''}; "
                     f"validation {env.get('validation')}.")
        lines.append("")
        tp = r.get("trained_pair")
        if tp:
            lines += [
                "## 1. Trained pair",
                "",
                f"Pair `{tp['pair']}`; held-out stdlib prompts (last ≤ {tp['prompt_tokens_max']} tokens, mean "
                f"{tp['prompt_tokens_mean']}), greedy, {tp['new_tokens']} new tokens per request (ignore_eos), "
                f"{tp['dtype']}, CUDA graphs {'on' if tp['cuda_graphs'] else 'off'}. Tokens/s = new tokens / wall "
                "time of the whole call (prefill included, warm-up excluded); speedup over the phasegraph baseline "
                "at the same batch; η = speedup / τ; time share by phase = host wall time inside each phase (trace; "
                "the GPU runs asynchronously, its wait lands in 'other').",
                "",
                "| engine | configuration | batch | tokens/s | τ | speedup | η | identical to baseline | time share by phase |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            order = [c[0] for c in PG_CONFIGS] + [HF_PLAIN, HF_ASSISTED]
            for row in sorted(tp["rows"], key=lambda x: (order.index(x["config"]), x["batch"])):
                ident = (f"{row['identical']}/{row['batch']}" if "identical" in row else "–")
                lines.append(
                    f"| {row['engine']} | {row['config']} | {row['batch']} | {row['tokens_per_s']:.1f} | "
                    f"{_fmt(row.get('tau'))} | {_fmt(row.get('speedup'))}× | {_fmt(row.get('eta'))} | {ident} | "
                    f"{_share_text(row.get('phase_share', {}))} |")
            if tp.get("draft_note"):
                lines += ["", f"Note: {tp['draft_note']}."]
            lines.append("")
        sc = r.get("scale")
        if sc:
            lines += [
                "## 2. Scale — SIMULATED acceptance",
                "",
                f"{sc['model']}; EAGLE-3-shaped head; prompts of {sc['prompt_tokens']} random tokens, "
                f"{sc['new_tokens']} new tokens; CUDA graphs {'on' if sc['cuda_graphs'] else 'off'}. "
                f"**{sc['label']}.** Copy bandwidth {sc['copy_bandwidth_Bps'] / 1e12:.3f} TB/s; weights a step reads "
                f"{sc['weight_bytes'] / 1e9:.3f} GB → bandwidth bound {1e3 * sc['bound_s']:.3f} ms/step.",
                "",
                "| configuration | τ simulated | τ measured | batch | tokens/s | speedup | η | step or iteration |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for b in sc["baseline"]:
                step = b.get("decode_step_s", b["step_s_end_to_end"])
                share = b.get("share_of_bound", b["share_of_bound_end_to_end"])
                lines.append(f"| baseline{' (graphed decode)' if sc['cuda_graphs'] else ''} | – | – | {b['batch']} | {b['tokens_per_s']:.1f} | 1.00× | – | "
                             f"{1e3 * step:.2f} ms = {100 * share:.1f}% of the bound |")
            for row in sorted(sc["rows"], key=lambda x: (x["config"], x["tau_simulated"], x.get("batch", 0))):
                if "skipped" in row:
                    lines.append(f"| {row['config']} | {row['tau_simulated']} | – | – | – | – | – | {row['skipped']} |")
                    continue
                it = ((row["seconds"] - row["prefill_s"]) / row["iterations"]) if row.get("iterations") else None
                reach = "" if row["reached"] else " (not reached)"
                lines.append(f"| {row['config']}, SIMULATED | {row['tau_simulated']} | {row['tau_measured']:.2f}{reach} | "
                             f"{row['batch']} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}× | {row['eta']:.2f} | "
                             f"{_fmt(it and 1e3 * it)} ms/iteration (end to end) |")
            if sc.get("phase_gpu_s"):
                lines += ["", "GPU time per phase of one iteration (bench_scale.spec_iteration_times, synchronised "
                          "around each phase), SIMULATED acceptance:", "",
                          "| configuration | τ | batch | iteration | host issue | draft | verify | finalize | draft-extend |",
                          "|---|---|---|---|---|---|---|---|---|"]
                for x in sc["phase_gpu_s"]:
                    ph = x["phase_s"]
                    lines.append(f"| {x['config']} | {x['tau_simulated']} | {x['batch']} | {1e3 * x['iteration_s']:.2f} ms | "
                                 f"{1e3 * x['host_issue_s']:.2f} ms ({100 * x['host_share']:.0f}%) | {1e3 * ph['draft']:.2f} | "
                                 f"{1e3 * ph['verify']:.2f} | {1e3 * ph['finalize-tree-path']:.2f} | {1e3 * ph['draft-extend']:.2f} |")
            lines.append("")
        lines += ["## Goals (issue 7)", "", "| goal | measured | status |", "|---|---|---|"]
        for g in r["goals"]:
            status = {True: "met", False: "**not met**", None: "not measured"}[g["met"]]
            lines.append(f"| {g['goal']} | {g['measured']} | {status} |")
        notes = [f"{g['goal']}: {g['note']}" for g in r["goals"] if g.get("note")]
        if notes or r["skipped"]:
            lines += ["", "Notes (measured):", ""]
            lines += [f"- {n}" for n in notes]
            lines += [f"- {s}" for s in r["skipped"]]
        if r["quick"]:
            lines += ["", "QUICK MODE: tiny models on this device; the figures only show that the pipeline runs."]
        return "\n".join(lines) + "\n"

    # -- plots ----------------------------------------------------------------------------------
    def plots(self) -> dict:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            import matplotlib.ticker
        except ImportError:
            return {"files": [], "skipped": "matplotlib is not installed (pip install matplotlib)"}
        files = []
        tag = " — QUICK MODE (tiny models)" if self.result["quick"] else ""
        tp = self.result.get("trained_pair") or {}
        sc = self.result.get("scale") or {}
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        ax = axes[0]
        for config in dict.fromkeys(r["config"] for r in tp.get("rows", [])):
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in tp["rows"] if r["config"] == config)
            label = config if len(config) < 40 else config.split(" (")[0] + " (batch 1)"
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set(title="trained pair (measured)", xlabel="batch size", ylabel="tokens/s")
        ax = axes[1]
        base = sorted((r["batch"], r["tokens_per_s"]) for r in sc.get("baseline", []))
        if base:
            ax.plot(*zip(*base, strict=True), marker="o", color="black",
                    label="baseline (graphed)" if sc.get("cuda_graphs") else "baseline")
        for key in dict.fromkeys((r["config"], r["tau_simulated"]) for r in sc.get("rows", []) if "eta" in r):
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in sc["rows"] if "eta" in r and (r["config"], r["tau_simulated"]) == key)
            ax.plot(*zip(*pts, strict=True), marker="s", linestyle="--", label=f"{key[0]}, SIMULATED τ={key[1]}")
        ax.set(title="scale, random weights — SIMULATED acceptance", xlabel="batch size", ylabel="tokens/s")
        for ax, batches in zip(axes, (tp.get("batches") or [1], sc.get("batches") or [1]), strict=True):
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.suptitle("phasegraph bench: tokens/s vs batch size" + tag)
        fig.tight_layout()
        fig.savefig(self.out / "tokens_per_s.png", dpi=120)
        plt.close(fig)
        files.append("tokens_per_s.png")

        fig, ax = plt.subplots(figsize=(7, 5))
        srows = [r for r in sc.get("rows", []) if "eta" in r]
        for key in dict.fromkeys((r["config"], r["batch"]) for r in srows):
            pts = sorted((r["tau_simulated"], r["eta"]) for r in srows if (r["config"], r["batch"]) == key)
            ax.plot(*zip(*pts, strict=True), marker="s", linestyle="--", label=f"scale {key[0]}, batch {key[1]} (SIMULATED τ)")
        for config in dict.fromkeys(r["config"] for r in tp.get("rows", []) if r.get("eta") is not None):
            pts = [(r["tau"], r["eta"]) for r in tp["rows"] if r["config"] == config and r.get("eta") is not None]
            ax.scatter(*zip(*pts, strict=True), marker="o", s=40, label=f"trained pair: {config} (measured τ)")
        ax.axhline(ETA_GOAL, color="grey", linestyle=":", label=f"goal η = {ETA_GOAL}")
        ax.set(title="efficiency η = speedup / τ" + tag, xlabel="τ (mean acceptance length)", ylabel="η")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(self.out / "eta_vs_tau.png", dpi=120)
        plt.close(fig)
        files.append("eta_vs_tau.png")
        return {"files": files}


# ------------------------------------------------------------------------------------------------
# command
# ------------------------------------------------------------------------------------------------


def _resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    defaults = QUICK if args.quick else FULL
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    args.batch_list = _ints(args.batches)
    args.scale_batch_list = _ints(args.scale_batches)
    args.scale_tau_list = _ints(args.scale_taus)
    args.parts_list = _ints(args.parts)
    if set(args.parts_list) - {1, 2}:
        raise CliError(f"--parts takes 1 and/or 2, got {args.parts!r}")
    args.scale_config_list = [c.strip() for c in args.scale_configs.split(",") if c.strip()]
    unknown = [c for c in args.scale_config_list if c not in SCALE_CONFIGS]
    if unknown or not args.scale_config_list:
        raise CliError(f"--scale-configs takes {', '.join(SCALE_CONFIGS)}; got {args.scale_configs!r}")
    if args.time_limit_s is None:
        args.time_limit_s = None if args.quick else 560.0
    if args.train_budget_s is None and not args.quick:
        args.train_budget_s = DEFAULT_TRAIN_BUDGET_S
    if args.train_budget_s is not None and args.train_budget_s <= 0:
        args.train_budget_s = None
    return args


def run_bench(args: argparse.Namespace) -> int:
    import torch

    args = _resolve_args(args)
    bench = Bench(args)
    if not bench.cuda:
        torch.set_num_threads(max(1, args.threads))
    a = args
    bench.result["settings"] = {k: v for k, v in vars(a).items() if k not in ("func", "argv")}
    pair = Path(a.pair) if a.pair else bench.out / "pair"
    if 1 in a.parts_list and not _has_pair(pair) and not a.skip_train:
        # the training recipe is deterministic only with this set before cuBLAS starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    est = bench.estimate()
    bench.result["estimate_s"] = {k: round(v, 1) for k, v in est.items()}
    print(f"phasegraph bench{' --quick' if a.quick else ''}: device {bench.device}, parts {a.parts_list}; "
          f"estimated time: " + ", ".join(f"{k} ~{v:.0f} s" for k, v in est.items()), flush=True)
    if a.time_limit_s and est["total"] > a.time_limit_s:
        print(f"warning: the estimate ({est['total']:.0f} s) exceeds --time-limit-s {a.time_limit_s:.0f} s: rows past "
              "the limit are skipped (lower --train-budget-s, or run --parts 1 and --parts 2 apart)", flush=True)
    if a.dry_run:
        return 0

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    interrupted = None
    try:
        bench.result["env"] = environment(bench.device, a.validate)
        if 1 in a.parts_list:
            bench.guard("part 1", bench.part1)
            _free()
            bench.write()
        if 2 in a.parts_list:
            bench.guard("part 2", bench.part2)
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "interrupted"
        bench.result["interrupted"] = interrupted
    finally:
        signal.signal(signal.SIGTERM, previous)
        bench.write(final=True)
    if bench.result.get("errors"):
        print("phasegraph bench: errors (the rows they hit are missing):\n  " + "\n  ".join(bench.result["errors"]),
              file=sys.stderr)
    return 130 if interrupted else (1 if bench.result.get("errors") else 0)


@register
def add_bench_command(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="end-to-end speed: trained pair vs transformers, and the 8B shape (simulated acceptance)",
        description="phasegraph vs its own baseline and transformers' generate on one GPU (issue 7). "
                    "Writes bench.json, bench.md, tokens_per_s.png and eta_vs_tau.png into --out.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--pair", metavar="DIR",
                   help="trained pair (target/, eagle3/, draft/): reused if present, else trained into it "
                        "(default: OUT/pair)")
    p.add_argument("--skip-train", action="store_true", help="never train: --pair must hold a pair")
    p.add_argument("--train-budget-s", type=float, metavar="S",
                   help="wall-clock budget of the training recipe (stages stop early; default 300; "
                        "none with --quick; 0 = none)")
    p.add_argument("--train-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the training preset (repeatable), e.g. target_train.steps=500")
    p.add_argument("--parts", default="1,2", help="which parts to run: 1 (trained pair), 2 (scale); default 1,2")
    p.add_argument("--quick", action="store_true",
                   help="the whole pipeline with tiny models (tiny preset pair, tiny scale model), ~1 minute on a CPU")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--batches", metavar="B,B,...", help="part 1 batch sizes (default 1,8,32; quick 1,2)")
    p.add_argument("--new-tokens", type=int, metavar="N", help="part 1 new tokens (default 256; quick 16)")
    p.add_argument("--prompt-tokens", type=int, metavar="N", help="keep each prompt's last N tokens (default 256; quick 64)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    p.add_argument("--scale-batches", metavar="B,B,...", help="part 2 batch sizes (default 1,8,32,64; quick 1,2)")
    p.add_argument("--scale-taus", default="2,3,4", metavar="T,T,...", help="simulated acceptance lengths (default 2,3,4)")
    p.add_argument("--scale-configs", default="chain", metavar="chain,tree",
                   help="part 2 drafts: chain (S=3, default: reaches τ=4), tree (K=4 S=4 N=16: with random "
                        "weights the tree keeps depth-1 and depth-2 nodes only, so τ ≤ 3)")
    p.add_argument("--scale-new-tokens", type=int, metavar="N", help="part 2 new tokens (default 64; quick 16)")
    p.add_argument("--scale-prompt-tokens", type=int, metavar="N", help="part 2 prompt tokens (default 128; quick 32)")
    p.add_argument("--scale-layers", type=int, default=32, metavar="L", help="layers of the 8B shape (default 32)")
    p.add_argument("--validate", choices=["strict", "boundary", "off"],
                   help="phase validation mode of the engines (default: the library default, boundary)")
    p.add_argument("--time-limit-s", type=float, metavar="S",
                   help="skip the rows that would start after S seconds and write what was measured "
                        "(default 560; none with --quick)")
    p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, run nothing")
    p.set_defaults(func=run_bench, argv=_argv())


def _argv() -> list[str]:
    """The command line after ``bench`` (for the record), when run from the command line."""
    argv = sys.argv[1:]
    if "bench" in argv:
        return argv[argv.index("bench") + 1:]
    return argv if sys.argv and sys.argv[0].endswith("bench_e2e.py") else []
