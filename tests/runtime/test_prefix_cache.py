"""The radix prefix cache on its own and inside the KV manager: matching, the lead-0 next-token
rule, splits, locks, LRU eviction and the page accounting."""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.errors import KVAccountingError, OutOfKVPages
from phasegraph.runtime.kv_pool import KVCacheManager, KVSpec
from phasegraph.runtime.prefix_cache import RadixCache

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
