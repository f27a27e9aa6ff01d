"""GPU training is reproducible: two runs of the bench pair's recipe (shortened) save the same
weights byte for byte (benchmarks/train_repro.py; under the old warn-only mode SDPA's attention
backward made every file differ)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu]

ROOT = Path(__file__).resolve().parents[2]
SHORTER = ["target_train.steps=20", "target_train.eval_every=10", "head_train.steps=10",
           "head_train.eval_every=5", "draft_train.steps=10", "draft_train.eval_every=5",
           "head.selfgen_seqs=16", "head.selfgen_batch=16"]


def test_two_gpu_trainings_save_identical_weights(tmp_path):
    sets = [arg for s in SHORTER for arg in ("--set", s)]
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_repro.py"), "--out", str(tmp_path),
                           "--runs", "2", *sets], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "train_repro.json").read_text())
    assert result["device"] != "cpu" and not result["warn_only"]
    assert set(result["runs"][0]["hashes"]) == {"target", "eagle3", "draft"}
    assert result["identical_to_run0"] == [True, True] and result["differing_models"] == []
    assert all(not s["stopped_early"] for r in result["runs"] for s in r["stages"].values())


@pytest.mark.parametrize("overrides", [[], ["head.draft_vocab_size=256"]], ids=["tiny", "tiny-draft-vocab"])
def test_every_stage_of_the_recipe_runs_strictly_deterministic_on_the_gpu(tmp_path, overrides):
    """Strict mode raises on any op without a deterministic CUDA kernel: every stage the recipe
    has (with the simulated speculative decode and a reduced draft vocabulary) must have one."""
    from phasegraph.train.presets import PRESETS, apply_overrides
    from phasegraph.train.recipe import run_recipe

    preset = apply_overrides(PRESETS["tiny"], overrides)
    reports = [run_recipe(preset, tmp_path / name, device="cuda", progress=False, log=lambda s: None)
               for name in ("a", "b")]
    assert reports[0]["acceptance"] and reports[0]["acceptance"] == reports[1]["acceptance"]
    for sub in ("target", "eagle3"):
        a, b = (tmp_path / n / sub / "model.safetensors" for n in ("a", "b"))
        assert a.read_bytes() == b.read_bytes(), sub
