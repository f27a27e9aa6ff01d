"""The prefix cache on the GPU: CUDA graphs of every phase and of prefill, overlap scheduling,
and Triton attention over borrowed pages change no output.

    python -m pytest -m gpu tests/gpu/test_prefix_cache_gpu.py -q

A prefill from a cached length runs prefill-extend's graph with positions that start past 0 (the
prefix's KV read through the page table), and the overlapped scheduler hands a finished
request's pages to the cache while the next iteration is in flight.
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.config import SamplingParams
from phasegraph.runtime.engine import Engine
from tests.gpu.test_cuda_graphs import VOCAB, _noisy_self_draft, _reference, _target
from tests.gpu.test_overlap_gpu import SPECS

pytestmark = pytest.mark.gpu



@pytest.fixture(scope="module")
def setup():
    target = _target()
    g = torch.Generator().manual_seed(3)
    head = torch.randint(0, VOCAB, (70,), generator=g).tolist()
    prompts = [head + torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in (2, 9, 17, 5, 30, 1)]
    prompts.append(head[:40])
    return target, _noisy_self_draft(target), prompts, _reference(target, prompts, new_tokens=48)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", list(SPECS))
def test_cached_prefixes_are_lossless_with_graphs_and_overlap(setup, name, page_size):
    target, draft, prompts, ref = setup
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
