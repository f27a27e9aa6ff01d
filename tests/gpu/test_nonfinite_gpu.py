"""On the GPU (Triton kernels, CUDA graphs, overlap scheduling): a target whose logits stop being
finite fails only the request that reached them, which keeps its clean prefix
(tests/engine/test_nonfinite_logits.py is the CPU version, with the torch references)."""

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
