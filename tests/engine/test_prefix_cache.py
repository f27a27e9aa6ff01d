"""The prefix cache changes no output: every request produces the tokens (and logprobs) of the
same engine without the cache, for chain and tree drafting, EAGLE-3, EAGLE-1, a standalone draft
and the target alone, page sizes 1 and 16, CUDA graphs emulated on the CPU, and a pool so small
that the scheduler retracts. Afterwards the pool is free but for the cache's own pages, which
clearing gives back (no leak). The workload shares prefixes every way the tree must handle:
a common head, identical prompts, a prompt that is another's prefix, a later wave that goes on
from an earlier request's output, and sampled requests beside greedy ones.

Issue 62's goal for the prefix cache, on the embedded pair: many requests sharing a
1,000-token system prompt read at least 95 % of its tokens from the cache with speculation on,
the same share as without speculation (SGLang #32459 saw reuse fall from 97 % to 40-53 % with
speculation), and speculation still gives the target's greedy tokens.

The radix prefix cache on its own and inside the KV manager: matching, the lead-0 next-token
rule, splits, locks, LRU eviction and the page accounting."""

from __future__ import annotations

import pytest
import torch

from phasegraph import Engine, SamplingParams, SpecConfig
from phasegraph.demo import demo_pair_dir
from phasegraph.runtime.errors import KVAccountingError, OutOfKVPages
from phasegraph.runtime.kv_pool import KVCacheManager, KVSpec
from phasegraph.runtime.prefix_cache import RadixCache
from tests.engine.support import arch_bundle, assert_all_free, engine_for, greedy, make_prompts

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


SYSTEM_TOKENS = 1000
N_REQUESTS = 24


def _system_prompt(tokenizer) -> list[int]:
    text = "".join(f"def helper_{i}(values):\n    return [v * {i} for v in values if v > {i}]\n\n" for i in range(60))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= SYSTEM_TOKENS
    return ids[:SYSTEM_TOKENS]


def _served(spec: SpecConfig | None, page_size: int):
    pair = demo_pair_dir()
    draft = None if spec is None else pair / "eagle3"
    engine = Engine.from_pretrained(pair / "target", draft, spec=spec or SpecConfig(method="none"),
                                    page_size=page_size, prefix_cache=True, max_batch_size=N_REQUESTS)
    system = _system_prompt(engine.tokenizer)
    prompts = [system + engine.tokenizer(f"# request {i}\nclass Task{i}:")["input_ids"] for i in range(N_REQUESTS)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    shared = sum(min(o.stats.cached_tokens, SYSTEM_TOKENS) for o in outs) / (N_REQUESTS * SYSTEM_TOKENS)
    engine.check()
    assert engine.kv.num_free_pages == engine.kv.allocator.total and engine.cached_pages > 0
    return [o.token_ids for o in outs], shared


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_shared_system_prompt_is_read_from_the_cache_with_speculation(page_size):
    plain_tokens, plain = _served(None, page_size)
    spec_tokens, spec = _served(SpecConfig(method="eagle3", num_steps=3, topk=4, num_draft_tokens=8), page_size)
    assert spec_tokens == plain_tokens
    assert spec >= 0.95, f"{spec:.1%} of the shared prompt from the cache with speculation"
    # the first request prefills it; every other one reads it, page-aligned
    aligned = SYSTEM_TOKENS // page_size * page_size
    assert plain == (N_REQUESTS - 1) * aligned / (N_REQUESTS * SYSTEM_TOKENS)
    # a lead-0 draft may miss one token per request: the last draft row of a cached page carries
    # the token after it, the request's own
    assert plain - spec <= (N_REQUESTS - 1) / (N_REQUESTS * SYSTEM_TOKENS) + 1e-12


SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)


def test_match_stops_at_the_limit_and_at_a_mismatch():
    cache = RadixCache(1, shift=0)
    node, taken = cache.insert([1, 2, 3, 4], [11, 12, 13, 14])
    assert taken == {11, 12, 13, 14} and cache.num_pages == cache.evictable_pages == 4
    assert cache.match([1, 2, 3, 4, 5], 4).pages == (11, 12, 13, 14)
    assert cache.match([1, 2, 3, 4], 3).pages == (11, 12, 13)  # the limit splits the node
    assert cache.match([1, 2, 9], 2).length == 2
    assert cache.match([7, 2, 3], 2).length == 0
    assert cache.check([]) == []


def test_lead0_keys_a_page_by_the_tokens_up_to_the_one_after_it():
    cache = RadixCache(1, shift=1)
    cache.insert([1, 2, 3, 4, 9], [11, 12, 13, 14])  # 4's draft row was computed with 9 after it
    assert cache.match([1, 2, 3, 4, 9, 0], 5).length == 4
    assert cache.match([1, 2, 3, 4, 5, 0], 5).length == 3
    assert cache.match([1, 2, 7, 0], 3).length == 1  # 2's draft row carries 3, this one goes on with 7
    assert cache.match([5, 2, 3, 4, 9, 0], 5).length == 0  # another first token
    # a sequence parting after [1, 2] keeps its own page of 2 (the draft row that carries 7)
    node, taken = cache.insert([1, 2, 7, 0], [21, 22, 23])
    assert taken == {22, 23} and cache.path_pages(node) == [11, 22, 23]
    assert cache.match([1, 2, 7, 0, 5], 4).pages == (11, 22, 23)
    assert cache.match([1, 2, 3, 4, 9, 1], 5).pages == (11, 12, 13, 14)
    assert cache.check([]) == []
    with pytest.raises(ValueError, match=r"\+1"):
        cache.insert([1, 2], [31, 32])


def test_pages_hold_whole_pages_of_tokens():
    cache = RadixCache(4, shift=0)
    with pytest.raises(ValueError, match="do not fill"):
        cache.insert([1, 2, 3], [5])
    cache.insert(list(range(12)), [5, 6, 7])
    assert cache.match(list(range(11)) + [99, 0], 12).pages == (5, 6)
    assert cache.match(list(range(13)), 12).pages == (5, 6, 7)
    node, taken = cache.insert(list(range(8)) + [50, 51, 52, 53], [8, 9, 10])  # 8, 9 are duplicates
    assert taken == {10} and cache.path_pages(node) == [5, 6, 10]
    assert cache.check([]) == []


def test_eviction_is_lru_over_unlocked_leaves():
    cache = RadixCache(1, shift=0)
    a, _ = cache.insert([1, 2], [11, 12])
    b, taken = cache.insert([1, 3], [99, 13])
    assert taken == {13}  # 1 is held already: 99 stays the caller's
    c, _ = cache.insert([5], [15])
    cache.match([1, 2, 0], 2)  # a is used last
    cache.lock(b)
    assert cache.evictable_pages == 2  # 12 and 15: 11 is b's parent
    assert cache.evict(1) == [15]
    assert cache.evict(5) == [12]  # 11 is b's parent, locked with it
    assert cache.check([b]) == []
    cache.unlock(b)
    assert sorted(cache.clear()) == [11, 13] and cache.num_pages == 0


def _manager(num_pages=12, page_size=1, prefix_cache=True):
    return KVCacheManager(num_pages=num_pages, page_size=page_size, max_reqs=4, max_pages_per_req=16,
                          target=SPEC, draft=SPEC, topk=1, num_steps=2, prefix_cache=prefix_cache)


def test_a_borrowed_prefix_is_locked_and_kept_by_the_cache():
    m = _manager()
    tokens = [1, 2, 3, 4, 5]
    row = m.admit(6)
    m.cache_row(row, tokens + [7], 5)  # after prefill: the prompt's pages go to the cache
    m.check()
    assert m.cached_pages == 5 and m.cached_evictable_pages == 0
    match = m.match_prefix(tokens + [7, 8])
    assert match.length == 6 - 1 and match.unlocked_pages == 0
    other = m.admit(8, match)
    assert m.table.owned[other][:5] == m.table.owned[row][:5]
    assert m.req_to_page[other, :5].tolist() == m.table.owned[row][:5]
    m.check()
    m.release(row)
    m.release(other)
    m.check()
    assert m.num_free_pages == m.allocator.total and m.cached_pages == 5
    assert m.clear_prefix_cache() == 5 and m.allocator.num_free == m.allocator.total


def test_admission_evicts_cached_pages_under_pressure():
    m = _manager(num_pages=12)
    row = m.admit(8)  # 8 pages and one region page
    m.cache_row(row, list(range(8)) + [0], 8)
    m.release(row)
    assert m.allocator.num_free == 3 and m.num_free_pages == 11
    row = m.admit(10)  # needs 11: evicts the cached ones
    assert m.cached_pages == 0 and m.cache_stats.evicted_pages == 8
    m.check()
    with pytest.raises(OutOfKVPages):
        m.admit(1)
    m.release(row)
    m.check()


def test_check_finds_a_row_freeing_a_cached_page():
    m = _manager()
    row = m.admit(4)
    m.cache_row(row, [1, 2, 3, 4, 5], 4)
    m.table.borrowed[row].clear()  # the row would free pages the cache owns
    with pytest.raises(KVAccountingError, match="owned twice"):
        m.check()
