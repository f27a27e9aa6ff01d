"""Whole engine steps of the bench pair (random weights, SIMULATED acceptance) under several
variants of the code, interleaved round by round so that drift of the GPU lands on every variant
alike: the loop the A/B scripts share (``attention_splits_ab.py``, ``tiled_linear_ab.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_scale  # noqa: E402
from profile_pair_host import build_pair, simulated_configs  # noqa: E402

# Engine keywords of every variant's engines; a variant's setup may change them (and its restore
# put them back), as attention_chunk_ab.py's --max-contexts does.
ENGINE_KW = {"max_context": 1024}


def interleaved_step_times(variants: dict[str, Callable[[], None]], batches: list[int],
                           configs: list[str], rounds: int) -> list[dict]:
    """Per round, variant (its setup called first), configuration and batch size: the scheduler's
    step time and the GPU's busy time per step (``bench_scale.scheduler_step_times``)."""
    from phasegraph.runtime.engine import Engine

    target, head = build_pair(torch.float32, "cuda", None, torch.bfloat16)
    chosen = [c for key, c in simulated_configs(target, head).items() if key in configs]
    max_b = max(batches)
    rows = []
    for rnd in range(rounds):
        for variant, setup in variants.items():
            setup()
            for name, tgt, draft, spec, tau in chosen:
                eng = Engine(tgt, draft, spec=spec, max_batch_size=max_b, kv_pool_tokens=max_b * 2048,
                             simulate_accept_length=tau, cuda_graphs=True, trace=False, validate="off",
                             **ENGINE_KW)
                for b in batches:
                    r = bench_scale.scheduler_step_times(eng, b, True)
                    r.update(config=name, variant=variant, round=rnd)
                    rows.append(r)
                    print(f"round {rnd} {variant:<10} {name:<36} batch {b:>2}: {1e3 * r['step_s']:6.3f} ms/step, "
                          f"GPU busy {1e3 * r['gpu_busy_s']:6.3f} ms", flush=True)
                del eng
                torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict], baseline: str) -> list[str]:
    """GPU busy time per step, mean over rounds, per configuration and batch: each variant
    against ``baseline``."""
    keys = sorted({(r["config"], r["batch"]) for r in rows}, key=lambda k: (k[0], k[1]))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = []
    for config, batch in keys:
        means = {}
        for v in variants:
            xs = [r["gpu_busy_s"] for r in rows if (r["config"], r["batch"], r["variant"]) == (config, batch, v)]
            means[v] = sum(xs) / len(xs)
        base = means[baseline]
        parts = [f"{v} {1e3 * means[v]:.3f} ms ({100 * (means[v] / base - 1):+.1f} %)" for v in variants if v != baseline]
        lines.append(f"{config:<36} batch {batch:>2}: {baseline} {1e3 * base:.3f} ms; " + "; ".join(parts))
    return lines


def add_step_arguments(ap: argparse.ArgumentParser, rounds: int = 2) -> None:
    """The options every A/B script takes: ``--out``, ``--batches``, ``--configs``, ``--rounds``."""
    ap.add_argument("--out", default="out")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--configs", nargs="+", default=["baseline", "chain", "tree"])
    ap.add_argument("--rounds", type=int, default=rounds, help=f"rounds, variants interleaved (default {rounds})")


def run_and_write(variants: dict[str, Callable[[], None]], restore: Callable[[], None],
                  args: argparse.Namespace, baseline: str, name: str) -> int:
    """Time ``variants`` (:func:`interleaved_step_times`), call ``restore`` whatever happens,
    print the :func:`summary` against ``baseline`` and write ``{args.out}/{name}.json``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        rows = interleaved_step_times(variants, args.batches, args.configs, args.rounds)
    finally:
        restore()
    lines = summary(rows, baseline)
    print("\n".join(lines))
    (out / f"{name}.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "rows": rows, "summary": lines}, indent=2))
    return 0
