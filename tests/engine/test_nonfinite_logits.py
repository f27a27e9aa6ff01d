"""A target whose logits stop being finite mid-run fails that request loudly and no other.

The target's ``forward`` is wrapped so that every logits row at a position >= ``POISON_AT``
holds NaN (or +inf), as a float16 model's overflowing activations would. Only the long-prompt
request ever reaches that position. It must end with finish reason ``"error"`` and an error
naming the first bad token, keeping exactly the tokens a clean run emits before it (the greedy
argmax of a NaN row is its first NaN's id, so without the check it would go on emitting garbage).
The short-prompt request must come out as in a clean run, and every KV page must come back.

A draft model whose logits are not finite harms no output: its drafts are rejected, so every
verify accepts only the bonus token (tau 1). It is not silent either: the engine warns once
(``NonFiniteDraftWarning``), ``stats.nonfinite_drafts`` counts the verify steps, and strict
validation names the bad top-k or the tree's non-finite scores.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from phasegraph.cli import main
from phasegraph.phases.protocols import DraftOutput, TargetOutput
from phasegraph.runtime.config import SamplingParams
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import NonFiniteDraftWarning, RequestFailed
from phasegraph.runtime.models.eagle3 import Eagle3Draft
from phasegraph.runtime.models.target import HFTarget
from phasegraph.statemachine import InvariantViolation
from phasegraph.statemachine.modes import validation_mode
from tests.engine.support import (
    arch_bundle,
    assert_all_free,
    engine_for,
    make_prompts,
    text_bundle,
)

LONG, SHORT = 40, 5  # prompt lengths: the long request crosses POISON_AT, the short never does
CLEAN_TOKENS = 6  # the long request's output tokens 0..5 come from logits at positions < 45
POISON_AT = LONG + CLEAN_TOKENS - 1  # logits at this position choose output token CLEAN_TOKENS
NEW_TOKENS = 16  # the short request reaches position SHORT + 16 < POISON_AT

CONFIGS = {
    "baseline": ("none", {}),
    "eagle3-tree": ("eagle3", dict(topk=2, num_steps=3, num_draft_tokens=6)),
    "mtp-chain": ("mtp", dict(topk=1, num_steps=2)),
    "standalone-tree": ("standalone", dict(topk=2, num_steps=2, num_draft_tokens=4)),
}
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=30, seed=11, ignore_eos=True)


def poisoned_forward(real, at: int, value: float = float("nan")):
    """``real`` (a target's forward) with every logits row at a position >= ``at`` set to ``value``."""

    def forward(input_ids, positions, attn, logits_index=None) -> TargetOutput:
        out = real(input_ids, positions, attn, logits_index)
        row_positions = positions if logits_index is None else positions[logits_index]
        logits = out.logits.masked_fill((row_positions >= at)[:, None], value)
        return TargetOutput(logits=logits, features=out.features)

    return forward


def _poison(monkeypatch, engine, at: int = POISON_AT, value: float = float("nan")) -> None:
    monkeypatch.setattr(engine.target, "forward", poisoned_forward(engine.target.forward, at, value))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_only_the_request_with_non_finite_logits_fails_and_keeps_its_clean_prefix(
    engine_root, monkeypatch, config, params
):
    method, spec = CONFIGS[config]
    bundle = arch_bundle(engine_root, "llama")
    prompts = make_prompts([LONG, SHORT], seed=5)
    clean = engine_for(bundle, method, page_size=4, **spec).generate(prompts, params)

    engine = engine_for(bundle, method, page_size=4, check_every_step=True, overlap=True, **spec)
    _poison(monkeypatch, engine)
    with pytest.raises(RequestFailed) as err:
        engine.generate(prompts, params)
    long, short = err.value.outputs
    assert err.value.failed == [long]
    assert long.finish_reason == "error"
    assert long.token_ids == clean[0].token_ids[:CLEAN_TOKENS]
    assert f"logits for output token {CLEAN_TOKENS} were not finite" in long.error
    assert str(err.value).startswith(f"request {long.request_id} failed after {CLEAN_TOKENS} tokens: ")
    assert short.finish_reason == "length" and short.error is None
    assert short.token_ids == clean[1].token_ids
    assert_all_free(engine)
    # the engine serves on: the short prompt alone, clean
    assert engine.generate([prompts[1]], params)[0].token_ids == clean[1].token_ids


@pytest.mark.parametrize("value", [float("inf"), float("-inf")], ids=["+inf", "all -inf"])
def test_infinite_rows_fail_too(engine_root, monkeypatch, value):
    bundle = arch_bundle(engine_root, "llama")
    prompts = make_prompts([LONG], seed=5)
    engine = engine_for(bundle, "eagle3", topk=2, num_steps=3, num_draft_tokens=6, page_size=4)
    clean = engine.generate(prompts, GREEDY)[0]
    _poison(monkeypatch, engine, value=value)
    with pytest.raises(RequestFailed) as err:
        engine.generate(prompts, GREEDY)
    assert err.value.outputs[0].token_ids == clean.token_ids[:CLEAN_TOKENS]


@pytest.mark.parametrize("config", ["baseline", "eagle3-tree"])
def test_non_finite_logits_at_the_first_token_fail_at_prefill(engine_root, monkeypatch, config):
    method, spec = CONFIGS[config]
    bundle = arch_bundle(engine_root, "llama")
    prompts = make_prompts([LONG, SHORT], seed=5)
    clean = engine_for(bundle, method, page_size=4, **spec).generate(prompts, GREEDY)
    engine = engine_for(bundle, method, page_size=4, **spec)
    _poison(monkeypatch, engine, at=LONG - 1)  # the prompt's last row chooses output token 0
    with pytest.raises(RequestFailed) as err:
        engine.generate(prompts, GREEDY)
    long, short = err.value.outputs
    assert long.finish_reason == "error" and long.token_ids == []
    assert "logits for output token 0 were not finite" in long.error
    assert short.token_ids == clean[1].token_ids
    assert_all_free(engine)


def test_step_api_reports_the_error_in_the_delta(engine_root, monkeypatch):
    bundle = arch_bundle(engine_root, "llama")
    prompts = make_prompts([LONG, SHORT], seed=5)
    engine = engine_for(bundle, "eagle3", topk=2, num_steps=3, num_draft_tokens=6, page_size=4)
    _poison(monkeypatch, engine)
    engine.add_request("long", prompts[0], GREEDY)
    engine.add_request("short", prompts[1], GREEDY)
    tokens, finish, errors = {"long": [], "short": []}, {}, {}
    while engine.has_unfinished():
        for d in engine.step():
            tokens[d.request_id] += d.new_token_ids
            if d.finish_reason is not None:
                finish[d.request_id], errors[d.request_id] = d.finish_reason, d.error
    assert finish == {"long": "error", "short": "length"}
    assert len(tokens["long"]) == CLEAN_TOKENS and len(tokens["short"]) == NEW_TOKENS
    assert "not finite" in errors["long"] and errors["short"] is None
    assert_all_free(engine)


def test_cli_generate_prints_the_clean_prefix_and_the_error(engine_root, monkeypatch, capsys):
    target, _, _ = text_bundle(engine_root)
    prefix = Engine.from_pretrained(target).generate(
        [[11, 12, 13, 14, 15]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    real = HFTarget.forward

    def forward(self, input_ids, positions, attn, logits_index=None):
        poisoned = poisoned_forward(real.__get__(self), at=5 + 2)  # 5 prompt ids: tokens 0..2 clean
        return poisoned(input_ids, positions, attn, logits_index)

    monkeypatch.setattr(HFTarget, "forward", forward)
    rc = main(["generate", "--target", str(target), "--prompt-ids", "11,12,13,14,15",
               "--max-new-tokens", "12", "--method", "none", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 2  # the CLI's error status
    assert out == prefix.text + "\n"  # what came before the failure
    assert "failed after 3 tokens" in err and "were not finite (NaN or infinity)" in err
    assert "Traceback" not in err


def poisoned_draft_forward(real, steps_only: bool = False):
    """``real`` (a draft's forward) with every logits row NaN; ``steps_only``: only in the
    draft phase's own forwards (``from_target=False``), not in draft-extend's."""

    def forward(*args, **kwargs) -> DraftOutput:
        out = real(*args, **kwargs)
        if steps_only and kwargs["from_target"]:
            return out
        return DraftOutput(logits=torch.full_like(out.logits, float("nan")), hidden=out.hidden,
                           hidden_rows=out.hidden_rows)

    return forward


def poison_draft(monkeypatch, engine, steps_only: bool = False) -> None:
    """Every logits row the draft model returns holds NaN (``steps_only``: see above)."""
    monkeypatch.setattr(engine.draft, "forward", poisoned_draft_forward(engine.draft.forward, steps_only))


def generate_warned(engine, prompts, params) -> tuple[list, list[warnings.WarningMessage]]:
    """``engine.generate``'s outputs and the NonFiniteDraftWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = engine.generate(prompts, params)
    return outs, [w for w in caught if issubclass(w.category, NonFiniteDraftWarning)]


@pytest.mark.parametrize("steps_only", [False, True], ids=["every-forward", "draft-steps-only"])
@pytest.mark.parametrize("config", ["eagle3-tree", "mtp-chain", "standalone-tree"])
def test_a_draft_with_non_finite_logits_costs_speed_not_output(engine_root, monkeypatch, config,
                                                               steps_only):
    method, spec = CONFIGS[config]
    bundle = arch_bundle(engine_root, "llama")
    prompts = make_prompts([LONG, SHORT], seed=5)
    baseline = engine_for(bundle, "none", page_size=4).generate(prompts, GREEDY)

    healthy, said = generate_warned(engine_for(bundle, method, page_size=4, **spec), prompts, GREEDY)
    assert not said and all(o.stats.nonfinite_drafts == 0 for o in healthy)

    engine = engine_for(bundle, method, page_size=4, validate="boundary", **spec)
    poison_draft(monkeypatch, engine, steps_only)
    outs, said = generate_warned(engine, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline]
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
    if not steps_only:  # every verify accepted the bonus token alone
        for o in outs:
            assert o.stats.accept_lengths == [1] * (NEW_TOKENS - 1)
    # loud, once: every verify step of both requests counted
    assert len(said) == 1
    assert "the draft's logits were not finite (NaN or infinity)" in str(said[0].message)
    assert [o.stats.nonfinite_drafts for o in outs] == [len(o.stats.accept_lengths) for o in outs]
    assert all(o.stats.nonfinite_drafts > 0 for o in outs)
    assert_all_free(engine)

    strict = engine_for(bundle, method, page_size=4, validate="strict", **spec)
    poison_draft(monkeypatch, strict, steps_only)
    where = (r"phase 'draft'.*the draft's candidate scores are finite.*NaN or infinite" if steps_only
             else r"draft-extend.*0 <= topk_p <= 1.*nan")
    with pytest.raises(InvariantViolation, match=where):
        strict.generate(prompts, GREEDY)


def test_a_non_finite_draft_is_counted_when_sampling_too(engine_root, monkeypatch):
    """Sampled verify may accept a NaN draft's in-range token (the target drew it): every step
    is still counted, whatever it accepted."""
    bundle = arch_bundle(engine_root, "llama")
    engine = engine_for(bundle, "eagle3", page_size=4, validate="boundary", **CONFIGS["eagle3-tree"][1])
    poison_draft(monkeypatch, engine)
    outs, said = generate_warned(engine, make_prompts([LONG, SHORT], seed=5), SAMPLED)
    assert len(said) == 1 and all(o.finish_reason == "length" for o in outs)
    assert [o.stats.nonfinite_drafts for o in outs] == [len(o.stats.accept_lengths) for o in outs]


def test_cli_generate_says_when_the_draft_was_not_finite(engine_root, monkeypatch, capsys):
    target, drafts, _ = text_bundle(engine_root)
    real = Eagle3Draft.forward
    monkeypatch.setattr(Eagle3Draft, "forward",
                        lambda self, *a, **k: poisoned_draft_forward(real.__get__(self))(*a, **k))
    clean = Engine.from_pretrained(target).generate(
        [[11, 12, 13, 14, 15]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    argv = ["generate", "--target", str(target), "--draft", str(drafts["eagle3"]), "--method", "eagle3",
            "--prompt-ids", "11,12,13,14,15", "--max-new-tokens", "8", "--ignore-eos", "--no-progress"]
    # strict validation (the pytest plugin's default) stops at the NaN top-k, in one line
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "phasegraph: error: DraftState (output of phase 'draft-extend')" in err and "topk_p [nan]" in err
    assert "Traceback" not in err

    with validation_mode("boundary"), warnings.catch_warnings():  # the library's default
        warnings.simplefilter("error")  # the CLI says it in its summary line, not as a warning
        rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0 and out == clean.text + "\n", err
    assert "mean acceptance length: 1.00 over 7 verify steps (in 7 of them the draft's logits were not finite" in err
    assert "Traceback" not in err
