"""On the GPU (Triton kernels, CUDA graphs, overlap scheduling): a target whose logits stop being
finite fails only the request that reached them, which keeps its clean prefix, and a draft
whose logits are not finite only lowers tau, and says so once (tests/engine/test_nonfinite_logits.py is the CPU
version, with the torch references)."""

from __future__ import annotations

import pytest

from phasegraph.runtime.errors import RequestFailed
from tests.engine import support
from tests.engine.test_nonfinite_logits import (
    CLEAN_TOKENS,
    GREEDY,
    LONG,
    POISON_AT,
    SAMPLED,
    SHORT,
    generate_warned,
    poison_draft,
    poisoned_forward,
)

pytestmark = [pytest.mark.gpu]

CONFIGS = {
    "baseline": ("none", {}),
    "eagle3-tree": ("eagle3", dict(topk=2, num_steps=3, num_draft_tokens=6)),
    "standalone-chain": ("standalone", dict(topk=1, num_steps=3)),
}


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_non_finite_logits_fail_one_request_under_graphs_and_overlap(tmp_path_factory, monkeypatch,
                                                                     config, params):
    method, spec = CONFIGS[config]
    bundle = support.arch_bundle(tmp_path_factory.mktemp("nonfinite"), "llama")
    prompts = support.make_prompts([LONG, SHORT], seed=5)
    clean = support.engine_for(bundle, method, page_size=4, **spec).generate(prompts, params)
    engine = support.engine_for(bundle, method, page_size=4, **spec)
    assert engine.device.type == "cuda" and engine.overlap
    monkeypatch.setattr(engine.target, "forward", poisoned_forward(engine.target.forward, POISON_AT))
    with pytest.raises(RequestFailed) as err:
        engine.generate(prompts, params)
    long, short = err.value.outputs
    assert long.finish_reason == "error"
    assert long.token_ids == clean[0].token_ids[:CLEAN_TOKENS]
    assert short.token_ids == clean[1].token_ids and short.finish_reason == "length"
    support.assert_all_free(engine)
    # the captured graphs serve on: the short prompt alone, clean
    assert engine.generate([prompts[1]], params)[0].token_ids == clean[1].token_ids


@pytest.mark.parametrize("steps_only", [False, True], ids=["every-forward", "draft-steps-only"])
@pytest.mark.parametrize("config", ["eagle3-tree", "standalone-chain"])
def test_a_draft_with_non_finite_logits_costs_speed_not_output_under_graphs(tmp_path_factory, monkeypatch,
                                                                           config, steps_only):
    """The Triton top-k kernels given NaN rows still pick in-range tokens; verify rejects them;
    the Triton tree selection flags the NaN scores and the host warns once (boundary mode)."""
    method, spec = CONFIGS[config]
    bundle = support.arch_bundle(tmp_path_factory.mktemp("nonfinite-draft"), "llama")
    prompts = support.make_prompts([LONG, SHORT], seed=5)
    baseline = support.engine_for(bundle, "none", page_size=4).generate(prompts, GREEDY)
    healthy, said = generate_warned(support.engine_for(bundle, method, page_size=4, **spec), prompts, GREEDY)
    assert not said and all(o.stats.nonfinite_drafts == 0 for o in healthy)
    engine = support.engine_for(bundle, method, page_size=4, validate="boundary", **spec)
    assert engine.device.type == "cuda" and engine.overlap
    poison_draft(monkeypatch, engine, steps_only)
    outs, said = generate_warned(engine, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline]
    assert len(said) == 1
    for o in outs:
        assert o.finish_reason == "length"
        assert o.stats.nonfinite_drafts == len(o.stats.accept_lengths) > 0
        if not steps_only:
            assert o.stats.accept_lengths == [1] * (GREEDY.max_new_tokens - 1)
    support.assert_all_free(engine)
