"""The `tiny` preset end to end, the saved formats, determinism, and the CLI."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from safetensors import safe_open

from phasegraph.cli.train import main
from phasegraph.train.eagle3_head import eagle3_aux_layers, load_eagle3_head
from phasegraph.train.presets import PRESETS, apply_overrides
from phasegraph.train.recipe import run_recipe

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fastest setting on a small, shared CPU
    yield
    torch.set_num_threads(threads)


def _run(preset, out, seed=0):
    """Returns the report and the (wall, CPU) seconds the run took."""
    t0, c0 = time.perf_counter(), time.process_time()
    report = run_recipe(preset, out, seed=seed, device="cpu", progress=False, log=lambda s: None)
    return report, (time.perf_counter() - t0, time.process_time() - c0)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, single_thread):
    out = tmp_path_factory.mktemp("tiny")
    report, times = _run(TINY, out)
    return out, report, times


def _tensors(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_tiny_preset_is_fast(tiny_run):
    # CPU time, not wall time: other processes on a shared machine must not fail this test.
    # (About 25 s of either on an idle 2-core machine.)
    _, report, (wall, cpu) = tiny_run
    assert cpu < 60, f"tiny preset used {cpu:.1f}s of CPU ({wall:.1f}s wall)"
    assert report["wall_s"]["total"] <= round(wall, 2)  # the report keeps 2 decimals


def test_files_and_report(tiny_run):
    out, report, _ = tiny_run
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (out / "target" / name).is_file(), name
    for name in ("config.json", "model.safetensors"):
        assert (out / "eagle3" / name).is_file(), name
    assert not (out / "draft").exists()
    on_disk = json.loads((out / "train_report.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    splits = report["corpus"]["splits"]
    assert set(splits) == {"train", "valid", "heldout"}
    assert all(s["files"] > 0 and s["bytes"] > 0 and s["tokens"] > 0 for s in splits.values())
    assert report["target"]["heldout_loss"] > 0
    assert report["target"]["heldout_ppl"] == pytest.approx(
        2.718281828 ** report["target"]["heldout_loss"], rel=1e-3)
    assert len(report["head"]["heldout_agreement_by_step"]) == TINY.head.unroll
    assert all(0 <= a <= 1 for a in report["head"]["heldout_agreement_by_step"])
    acc = report["acceptance"]
    assert 1 <= acc["eagle3_chain"]["tau"] <= TINY.eval.chain_steps + 1
    assert 1 <= acc["eagle3_tree"]["tau"] <= TINY.eval.tree_steps + 1
    assert acc["eagle3_chain"]["verify_steps"] > 0
    assert report["target"]["train"]["steps"] == TINY.target_train.steps
    assert report["head"]["train"]["steps"] == TINY.head_train.steps
    assert not report["stopped_early"]
    assert {"torch", "transformers", "tokenizers", "python"} <= set(report["versions"])
    sizes = {n: (out / "target" / n).stat().st_size for n in report["files"]["target"]}
    assert sizes == report["files"]["target"]
    assert report["package_size"]["within_budget"]


def test_target_and_tokenizer_load_with_transformers(tiny_run, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out, _, _ = tiny_run
    tok = AutoTokenizer.from_pretrained(out / "target")
    model = AutoModelForCausalLM.from_pretrained(out / "target")
    assert model.dtype == torch.bfloat16
    cfg = model.config
    assert cfg.vocab_size == TINY.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id == 0
    assert cfg.bos_token_id == cfg.pad_token_id == 0
    assert cfg.num_hidden_layers == TINY.target.num_layers
    assert cfg.tie_word_embeddings
    assert model.generation_config.eos_token_id == 0
    ids = tok("def main():\n    return 0\n", return_tensors="pt")["input_ids"]
    assert ids[0, 0] != tok.eos_token_id  # nothing prepended
    with torch.no_grad():
        logits = model.float()(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    tensors = _tensors(out / "target" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert "lm_head.weight" not in tensors  # tied: stored once


def test_head_checkpoint_matches_the_target(tiny_run):
    out, report, _ = tiny_run
    cfg = json.loads((out / "eagle3" / "config.json").read_text())
    t_cfg = json.loads((out / "target" / "config.json").read_text())
    h = t_cfg["hidden_size"]
    assert cfg["num_hidden_layers"] == 1
    assert cfg["hidden_size"] == cfg["target_hidden_size"] == h
    assert cfg["eagle_aux_layers"] == list(eagle3_aux_layers(t_cfg["num_hidden_layers"]))
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == t_cfg["vocab_size"]
    assert cfg["rope_theta"] == t_cfg["rope_parameters"]["rope_theta"]
    tensors = _tensors(out / "eagle3" / "model.safetensors")
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (nh * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (nkv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (nkv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nh * d),
        "midlayer.mlp.gate_proj.weight": (cfg["intermediate_size"], h),
        "midlayer.mlp.up_proj.weight": (cfg["intermediate_size"], h),
        "midlayer.mlp.down_proj.weight": (h, cfg["intermediate_size"]),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (cfg["draft_vocab_size"], h),
    }
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())
    head = load_eagle3_head(out / "eagle3")
    assert head.cfg.eagle_aux_layers == eagle3_aux_layers(t_cfg["num_hidden_layers"])


def _small(preset):
    return apply_overrides(preset, [
        "corpus.max_train_bytes=250000", "corpus.max_valid_bytes=30000",
        "corpus.max_heldout_bytes=40000", "target_train.steps=4", "target_train.eval_every=2",
        "head_train.steps=3", "head_train.eval_every=2", "head.selfgen_seqs=4",
        "head.selfgen_batch=2", "eval.max_prompts=2", "eval.gen_tokens=10",
    ])


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, single_thread):
    preset = _small(TINY)
    reports = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        reports[name], _ = _run(preset, tmp_path / name, seed=seed)
    for sub in ("target", "eagle3"):
        a = _tensors(tmp_path / "a" / sub / "model.safetensors")
        b = _tensors(tmp_path / "b" / sub / "model.safetensors")
        c = _tensors(tmp_path / "c" / sub / "model.safetensors")
        assert a.keys() == b.keys() == c.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), sub
        assert not all(torch.equal(a[k], c[k]) for k in a), sub
    assert (tmp_path / "a" / "target" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "target" / "tokenizer.json").read_bytes()
    ra, rb = reports["a"], reports["b"]
    assert ra["target"]["heldout_loss"] == rb["target"]["heldout_loss"]
    assert ra["head"]["heldout_agreement_by_step"] == rb["head"]["heldout_agreement_by_step"]
    assert ra["acceptance"] == rb["acceptance"]


def test_training_runs_strictly_deterministic_kernels_and_restores_the_flags(tmp_path, single_thread, monkeypatch):
    """Warn-only mode lets SDPA's nondeterministic attention backward run on a GPU (the bench's
    pair then differed from run to run); the recipe asks for the strict mode."""
    seen = []
    real = torch.use_deterministic_algorithms

    def spy(mode, *, warn_only=False):
        seen.append((mode, warn_only))
        real(mode, warn_only=warn_only)

    monkeypatch.setattr(torch, "use_deterministic_algorithms", spy)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    _run(apply_overrides(_small(TINY), ["target_train.steps=2", "head_train.steps=1"]), tmp_path)
    assert seen[0] == (True, False)
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == before


def test_time_budget_stops_early_and_records_it(tmp_path, single_thread):
    preset = apply_overrides(_small(TINY), ["target_train.steps=100000"])
    report = run_recipe(preset, tmp_path, seed=0, device="cpu", time_budget_s=10.0,
                        progress=False, log=lambda s: None)
    assert report["stopped_early"]
    assert report["target"]["train"]["stopped_early"]
    assert 0 < report["target"]["train"]["steps"] < 100000


def test_cli_plan_and_overrides(capsys):
    assert main(["demo-pair", "--plan"]) == 0
    text = capsys.readouterr().out
    assert "target" in text and "eagle3 head" in text and "projected H100 time" in text
    with pytest.raises(SystemExit) as exited:  # a one-line usage error, not a traceback
        main(["tiny", "--plan", "--set", "target_train.nope=1"])
    assert exited.value.code == 2
    assert "error: unknown preset field 'target_train.nope'" in capsys.readouterr().err
    assert apply_overrides(TINY, ["head.draft_vocab_size=256"]).head.draft_vocab_size == 256
    with pytest.raises(ValueError, match=r"override 'eval.max_prompts=abc': expected an integer, got 'abc'"):
        apply_overrides(TINY, ["eval.max_prompts=abc"])
    with pytest.raises(ValueError, match=r"override 'target_train.lr=fast': expected a number"):
        apply_overrides(TINY, ["target_train.lr=fast"])
    # values out of a field's range: refused where they are given, not deep inside training
    for item, message in [
        ("target_train.steps=-5", "steps must be 0 or more"),
        ("target.hidden_size=0", "hidden_size must be greater than 0"),
        ("head_train.lr=-1e-3", "lr must be greater than 0"),
        ("target_train.lr=nan", "expected a finite number, got 'nan'"),
        ("eval.max_prompts=-1", "max_prompts must be 0 or more"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"override {item!r}: {message}")):
            apply_overrides(TINY, [item])
    assert apply_overrides(TINY, ["target_train.steps=0"]).target_train.steps == 0
    with pytest.raises(SystemExit):
        main(["tiny"])  # --out missing


def test_no_acceptance_check_with_zero_prompts(tmp_path, single_thread):
    """``eval.max_prompts=0`` (what ``phasegraph bench`` passes: it measures τ on the engine)
    skips the simulated speculative decode; the report and its summary say so."""
    lines = []
    preset = apply_overrides(_small(TINY), ["eval.max_prompts=0"])
    report = run_recipe(preset, tmp_path, seed=0, device="cpu", progress=False, log=lines.append)
    assert report["acceptance"] is None
    assert "acceptance" not in report["wall_s"]
    assert json.loads((tmp_path / "train_report.json").read_text())["acceptance"] is None
    assert "simulated tau (held-out) | not run (eval.max_prompts=0)" in lines[-1]
    assert (tmp_path / "eagle3" / "model.safetensors").is_file()


def test_training_refuses_a_directory_that_holds_files(tmp_path, capsys, single_thread):
    """Nothing lost: the recipe and its CLI refuse to train into a non-empty directory before
    they read or write anything; ``overwrite=True`` (``--overwrite``) trains there on purpose and
    leaves the files it does not write alone."""
    out = tmp_path / "pair"
    (out / "target").mkdir(parents=True)
    (out / "target" / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"pair is not empty \(notes.txt, target\): training would overwrite"):
        run_recipe(TINY, out, device="cpu", progress=False, log=lambda s: None)
    with pytest.raises(SystemExit) as exited:
        main(["tiny", "--out", str(out)])
    assert exited.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == ["config.json", "notes.txt", "target"]
    assert (out / "target" / "config.json").read_text() == "{}"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        run_recipe(TINY, tmp_path / "file", device="cpu", progress=False, log=lambda s: None)

    report = run_recipe(_small(TINY), out, device="cpu", progress=False, log=lambda s: None, overwrite=True)
    assert report["target"]["params"] > 0
    assert json.loads((out / "target" / "config.json").read_text())["model_type"] == "llama"
    assert (out / "notes.txt").read_text() == "mine"
