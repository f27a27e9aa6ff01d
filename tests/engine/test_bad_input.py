"""Bad input gets a named exception with an actionable message and harms no other request.

Each case starts from an engine with a good request already running, makes the bad call, checks
the exception type and message, checks that nothing was queued and every invariant holds, then
finishes the good request and compares its output with a clean run. Loader errors (a draft that
does not fit the target, a missing or truncated checkpoint file, an unknown method) are made
while such an engine is mid-run, too.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import (
    CheckpointFileError,
    CheckpointMismatch,
    DraftMismatch,
    InvalidConfig,
    InvalidRequest,
    PhasegraphRuntimeError,
)
from phasegraph.testing.checkpoints import (
    write_eagle1_draft,
    write_eagle3_draft,
    write_hf_target,
    write_mtp_draft,
    write_standalone_draft,
)
from tests.engine.support import (
    VOCAB,
    arch_bundle,
    assert_all_free,
    engine_for,
    greedy,
    make_prompts,
    text_bundle,
)

GOOD_PROMPT = [7, 3, 19, 88, 41, 2, 60]


@pytest.fixture(scope="module")
def clean_output(engine_root):
    bundle = arch_bundle(engine_root, "llama")
    eng = engine_for(bundle, "eagle3", topk=2, num_steps=2)
    return eng.generate([GOOD_PROMPT], greedy(16))[0].token_ids


# the tokens request "good" has emitted so far, by engine (busy and _step record them)
_EMITTED: dict[int, list[int]] = {}


@pytest.fixture
def busy(engine_root):
    """An engine with request "good" admitted and running (two steps taken, tokens emitted)."""
    bundle = arch_bundle(engine_root, "llama")
    eng = engine_for(bundle, "eagle3", topk=2, num_steps=2, check_every_step=True)
    eng.add_request("good", GOOD_PROMPT, greedy(16))
    _EMITTED[id(eng)] = []
    _step(eng)
    _step(eng)
    assert _EMITTED[id(eng)] and eng.has_unfinished()
    yield eng
    del _EMITTED[id(eng)]


def _step(eng) -> list:
    """One engine step: its deltas, all of request "good", whose tokens are recorded."""
    deltas = eng.step()
    for d in deltas:
        assert d.request_id == "good", "a bad request was queued"
        _EMITTED[id(eng)] += d.new_token_ids
    return deltas


def _finish_good(eng, clean_output):
    """Runs the good request to its end: it must still be running, emit more, finish by its
    length budget, and its whole output (every step's, the fixture's too) must equal the clean
    run's."""
    assert eng.has_unfinished(), "the good request is no longer running"
    emitted_before = len(_EMITTED[id(eng)])
    reasons = []
    while eng.has_unfinished():
        reasons += [d.finish_reason for d in _step(eng)]
    assert_all_free(eng)
    assert len(_EMITTED[id(eng)]) > emitted_before, "the good request emitted nothing after the bad call"
    assert reasons[-1] == "length"
    assert _EMITTED[id(eng)] == clean_output


def _queued(eng):
    return sorted(r.request_id for r in (*eng.scheduler.running, *eng.scheduler.waiting))


BAD_REQUESTS = {
    # name: (prompt, params factory, exception, words the message must contain)
    "empty-prompt": ([], lambda: greedy(4), InvalidRequest, ["empty"]),
    "empty-string": ("", lambda: greedy(4), InvalidRequest, ["tokenizer"]),
    "too-long-prompt": ([1] * 256, lambda: greedy(4), InvalidRequest, ["256 tokens", "context"]),
    "negative-token": ([3, -1, 5], lambda: greedy(4), InvalidRequest, ["-1", f"[0, {VOCAB})"]),
    "token-equal-vocab": ([3, VOCAB], lambda: greedy(4), InvalidRequest, [str(VOCAB), "vocabulary"]),
    "huge-token": ([2**70], lambda: greedy(4), InvalidRequest, [str(2**70), "vocabulary"]),
    "float-token": ([1.5, 2], lambda: greedy(4), InvalidRequest, ["1.5"]),
    "string-prompt-no-tokenizer": ("hello", lambda: greedy(4), InvalidRequest, ["tokenizer", "token ids"]),
    "not-a-prompt": (42, lambda: greedy(4), InvalidRequest, ["int"]),
    "stop-id-outside-vocab": ([1, 2], lambda: greedy(4, stop_token_ids=[VOCAB + 3]), InvalidRequest, ["stop_token_ids", str(VOCAB + 3)]),
    "logit-bias-outside-vocab": ([1, 2], lambda: greedy(4, logit_bias={2: 1.0, VOCAB: -5.0}), InvalidRequest,
                                 ["logit_bias", str(VOCAB), "vocabulary"]),
    # was: the stop strings silently never matched (no tokenizer to decode the text with)
    "stop-string-no-tokenizer": ([1, 2], lambda: greedy(4, stop=["foo"]), InvalidRequest,
                                 ["stop strings ['foo'] need a tokenizer", "stop_token_ids"]),
    "params-not-sampling-params": ([1, 2], lambda: {"max_new_tokens": 4}, InvalidRequest, ["SamplingParams"]),
    # a 2-D tensor is a batch, not one prompt (it was flattened into one prompt, silently)
    "2d-tensor-prompt": (torch.tensor([[1, 2], [3, 4]]), lambda: greedy(4), InvalidRequest, ["1-D", "[2, 2]"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_harms_nothing(busy, clean_output, case):
    prompt, params, exc, words = BAD_REQUESTS[case]
    before = _queued(busy)
    with pytest.raises(exc) as info:
        busy.add_request(f"bad-{case}", prompt, params())
    for w in words:
        assert w in str(info.value), f"message {str(info.value)!r} lacks {w!r}"
    with pytest.raises(exc):  # generate checks every prompt before running any
        busy.generate([GOOD_PROMPT, prompt], params())
    assert _queued(busy) == before
    busy.check()
    _finish_good(busy, clean_output)


BAD_PARAMS = {
    "max-new-tokens-zero": (dict(max_new_tokens=0), ["max_new_tokens", ">= 1"]),
    "max-new-tokens-negative": (dict(max_new_tokens=-5), ["max_new_tokens"]),
    "max-new-tokens-float": (dict(max_new_tokens=4.0), ["max_new_tokens", "integer"]),
    "temperature-negative": (dict(temperature=-0.1), ["temperature", ">= 0"]),
    "temperature-nan": (dict(temperature=math.nan), ["temperature", "finite"]),
    "temperature-inf": (dict(temperature=math.inf), ["temperature", "finite"]),
    "top-p-zero": (dict(top_p=0.0), ["top_p", "(0, 1]"]),
    "top-p-above-one": (dict(top_p=1.5), ["top_p", "(0, 1]"]),
    "top-p-nan": (dict(top_p=math.nan), ["top_p"]),
    "top-k-negative": (dict(top_k=-1), ["top_k"]),
    "stop-empty-string": (dict(stop=[""]), ["stop"]),
    "stop-id-negative": (dict(stop_token_ids=[-2]), ["stop_token_ids"]),
    "seed-not-int": (dict(seed="7"), ["seed"]),
    # beyond int64 these were accepted, then failed inside a scheduler step, leaking a row
    "seed-beyond-int64": (dict(seed=2**70), ["seed", "64-bit"]),
    "top-k-beyond-int64": (dict(top_k=2**70), ["top_k", "2**63"]),
    "stop-not-a-list": (dict(stop=5), ["stop", "got 5"]),
    "stop-ids-not-a-list": (dict(stop_token_ids=5), ["stop_token_ids", "got 5"]),
    # any non-empty string is truthy: ignore_eos="no" ignored EOS
    "ignore-eos-string": (dict(ignore_eos="no"), ["ignore_eos", "True or False"]),
    "logprobs-string": (dict(logprobs="yes"), ["logprobs", "True or False"]),
    "logprobs-above-20": (dict(logprobs=21), ["logprobs", "[0, 20]", "got 21"]),
    "logprobs-negative": (dict(logprobs=-1), ["logprobs", "[0, 20]"]),
    "logprobs-float": (dict(logprobs=2.5), ["logprobs", "got 2.5"]),
    "prompt-logprobs-above-20": (dict(prompt_logprobs=21), ["prompt_logprobs", "[0, 20]"]),
    "prompt-logprobs-bool": (dict(prompt_logprobs=True), ["prompt_logprobs", "got True"]),
    "min-p-above-one": (dict(min_p=1.5), ["min_p", "[0, 1]"]),
    "min-p-nan": (dict(min_p=math.nan), ["min_p", "finite"]),
    "repetition-zero": (dict(repetition_penalty=0.0), ["repetition_penalty", "> 0"]),
    "repetition-inf": (dict(repetition_penalty=math.inf), ["repetition_penalty", "finite"]),
    "repetition-nan": (dict(repetition_penalty=math.nan), ["repetition_penalty", "finite"]),
    "frequency-above-two": (dict(frequency_penalty=2.5), ["frequency_penalty", "[-2, 2]"]),
    "frequency-minus-inf": (dict(frequency_penalty=-math.inf), ["frequency_penalty", "finite"]),
    "presence-below-minus-two": (dict(presence_penalty=-3), ["presence_penalty", "[-2, 2]"]),
    "presence-nan": (dict(presence_penalty=math.nan), ["presence_penalty", "finite"]),
    "presence-string": (dict(presence_penalty="0.5"), ["presence_penalty", "number"]),
    "logit-bias-nan": (dict(logit_bias={3: math.nan}), ["logit_bias[3]", "finite"]),
    "logit-bias-above-100": (dict(logit_bias={3: 101}), ["logit_bias[3]", "[-100, 100]"]),
    "logit-bias-negative-id": (dict(logit_bias={-1: 1.0}), ["logit_bias", "token ids"]),
    "logit-bias-float-id": (dict(logit_bias={1.5: 1.0}), ["logit_bias", "token ids"]),
    "logit-bias-not-a-mapping": (dict(logit_bias=[3, 1.0]), ["logit_bias", "mapping"]),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_params_are_refused(busy, clean_output, case):
    kw, words = BAD_PARAMS[case]
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kw)
    for w in words:
        assert w in str(info.value), f"message {str(info.value)!r} lacks {w!r}"
    assert isinstance(info.value, ValueError) and isinstance(info.value, PhasegraphRuntimeError)
    busy.check()
    _finish_good(busy, clean_output)


def test_sampling_params_none_lists_and_a_tiny_temperature(busy, clean_output):
    """``stop=None`` / ``stop_token_ids=None`` mean none (was: TypeError); a temperature below
    1e-5 is greedy (was: logits / t overflowing float32 into NaN, then token 0 forever)."""
    params = SamplingParams(stop=None, stop_token_ids=None, temperature=1e-40)
    assert params.stop == () and params.stop_token_ids == () and params.greedy
    want = busy.generate([[3, 9, 27]], greedy(8))[0].token_ids
    got = busy.generate([[3, 9, 27]], greedy(8, temperature=1e-40))[0].token_ids
    assert got == want
    _finish_good(busy, clean_output)


def test_request_ids_are_strings(busy, clean_output):
    """Non-string ids are refused by add_request, abort and retract (abort(["x"]) was a
    TypeError from a dict lookup)."""
    for call in (lambda: busy.add_request(5, [1, 2], greedy(4)),
                 lambda: busy.add_request(None, [1, 2], greedy(4)),
                 lambda: busy.abort(["good"]),
                 lambda: busy.retract(7)):
        with pytest.raises(InvalidRequest, match="a request id is a string"):
            call()
    assert _queued(busy) == ["good"]
    _finish_good(busy, clean_output)


@pytest.mark.parametrize("prompts", [None, (p for p in [[1, 2]]), {(1, 2)}, np.array([1, 2, 3])],
                         ids=["none", "generator", "set", "ndarray"])
def test_generate_takes_a_list_of_prompts(busy, clean_output, prompts):
    with pytest.raises(InvalidRequest, match="prompts must be a list of prompts"):
        busy.generate(prompts, greedy(4))
    assert _queued(busy) == ["good"]
    _finish_good(busy, clean_output)


def test_duplicate_request_id(busy, clean_output):
    with pytest.raises(InvalidRequest, match="'good' is already in use"):
        busy.add_request("good", [1, 2, 3], greedy(4))
    assert _queued(busy) == ["good"]
    _finish_good(busy, clean_output)


def test_request_larger_than_the_pool(engine_root):
    bundle = arch_bundle(engine_root, "llama")
    eng = engine_for(bundle, "none", kv_pool_tokens=64)
    with pytest.raises(InvalidRequest, match="raise kv_pool_tokens"):
        eng.add_request("big", [1] * 40, greedy(40))
    eng.add_request("small", [1] * 10, greedy(10))  # fits
    while eng.has_unfinished():
        eng.step()
    assert_all_free(eng)


BAD_CONFIGS = {
    "unknown-method": (lambda: SpecConfig(method="eagle4"), InvalidConfig, ["eagle4", "eagle3", "standalone"]),
    "topk-zero": (lambda: SpecConfig(method="eagle3", topk=0), InvalidConfig, ["topk"]),
    "too-many-draft-tokens": (lambda: SpecConfig(method="eagle3", topk=1, num_steps=2, num_draft_tokens=9), InvalidConfig, ["num_draft_tokens"]),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_spec_config(busy, clean_output, case):
    make, exc, words = BAD_CONFIGS[case]
    with pytest.raises(exc) as info:
        make()
    for w in words:
        assert w in str(info.value)
    _finish_good(busy, clean_output)


def test_bad_engine_settings(busy, clean_output, engine_root):
    bundle = arch_bundle(engine_root, "llama")
    e3 = dict(spec=SpecConfig(method="eagle3", num_steps=2, topk=2))
    for kw, words in [
        (dict(page_size=0), ["page_size"]),
        (dict(dtype="float8"), ["dtype"]),
        (dict(spec=SpecConfig(method="eagle3"), draft=None), ["draft"]),
        (dict(spec="eagle4"), ["eagle4"]),
        (dict(spec=42), ["SpecConfig"]),
        (dict(max_batch_size=0), ["max_batch_size"]),
        (dict(kv_pool_tokens=0), ["kv_pool_tokens"]),
        (dict(device="tpu"), ["device", "'tpu'", "'cuda:N'"]),
        (dict(device="mps"), ["device", "'mps'", "CPUs and NVIDIA GPUs"]),
        (dict(device=3.5), ["device", "3.5"]),
        (dict(max_context=0), ["max_context", "in [1, 2147483647]", "got 0"]),  # was: silently the default
        # a truthy string turned a switch on ("no" traced, "yes" graphed as if True)
        (dict(trace="no"), ["trace must be one of True, False", "got 'no'"]),
        (dict(overlap="yes"), ["overlap must be one of True, False, None", "got 'yes'"]),
        (dict(cuda_graphs="yes"), ["cuda_graphs must be one of True, False, None, 'emulate'", "got 'yes'"]),
        (dict(check_every_step=1), ["check_every_step", "got 1"]),
        (dict(prefill_graphs="off"), ["prefill_graphs", "got 'off'"]),
        (dict(max_context=-5), ["max_context", "got -5"]),
        (dict(validate="bogus"), ["validate", "'bogus'", "strict"]),  # was: a plain ValueError
        (dict(seed="x"), ["seed", "'x'"]),
        (dict(eos_token_ids=5), ["eos_token_ids", "got 5"]),  # was: TypeError
        (dict(eos_token_ids=[VOCAB]), ["eos_token_ids", f"[0, {VOCAB})"]),
        (dict(cuda_graphs="emulate", graph_buckets=[0, 2]), ["graph_buckets", ">= 1"]),
        (dict(cuda_graphs="emulate", graph_buckets="abc"), ["graph_buckets"]),  # was: TypeError
        (dict(simulate_accept_length=2.5), ["simulate_accept_length", "integer"]),  # was: TypeError
        (dict(dtype=torch.int32), ["dtype", "floating-point", "torch.int32"]),  # was: transformers' ValueError
        (dict(draft_dtype=torch.int64), ["draft_dtype", "torch.int64"]),  # was: nn.Module.to's TypeError
        (dict(dtype=torch.float8_e4m3fn), ["dtype", "float8"]),  # was: TypeError from torch
        # a page larger than the pool: "the pool holds -1000000" at the first request
        (dict(page_size=8192), ["kv_pool_tokens=4096", "page_size=8192", "raise kv_pool_tokens"]),
        # a page table of 2**31 pages for each of 65536 rows (was: MemoryError)
        (dict(max_context=2**31 - 1, max_batch_size=2**16), ["KV cache", "does not fit", "cpu memory"]),
        # sizes past 64 bits: was OverflowError / a torch C++ error from deep inside the KV pool
        (dict(kv_pool_tokens=10**30), ["kv_pool_tokens must be an integer in [1, 2147483647]", str(10**30)]),
        (dict(page_size=10**30), ["page_size must be an integer in [1, 65536]", str(10**30)]),
        (dict(max_batch_size=10**20), ["max_batch_size must be an integer in [1, 65536]", str(10**20)]),
        (dict(max_context=10**30), ["max_context must be an integer in [1, 2147483647]", str(10**30)]),
        # top-k of a 96-token vocabulary: a ValueError from the draft kernel at the first step
        (dict(spec=SpecConfig(method="eagle3", num_steps=2, topk=97)), ["topk=97", "vocabulary of 96"]),
        (dict(spec=SpecConfig(method="standalone", topk=97)), ["topk=97"]),
        # a draft directory and method 'none': the draft was silently ignored
        (dict(spec=SpecConfig(method="none")), ["draft_dir", "method 'none'", "SpecConfig(method=...)"]),
        (dict(target=None), ["target_dir", "None"]),  # was: TypeError from pathlib
        (dict(target=5), ["target_dir", "int"]),
    ]:
        kw = {**e3, **kw}
        method = getattr(kw["spec"], "method", "eagle3")
        draft = kw.pop("draft", bundle.drafts.get(method, bundle.drafts["eagle3"]))
        target = kw.pop("target", bundle.target)
        kw.setdefault("kv_pool_tokens", 4096)
        with pytest.raises(InvalidConfig) as info:
            Engine.from_pretrained(target, draft, **kw)
        for w in words:
            assert w in str(info.value), (kw, str(info.value))
    _finish_good(busy, clean_output)


@pytest.mark.parametrize(("env", "value", "words"), [
    # was: a RuntimeError from inside the first kernel launch, with requests admitted
    ("PHASEGRAPH_KERNELS", "triton", ["PHASEGRAPH_KERNELS=triton, but triton cannot be imported"]),
    ("PHASEGRAPH_KERNELS", "fast", ["PHASEGRAPH_KERNELS='fast'", "auto, reference, triton"]),
    ("PHASEGRAPH_EARLY_WEIGHTS", "maybe", ["PHASEGRAPH_EARLY_WEIGHTS='maybe'", "auto, on, off"]),
])
def test_kernel_settings_are_refused_when_the_engine_is_built(busy, clean_output, engine_root, monkeypatch,
                                                             env, value, words):
    import phasegraph.kernels._dispatch as dispatch

    bundle = arch_bundle(engine_root, "llama")
    monkeypatch.setattr(dispatch, "HAS_TRITON", False)
    monkeypatch.setenv(env, value)
    with pytest.raises(InvalidConfig) as info:
        Engine.from_pretrained(bundle.target, None, kv_pool_tokens=4096)
    for w in words:
        assert w in str(info.value), str(info.value)
    monkeypatch.delenv(env)
    _finish_good(busy, clean_output)


def test_engine_takes_loaded_models_and_no_ignored_draft(busy, clean_output):
    """``Engine(...)`` given paths (meant for from_pretrained) or a draft beside method 'none'."""
    bundle_target, draft = busy.target, busy.draft
    with pytest.raises(InvalidConfig, match=r"takes a loaded model, not the path .*Engine.from_pretrained"):
        Engine("some/target/dir")  # was: AttributeError: 'str' object has no attribute 'device'
    with pytest.raises(InvalidConfig, match="Engine.from_pretrained"):
        Engine(bundle_target, "some/draft/dir", spec=SpecConfig(method="eagle3"))
    with pytest.raises(InvalidConfig, match="a draft was given but spec is method 'none'"):
        Engine(bundle_target, draft)  # was: the draft silently ignored
    # was: AttributeError: 'LlamaForCausalLM' object has no attribute 'kv_spec' (from torch)
    with pytest.raises(InvalidConfig, match=r"takes a phasegraph target model \(HFTarget\(model, feature_mode=\.\.\.\)\); "
                                            r"got LlamaForCausalLM, which lacks .*kv_spec, attach_kv"):
        Engine(bundle_target.model)
    with pytest.raises(InvalidConfig, match="got NoneType"):
        Engine(None)  # was: AttributeError: 'NoneType' object has no attribute 'device'
    with pytest.raises(InvalidConfig, match="takes a phasegraph draft model .* got HFTarget, which lacks uses_features"):
        Engine(bundle_target, bundle_target, spec=SpecConfig(method="eagle3"))
    assert _queued(busy) == ["good"]
    _finish_good(busy, clean_output)


def test_generate_picks_request_ids_no_caller_holds(engine_root):
    """``generate`` names its requests itself; ids a caller gave ``add_request`` must not clash
    with them (was: InvalidRequest "request id 'gen-1-0' is already in use", an id the caller
    never passed to generate)."""
    bundle = arch_bundle(engine_root, "llama")
    prompts = make_prompts([5, 7], seed=3)
    want = [o.token_ids for o in engine_for(bundle, "none").generate(prompts, greedy(6))]
    eng = engine_for(bundle, "none")
    taken = [f"gen-{base}-{i}" for base in range(4) for i in range(2)]
    for rid in taken:
        eng.add_request(rid, [1, 2, 3], greedy(3))
    got = eng.generate(prompts, greedy(6))
    assert [o.token_ids for o in got] == want
    assert sorted(eng._requests) == sorted(taken)  # the caller's requests are still theirs
    while eng.has_unfinished():
        eng.step()
    assert_all_free(eng)


@pytest.mark.parametrize(("name", "text", "words"), [
    ("generation_config.json", "null", "generation_config.json must hold a JSON object; got a NoneType"),
    ("generation_config.json", "[2]", "generation_config.json must hold a JSON object; got a list"),
    ("generation_config.json", '{"eos_token_id": ["x"]}', "eos_token_id must be a token id or a list of them; got ['x']"),
    ("generation_config.json", "{", "generation_config.json: cannot parse generation_config.json"),
    ("tokenizer_config.json", "[]", "cannot load the tokenizer from tokenizer.json, tokenizer_config.json"),
    ("tokenizer.json", "", "cannot load the tokenizer from tokenizer.json"),
])
def test_broken_files_beside_the_weights_name_themselves(busy, clean_output, engine_root, tmp_path, name, text, words):
    """Was: AttributeError / JSONDecodeError / ValueError from deep inside the engine or
    transformers, naming no file."""
    target, _, _ = text_bundle(engine_root)
    d = _copy(target, tmp_path / "t")
    (d / name).write_text(text)
    with pytest.raises(CheckpointFileError) as info:
        Engine.from_pretrained(d, None, kv_pool_tokens=4096)
    assert str(d) in str(info.value) and words in str(info.value), str(info.value)
    assert _queued(busy) == ["good"]
    _finish_good(busy, clean_output)


# ---------------------------------------------------------------------------------------------
# drafts that do not fit the target, broken checkpoint files


def _other_target(tmp_path, **overrides):
    return write_hf_target(tmp_path / "other", "llama", hidden_size=48, vocab_size=VOCAB, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, **overrides)


def _misfit_drafts(tmp_path, target):
    """(method, draft dir, words) of drafts whose hidden size or vocabulary do not fit the
    llama bundle's target (hidden 32, vocabulary 96)."""
    wide = _other_target(tmp_path)  # hidden 48
    big_vocab = write_hf_target(tmp_path / "vocab", "llama", hidden_size=32, vocab_size=VOCAB + 32,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=64)
    return [
        ("eagle", write_eagle1_draft(tmp_path / "e1-wide", wide), ["hidden_size 48", "32"]),
        ("eagle3", write_eagle3_draft(tmp_path / "e3-wide", wide), ["hidden_size 48", "32"]),
        ("mtp", write_mtp_draft(tmp_path / "mtp-wide", wide), ["hidden_size 48", "32"]),
        ("eagle", write_eagle1_draft(tmp_path / "e1-vocab", big_vocab), ["vocab_size 128", "96"]),
        ("eagle3", write_eagle3_draft(tmp_path / "e3-vocab", big_vocab), ["vocab_size 128", "96"]),
        ("mtp", write_mtp_draft(tmp_path / "mtp-vocab", big_vocab), ["vocab_size 128", "96"]),
        ("standalone", write_standalone_draft(tmp_path / "sa-vocab", big_vocab), ["vocab_size 128", "96"]),
        ("eagle3", _eagle3_for_other_features(tmp_path / "e3-features", target), ["features of width 120", "provides 96"]),
    ]


def _eagle3_for_other_features(directory, target):
    """An EAGLE-3 head whose config says it fuses the features of a target of hidden size 40."""
    import json

    write_eagle3_draft(directory, target)
    config = json.loads((directory / "config.json").read_text())
    config["target_hidden_size"] = 40
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_drafts_that_do_not_fit_the_target(busy, clean_output, engine_root, tmp_path):
    bundle = arch_bundle(engine_root, "llama")
    for method, draft, words in _misfit_drafts(tmp_path, bundle.target):
        with pytest.raises(DraftMismatch) as info:
            Engine.from_pretrained(bundle.target, draft, spec=SpecConfig(method=method))
        for w in words:
            assert w in str(info.value), (method, draft.name, str(info.value))
        _step(busy)
    _finish_good(busy, clean_output)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _truncate(path, keep: float):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_missing_and_truncated_checkpoint_files(busy, clean_output, engine_root, tmp_path):
    bundle = arch_bundle(engine_root, "llama")
    sharded = arch_bundle(engine_root, "mistral")  # 2 shards + index
    target, e3 = bundle.target, bundle.drafts["eagle3"]
    cases = []
    t = _copy(target, tmp_path / "t-missing")
    (t / "model.safetensors").unlink()
    cases.append((t, e3, ["no checkpoint file found", "model.safetensors"]))
    t = _copy(target, tmp_path / "t-trunc")
    _truncate(t / "model.safetensors", 0.6)
    cases.append((t, e3, ["model.safetensors", "truncated"]))
    t = _copy(target, tmp_path / "t-header")
    _truncate(t / "model.safetensors", 0.0001)
    cases.append((t, e3, ["model.safetensors", "truncated"]))
    t = _copy(sharded.target, tmp_path / "t-shard-missing")
    (t / "model-00002-of-00002.safetensors").unlink()
    cases.append((t, sharded.drafts["eagle3"], ["model-00002-of-00002.safetensors", "not found"]))
    t = _copy(sharded.target, tmp_path / "t-shard-trunc")
    _truncate(t / "model-00001-of-00002.safetensors", 0.5)
    cases.append((t, sharded.drafts["eagle3"], ["model-00001-of-00002.safetensors", "truncated"]))
    d = _copy(e3, tmp_path / "d-missing")
    (d / "model.safetensors").unlink()
    cases.append((target, d, ["no checkpoint file found"]))
    d = _copy(e3, tmp_path / "d-trunc")
    _truncate(d / "model.safetensors", 0.7)
    cases.append((target, d, ["model.safetensors", "truncated"]))
    cases.append((tmp_path / "nowhere", e3, ["config.json not found"]))
    cases.append((target, tmp_path / "nowhere", ["config.json not found"]))
    for tdir, ddir, words in cases:
        with pytest.raises(CheckpointFileError) as info:
            Engine.from_pretrained(tdir, ddir, spec=SpecConfig(method="eagle3"))
        for w in words:
            assert w in str(info.value), (tdir.name, ddir.name, str(info.value))
        _step(busy)
    _finish_good(busy, clean_output)


def test_draft_with_missing_or_misshaped_keys(busy, clean_output, engine_root, tmp_path):
    from safetensors.torch import load_file, save_file

    bundle = arch_bundle(engine_root, "llama")
    d = _copy(bundle.drafts["eagle3"], tmp_path / "d-keys")
    state = load_file(str(d / "model.safetensors"))
    del state["midlayer.mlp.up_proj.weight"]
    state["fc.weight"] = state["fc.weight"][:, :-1].contiguous()
    state["extra.weight"] = state["norm.weight"].clone()
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointMismatch) as info:
        Engine.from_pretrained(bundle.target, d, spec=SpecConfig(method="eagle3"))
    msg = str(info.value)
    for w in ["midlayer.mlp.up_proj.weight", "extra.weight", "fc.weight", "[32, 95]", "[32, 96]"]:
        assert w in msg, msg
    _finish_good(busy, clean_output)


def test_standalone_draft_with_another_tokenizer(busy, clean_output, engine_root, tmp_path):
    """Same vocabulary size, other token ids: every draft would be rejected, silently (the output
    is still the target's); the loader names a token id the two tokenizers disagree on."""
    import json

    target, drafts, _ = text_bundle(engine_root)
    Engine.from_pretrained(target, drafts["self"], spec=SpecConfig(method="standalone"))  # same: fine
    d = _copy(drafts["self"], tmp_path / "other-tokenizer")
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftMismatch) as info:
        Engine.from_pretrained(target, d, spec=SpecConfig(method="standalone"))
    msg = str(info.value)
    assert "tokenizer differs from the target's: 2 token id(s) name other tokens" in msg, msg
    assert f"id {vocab[b]} is {b!r} for the draft, {a!r} for the target" in msg, msg
    _step(busy)
    _finish_good(busy, clean_output)


def test_string_prompt_without_tokenizer_in_generate(busy, clean_output):
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        busy.generate(["def fib(n):"], greedy(4))
    with pytest.raises(InvalidRequest, match="2 prompts but 3 SamplingParams"):
        busy.generate(make_prompts([3, 4], seed=1), [greedy(4)] * 3)
    _finish_good(busy, clean_output)
