"""The embedded demo pair (issue 6): loads through the public path, lossless, real acceptance."""

from __future__ import annotations

import io
import json
import tokenize

import pytest
import torch

from phasegraph import Engine, SamplingParams, SpecConfig
from phasegraph.demo import DEMO_CHAIN, DEMO_TREE, demo_pair_dir, demo_prompts

PROMPTS = 4
TOKENS = 64


@pytest.fixture(scope="module")
def outputs():
    torch.set_num_threads(1)
    prompts = demo_prompts(PROMPTS)
    params = SamplingParams(max_new_tokens=TOKENS)
    pair = demo_pair_dir()
    out = {}
    for name, kw in (("none", {"method": "none"}), ("chain", DEMO_CHAIN), ("tree", DEMO_TREE)):
        spec = SpecConfig(**kw)
        eng = Engine.from_pretrained(pair / "target", pair / "eagle3" if spec.speculative else None,
                                     spec=spec, device="cpu", dtype="float32")
        out[name] = eng.generate(prompts, params)
    return out


def test_files_fit_the_shipping_budget():
    files = [p for p in demo_pair_dir().rglob("*") if p.is_file() and p.suffix in (".json", ".safetensors")]
    sizes = {p.name: p.stat().st_size for p in files}
    total = sum(p.stat().st_size for p in files if p.name != "train_report.json")
    assert total <= 24 * 2**20, sizes
    assert max(sizes.values()) <= 16 * 2**20, sizes
    report = json.loads((demo_pair_dir() / "train_report.json").read_text())
    assert report["preset"] == "demo-pair" and report["seed"] == 0


def test_speculative_output_is_the_baseline_output(outputs):
    base = [o.token_ids for o in outputs["none"]]
    assert all(len(t) == TOKENS or o.finish_reason == "stop" for t, o in zip(base, outputs["none"], strict=True))
    for name in ("chain", "tree"):
        assert [o.token_ids for o in outputs[name]] == base, name


def test_acceptance_is_real(outputs):
    def tau(name):
        lens = [n for o in outputs[name] for n in o.stats.accept_lengths]
        return sum(lens) / len(lens)

    # the pair's measured tau on these held-out prompts (CPU, float32), within a tolerance that
    # float rounding across CPUs stays inside: a bug that only lowers acceptance (the draft
    # extended with features in node order instead of the accepted path's: tree 2.80) fails
    assert tau("chain") == pytest.approx(2.49, abs=0.1)
    assert tau("tree") == pytest.approx(3.37, abs=0.1)


def _tokenizes_as_python(source: str) -> bool:
    """Python's tokenizer reads ``source`` with no error token; a text cut inside a string or a
    bracket (the 64-token budget ends anywhere) counts as Python."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except tokenize.TokenError as exc:
        return str(exc.args[0]).startswith("EOF in multi-line")
    except (IndentationError, SyntaxError):
        return False
    return not any(t.type == tokenize.ERRORTOKEN and t.string.strip() for t in tokens)


def test_completions_are_python(outputs):
    prompts = demo_prompts(PROMPTS)
    for prompt, out in zip(prompts, outputs["none"], strict=True):
        assert _tokenizes_as_python(prompt + out.text), out.text
    text = "".join(o.text for o in outputs["none"])
    keywords = {k for k in ("def ", "class ", "return", "self", "import ", "if ", "for ") if k in text}
    assert len(keywords) >= 2, text
