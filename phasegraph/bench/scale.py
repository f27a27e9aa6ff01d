"""Part 2 of ``phasegraph bench``: benchmarks/bench_scale.py's Llama-3-8B shape (random weights) with
SIMULATED acceptance against the graphed baseline, and bench_scale's GPU probes."""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path

from phasegraph.bench.common import (
    SCALE_CONFIGS,
    BenchError,
    BenchRun,
    count_phase,
    fill_random_weights,
    forward_weight_bytes,
    free_memory,
    load_bench_scale,
    mean_accept_length,
    phase_share,
    prefill_seconds,
    repeats_at,
    shape_counts,
    sync,
    warm_then_time,
)
from phasegraph.bench.pair import measure_features
from phasegraph.bench.report import write_outputs

QUICK_SCALE_MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096}


def measure_scale(run: BenchRun) -> None:
    """Part 2: fills ``run.result["scale"]``, writing the outputs after every row group."""
    import torch
    from tqdm.auto import tqdm

    from phasegraph import SamplingParams, SpecConfig

    a = run.args
    if not run.cuda and not a.quick:
        raise BenchError("part 2 (8B shape) needs a CUDA GPU: use --quick on the CPU, or --parts 1")
    t_part = time.perf_counter()
    bs = load_bench_scale()
    bw = bs.copy_bandwidth() if run.cuda else _host_copy_bandwidth(run)
    if a.quick:
        target, head = _small_scale_pair(run)
        model_label = "tiny Llama (QUICK MODE: " + ", ".join(f"{k}={v}" for k, v in QUICK_SCALE_MODEL.items()) + ")"
    else:
        target = bs.build_target(a.scale_layers)
        head = bs.build_eagle3_head(target)
        model_label = f"Llama-3-8B shape ({a.scale_layers} layers), random bf16 weights"
    wbytes = forward_weight_bytes(target.model)
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
        "cuda_graphs": run.graphs, "prefill_graphs": run.prefill_graphs,
        "baseline": [], "rows": [], "phase_gpu_s": [],
    }
    run.result["scale"] = part
    n_rows = len(a.scale_batch_list) * (1 + len(a.scale_tau_list) * len(a.scale_config_list))
    bar = tqdm(total=n_rows, desc="part 2: scale (simulated)", unit="row", disable=a.no_progress, dynamic_ncols=True)
    engine_kw = {"max_batch_size": max_b, "kv_pool_tokens": kv_tokens, "max_context": 1024,
                 "cuda_graphs": run.graphs, "validate": a.validate, "prefill_graphs": run.prefill_graphs}

    base_tps: dict[int, float] = {}
    run.guard("scale baseline", _measure_baseline, run, bs, target, prompts, params, engine_kw, base_tps, bar)
    free_memory()
    write_outputs(run)
    for key in a.scale_config_list:
        name, spec_kw = SCALE_CONFIGS[key]
        spec = SpecConfig(**spec_kw)
        for tau in sorted(a.scale_tau_list, reverse=True):  # τ = 4 (the goals' τ) first
            if tau > spec.num_steps + 1:
                part["rows"].append({"config": name, "tau_simulated": tau, "skipped":
                                     f"{name} accepts at most {spec.num_steps + 1}"})
                bar.update(len(a.scale_batch_list))
                continue
            if run.out_of_time(f"scale {name} τ={tau}"):
                bar.update(len(a.scale_batch_list))
                continue
            run.guard(f"scale {name} τ={tau}", _measure_spec, run, bs, target, head, name, spec, tau,
                      prompts, params, engine_kw, base_tps, bar)
            free_memory()
            write_outputs(run)
    bar.close()
    if a.features and not run.out_of_time("scale feature rows"):
        run.guard("scale feature rows", _measure_features, run, target, head, prompts, engine_kw, part)
        free_memory()
        write_outputs(run)
    del head, target
    free_memory()
    run.result["parts_wall_s"]["part 2"] = round(time.perf_counter() - t_part, 1)


# the simulated acceptance length of the chain's feature rows: the goals' τ
FEATURE_TAU = 4


def _measure_features(run: BenchRun, target, head, prompts, engine_kw: dict, part: dict) -> None:
    """``--features`` at this shape, batch 1: the baseline and the chain at SIMULATED τ = 4, plain,
    with a JSON schema and with logprobs=20 (:func:`~phasegraph.bench.pair.measure_features`).
    A grammar needs a tokenizer and random weights have none, so the embedded demo pair's lends
    the grammar its 4,096 tokens (the rest of the vocabulary is never allowed): what the rows
    compare is the grammar's host round trips against this shape's iterations, not the text."""
    from phasegraph import Engine, SpecConfig
    from phasegraph.runtime.models.loading import load_tokenizer

    tokenizer = load_tokenizer(Path(str(resources.files("phasegraph") / "data" / "demo_pair" / "target")))
    part["feature_tokenizer"] = "the demo pair's (4,096 tokens), for the grammar only"
    part["feature_tau_simulated"] = FEATURE_TAU

    def make(spec_kw: dict, speculative: bool):
        return Engine(target, head if speculative else None, spec=SpecConfig(**spec_kw), tokenizer=tokenizer,
                      eos_token_ids=(tokenizer.eos_token_id,),
                      simulate_accept_length=FEATURE_TAU if speculative else None, **engine_kw)

    measure_features(run, make, prompts, part, batches=[1], new_tokens=run.args.scale_new_tokens)


def _small_scale_pair(run: BenchRun):
    """Quick mode: a tiny random Llama (QUICK_SCALE_MODEL) + EAGLE-3 head, initialised like
    bench_scale's 8B builders (normal(0, 0.02), norms 1, d2t zero)."""
    import torch
    from transformers import LlamaConfig

    from phasegraph.runtime.models.attention_backend import ATTN_IMPLEMENTATION
    from phasegraph.runtime.models.eagle3 import Eagle3Draft, Eagle3Head
    from phasegraph.runtime.models.target import HFTarget, build_causal_lm

    cfg = LlamaConfig(**QUICK_SCALE_MODEL, max_position_embeddings=1024, tie_word_embeddings=False)
    model = build_causal_lm(cfg, dtype=run.dtype, device=run.device, init=False)
    hcfg = LlamaConfig(**{**QUICK_SCALE_MODEL, "num_hidden_layers": 1}, max_position_embeddings=1024)
    hcfg.draft_vocab_size, hcfg.target_hidden_size = 1024, cfg.hidden_size
    hcfg._attn_implementation = ATTN_IMPLEMENTATION  # as draft_config() sets it for loaded heads
    with torch.device(run.device):
        head = Eagle3Head(hcfg, target_hidden_size=cfg.hidden_size, draft_vocab_size=1024,
                          with_d2t=True, with_t2d=False)
    fill_random_weights(model, head)
    head.d2t.zero_()
    head.to(run.dtype)
    target = HFTarget(model, feature_mode="eagle3")
    return target, Eagle3Draft(target, hcfg, head)


def _host_copy_bandwidth(run: BenchRun, nbytes: int = 256 << 20) -> float:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=run.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        sync(run.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(run.device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def _measure_baseline(run: BenchRun, bs, target, prompts, params, engine_kw, base_tps, bar) -> None:
    from phasegraph import Engine, SpecConfig
    from phasegraph.runtime.models.target import HFTarget

    part = run.result["scale"]
    bound = part["bound_s"]
    base_target = HFTarget(target.model, feature_mode="none")  # the same weights, no features
    engine = Engine(base_target, spec=SpecConfig(method="none"), trace=True, **engine_kw)
    engine.warm_up(sampled=False)  # every bucket's graphs first, as part 1's engines and a server do
    for b in run.args.scale_batch_list:
        bar.set_postfix_str(f"baseline, batch {b}")
        if run.out_of_time(f"scale baseline batch {b}"):
            bar.update(1)
            continue
        _, wall, outs, gc_pauses, captured = warm_then_time(run, engine, [prompts[:b]], params, repeats_at(run, b))
        tokens = sum(len(o.token_ids) for o in outs)
        steps = count_phase(engine.trace, "decode")
        prefill = prefill_seconds(engine.trace)
        row = {"batch": b, "seconds": wall, "new_tokens": tokens, "tokens_per_s": tokens / wall,
               "step_s_end_to_end": (wall - prefill) / max(1, steps),
               "phase_share": phase_share(engine.trace, wall), "gc": gc_pauses, "captured_while_timed": captured}
        row["share_of_bound_end_to_end"] = bound / row["step_s_end_to_end"]
        if run.cuda:  # GPU time of one graphed decode step (bench_scale's probe)
            t = bs.decode_step_time(engine, b, context=part["prompt_tokens"])
            row["decode_step_s"] = t
            row["share_of_bound"] = bound / t
        base_tps[b] = row["tokens_per_s"]
        part["baseline"].append(row)
        bar.update(1)
        run.log(f"  scale baseline batch {b:>3}: {row['tokens_per_s']:9.1f} tok/s, step "
                f"{1e3 * row.get('decode_step_s', row['step_s_end_to_end']):.2f} ms, bound {1e3 * bound:.2f} ms")


def goal_order(batches: list[int]) -> list[int]:
    """The smallest and the largest batch first (the goals' rows), then the rest: a run cut by
    --time-limit-s loses the rows that matter least."""
    ends = sorted({min(batches), max(batches)})
    return ends + [b for b in batches if b not in ends]


def _measure_spec(run: BenchRun, bs, target, head, name, spec, tau, prompts, params, engine_kw, base_tps,
                  bar) -> None:
    from phasegraph import Engine

    a = run.args
    part = run.result["scale"]
    engine = Engine(target, head, spec=spec, simulate_accept_length=tau, trace=True, **engine_kw)
    engine.warm_up(sampled=False)  # greedy rows
    for b in goal_order(a.scale_batch_list):
        bar.set_postfix_str(f"{name}, SIMULATED τ={tau}, batch {b}")
        if b not in base_tps or run.out_of_time(f"scale {name} τ={tau} batch {b}"):
            bar.update(1)
            continue
        _, wall, outs, gc_pauses, captured = warm_then_time(run, engine, [prompts[:b]], params, repeats_at(run, b))
        tokens = sum(len(o.token_ids) for o in outs)
        speedup = (tokens / wall) / base_tps[b]
        # below tau by the budget's last, shorter iteration; 1 where adaptive ran no drafts
        measured = mean_accept_length(outs) or 1.0
        row = {"config": name, "tau_simulated": tau, "tau_measured": measured,
               "reached": measured >= tau - 0.25 or bool(spec.adaptive),  # adaptive may choose shorter
               "batch": b, "seconds": wall, "new_tokens": tokens, "tokens_per_s": tokens / wall,
               "baseline_tokens_per_s": base_tps[b], "speedup": speedup, "eta": speedup / measured,
               "iterations": count_phase(engine.trace, "verify"), "nodes": spec.num_draft_tokens,
               "prefill_s": prefill_seconds(engine.trace),
               "phase_share": phase_share(engine.trace, wall), "gc": gc_pauses, "captured_while_timed": captured}
        if spec.adaptive:
            row["shapes"] = shape_counts(engine.trace)
            row["spec_costs"] = engine.scheduler.adaptive.costs.to_dict()
        part["rows"].append(row)
        bar.update(1)
        run.log(f"  scale {name:<18} SIMULATED τ={tau} (measured {measured:.2f}) batch {b:>3}: "
                f"{row['tokens_per_s']:9.1f} tok/s speedup {speedup:.2f} η {row['eta']:.2f}")
    if run.cuda and tau == max(a.scale_tau_list) and not spec.adaptive:
        # GPU time per phase at the smallest and largest batch (bench_scale's probe): what
        # limits η at batch 1 and the speedup at the largest batch, measured. One graph per
        # phase: the iteration graph the timed rows replay runs all four phases at draft.
        del engine
        free_memory()
        engine = Engine(target, head, spec=spec, simulate_accept_length=tau, trace=False,
                        **{**engine_kw, "graph_scope": "phase"})
        for b in sorted({min(a.scale_batch_list), max(a.scale_batch_list)}):
            r = bs.spec_iteration_times(engine, b, context=part["prompt_tokens"], repeats=5)
            part["phase_gpu_s"].append({"config": name, "tau_simulated": tau, "graph_scope": "phase", **r})
