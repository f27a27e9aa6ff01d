"""``phasegraph generate`` and ``phasegraph graph --trace`` through the CLI's ``main([...])``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phasegraph.cli import main
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from tests.engine.support import arch_bundle, text_bundle

PROMPT = "def fib(n):"


def _expected(target, draft, spec, max_new_tokens, **kw):
    eng = Engine.from_pretrained(target, draft, spec=spec, **kw)
    return eng.generate(PROMPT, SamplingParams(max_new_tokens=max_new_tokens))[0]


def test_generate_speculative_prints_completion_progress_and_acceptance(engine_root, tmp_path, capsys):
    target, drafts, _ = text_bundle(engine_root)
    trace = tmp_path / "run.json"
    rc = main([
        "generate", "--target", str(target), "--draft", str(drafts["eagle3"]), "--method", "eagle3",
        "--prompt", PROMPT, "--max-new-tokens", "48", "--topk", "4", "--num-steps", "3",
        "--num-draft-tokens", "8", "--page-size", "4", "--trace", str(trace),
    ])
    out, err = capsys.readouterr()
    assert rc == 0, err
    want = _expected(target, drafts["eagle3"], SpecConfig(method="eagle3", topk=4, num_steps=3, num_draft_tokens=8),
                     48, page_size=4)
    assert out == want.text + "\n"
    assert f"mean acceptance length: {want.stats.mean_accept_length:.2f}" in err
    assert "generating" in err and "tok" in err  # the tqdm progress bar (48 >= 32 new tokens)
    assert "wrote the phase trace" in err
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"prefill-extend", "draft-extend", "draft", "verify", "finalize-tree-path", "merge", "filter"} <= names

    # the trace overlaid on the drawn graph: visit counts and mean time per edge
    assert main(["graph", "--trace", str(trace)]) == 0
    text = capsys.readouterr().out
    steps = len(want.stats.accept_lengths)
    assert f"verify -> finalize-tree-path  (×{steps} ·" in text
    assert f"draft-extend -> draft  (×{steps - 1} ·" in text  # the first draft follows merge
    assert "merge -> draft  (×1 ·" in text and "draft-extend -> filter  (×1 ·" in text
    assert "visits=" in text and "mean=" in text
    dot = tmp_path / "g.dot"
    assert main(["graph", "--format", "dot", "--trace", str(trace), "--out", str(dot)]) == 0
    assert f'"verify" -> "finalize-tree-path" [label="×{steps} ·' in dot.read_text()


def test_generate_baseline_short_has_no_progress_bar(engine_root, capsys):
    target, _, _ = text_bundle(engine_root)
    rc = main(["generate", "--target", str(target), "--prompt", PROMPT, "--max-new-tokens", "8",
               "--temperature", "0.7", "--seed", "5"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    eng = Engine.from_pretrained(target)
    want = eng.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.7, seed=5))[0]
    assert out == want.text + "\n"
    assert "mean acceptance length: n/a (method none)" in err
    assert "generating" not in err


def test_generate_token_ids_without_tokenizer(engine_root, capsys):
    bundle = arch_bundle(engine_root, "qwen3")
    rc = main(["generate", "--target", str(bundle.target), "--draft", str(bundle.drafts["mtp"]),
               "--method", "mtp", "--prompt-ids", ",".join(map(str, bundle.prompts[1])),
               "--max-new-tokens", "27", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.split() == [str(t) for t in bundle.reference[1]]


def test_generate_says_when_the_context_cut_the_tokens_asked_for(engine_root, capsys):
    bundle = arch_bundle(engine_root, "qwen3")  # max_position_embeddings 256
    prompt = list(bundle.prompts[1])
    assert main(["generate", "--target", str(bundle.target), "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "1000", "--ignore-eos", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 256 - len(prompt)
    assert (f"finish reason: length (the model's context of 256 tokens holds the {len(prompt)}-token "
            f"prompt and {256 - len(prompt)} new ones, not the 1000 asked for)") in err
    assert main(["generate", "--target", str(bundle.target), "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "5", "--ignore-eos", "--no-progress"]) == 0
    assert capsys.readouterr().err.rstrip().endswith("finish reason: length")


def test_generate_text_without_tokenizer_names_the_flag_that_works(engine_root, capsys):
    bundle = arch_bundle(engine_root, "qwen3")
    assert main(["generate", "--target", str(bundle.target), "--prompt", "def f():",
                 "--max-new-tokens", "4", "--no-progress"]) == 2
    out, err = capsys.readouterr()  # err: transformers' weight-loading bar, then the error line
    assert err.splitlines()[-1] == (
        f"phasegraph: error: --target {bundle.target} has no tokenizer, so --prompt TEXT cannot be "
        "encoded: pass the prompt's token ids with --prompt-ids (e.g. --prompt-ids 1,2,3)")
    assert out == "" and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--prompt", PROMPT, "--method", "eagle4", "--draft", "{draft}"], ["--method", "eagle4"]),
        (["--prompt", PROMPT, "--method", "eagle3"], ["needs --draft"]),
        (["--prompt", PROMPT, "--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--prompt", PROMPT, "--temperature", "-1"], ["--temperature"]),
        (["--prompt", PROMPT, "--top-p", "1.5"], ["--top-p"]),
        (["--prompt", PROMPT, "--topk", "0", "--draft", "{draft}"], ["--topk"]),
        (["--prompt", PROMPT, "--page-size", "0"], ["--page-size"]),
        (["--prompt", ""], ["empty"]),
        (["--prompt-ids", "1,x"], ["--prompt-ids"]),
        (["--prompt-ids", "5,100000"], ["outside the vocabulary"]),
        (["--prompt", PROMPT, "--draft", "{missing}"], ["config.json not found"]),
        (["--prompt", PROMPT, "--draft", "{wrong}", "--method", "eagle3"], ["vocab_size"]),
        (["--prompt", PROMPT, "--trace", "{trace_dir}"], ["--trace", "not a writable file"]),
        (["--prompt", PROMPT, "--max-context", "0"], ["--max-context must be"]),
        (["--prompt", PROMPT, "--max-context", "3"], ["the context holds 3, so there is no room"]),
        (["--prompt", PROMPT, "--logprobs", "2"], ["--logprobs needs --jsonl"]),
        (["--prompt", PROMPT, "--logprobs", "21", "--jsonl"], ["--logprobs must be in [0, 20]"]),
        (["--prompt", PROMPT, "--min-p", "2"], ["--min-p must be in [0, 1]"]),
        (["--prompt", PROMPT, "--presence-penalty", "3"], ["--presence-penalty must be in [-2, 2]"]),
        (["--prompt", PROMPT, "--repetition-penalty", "nan"], ["--repetition-penalty must be finite"]),
        (["--prompt", PROMPT, "--json-schema", "{missing}"], ["--json-schema", "no such file"]),
        (["--prompt", PROMPT, "--json-schema", "{not_json}"], ["--json-schema", "JSON"]),
        (["--prompt", PROMPT, "--regex", "a(b"], ["regex", "does not compile"]),
        (["--prompt", PROMPT, "--grammar", "{bad_grammar}"], ["grammar", "does not compile"]),
    ],
    ids=["unknown-method", "no-draft", "max-new-tokens", "temperature", "top-p", "topk", "page-size",
         "empty-prompt", "bad-ids", "ids-outside-vocab", "missing-draft", "draft-misfit", "trace-unwritable",
         "max-context", "max-context-below-prompt", "logprobs-without-jsonl", "logprobs-past-20", "min-p", "presence-penalty", "repetition-penalty-nan",
         "json-schema-missing", "json-schema-not-json", "regex", "grammar"],
)
def test_generate_bad_input_is_one_line_exit_2(engine_root, tmp_path, capsys, args, words):
    target, drafts, _ = text_bundle(engine_root)
    (tmp_path / "not.json").write_text("{oops")
    (tmp_path / "bad.ebnf").write_text("root ::= undefined_rule")
    subs = {"{draft}": str(drafts["eagle3"]), "{missing}": str(tmp_path / "missing"),
            "{wrong}": str(arch_bundle(engine_root, "llama").drafts["eagle3"]), "{trace_dir}": str(tmp_path),
            "{not_json}": str(tmp_path / "not.json"), "{bad_grammar}": str(tmp_path / "bad.ebnf")}
    argv = ["generate", "--target", str(target), "--max-new-tokens", "4", "--no-progress"]
    argv += [subs.get(a, a) for a in args]
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("phasegraph: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err


def test_generate_jsonl_with_penalties_min_p_and_logprobs_equals_the_engine(engine_root, capsys):
    target, drafts, _ = text_bundle(engine_root)
    prompts = [PROMPT, "class Node:"]
    rc = main(["generate", "--target", str(target), "--draft", str(drafts["eagle3"]), "--method", "eagle3",
               "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "12", "--no-progress",
               "--temperature", "0.8", "--seed", "3", "--min-p", "0.05", "--repetition-penalty", "1.2",
               "--frequency-penalty", "0.3", "--presence-penalty", "0.2", "--jsonl", "--logprobs", "3"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, min_p=0.05, repetition_penalty=1.2,
                            frequency_penalty=0.3, presence_penalty=0.2, logprobs=3)
    eng = Engine.from_pretrained(target, drafts["eagle3"], spec=SpecConfig(method="eagle3"))
    want = eng.generate(prompts, params)
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 2
    for line, w in zip(lines, want, strict=True):
        assert (line["text"], line["token_ids"], line["finish_reason"]) == (w.text, w.token_ids, w.finish_reason)
        assert line["accept_lengths"] == w.stats.accept_lengths
        assert line["logprobs"] == pytest.approx(w.logprobs)
        assert [[t for t, _ in alts] for alts in line["top_logprobs"]] == [[t for t, _ in a] for a in w.top_logprobs]


def test_generate_structured_output_follows_the_file_or_regex(engine_root, tmp_path, capsys):
    import jsonschema

    target, _, _ = text_bundle(engine_root)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "answer.ebnf").write_text('root ::= "yes" | "no"')
    eng = Engine.from_pretrained(target)
    printed = {}
    for flag, value, kw in (("--json-schema", str(tmp_path / "schema.json"), {"json_schema": schema}),
                            ("--regex", "(yes|no) [0-9]{1,2}", {"regex": "(yes|no) [0-9]{1,2}"}),
                            ("--grammar", str(tmp_path / "answer.ebnf"), {"grammar": 'root ::= "yes" | "no"'})):
        assert main(["generate", "--target", str(target), "--prompt", PROMPT, "--max-new-tokens", "24",
                     "--no-progress", flag, value]) == 0
        printed[flag] = capsys.readouterr().out
        want = eng.generate(PROMPT, SamplingParams(max_new_tokens=24, **kw))[0]
        assert printed[flag] == want.text + "\n" and want.finish_reason == "stop"
    jsonschema.validate(json.loads(printed["--json-schema"]), schema)
    assert printed["--grammar"] in ("yes\n", "no\n")


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--target", "x", "--prompt", "p", "--max-new-tokens", "many"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("phasegraph: error: argument --max-new-tokens: invalid int value") and err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["generate", "--target", "x"])  # no prompt
    assert capsys.readouterr().err.count("\n") == 1


def _not_a_model(tmp_path, kind: str, target):
    """A --target/--draft path that holds no usable checkpoint."""
    import shutil

    if kind == "file":
        path = tmp_path / "weights.safetensors"
        path.write_text("x")
        return path
    path = shutil.copytree(target, tmp_path / kind)
    config = path / "config.json"
    if kind == "config-list":
        config.write_text("[1, 2]")
    elif kind == "config-heads":
        config.write_text(json.dumps(json.loads(config.read_text()) | {"num_attention_heads": 0}))
    elif kind == "config-rope":
        config.write_text(json.dumps(json.loads(config.read_text())
                                     | {"rope_scaling": {"rope_type": "bogus", "factor": 2.0}, "rope_parameters": None}))
    return path


@pytest.mark.parametrize("role", ["--target", "--draft"])
@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("file", ["config.json not found", "it is a file, not a checkpoint directory"]),
        ("config-list", ["config.json must hold a JSON object; got a list"]),  # was: AttributeError
        ("config-heads", ["num_attention_heads must be an integer >= 1; got 0"]),  # was: ZeroDivisionError
        ("config-rope", ["transformers cannot build a model from this config", "'bogus'"]),  # was: KeyError
    ],
)
def test_generate_a_directory_that_is_no_model_is_one_line_exit_2(engine_root, tmp_path, capsys, role, kind, words):
    bundle = arch_bundle(engine_root, "llama")
    source = bundle.target if role == "--target" else bundle.drafts["eagle3"]
    dirs = {"--target": str(bundle.target), "--draft": str(bundle.drafts["eagle3"])}
    dirs[role] = str(_not_a_model(tmp_path, kind, source))
    capsys.readouterr()
    rc = main(["generate", "--target", dirs["--target"], "--draft", dirs["--draft"], "--method", "eagle3",
               "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("phasegraph: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_generate_an_unwritable_trace_is_refused_before_the_run(engine_root, capsys, monkeypatch):
    """--trace in a directory that takes no file: refused before the engine is built (was: a raw
    errno line after the whole run)."""
    import phasegraph.runtime.engine as engine

    target, _, _ = text_bundle(engine_root)

    def no_run(*args, **kwargs):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(engine.Engine, "from_pretrained", no_run)
    assert main(["generate", "--target", str(target), "--prompt", PROMPT, "--trace", "/proc/pg-trace.json"]) == 2
    err = capsys.readouterr().err
    assert err == "phasegraph: error: --trace /proc/pg-trace.json: cannot be written (No such file or directory)\n"
