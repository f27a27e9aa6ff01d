"""Stop conditions (max_new_tokens, EOS, stop token ids, stop strings) and logprobs.

The target has a tiny byte-level BPE tokenizer saved beside it (``support.text_bundle``), so
prompts may be strings and stop strings apply to the decoded text. Each check runs for the
target alone, an EAGLE-3 tree, and a chain and a tree whose draft is the target itself (many
drafts accepted per step, so a stop lands inside an accepted path). Reference points: the
unconstrained greedy continuation (stops cut it at their first occurrence), transformers'
``generate`` with the same EOS, and transformers' forward rescoring the emitted sequence
(logprobs within 1e-4 of log_softmax of the target's own logits).
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from tests.engine.support import assert_all_free, text_bundle

PROMPTS = ["def fib(n):", "hello", "the quick brown fox"]
NEW = 40
METHODS = {
    "none": (None, SpecConfig(method="none")),
    "eagle3-tree": ("eagle3", SpecConfig(method="eagle3", topk=4, num_steps=3, num_draft_tokens=8)),
    "self-chain": ("self", SpecConfig(method="standalone", topk=1, num_steps=4)),
    # the target as its own draft in a tree: accepted paths run through nodes out of node order,
    # so per-node outputs (logprobs) are right only if compacted along the path
    "self-tree": ("self", SpecConfig(method="standalone", topk=4, num_steps=3, num_draft_tokens=10)),
}


def _engine(root, method, **kw):
    target, drafts, _ = text_bundle(root)
    draft, spec = METHODS[method]
    return Engine.from_pretrained(target, drafts[draft] if draft else None, spec=spec,
                                  page_size=4, check_every_step=True, **kw)


@pytest.fixture(scope="module")
def unconstrained(engine_root):
    """Greedy continuations with nothing but the budget to stop them (target alone)."""
    eng = _engine(engine_root, "none")
    return eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))


def test_tokenizer_is_loaded_and_eos_comes_from_config(engine_root):
    eng = _engine(engine_root, "none")
    _, _, tok = text_bundle(engine_root)
    assert eng.tokenizer is not None
    assert eng.eos_token_ids == (tok.eos_token_id,)
    out = eng.generate("def fib(n):", SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert out.prompt_token_ids == tok("def fib(n):")["input_ids"]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("method", list(METHODS))
def test_max_new_tokens(engine_root, unconstrained, method):
    eng = _engine(engine_root, method)
    for budget in (1, 2, 7):
        outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=budget, ignore_eos=True))
        for o, full in zip(outs, unconstrained, strict=True):
            assert o.finish_reason == "length"
            assert o.token_ids == full.token_ids[:budget]
    assert_all_free(eng)


def _first_new_token(tokens, start=3):
    """(index, token) of a token that first occurs at index >= start."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i, tokens[i]
    raise AssertionError(f"no fresh token in {tokens}")


@pytest.mark.parametrize("method", list(METHODS))
def test_eos_matches_transformers_generate(engine_root, unconstrained, method):
    """With an EOS that the continuation reaches, the output stops there, EOS included, as
    transformers' generate does; ignore_eos runs past it."""
    target, _, tok = text_bundle(engine_root)
    for p, full in zip(PROMPTS, unconstrained, strict=True):
        i, eos = _first_new_token(full.token_ids)
        eng = _engine(engine_root, method, eos_token_ids=(eos,))
        out = eng.generate(p, SamplingParams(max_new_tokens=NEW))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[: i + 1]
        ids = tok(p)["input_ids"]
        assert out.token_ids == _hf_generate_eos(target, ids, eos)
        past = eng.generate(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
        assert past.token_ids == full.token_ids and past.finish_reason == "length"
        assert_all_free(eng)


def _hf_generate_eos(target, ids, eos):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    seq = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)
    return seq[0, len(ids):].tolist()


@pytest.mark.parametrize("method", list(METHODS))
def test_stop_token_ids(engine_root, unconstrained, method):
    eng = _engine(engine_root, method)
    for p, full in zip(PROMPTS, unconstrained, strict=True):
        i, stop = _first_new_token(full.token_ids, start=5)
        out = eng.generate(p, SamplingParams(max_new_tokens=NEW, stop_token_ids=[stop], ignore_eos=True,
                                             logprobs=True))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[: i + 1]
        assert len(out.logprobs) == len(out.token_ids)
    assert_all_free(eng)


def _pick_stop_string(text: str) -> tuple[int, str]:
    for i in range(6, len(text) - 3):
        s = text[i : i + 3]
        if "\ufffd" not in s and s.strip() and text.find(s) == i:
            return i, s
    raise AssertionError(f"no stop string to pick in {text!r}")


@pytest.mark.parametrize("method", list(METHODS))
def test_stop_strings_cut_the_text_and_stream_consistently(engine_root, unconstrained, method):
    _, _, tok = text_bundle(engine_root)
    eng = _engine(engine_root, method)
    for n, (p, full) in enumerate(zip(PROMPTS, unconstrained, strict=True)):
        cut, stop = _pick_stop_string(full.text)
        params = SamplingParams(max_new_tokens=NEW, stop=[stop, "never-generated"], ignore_eos=True, logprobs=True)
        eng.add_request(f"s{n}", p, params)
        tokens, text, reasons = [], "", []
        while eng.has_unfinished():
            for d in eng.step():
                tokens += d.new_token_ids
                text += d.new_text
                if d.finish_reason:
                    reasons.append(d.finish_reason)
        assert reasons == ["stop"]
        assert text == full.text[:cut], "the text must stop right before the stop string"
        assert stop not in text
        # the shortest token prefix whose text reaches the stop string
        k = next(k for k in range(1, NEW + 1) if stop in tok.decode(full.token_ids[:k], skip_special_tokens=True))
        assert tokens == full.token_ids[:k]
        out = eng.generate(p, params)[0]
        assert (out.text, out.token_ids, out.finish_reason) == (text, tokens, "stop")
        assert len(out.logprobs) == len(out.token_ids)
    assert_all_free(eng)


# ---------------------------------------------------------------------------------------------
# logprobs


def _rescore(target, prompt_ids, tokens):
    """log_softmax of transformers' own logits at each emitted token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    seq = torch.tensor([list(prompt_ids) + list(tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
    rows = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(tokens))
    return logp[rows, torch.tensor(tokens)].tolist()


@pytest.mark.parametrize("method", list(METHODS))
def test_logprobs_align_with_the_target(engine_root, method):
    target, _, _ = text_bundle(engine_root)
    eng = _engine(engine_root, method)
    params = [
        SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=19, ignore_eos=True, logprobs=True, temperature=0.8, seed=3),
        SamplingParams(max_new_tokens=21, ignore_eos=True, logprobs=True, temperature=1.3, top_p=0.8, seed=4),
        SamplingParams(max_new_tokens=9, ignore_eos=True),  # no logprobs asked in the same batch
    ]
    outs = eng.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]], params)
    for o, sp in zip(outs, params, strict=True):
        if not sp.logprobs:
            assert o.logprobs is None
            continue
        assert len(o.logprobs) == len(o.token_ids) == sp.max_new_tokens
        want = _rescore(target, o.prompt_token_ids, o.token_ids)
        assert o.logprobs == pytest.approx(want, abs=1e-4)
        assert all(lp <= 0 for lp in o.logprobs)
    assert_all_free(eng)


class _CountingTokenizer:
    """The bundle's tokenizer, counting its decode calls."""

    def __init__(self, inner):
        self.inner, self.decodes = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self.inner.decode(*args, **kwargs)


def test_generate_decodes_each_text_once(engine_root):
    """Without stop strings, generate decodes each request's text once, when it returns (not
    every iteration); the text is the tokenizer's decode of the output."""
    eng = _engine(engine_root, "none")
    counting = _CountingTokenizer(eng.tokenizer)
    eng.tokenizer = counting
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert counting.decodes == len(PROMPTS)
    for o in outs:
        assert len(o.token_ids) == NEW
        assert o.text == counting.inner.decode(o.token_ids, skip_special_tokens=True)


def test_requests_of_the_step_api_lose_nothing_to_generate(engine_root, unconstrained):
    """A request added with add_request runs in the same batch as a generate call; what it
    produced there is reported by the next step() calls, text included."""
    eng = _engine(engine_root, "none")
    eng.add_request("side", PROMPTS[0], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    eng.generate(PROMPTS[1:], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    tokens, text, finish = [], "", None
    for _ in range(NEW + 2):
        if finish is not None:
            break
        for d in eng.step():
            assert d.request_id == "side"
            tokens += d.new_token_ids
            text += d.new_text
            finish = d.finish_reason
    assert finish == "length"
    assert tokens == unconstrained[0].token_ids
    assert text == unconstrained[0].text
    assert_all_free(eng)
