"""PageAllocator, RequestTable, KVCacheManager: unit tests and a stateful accounting fuzz.

phasegraph.runtime.errors.is_out_of_memory: the one test of "memory ran out" that the engine's
KV allocation, the bench's warm-up and ``python -m phasegraph.train`` share."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from phasegraph.runtime.errors import (
    InvalidPageFree,
    InvalidRow,
    KVAccountingError,
    OutOfKVPages,
    OutOfRequestRows,
    RequestTooLong,
    is_out_of_memory,
)
from phasegraph.runtime.kv_pool import KVCacheManager, KVPool, KVSpec, PageAllocator

TARGET = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
DRAFT = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)


def manager(**kw) -> KVCacheManager:
    args = dict(
        num_pages=20,
        page_size=4,
        max_reqs=4,
        max_pages_per_req=6,
        target=TARGET,
        draft=DRAFT,
        topk=2,
        num_steps=3,
    )
    args.update(kw)
    return KVCacheManager(**args)


def test_allocator_never_hands_out_page_zero_and_fails_without_side_effects():
    alloc = PageAllocator(6)
    assert alloc.total == 5 and alloc.num_free == 5
    pages = alloc.alloc(3)
    assert pages.dtype == torch.int64 and pages.tolist() == [1, 2, 3]
    with pytest.raises(OutOfKVPages, match="requested 3 KV pages but only 2 are free") as info:
        alloc.alloc(3)
    assert info.value.requested == 3 and info.value.available == 2
    assert alloc.num_free == 2
    rest = alloc.alloc(2)
    assert 0 not in rest.tolist() + pages.tolist()
    assert alloc.alloc(0).numel() == 0


def test_allocator_rejects_double_free_reserved_and_out_of_range_atomically():
    alloc = PageAllocator(6)
    pages = alloc.alloc(3)
    alloc.free(pages[:1])
    with pytest.raises(InvalidPageFree, match="double free of page 1"):
        alloc.free([2, 1])
    assert alloc.num_free == 3  # page 2 was not freed by the failed call
    with pytest.raises(InvalidPageFree, match="reserved"):
        alloc.free([0])
    with pytest.raises(InvalidPageFree, match="out of range"):
        alloc.free([6])
    with pytest.raises(InvalidPageFree, match="double free of page 3"):
        alloc.free([3, 3])
    alloc.free(torch.tensor([2, 3]))
    assert alloc.num_free == 5


def test_pools_have_per_layer_tensors_with_the_spec_shape():
    pool = KVPool(TARGET, num_slots=12, device="cpu")
    assert len(pool.k) == len(pool.v) == 2
    assert pool.k[0].shape == (12, 2, 4) and pool.k[0].dtype == torch.float32
    assert pool.k[0].data_ptr() != pool.k[1].data_ptr()
    assert pool.nbytes() == 2 * 2 * 12 * 2 * 4 * 4


def test_manager_pools_share_slots_and_regions_follow_page_size():
    m = manager()
    assert m.target_pool.num_slots == m.draft_pool.num_slots == 80
    assert m.draft_pool.num_layers == 1 and m.draft_pool.k[0].shape == (80, 1, 8)
    assert m.region_len == math.ceil((4 - 1 + 3 - 1) / 4) == 2
    assert m.region_pages.shape == (4, 2, 2)
    assert manager(page_size=1, num_steps=4).region_len == 3
    assert manager(page_size=16, num_steps=1).region_len == 1
    assert manager(draft=None).region_pages.shape == (4, 0, 0)


def test_admit_ensure_release_updates_tables():
    m = manager()
    row = m.admit(5)  # 2 pages + 2x2 region pages
    assert row == 1
    assert m.num_free_pages == 19 - 6
    table = m.req_to_page[row]
    assert (table[:2] > 0).all() and (table[2:] == 0).all()
    assert (m.region_pages[row] > 0).all()
    assert set(m.region_pages[row].flatten().tolist()).isdisjoint(table[:2].tolist())
    m.ensure_capacity(row, 8)  # still 2 pages
    assert m.num_free_pages == 13
    m.ensure_capacity(row, 9)
    assert m.num_free_pages == 12 and (m.req_to_page[row, :3] > 0).all()
    m.check()
    m.release(row)
    assert m.num_free_pages == 19
    assert (m.req_to_page[row] == 0).all() and (m.region_pages[row] == 0).all()
    assert (m.req_to_page[0] == 0).all()
    m.check()
    with pytest.raises(InvalidRow):
        m.release(row)
    with pytest.raises(InvalidRow):
        m.ensure_capacity(0, 4)


def test_admit_is_all_or_nothing():
    m = manager(num_pages=10)  # 9 usable
    with pytest.raises(OutOfKVPages):
        m.admit(24)  # 6 + 4 region pages
    assert m.num_free_pages == 9 and m.table.num_free_rows == 3
    with pytest.raises(RequestTooLong, match="25 tokens"):
        m.admit(25)
    m.admit(1)  # 1 page + 4 region pages
    with pytest.raises(OutOfKVPages, match="requested 5 KV pages but only 4 are free"):
        m.admit(1)
    assert m.num_free_pages == 4 and m.table.num_free_rows == 2
    m.check()


def test_out_of_rows():
    m = manager(num_pages=100, max_reqs=3)
    m.admit(1)
    m.admit(1)
    with pytest.raises(OutOfRequestRows):
        m.admit(1)
    m.check()


def test_check_lists_every_problem():
    m = manager()
    a = m.admit(9)
    b = m.admit(2)
    page = m.table.owned[a][0]
    m.table.owned[b].append(page)  # owned twice
    m.allocator._free.append(m.allocator._free[0])  # in the free list twice
    m.table.owned[3] = [m.allocator._free[1]]  # a free row holding a page that is also free
    with pytest.raises(KVAccountingError) as info:
        m.check()
    text = str(info.value)
    assert "owned twice" in text
    assert "free list more than once" in text
    assert "free row 3 holds pages" in text
    assert "also in the free list" in text
    assert "!= total pages" in text
    assert len(info.value.problems) >= 5


def test_spare_pages_are_taken_when_free_and_trimmed_back():
    m = manager(draft=None)  # page size 4, 19 free pages, at most 6 pages per row
    row = m.admit(5)  # 2 pages
    m.ensure_capacity_many([row], [9], spare_tokens=8)  # 3 pages asked, 5 = ceil(17 / 4) taken
    assert len(m.table.owned[row]) == 5 and m.num_free_pages == 14
    assert (m.req_to_page[row, :5] > 0).all() and (m.req_to_page[row, 5:] == 0).all()
    m.ensure_capacity_many([row], [20], spare_tokens=8)  # already owned: nothing moves
    assert len(m.table.owned[row]) == 5 and m.num_free_pages == 14
    m.ensure_capacity_many([row], [21], spare_tokens=64)  # spare capped at the row's 6 pages
    assert len(m.table.owned[row]) == 6
    m.check()
    assert m.trim(row, 9) == 3  # keeps ceil(9 / 4) = 3 pages
    assert len(m.table.owned[row]) == 3 and m.num_free_pages == 16
    assert (m.req_to_page[row, :3] > 0).all() and (m.req_to_page[row, 3:] == 0).all()
    assert m.trim(row, 12) == 0
    m.check()


def test_spare_pages_are_not_taken_from_a_short_pool():
    m = manager(draft=None, num_pages=5, max_pages_per_req=4)  # 4 free pages
    a, b = m.admit(4), m.admit(4)  # one page each, 2 left
    m.ensure_capacity_many([a, b], [5, 5], spare_tokens=8)  # spare would need 2 x 2 pages > 2 free
    assert [len(m.table.owned[r]) for r in (a, b)] == [2, 2] and m.num_free_pages == 0
    with pytest.raises(OutOfKVPages):
        m.ensure_capacity_many([a], [9], spare_tokens=8)
    assert len(m.table.owned[a]) == 2
    m.check()


class KVAccounting(RuleBasedStateMachine):
    """Random admit / grow (with and without spare pages) / trim / release sequences keep the
    accounting exact."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4, 16]), topk=st.integers(0, 3), steps=st.integers(1, 4)
    )
    def setup(self, page_size, topk, steps):
        self.m = KVCacheManager(
            num_pages=24,
            page_size=page_size,
            max_reqs=5,
            max_pages_per_req=8,
            target=TARGET,
            draft=DRAFT if topk else None,
            topk=max(topk, 1),
            num_steps=steps,
        )
        self.tokens: dict[int, int] = {}  # row -> tokens owned so far (max requested)
        self.pages: dict[int, int] = {}  # row -> pages it owns (spare included)

    def expected_in_use(self) -> int:
        return sum(n + self.m.pages_per_admission for n in self.pages.values())

    @rule(n=st.integers(0, 40))
    def admit(self, n):
        free, rows = self.m.num_free_pages, self.m.table.num_free_rows
        try:
            row = self.m.admit(n)
        except (OutOfKVPages, OutOfRequestRows, RequestTooLong):
            assert (self.m.num_free_pages, self.m.table.num_free_rows) == (free, rows)
            return
        assert row not in self.tokens and row != 0
        self.tokens[row] = n
        self.pages[row] = math.ceil(n / self.m.page_size)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 20), spare=st.sampled_from([0, 0, 3, 16]))
    def grow(self, data, extra, spare):
        row = data.draw(st.sampled_from(sorted(self.tokens)))
        m, free = self.m, self.m.num_free_pages
        want = self.tokens[row] + extra
        try:
            m.ensure_capacity_many([row], [want], spare_tokens=spare)
        except (OutOfKVPages, RequestTooLong):
            assert m.num_free_pages == free
            return
        need = math.ceil(want / m.page_size)
        if need > self.pages[row]:
            roomy = max(need, min(math.ceil((want + spare) / m.page_size), m.table.max_pages))
            self.pages[row] = roomy if roomy - self.pages[row] <= free else need
        self.tokens[row] = want

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), keep=st.integers(0, 40))
    def trim(self, data, keep):
        row = data.draw(st.sampled_from(sorted(self.tokens)))
        kept = min(self.pages[row], math.ceil(keep / self.m.page_size))
        assert self.m.trim(row, keep) == self.pages[row] - kept
        self.pages[row] = kept
        self.tokens[row] = min(self.tokens[row], kept * self.m.page_size)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        row = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.release(row)
        del self.tokens[row], self.pages[row]

    @invariant()
    def accounting_holds(self):
        self.m.check()
        assert self.m.num_free_pages == self.m.allocator.total - self.expected_in_use()
        assert sorted(self.m.table.rows_in_use()) == sorted(self.tokens)


TestKVAccounting = KVAccounting.TestCase
TestKVAccounting.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("exc", [
    MemoryError(),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB."),
    RuntimeError("CUDA error: out of memory"),  # a CUDA call's own, e.g. a graph's instantiation
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 103079215104 bytes."),
])
def test_memory_that_ran_out_is_recognised(exc):
    assert is_out_of_memory(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("boom"),
    RuntimeError("expected scalar type Float but found BFloat16"),
    ValueError("out of range"),
])
def test_other_errors_are_not_taken_for_running_out_of_memory(exc):
    assert not is_out_of_memory(exc)
