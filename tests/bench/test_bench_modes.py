"""benchmarks/bench_tp.py on the CPU: the random slice builder and the goals' arithmetic (the
GPU runs happen on the device machine).

`phasegraph bench --serve --quick` on the CPU: the real server under Poisson arrivals with
the embedded pair, speculation on and off, the engine on the server's thread or in an engine
process; and the figures' arithmetic on made-up streams."""

from __future__ import annotations

import json

import pytest
import torch

from phasegraph.bench import serve
from phasegraph.bench.common import load_bench_script
from phasegraph.bench.serve import (
    ITL_GOAL_RATIO,
    _percentile,
    _Run,
    _Stream,
    evaluate_goals,
    summarize,
)
from phasegraph.cli import main
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.tensor_parallel import TensorParallelGroup

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def test_random_target_builds_every_layer_and_runs(monkeypatch):
    bench = load_bench_script("bench_tp")
    monkeypatch.setitem(bench.SHAPES, "tiny", TINY)
    target = bench.random_target("tiny", None, device="cpu")
    assert target.num_layers == len(target.fused_layers) == 3
    assert target.kv_spec.num_layers == 3 and target.kv_spec.num_kv_heads == 2
    assert target.fused_layers[0].qkv_weight is not target.fused_layers[1].qkv_weight
    layer = target.fused_layers[0]
    per_layer = sum(t.numel() for t in (layer.input_norm, layer.post_norm, layer.qkv_weight, layer.o_weight,
                                        layer.gate_up_weight, layer.down_weight))
    assert bench.rank_weight_bytes(target) == 4 * (3 * per_layer + 64 + 256 * 64)
    engine = Engine(bench._baseline_view(target), spec=SpecConfig(method="none"), kv_pool_tokens=512)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert len(out[0].token_ids) == 5


def test_random_target_slices_per_rank(monkeypatch):
    bench = load_bench_script("bench_tp")
    monkeypatch.setitem(bench.SHAPES, "tiny", TINY)
    group = TensorParallelGroup(1, 2, "gloo", torch.device("cpu"), 10.0, "spmd")
    target = bench.random_target("tiny", group, device="cpu")
    layer = target.fused_layers[2]
    assert layer.num_heads == 2 and layer.num_kv_heads == 1
    assert layer.qkv_weight.shape == (4 * 16, 64) and layer.o_weight.shape == (64, 32)
    assert layer.gate_up_weight.shape == (128, 64) and layer.down_weight.shape == (64, 64)
    assert target.kv_spec.num_kv_heads == 1 and target.tp is group


def test_report_marks_the_goals(tmp_path):
    bench = load_bench_script("bench_tp")
    parts = [
        {"shape": "70B", "tp": 2, "baseline": [{"batch": 1, "decode_step_s": 0.02, "share_of_bound": 0.83,
                                                "all_reduce_s": 0.0028}],
         "spec": [{"config": "adaptive up to the tree", "tau_simulated": 4, "error": "RuntimeError: no"},
                  {"config": "chain S=3", "tau_simulated": 4, "batch": 1, "eta": 0.7}]},
        {"shape": "8B", "tp": 2, "baseline": [{"batch": 1, "decode_step_s": 0.003}], "spec": [],
         "baseline_model_reduce": [{"batch": 1, "decode_step_s": 0.0028, "share_of_bound": 0.7,
                                    "all_reduce_s": 0.0009}]},
    ]
    (tmp_path / "tp2.json").write_text(json.dumps({"parts": parts}))
    (tmp_path / "tp1.json").write_text(json.dumps({"parts": [
        {"shape": "8B", "tp": 1, "baseline": [{"batch": 1, "decode_step_s": 0.005}], "spec": []}]}))
    assert bench.main(["--report", str(tmp_path)]) == 0
    lines = (tmp_path / "goals.txt").read_text().splitlines()
    assert lines[0].startswith("70B TP=2 batch-1 decode step 20.00 ms = 83.0 %") and lines[0].count("NOT MET") == 0
    assert lines[1].endswith("NOT MET")  # η 0.70 < 0.75
    assert "= 0.600 (goal <= 0.62): MET" in lines[2]
    assert lines[3] == ("8B TP=2 batch-1 decode step with bf16 sums (tp_reduce_dtype=model): 2.80 ms = 70.0 % of the "
                        "bound, 0.560x the TP=1 step; all-reduces alone 0.90 ms")


def test_phasegraph_bench_tp_runs_torchrun_then_tp1_then_report(monkeypatch, tmp_path):
    """``phasegraph bench --tp 2``: the three runs in order (TP=2 first: the 70B goals), multicast
    off in their environment."""
    import subprocess

    from phasegraph.cli import main

    calls = []

    def fake_run(cmd, env, check):
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert main(["bench", "--tp", "2", "--out", str(tmp_path / "o")]) == 0
    (two, env), (one, _), (rep, _) = calls
    assert one[-6:] == ["--tp", "1", "--out", str(tmp_path / "o"), "--new-tokens", "256"]
    assert two[0].endswith("torchrun") and two[1:3] == ["--nproc-per-node", "2"] and "--tp" in two
    assert rep[-2:] == ["--report", str(tmp_path / "o")]
    assert env["NCCL_NVLS_ENABLE"] == "0"


def _cpu_eagle3_head(target):
    """bench_scale's EAGLE-3 head builder, on the CPU in float32 (it builds on CUDA in bf16)."""
    from transformers import LlamaConfig

    from phasegraph.bench.common import fill_random_weights
    from phasegraph.runtime.models.attention_backend import ATTN_IMPLEMENTATION
    from phasegraph.runtime.models.eagle3 import Eagle3Draft, Eagle3Head

    t = target.config
    cfg = LlamaConfig(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=1,
                      num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                      vocab_size=t.vocab_size, max_position_embeddings=1024)
    cfg.draft_vocab_size, cfg.target_hidden_size = 64, t.hidden_size
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    head = Eagle3Head(cfg, target_hidden_size=t.hidden_size, draft_vocab_size=64, with_d2t=True, with_t2d=False)
    fill_random_weights(head)
    head.d2t.zero_()
    return Eagle3Draft(target, cfg, head)


def test_measure_shape_fills_every_row_on_the_cpu(monkeypatch, tmp_path):
    """The whole row flow at TP=1 with the GPU probes stubbed: baseline rows, then chain and tree
    (fixed shapes) and adaptive speculation at simulated τ=4, each saved as it is measured."""
    import types

    import phasegraph

    adaptive = []  # per speculative engine: whether it adapts

    class Recording(phasegraph.Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if self.spec.speculative:
                adaptive.append(self.scheduler.adaptive is not None)

    monkeypatch.setattr(phasegraph, "Engine", Recording)
    bench = load_bench_script("bench_tp")
    monkeypatch.setitem(bench.SHAPES, "8B", TINY)  # the 8B rows' flow, on the tiny shape
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda *a: None)
    real = bench.random_target
    monkeypatch.setattr(bench, "random_target", lambda shape, group, layers: real(shape, group, layers, "cpu"))
    bs = types.SimpleNamespace(build_eagle3_head=_cpu_eagle3_head, copy_bandwidth=lambda: 1e10,
                               decode_step_time=lambda engine, b, context: 0.002)
    args = types.SimpleNamespace(batches_8b=[1, 3], batches_70b=[1], taus_70b=[4], layers=None, prompt_tokens=8,
                                 new_tokens=33, symm_mem=False)
    saved = []
    out: dict = {}
    bench.measure_shape("8B", None, bs, args, lambda line: None, out, lambda: saved.append(len(out["spec"])))
    assert [r["batch"] for r in out["baseline"]] == [1, 3]
    assert out["baseline"][0]["share_of_bound"] == out["bound_s"] / 0.002
    assert [(r["config"], r["batch"]) for r in out["spec"]] == [
        ("chain S=3", 1), ("chain S=3", 3), ("tree K=4 S=4 N=16", 1), ("tree K=4 S=4 N=16", 3),
        ("adaptive up to the tree", 1), ("adaptive up to the tree", 3)]
    assert adaptive == [False, False, True]
    for row in out["spec"]:
        assert row["tau_measured"] > 2  # simulated: several drafts accepted per iteration
        assert row["eta"] == row["speedup"] / row["tau_measured"]
    assert saved == [0, 0, 1, 2, 3, 4, 5, 6]


RATES = (3.0, 12.0)
REQUESTS = 3
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def serve_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_bench")
    code = main(["bench", "--serve", "--quick", "--out", str(out), "--serve-rates", ",".join(map(str, RATES)),
                 "--serve-requests", str(REQUESTS), "--new-tokens", str(NEW_TOKENS)])
    return out, code


def test_every_request_streams_every_token_in_both_modes(serve_run):
    out, code = serve_run
    assert code == 0
    r = json.loads((out / "serve_bench.json").read_text())
    assert r["quick"] is True and r["pair"] == "the embedded demo pair"
    assert set(r["modes"]) == {"speculative", "baseline"}
    for mode in r["modes"].values():
        assert [row["rate"] for row in mode["rows"]] == list(RATES)
        for row in mode["rows"]:
            # greedy, ignore_eos: exactly the budget arrives in every stream, none lost or doubled
            assert row["requests"] == REQUESTS and row["failed"] == 0
            assert row["tokens"] == REQUESTS * NEW_TOKENS
            assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
            assert 0 < row["itl_p50_s"] <= row["itl_p99_s"]
            assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["wall_s"])
        assert mode["bare_step_s"] > 0 and mode["served_step_s"] > 0
        # the bare engine and the server ran the same iterations: the overhead compares like with like
        assert mode["same_iterations"] is True and mode["overhead_basis"] == "iteration"
        assert mode["iterations"]["bare"] == mode["iterations"]["served"]
        assert mode["http_overhead"] == pytest.approx(mode["served_step_s"] / mode["bare_step_s"] - 1)
        assert mode["serving_host_s_per_step"] > 0
        assert mode["device_wait_s_per_iteration"] == {"bare": 0.0, "served": 0.0}  # no device to wait for
    # several tokens per iteration under speculation: fewer iterations for the same tokens
    its = {m: r["modes"][m]["iterations"]["served"][0] for m in r["modes"]}
    assert its["speculative"] < its["baseline"] <= NEW_TOKENS
    goals = r["goals"]
    assert len(goals) == 3 and all(isinstance(g["met"], bool) for g in goals)
    spec, base = r["modes"]["speculative"]["rows"], r["modes"]["baseline"]["rows"]
    assert goals[0]["value"] == pytest.approx(spec[0]["itl_p50_s"] / base[0]["itl_p50_s"])
    assert goals[0]["met"] == (goals[0]["value"] <= ITL_GOAL_RATIO)


def test_the_serve_bench_measures_through_an_engine_process(tmp_path):
    code = main(["bench", "--serve", "--quick", "--engine-process", "--out", str(tmp_path), "--serve-rates", "4",
                 "--serve-requests", "1", "--new-tokens", str(NEW_TOKENS)])
    assert code == 0
    r = json.loads((tmp_path / "serve_bench.json").read_text())
    assert r["engine_process"] is True and set(r["modes"]) == {"speculative", "baseline"}
    for mode in r["modes"].values():
        assert mode["rows"][0]["failed"] == 0 and mode["rows"][0]["tokens"] == NEW_TOKENS
        # the bare runs stepped the engine in the engine process, as the server's steps ran
        assert mode["same_iterations"] is True
        assert mode["http_overhead"] == pytest.approx(mode["served_step_s"] / mode["bare_step_s"] - 1)
        assert mode["serving_host_s_per_step"] > 0
    assert "the engine in a process of its own" in (tmp_path / "serve_bench.md").read_text()


def test_markdown_and_plot(serve_run):
    out, _ = serve_run
    md = (out / "serve_bench.md").read_text()
    assert md.count("| speculative |") == len(RATES) + 1 and md.count("| baseline |") == len(RATES) + 1
    assert "asyncio + HTTP" in md and "p50 ITL with speculation" in md
    png = out / "serve_latency.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_chunk_gap_is_shared_between_its_tokens():
    a = _Stream(sent=0.0, chunks=[(0.1, 1), (0.13, 3), (0.14, 1)])
    b = _Stream(sent=0.0, error="HTTP 500")
    row = summarize(2.0, [a, b], wall=0.5)
    assert row["failed"] == 1 and row["tokens"] == 5 and row["tokens_per_s"] == pytest.approx(10.0)
    assert row["ttft_p50_s"] == pytest.approx(0.1)
    assert row["itl_p50_s"] == pytest.approx(0.01)  # 30 ms over 3 tokens, three times; then 10 ms
    assert row["chunk_gap_p99_s"] == pytest.approx(0.03 - 0.02 * 0.01, abs=1e-9)
    assert _percentile([3.0, 1.0, 2.0], 50) == 2.0 and _percentile([1.0, 2.0], 99) == pytest.approx(1.99)


class _FakeServer:
    """What _measure_overhead reads of an AsyncEngine: call() and stats()."""

    def __init__(self):
        self.steps = 0

    async def call(self, fn):
        return fn(None)

    def stats(self):
        self.steps += 10
        return type("Stats", (), {"steps": self.steps, "serving_seconds": self.steps * 1e-5})()


@pytest.mark.parametrize("same", [True, False])
def test_the_overhead_compares_the_same_iterations_else_tokens(monkeypatch, same):
    """Served runs whose iterations differ from the bare engine's (another adaptive shape, say)
    are compared per token, never per iteration."""
    bare = _Run((0.0, 1.0, 2.0, 3.0), (1, 3, 3, 3), device_wait_s=0.4)  # 1 s an iteration of 3 tokens
    served = _Run((0.0, 1.1, 2.2, 3.3), (1, 3, 3, 3)) if same else _Run((0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0),
                                                                        (1, 2, 1, 2, 1, 2, 1))
    monkeypatch.setattr(serve, "_bare_run", lambda engine, prompt, s: bare)
    monkeypatch.setattr(serve, "_served_run", lambda url, aengine, prompt, s, clients: served)
    s = serve.ServeSettings(rates=(1.0,), requests=1, new_tokens=10, prompt_tokens=4, max_batch=1, overhead_repeats=3)
    out = serve._measure_overhead("http://x", _FakeServer(), [1, 2], s, clients=None)
    assert out["same_iterations"] is same and out["overhead_basis"] == ("iteration" if same else "token")
    assert out["iterations"] == {"bare": [4] * 3, "served": [len(served.tokens)] * 3}
    assert out["bare_step_s"] == pytest.approx(1.0) and out["bare_token_s"] == pytest.approx(1 / 3)
    # per iteration the second served run would look 50 % faster; per token it is equal
    assert out["http_overhead"] == pytest.approx(0.1 if same else 0.0)
    assert out["serving_host_s_per_step"] == pytest.approx(1e-5)
    assert out["device_wait_s_per_iteration"] == {"bare": pytest.approx(0.1), "served": 0.0}


def test_goals_compare_the_modes():
    def mode(itl, tps, overhead):
        rows = [{"rate": r, "itl_p50_s": itl, "tokens_per_s": t} for r, t in zip((1, 8), tps, strict=True)]
        return {"rows": rows, "http_overhead": overhead}

    goals = evaluate_goals({"modes": {"speculative": mode(0.005, (100, 390), 0.02),
                                      "baseline": mode(0.01, (60, 400), 0.01)}})
    assert [g["met"] for g in goals] == [True, False, True]
    assert goals[1]["value"] == pytest.approx(390 / 400) and "8 req/s" in goals[1]["goal"]
    # at low load both serve the offered load: a shortfall there is not compared, one above it is
    goals = evaluate_goals({"modes": {"speculative": mode(0.005, (99.9, 410), 0.02),
                                      "baseline": mode(0.01, (100, 400), 0.01)}})
    assert goals[1]["met"] and goals[1]["value"] == pytest.approx(410 / 400) and "high load" in goals[1]["goal"]


@pytest.mark.parametrize(("bad", "message"), [
    (["--serve-rates", "0,2"], "--serve-rates"),
    (["--serve-rates", "fast"], "--serve-rates"),
    (["--serve-requests", "0"], "--serve-requests"),
])
def test_bad_options_fail_before_anything_runs(tmp_path, capsys, bad, message):
    assert main(["bench", "--serve", "--quick", "--out", str(tmp_path / "o"), *bad]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_feature_goals_compare_json_with_its_own_lengths_and_logprobs_with_plain():
    from phasegraph.bench.common import BASELINE, CHAIN
    from phasegraph.bench.report import _feature_goals

    def row(config, feature, tok_s, **kw):
        return {"config": config, "feature": feature, "batch": 1, "tokens_per_s": tok_s, **kw}

    part = {"rows": [row(BASELINE, "plain", 1000.0), row(BASELINE, "json_schema", 400.0),
                     row(BASELINE, "logprobs=20", 950.0), row(CHAIN, "plain", 2000.0),
                     row(CHAIN, "json_schema", 900.0, plain_same_lengths_tokens_per_s=1000.0),
                     row(CHAIN, "logprobs=20", 1700.0)]}
    goals = []
    _feature_goals(lambda goal, measured, met, note=None: goals.append((goal, measured, met)), part)
    assert [g[2] for g in goals] == [True, True, False]  # 0.90x of its lengths; 2.25x decode; +17.6 %
    assert goals[0][1].startswith("0.90×") and goals[1][1].startswith("2.25×")
    assert "+5.3 %" in goals[2][1] and "+17.6 %" in goals[2][1]
    goals.clear()
    _feature_goals(lambda goal, measured, met, note=None: goals.append((goal, measured, met)), {})
    assert [g[1:] for g in goals] == [("not measured", None)] * 3


@pytest.mark.parametrize(("chain_tau", "tree_tau", "identical", "met"), [
    (2.5, 3.0, 3, [True, True]),  # at the bounds: met
    (2.49, 3.4, 2, [False, False]),  # the chain short of 2.5, one tree output differs
    (None, 3.2, 3, [None, True]),  # no chain row (--pair-configs tree): not measured
])
def test_real_model_goals_and_table(chain_tau, tree_tau, identical, met):
    """Batch 1 (3 problems) reads above both goals; the largest batch (the most problems) decides,
    each problem counted once: its 6 distinct problems' τ, not that of the 8 requests, which
    repeat two problems whose τ would pull the chain's to 2.2."""
    from phasegraph.bench.common import BASELINE, CHAIN, TREE
    from phasegraph.bench.report import _real_model_goals, _real_model_lines

    def row(config, tau, tok_s, same=3, batch=1, distinct=None):
        speedup = tok_s / 100.0
        requests = 3 if batch == 1 else batch
        return {"engine": "phasegraph", "config": config, "batch": batch, "requests": requests,
                "tokens_per_s": tok_s, "tau": tau, "speedup": speedup, "eta": speedup / tau if tau else None,
                "identical": same, "requests_distinct": requests if distinct is None else 6,
                "tau_distinct": tau if distinct is None else distinct}

    rows = [row(BASELINE, None, 100.0), row(TREE, 4.5, 240.0, identical),
            row(BASELINE, None, 400.0, 8, batch=8), row(TREE, tree_tau, 900.0, 8, batch=8)]
    rows += [row(CHAIN, 3.9, 200.0), row(CHAIN, 2.2, 700.0, 8, batch=8, distinct=chain_tau)] if chain_tau else []
    part = {"target": "SmolLM2-135M-Instruct", "target_dir": "/cache/smol", "head": "/data/smollm2_eagle3",
            "prompts": "HumanEval's held-out problems through the chat template", "prompts_distinct": 41,
            "prompt_tokens_mean": 180.5, "new_tokens": 256, "dtype": "float32", "draft_dtype": "bfloat16",
            "cuda_graphs": True, "prefill_graphs": True, "batch1_prompts": 3, "rows": rows}
    goals = []
    _real_model_goals(lambda goal, measured, met, note=None: goals.append((goal, measured, met, note)), part)
    (tau_goal, tau_measured, tau_met, _), (same_goal, same_measured, same_met, same_note) = goals
    assert tau_goal == ("real model (SmolLM2-135M-Instruct), held-out HumanEval, greedy, largest batch, "
                        "each problem once: chain τ ≥ 2.5, tree τ ≥ 3.0")
    chain_text = "–" if chain_tau is None else f"{chain_tau:.2f} (batch 8, 6 problems of 8 requests)"
    assert tau_measured == f"chain τ = {chain_text}, tree τ = {tree_tau:.2f} (batch 8, 8 problems)"
    assert same_goal == "real model: greedy outputs identical to the baseline in every row"
    spec_rows = [r for r in rows if r["config"] != BASELINE]
    total = sum(r["requests"] for r in spec_rows)
    assert same_measured == f"{total - 3 + identical}/{total} outputs identical"
    assert [tau_met, same_met] == met
    assert same_note == (None if identical == 3 else f"rows with differences: {TREE} b1: 2/3")
    lines = _real_model_lines(part)
    assert lines[0] == "## 1. Real model: SmolLM2-135M-Instruct"
    assert f"| {TREE} | 1 | 240.0 | 4.50 | 2.40× | {2.4 / 4.5:.2f} | {identical}/3 |" in lines
    assert f"| {TREE} | 8 | 900.0 | {tree_tau:.2f} | 9.00× | {9 / tree_tau:.2f} | 8/8 |" in lines
    assert f"| {BASELINE} | 1 | 100.0 | – | 1.00× | – | 3/3 |" in lines
    # the group not run: both goals not measured, the note alone in bench.md
    goals.clear()
    note = {"note": "the real model (SmolLM2-135M-Instruct) is not run: --no-real-model"}
    _real_model_goals(lambda goal, measured, met, note=None: goals.append((measured, met)), note)
    assert goals == [("not measured", None), ("not measured", None)]
    assert _real_model_lines(note) == ["## 1. Real model: SmolLM2-135M-Instruct", "",
                                       "Note: the real model (SmolLM2-135M-Instruct) is not run: --no-real-model.", ""]


def test_distinct_tau_counts_each_prompt_once():
    """A row larger than its prompt set repeats prompts; τ over each prompt's first request."""
    from phasegraph.bench.pair import _distinct_tau
    from phasegraph.runtime.config import RequestOutput, RequestStats

    def out(prompt, lengths):
        return RequestOutput("r", list(prompt), [1] * sum(lengths), "", "length",
                             stats=RequestStats(accept_lengths=list(lengths)))

    outs = [out([1, 2], [4, 4]), out([3], [1, 1]), out([1, 2], [4, 4]), out([1, 2], [4, 4])]
    assert _distinct_tau(outs) == {"requests_distinct": 2, "tau_distinct": 2.5}  # not (8 + 2 + 16) / 8
    assert _distinct_tau([out([5], [])]) == {"requests_distinct": 1, "tau_distinct": None}
