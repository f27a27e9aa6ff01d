"""benchmarks/bench_tp.py on the CPU: the random slice builder and the goals' arithmetic (the
GPU runs happen on the device machine)."""

from __future__ import annotations

import json

import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.tensor_parallel import TensorParallelGroup

from .scripts import load_bench_script

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
         "spec": [{"tau_simulated": 4, "batch": 1, "eta": 0.7}]},
        {"shape": "8B", "tp": 2, "baseline": [{"batch": 1, "decode_step_s": 0.003}], "spec": []},
    ]
    (tmp_path / "tp2.json").write_text(json.dumps({"parts": parts}))
    (tmp_path / "tp1.json").write_text(json.dumps({"parts": [
        {"shape": "8B", "tp": 1, "baseline": [{"batch": 1, "decode_step_s": 0.005}], "spec": []}]}))
    assert bench.main(["--report", str(tmp_path)]) == 0
    lines = (tmp_path / "goals.txt").read_text().splitlines()
    assert lines[0].startswith("70B TP=2 batch-1 decode step 20.00 ms = 83.0 %") and lines[0].count("NOT MET") == 0
    assert lines[1].endswith("NOT MET")  # η 0.70 < 0.75
    assert "= 0.600 (goal <= 0.62): MET" in lines[2]


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
    assert one[-6:] == ["--tp", "1", "--out", str(tmp_path / "o"), "--new-tokens", "64"]
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
    at simulated τ=4, each saved as it is measured."""
    import types

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
        ("chain S=3", 1), ("chain S=3", 3), ("tree K=4 S=4 N=16", 1), ("tree K=4 S=4 N=16", 3)]
    for row in out["spec"]:
        assert row["tau_measured"] > 2  # simulated: several drafts accepted per iteration
        assert row["eta"] == row["speedup"] / row["tau_measured"]
    assert saved == [0, 0, 1, 2, 3, 4]
