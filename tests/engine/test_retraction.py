"""Retraction under KV-pool pressure leaves every output unchanged.

32 requests (mixed prompt lengths and budgets, half greedy, half sampled with a seed) run once
with a pool that holds all of them and once with a pool far too small for the workload: the
scheduler must retract (at least 5 times, asserted), requeue and resume them, and every request
must produce exactly the tokens (and logprobs) of the unconstrained run. KV accounting and
host/device agreement are checked after every step (``check_every_step=True``).
"""

from __future__ import annotations

import pytest

from phasegraph.runtime.config import SamplingParams
from tests.engine.support import arch_bundle, assert_all_free, engine_for, make_prompts

N_REQUESTS = 32


def _workload():
    prompts = make_prompts(N_REQUESTS, seed=11)
    params = []
    for i in range(N_REQUESTS):
        budget = 12 + (7 * i) % 21
        if i % 2:
            params.append(SamplingParams(max_new_tokens=budget, temperature=0.8, top_p=0.9,
                                         seed=1000 + i, ignore_eos=True, logprobs=i % 4 == 1))
        else:
            params.append(SamplingParams(max_new_tokens=budget, ignore_eos=True, logprobs=i % 4 == 0))
    return prompts, params


CASES = {
    # name: (method, spec kwargs, page size, pool tokens of the constrained run)
    "baseline-P16": ("none", {}, 16, 192),
    "eagle3-tree-P1": ("eagle3", dict(topk=4, num_steps=3, num_draft_tokens=8), 1, 160),
    "eagle3-tree-P4": ("eagle3", dict(topk=2, num_steps=3), 4, 200),
}


@pytest.mark.parametrize("case", list(CASES))
def test_small_pool_retracts_and_outputs_are_unchanged(engine_root, case):
    method, spec, page_size, pool = CASES[case]
    bundle = arch_bundle(engine_root, "llama")
    prompts, params = _workload()

    free = engine_for(bundle, method, page_size=page_size, max_batch_size=N_REQUESTS, kv_pool_tokens=8192, **spec)
    want = free.generate(prompts, params)
    assert free.num_retractions == 0

    tight = engine_for(bundle, method, page_size=page_size, max_batch_size=N_REQUESTS,
                       kv_pool_tokens=pool, check_every_step=True, **spec)
    got = tight.generate(prompts, params)
    assert tight.num_retractions >= 5, f"only {tight.num_retractions} retractions: the pool is not tight"
    assert sum(o.stats.retractions for o in got) == tight.num_retractions
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} changed under retraction ({g.stats.retractions} retractions)"
        assert g.finish_reason == w.finish_reason == "length"
        assert len(g.token_ids) == params[i].max_new_tokens
        if params[i].logprobs:
            assert len(g.logprobs) == len(g.token_ids)
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        else:
            assert g.logprobs is None
        if method != "none":
            # prefill emits the first token (a resumed request keeps its bonus token instead of
            # drawing a new one); verify steps emit the rest
            assert sum(g.stats.accept_lengths) + 1 == len(g.token_ids)
    assert_all_free(tight)
