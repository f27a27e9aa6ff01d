"""Adaptive speculation on the GPU: measured costs, CUDA graphs per bucket and shape, splits.

- An engine with the default ``adaptive`` measures its cost table at start-up (every shape at
  batch 1 and 8, graphs captured on the way), and its greedy outputs equal the baseline's (the
  same engine with ``method="none"``, float32) while the batch drains from 8 to 1 through
  buckets and shapes; each shape that ran replayed its own iteration graphs.
- An injected compute-bound table splits a batch: non-speculating requests run decode beside
  the others' chain, outputs still the baseline's.
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.adaptive import OFF, CostTable, SpecShape
from phasegraph.runtime.config import SamplingParams
from tests.engine import support

pytestmark = pytest.mark.gpu
BUDGETS = (6, 12, 18, 24, 30, 36, 42, 48)


@pytest.fixture(scope="module")
def bundle_and_baseline(tmp_path_factory):
    bundle = support.arch_bundle(tmp_path_factory.mktemp("adaptive-gpu"), "llama")
    prompts = support.make_prompts(8, seed=17)
    engine = support.engine_for(bundle, "none", dtype=torch.float32, max_batch_size=8)
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in BUDGETS])
    return bundle, prompts, [list(o.token_ids) for o in outs]


@pytest.mark.parametrize("method", ["eagle3", "standalone"])
def test_measured_adaptive_speculation_keeps_the_baseline_tokens(bundle_and_baseline, method):
    bundle, prompts, baseline = bundle_and_baseline
    engine = support.engine_for(bundle, method, topk=4, num_steps=3, num_draft_tokens=8, dtype=torch.float32,
                                max_batch_size=8, adaptive=None)
    costs = engine.scheduler.adaptive.costs
    assert costs.batches == (1, 8) and len(costs.shapes) == 4
    assert all(x > 0 for row in costs.seconds for x in row), costs
    print(costs.to_dict())
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in BUDGETS])
    assert [list(o.token_ids) for o in outs] == baseline
    print(engine.trace.notes("draft"), engine.trace.notes("decode"))
    assert engine.graph_runner.stats()["iteration"]["replays"] + engine.graph_runner.stats()["decode"]["replays"] > 0
    support.assert_all_free(engine)


def test_a_split_batch_on_graphs_keeps_the_baseline_tokens(bundle_and_baseline):
    bundle, prompts, baseline = bundle_and_baseline
    chain = SpecShape.chain(3)
    batches = (1, 2, 4, 8)
    table = CostTable((OFF, chain), batches, [[0.01 + 0.1 * b for b in batches], [0.01 + 0.2 * b for b in batches]],
                      0.005)
    engine = support.engine_for(bundle, "eagle3", topk=1, num_steps=3, dtype=torch.float32, max_batch_size=8,
                                adaptive=True, spec_costs=table)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, speculate=i % 2 == 0) for i, n in enumerate(BUDGETS)]
    outs = engine.generate(prompts, params)
    assert [list(o.token_ids) for o in outs] == baseline
    assert any("held: off" in note for note, _ in engine.trace.notes("split"))
    support.assert_all_free(engine)
