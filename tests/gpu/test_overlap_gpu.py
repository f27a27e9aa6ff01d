"""The engine's scheduling on the GPU: overlap (the default there) lossless and without hidden
host syncs, the prefix cache under graphs and overlap, adaptive speculation's measured costs.

    python -m pytest -m gpu tests/gpu/test_overlap_gpu.py -q

With ``overlap=True`` a step issues iteration i+1 before it waits for iteration i's tokens; any
other host synchronisation inside a step (a pageable host-to-device copy, a ``.tolist()`` of a
device tensor, a boolean-mask index) would make the host wait for the iteration it has just
issued and quietly undo the overlap. So the steady-state steps here run under
``torch.cuda.set_sync_debug_mode("error")``, except inside ``Scheduler._collect``: the one
synchronisation of an iteration.

A prefill from a cached prefix runs prefill-extend's graph with positions that start past 0 (the
prefix's KV read through the page table), and the overlapped scheduler hands a finished
request's pages to the cache while the next iteration is in flight.

An engine with the default ``adaptive`` measures its cost table at start-up (every shape at
batch 1 and 8, graphs captured on the way), and its greedy outputs equal the baseline's while
the batch drains from 8 to 1 through buckets and shapes; an injected compute-bound table splits
a batch, non-speculating requests running decode beside the others' chain.
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.adaptive import OFF, CostTable, SpecShape
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.scheduler import Scheduler
from tests.engine import support
from tests.gpu.test_cuda_graphs import VOCAB, _noisy_self_draft, _prompts, _reference, _target

pytestmark = pytest.mark.gpu

SPECS = {
    "baseline": SpecConfig(method="none"),
    "chain": SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=1),
    "tree": SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=4, num_draft_tokens=12),
}


@pytest.fixture(scope="module")
def setup():
    target = _target()
    prompts = _prompts(5, seed=7)
    return target, _noisy_self_draft(target), prompts, _reference(target, prompts)


def _engine(setup, name, **kw):
    target, draft, _, _ = setup
    spec = SPECS[name]
    return Engine(target, None if name == "baseline" else draft, spec=spec, max_batch_size=8,
                  kv_pool_tokens=16384, cuda_graphs=True, **kw)


@pytest.mark.parametrize("name", list(SPECS))
def test_overlapped_engine_is_lossless(setup, name):
    _, _, prompts, ref = setup
    eng = _engine(setup, name)
    assert eng.overlap, "overlap scheduling is the default on a GPU"
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert [tuple(o.token_ids) for o in outs] == ref
    eng.check()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name", list(SPECS))
def test_steady_state_step_syncs_only_to_collect(setup, name, overlap, monkeypatch):
    _, _, prompts, _ = setup
    eng = _engine(setup, name, overlap=overlap)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(f"s{i}", p, SamplingParams(max_new_tokens=200, ignore_eos=True))
    for _ in range(4):  # prefill, the eager first iteration, capture
        eng.step()
    collect = Scheduler._collect

    def collect_allowed_to_sync(self, done):
        mode = torch.cuda.get_sync_debug_mode()  # "error" inside the steps; not in check()'s drain
        torch.cuda.set_sync_debug_mode("default")
        try:
            return collect(self, done)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(Scheduler, "_collect", collect_allowed_to_sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(r.output) > 6 for r in eng.scheduler.running)
    eng.check()


@pytest.fixture(scope="module")
def prefixed():
    target = _target()
    g = torch.Generator().manual_seed(3)
    head = torch.randint(0, VOCAB, (70,), generator=g).tolist()
    prompts = [head + torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in (2, 9, 17, 5, 30, 1)]
    prompts.append(head[:40])
    return target, _noisy_self_draft(target), prompts, _reference(target, prompts, new_tokens=48)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", list(SPECS))
def test_cached_prefixes_are_lossless_with_graphs_and_overlap(prefixed, name, page_size):
    target, draft, prompts, ref = prefixed
    eng = Engine(target, None if name == "baseline" else draft, spec=SPECS[name], max_batch_size=8,
                 kv_pool_tokens=16384, cuda_graphs=True, prefill_graphs=True, page_size=page_size,
                 prefix_cache=True)
    assert eng.overlap
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    for _ in range(2):  # the second round reads every prompt from the cache, graphs captured
        outs = eng.generate(prompts, params)
        assert [tuple(o.token_ids) for o in outs] == ref
    assert eng.prefix_cache_stats().cached_tokens >= len(prompts) * 32
    eng.check()
    assert eng.kv.num_free_pages == eng.kv.allocator.total
    eng.clear_prefix_cache()
    assert eng.kv.allocator.num_free == eng.kv.allocator.total


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
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in BUDGETS])
    assert [list(o.token_ids) for o in outs] == baseline
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
