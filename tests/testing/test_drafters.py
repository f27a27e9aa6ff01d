"""The scripted drafters refuse a setup they cannot serve with a named error."""

from __future__ import annotations

import pytest

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import InvalidConfig
from phasegraph.testing.drafters import NoisyOracleDraft, OracleDraft
from tests.phases.lossless_support import VOCAB, prompts, reference, tiny_target


@pytest.mark.parametrize(("make", "message"), [
    (lambda: OracleDraft([1, 2], VOCAB), "OracleDraft: continuations must map each prompt"),  # was AttributeError
    (lambda: OracleDraft({}, 0), "OracleDraft: vocab_size must be an integer >= 2, got 0"),
    (lambda: NoisyOracleDraft({}, VOCAB, accept_rate=2.0),  # was an oracle that never missed
     "NoisyOracleDraft: accept_rate must be a number in \\[0, 1\\], got 2.0"),
    (lambda: NoisyOracleDraft({}, VOCAB, accept_rate=float("nan")), "got nan"),  # was one that never hit
])
def test_bad_drafter_arguments_are_invalid_config(make, message):
    with pytest.raises(InvalidConfig, match=message):
        make()


def _generate(drafter, ps, *, attach=True):
    engine = Engine(tiny_target(), drafter, spec=SpecConfig(method="eagle", num_steps=3, topk=2, num_draft_tokens=6),
                    max_batch_size=len(ps), kv_pool_tokens=8192)
    if attach:
        drafter.engine = engine
    return engine.generate(ps, SamplingParams(max_new_tokens=8, ignore_eos=True))


def test_a_drafter_without_its_engine_or_a_prompt_says_so():
    """Were AttributeError ('NoneType' object has no attribute 'scheduler') and a bare KeyError of
    the prompt's token ids, from inside the drafter's forward."""
    ps, ref = prompts(2), reference(2)
    with pytest.raises(InvalidConfig, match="OracleDraft.engine is not set: assign draft.engine = engine"):
        _generate(OracleDraft(dict(zip(map(tuple, ps), ref, strict=True)), VOCAB), ps, attach=False)
    with pytest.raises(InvalidConfig, match=f"OracleDraft has no continuation for the prompt of request '.*' \\({len(ps[1])} tokens\\)"):
        _generate(OracleDraft({tuple(ps[0]): ref[0]}, VOCAB), ps)
