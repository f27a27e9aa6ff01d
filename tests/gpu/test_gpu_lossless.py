"""The lossless matrix of issue 3 on the GPU, fp32, CUDA graphs on (issue 5).

    python -m pytest -m gpu tests/gpu/test_gpu_lossless.py -q

Every legal tree shape of the CPU matrix (topk ∈ {1,2,4,8}, num_steps ∈ {1,2,3,5},
num_draft_tokens ∈ {2, S+1, K·S, 16}) at page size 16 and batch 8, plus page sizes 1 and 4 at
batch sizes 1 and 3 for a chain and a tree shape. The draft is the target with noise on its
lm_head (a real model, so the draft loop is captured; acceptance stops at every depth). Outputs
must equal target-only greedy decoding.
"""

from __future__ import annotations

import pytest

from phasegraph.phases.context import check_tree_shape
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from tests.gpu.test_cuda_graphs import _noisy_self_draft, _prompts, _reference, _target

pytestmark = pytest.mark.gpu

TREES = [(k, s, n) for k in (1, 2, 4, 8) for s in (1, 2, 3, 5) for n in sorted({2, s + 1, k * s, 16})
         if not check_tree_shape(k, s, n)]


@pytest.fixture(scope="module")
def setup():
    target = _target()
    cases = {}
    for batch in (1, 3, 8):
        prompts = _prompts(batch, seed=100 + batch)
        cases[batch] = (prompts, _reference(target, prompts))
    return target, _noisy_self_draft(target), cases


def _run(setup, spec, page_size, batch):
    target, draft, cases = setup
    prompts, ref = cases[batch]
    eng = Engine(target, draft, spec=spec, max_batch_size=8, page_size=page_size,
                 kv_pool_tokens=16384, cuda_graphs=True, check_every_step=True)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert [tuple(o.token_ids) for o in outs] == ref
    assert sum(p["replays"] for p in eng.graph_runner.stats().values()) > 0


@pytest.mark.parametrize(("topk", "steps", "nodes"), TREES, ids=[f"K{k}-S{s}-N{n}" for k, s, n in TREES])
def test_every_tree_shape_with_graphs(setup, topk, steps, nodes):
    _run(setup, SpecConfig(method="standalone", num_steps=steps, topk=topk, num_draft_tokens=nodes), 16, 8)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("topk", "steps", "nodes"), [(1, 3, 4), (4, 3, 12)])
def test_page_sizes_and_batches_with_graphs(setup, page_size, batch, topk, steps, nodes):
    _run(setup, SpecConfig(method="standalone", num_steps=steps, topk=topk, num_draft_tokens=nodes), page_size, batch)
