"""The prefix cache changes no output: every request produces the tokens (and logprobs) of the
same engine without the cache, for chain and tree drafting, EAGLE-3, EAGLE-1, a standalone draft
and the target alone, page sizes 1 and 16, CUDA graphs emulated on the CPU, and a pool so small
that the scheduler retracts. Afterwards the pool is free but for the cache's own pages, which
clearing gives back (no leak). The workload shares prefixes every way the tree must handle:
a common head, identical prompts, a prompt that is another's prefix, a later wave that goes on
from an earlier request's output, and sampled requests beside greedy ones."""

from __future__ import annotations

import pytest

from phasegraph.runtime.config import SamplingParams

from .support import arch_bundle, assert_all_free, engine_for, greedy, make_prompts

HEAD = 40  # tokens every prompt of the first wave starts with


def _waves():
    head = make_prompts([HEAD], seed=5)[0]
    tails = make_prompts([3, 9, 1, 17, 6, 12, 4, 20], seed=6)
    first = [head + t for t in tails] + [list(head + tails[1]), head[:25]]
    params = []
    for i in range(len(first)):
        budget = 10 + (5 * i) % 13
        if i % 3 == 1:
            params.append(SamplingParams(max_new_tokens=budget, temperature=0.9, top_p=0.95, seed=70 + i,
                                         ignore_eos=True, logprobs=True))
        else:  # one asks for prompt logprobs: it prefills every prompt token beside cached ones
            params.append(SamplingParams(max_new_tokens=budget, ignore_eos=True, prompt_logprobs=2 if i == 5 else None))
    return first, params


def _run(engine, with_second_wave: bool = True):
    prompts, params = _waves()
    outs = engine.generate(prompts, params)
    if not with_second_wave:
        return outs
    # go on from the first wave's outputs: their committed KV was cached when they finished
    again = [list(p) + list(o.token_ids[:-2]) + [3] for p, o in zip(prompts[:4], outs[:4], strict=True)]
    return outs + engine.generate(again, [SamplingParams(max_new_tokens=8, ignore_eos=True)] * 4)


CASES = {
    # name: (method, spec kwargs, page size, extra engine options)
    "none-P1": ("none", {}, 1, {}),
    "none-P16": ("none", {}, 16, {}),
    "eagle3-chain-P1": ("eagle3", dict(topk=1, num_steps=3), 1, {}),
    "eagle3-tree-P16": ("eagle3", dict(topk=4, num_steps=3, num_draft_tokens=8), 16, {}),
    "eagle3-tree-P1-graphs": ("eagle3", dict(topk=4, num_steps=3, num_draft_tokens=8), 1,
                              dict(cuda_graphs="emulate")),
    "eagle1-tree-P4": ("eagle", dict(topk=2, num_steps=3), 4, {}),
    "mtp-chain-P1": ("mtp", dict(topk=1, num_steps=2), 1, {}),
    "eagle3-chain-P16-prefill-graphs": ("eagle3", dict(topk=1, num_steps=3), 16,
                                        dict(cuda_graphs="emulate", prefill_graphs=True)),
    "standalone-chain-P16": ("standalone", dict(topk=1, num_steps=3), 16, {}),
    "standalone-tree-P1": ("standalone", dict(topk=2, num_steps=3, num_draft_tokens=6), 1, {}),
    "eagle3-tree-P4-overlap": ("eagle3", dict(topk=2, num_steps=3, num_draft_tokens=6), 4, dict(overlap=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_equal_without_the_cache(engine_root, case):
    method, spec, page_size, extra = CASES[case]
    bundle = arch_bundle(engine_root, "llama")
    want = _run(engine_for(bundle, method, page_size=page_size, **spec, **extra))
    cached = engine_for(bundle, method, page_size=page_size, prefix_cache=True, check_every_step=True,
                        **spec, **extra)
    got = _run(cached)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} changed with the prefix cache"
        # drafts never change an output: equal acceptance shows the cached draft KV is right too
        assert g.stats.accept_lengths == w.stats.accept_lengths, f"request {i}: other drafts with the cache"
        assert (g.logprobs is None) == (w.logprobs is None)
        if g.logprobs is not None:
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None) == (i != 5)
        if g.prompt_logprobs is not None:
            assert g.prompt_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:], abs=1e-4)
    assert got[5].stats.cached_tokens == 0
    stats = cached.prefix_cache_stats()
    # the shared head (page-aligned) of 8 of the first wave, and each second-wave prompt's
    # first-wave sequence
    assert stats.cached_tokens >= 8 * (HEAD // page_size * page_size - page_size)
    assert sum(o.stats.cached_tokens for o in got) == stats.cached_tokens
    assert all(o.stats.cached_tokens > HEAD for o in got[-4:]), [o.stats.cached_tokens for o in got[-4:]]
    assert cached.cached_pages > 0
    assert_all_free(cached)  # free pages count the evictable cached ones
    assert cached.kv.allocator.num_free == cached.kv.allocator.total - cached.cached_pages
    assert cached.clear_prefix_cache() > 0
    assert cached.cached_pages == 0 and cached.kv.allocator.num_free == cached.kv.allocator.total
    cached.check()


RETRACT_CASES = {
    "none-P16": ("none", {}, 16, 256),
    "eagle3-tree-P4": ("eagle3", dict(topk=2, num_steps=3), 4, 240),
    "standalone-chain-P1": ("standalone", dict(topk=1, num_steps=3), 1, 200),
}


@pytest.mark.parametrize("case", list(RETRACT_CASES))
def test_a_tight_pool_retracts_and_evicts_without_changing_outputs(engine_root, case):
    method, spec, page_size, pool = RETRACT_CASES[case]
    bundle = arch_bundle(engine_root, "llama")
    want = _run(engine_for(bundle, method, page_size=page_size, **spec), with_second_wave=False)
    tight = engine_for(bundle, method, page_size=page_size, kv_pool_tokens=pool, prefix_cache=True,
                       check_every_step=True, **spec)
    got = _run(tight, with_second_wave=False)
    assert tight.num_retractions >= 2, f"only {tight.num_retractions} retractions: the pool is not tight"
    assert tight.prefix_cache_stats().evicted_pages > 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} changed ({g.stats.retractions} retractions)"
    assert_all_free(tight)
    tight.clear_prefix_cache()
    assert tight.kv.allocator.num_free == tight.kv.allocator.total


@pytest.mark.parametrize("overlap", [False, True])
def test_an_aborted_request_leaves_its_committed_kv_to_the_next(engine_root, overlap):
    bundle = arch_bundle(engine_root, "llama")
    prompt = make_prompts([30], seed=9)[0]
    spec = dict(topk=2, num_steps=3, num_draft_tokens=6)
    engine = engine_for(bundle, "eagle3", prefix_cache=True, overlap=overlap, check_every_step=True, **spec)
    engine.add_request("first", prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    emitted = []
    for _ in range(4):  # an iteration may be in flight when it is aborted
        emitted += [t for d in engine.step() for t in d.new_token_ids]
    assert engine.abort("first") and len(emitted) > 4
    while engine.has_unfinished():
        engine.step()
    # the prompt and what it emitted: all but the last token are its committed KV
    follow = prompt + emitted
    want = engine_for(bundle, "eagle3", **spec).generate([follow], greedy(12))[0]
    got = engine.generate([follow], greedy(12))[0]
    assert got.token_ids == want.token_ids
    assert got.stats.cached_tokens == len(follow) - 1
    assert_all_free(engine)
