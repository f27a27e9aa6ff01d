"""The paged KV pool: per-model K/V tensors, the page allocator, the request page table.

Conventions (``docs/internals.md``, "KV pool and pages"): a slot holds one token's key and value
for every layer of one model; ``slot = page * P + offset``; page 0 and request row 0 are
reserved (padding writes and reads go there). The target and draft pools have the same number
of slots and share one allocator, so a slot index means the same token in both.

Allocation is host-side bookkeeping between iterations; the device-side tensors the phases read
are ``RequestTable.req_to_page`` and ``KVCacheManager.region_pages``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import attrs
import torch

from phasegraph.kernels.cache_slots import draft_region_pages
from phasegraph.runtime.errors import (
    InvalidPageFree,
    InvalidRow,
    KVAccountingError,
    OutOfKVPages,
    OutOfRequestRows,
    RequestTooLong,
)
from phasegraph.runtime.prefix_cache import Node, PrefixMatch, RadixCache

RESERVED_PAGE = 0
RESERVED_ROW = 0


# An eviction frees at least this share of the pool (1/64): see KVCacheManager._make_room.
EVICT_SHARE = 64


@attrs.define
class PrefixCacheStats:
    """What the prefix cache served: prompt tokens prefilled against those read from it."""

    prompt_tokens: int = 0  # tokens of every prefill (resumed requests' committed tokens too)
    cached_tokens: int = 0  # of them, served from the cache
    evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@attrs.frozen
class KVSpec:
    """Shape of one model's KV: how many pool layers, kv heads, head dim, dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without waiting for the device: a CUDA copy goes through pinned
    memory, asynchronously (a copy from pageable memory would wait for every kernel queued
    before it, i.e. for the iteration in flight under overlap scheduling)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def check_pool_fits(pool: KVPool, spec: KVSpec, who: str) -> KVPool:
    """``pool`` if its layers, KV heads and head size are the ones ``spec`` describes."""
    have = (pool.spec.num_layers, pool.spec.num_kv_heads, pool.spec.head_dim)
    if have != (spec.num_layers, spec.num_kv_heads, spec.head_dim):
        raise ValueError(f"KV pool {pool.spec} does not fit {who} ({spec})")
    return pool


class KVPool:
    """K/V tensors of one model: ``k[layer], v[layer]: [num_slots, Hkv, D]``."""

    def __init__(self, spec: KVSpec, num_slots: int, device: torch.device | str) -> None:
        self.spec = spec
        self.num_slots = num_slots
        self.device = torch.device(device)
        shape = (num_slots, spec.num_kv_heads, spec.head_dim)
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=spec.dtype, device=self.device)
            for _ in range(spec.num_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=spec.dtype, device=self.device)
            for _ in range(spec.num_layers)
        ]

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class PageAllocator:
    """Free list of page ids ``1 .. num_pages-1`` (page 0 is the reserved sink)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        # A stack popped from the end: pages come out in ascending order at first.
        self._free: list[int] = list(range(num_pages - 1, RESERVED_PAGE, -1))
        self._is_free = bytearray(num_pages)
        for page in self._free:
            self._is_free[page] = 1

    @property
    def total(self) -> int:
        """Pages that can ever be handed out (page 0 excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        """A copy of the free list (for accounting checks)."""
        return list(self._free)

    def alloc(self, n: int) -> torch.Tensor:  # [n] int64, on the host
        """Take ``n`` pages; raise :class:`OutOfKVPages` (changing nothing) if too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfKVPages(n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._is_free[page] = 0
        return torch.tensor(pages, dtype=torch.int64)

    def free(self, pages: torch.Tensor | Iterable[int]) -> None:
        """Return pages; raise :class:`InvalidPageFree` (changing nothing) on a bad page."""
        ids = [int(p) for p in (pages.tolist() if isinstance(pages, torch.Tensor) else pages)]
        seen: set[int] = set()
        for page in ids:
            if page == RESERVED_PAGE:
                raise InvalidPageFree("page 0 is reserved and is never allocated or freed")
            if not 0 < page < self.num_pages:
                raise InvalidPageFree(f"page {page} is out of range [1, {self.num_pages})")
            if self._is_free[page] or page in seen:
                raise InvalidPageFree(f"double free of page {page}")
            seen.add(page)
        for page in ids:
            self._is_free[page] = 1
            self._free.append(page)


class RequestTable:
    """Rows of ``req_to_page [max_reqs, max_pages]`` and the pages each row owns (host side).

    Row 0 is reserved (padding rows read it: all its entries stay 0, the sink page).
    """

    def __init__(
        self,
        max_reqs: int,
        max_pages: int,
        page_size: int,
        allocator: PageAllocator,
        device: torch.device | str,
    ) -> None:
        if max_reqs < 2:
            raise ValueError(f"need at least 2 request rows (row 0 is reserved), got {max_reqs}")
        self.max_reqs = max_reqs
        self.max_pages = max_pages
        self.page_size = page_size
        self.allocator = allocator
        self.device = torch.device(device)
        self.req_to_page = torch.zeros(max_reqs, max_pages, dtype=torch.int64, device=self.device)
        self.owned: list[list[int]] = [[] for _ in range(max_reqs)]
        # pages of each row the prefix cache owns (a cached prefix it reuses, or pages it gave
        # the cache while it runs): never freed or trimmed by the row
        self.borrowed: list[set[int]] = [set() for _ in range(max_reqs)]
        self._free_rows: list[int] = list(range(max_reqs - 1, RESERVED_ROW, -1))
        self._in_use = bytearray(max_reqs)

    @property
    def max_tokens(self) -> int:
        return self.max_pages * self.page_size

    def rows_in_use(self) -> list[int]:
        return [r for r in range(self.max_reqs) if self._in_use[r]]

    def is_in_use(self, row: int) -> bool:
        return 0 <= row < self.max_reqs and bool(self._in_use[row])

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise OutOfRequestRows(self.max_reqs)
        row = self._free_rows.pop()
        self._in_use[row] = 1
        return row

    def check_row(self, row: int) -> None:
        """Raise :class:`InvalidRow` unless ``row`` is a request row in use."""
        if row == RESERVED_ROW:
            raise InvalidRow("request row 0 is reserved")
        if not self.is_in_use(row):
            raise InvalidRow(f"request row {row} is not in use")

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def ensure_capacity(self, row: int, num_tokens: int) -> None:
        """Make ``row`` own logical positions ``[0, num_tokens)``; all-or-nothing."""
        self.ensure_capacity_many([row], [num_tokens])

    def ensure_capacity_many(self, rows: list[int], num_tokens: list[int], spare_tokens: int = 0) -> None:
        """Make each ``rows[i]`` own logical positions ``[0, num_tokens[i])``, with one
        host-to-device copy and one write into the table (what the scheduler does every
        iteration). All-or-nothing: on :class:`OutOfKVPages` or :class:`RequestTooLong` nothing
        is allocated.

        ``spare_tokens``: a row that must grow takes the pages of that many more positions too
        (capped at the row's maximum) when the pool has them free, so that the next iterations
        find their pages already there and write nothing into the table; when the pool cannot
        spare them, each row gets exactly what it asked for. :meth:`trim` gives spare pages back.
        """
        grow = []
        for row, n in zip(rows, num_tokens, strict=True):
            self.check_row(row)
            if n > self.max_tokens:
                raise RequestTooLong(n, self.max_tokens)
            have, need = len(self.owned[row]), self.pages_for(n)
            if need > have:
                spare = min(self.pages_for(n + spare_tokens), self.max_pages) if spare_tokens > 0 else need
                grow.append((row, have, need, max(need, spare)))
        if not grow:
            return
        if sum(spare - have for _, have, _, spare in grow) <= self.allocator.num_free:
            grow = [(row, have, spare) for row, have, _, spare in grow]
        else:
            grow = [(row, have, need) for row, have, need, _ in grow]
        pages = self.allocator.alloc(sum(need - have for _, have, need in grow)).tolist()
        where_rows, where_cols = [], []
        start = 0
        for row, have, need in grow:
            self.owned[row].extend(pages[start : start + need - have])
            start += need - have
            where_rows += [row] * (need - have)
            where_cols += range(have, need)
        packed = to_device(torch.tensor([where_rows, where_cols, pages], dtype=torch.int64), self.device)  # [3, n]
        self.req_to_page[packed[0], packed[1]] = packed[2]

    def trim(self, row: int, num_tokens: int) -> int:
        """Give back the pages ``row`` owns past those of positions ``[0, num_tokens)`` (spare
        pages taken by :meth:`ensure_capacity_many`); their table entries return to 0. Returns
        how many pages were freed."""
        self.check_row(row)
        keep = self.pages_for(num_tokens)
        extra = self.owned[row][keep:]
        if self.borrowed[row].intersection(extra):
            raise InvalidPageFree(f"row {row}: trimming to {num_tokens} tokens would free pages of the prefix cache")
        if not extra:
            return 0
        del self.owned[row][keep:]
        self.allocator.free(extra)
        self.req_to_page[row, keep : keep + len(extra)].zero_()
        return len(extra)

    def borrow(self, row: int, pages: Sequence[int]) -> None:
        """Head the fresh ``row`` with ``pages`` of the prefix cache (never freed by the row)."""
        self.check_row(row)
        if self.owned[row]:
            raise InvalidRow(f"request row {row} owns pages already; only a fresh row borrows a prefix")
        if pages:
            self.owned[row] = list(pages)
            self.borrowed[row] = set(pages)
            self.req_to_page[row, : len(pages)] = to_device(torch.tensor(pages, dtype=torch.int64), self.device)

    def release(self, row: int) -> None:
        """Free every page the row owns (over-allocation included) but those of the prefix
        cache; the row stays in use."""
        self.check_row(row)
        if self.owned[row]:
            borrowed = self.borrowed[row]
            self.allocator.free([p for p in self.owned[row] if p not in borrowed])
            self.owned[row] = []
            self.borrowed[row] = set()
            self.req_to_page[row].zero_()

    def free_row(self, row: int) -> None:
        """Release the row's pages and return the row to the free list."""
        self.release(row)
        self._in_use[row] = 0
        self._free_rows.append(row)


class KVCacheManager:
    """One allocator, the request table, the target pool, the optional draft pool, and the
    per-request draft branch regions ``region_pages [max_reqs, K, R]`` (allocated at admission,
    released with the row; zero for rows not in use), ``R = draft_region_pages(P, S)``."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_reqs: int,
        max_pages_per_req: int,
        target: KVSpec,
        draft: KVSpec | None = None,
        topk: int = 1,
        num_steps: int = 1,
        device: torch.device | str = "cpu",
        prefix_cache: bool = False,
        draft_lead: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_pages * page_size
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages)
        self.table = RequestTable(max_reqs, max_pages_per_req, page_size, self.allocator, device)
        self.target_pool = KVPool(target, self.num_slots, device)
        self.draft_pool = KVPool(draft, self.num_slots, device) if draft is not None else None
        self.topk = topk if draft is not None else 0
        self.num_steps = num_steps
        self.region_len = draft_region_pages(page_size, num_steps) if draft is not None else 0
        self.region_pages = torch.zeros(
            max_reqs, self.topk, self.region_len, dtype=torch.int64, device=self.device
        )  # [max_reqs, K, R]
        self.region_owned: list[list[int]] = [[] for _ in range(max_reqs)]
        # lead 0: a page's draft KV depends on the token after the page
        self.prefix_cache = (
            RadixCache(page_size, shift=int(draft is not None and draft_lead == 0)) if prefix_cache else None
        )
        self.lock_node: list[Node | None] = [None] * max_reqs  # the cache node each row borrows up to
        self.cache_stats = PrefixCacheStats()

    # -- queries ------------------------------------------------------------------------------

    @property
    def req_to_page(self) -> torch.Tensor:  # [max_reqs, max_pages] int64
        return self.table.req_to_page

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation may take: the free ones and those the prefix cache may evict."""
        return self.allocator.num_free + self.cached_evictable_pages

    @property
    def cached_pages(self) -> int:
        """Pages the prefix cache owns (locked by running requests or evictable)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_pages

    @property
    def cached_evictable_pages(self) -> int:
        return 0 if self.prefix_cache is None else self.prefix_cache.evictable_pages

    @property
    def pages_per_admission(self) -> int:
        """Region pages one admitted request holds besides its page-table row."""
        return self.topk * self.region_len

    def pages_needed(self, num_tokens: int, row: int | None = None, prefix: PrefixMatch | None = None) -> int:
        """Pages to allocate so ``row`` (or a new request reusing ``prefix``) owns
        ``[0, num_tokens)``. The pages a new request's prefix locks count too: they leave the
        evictable pages :attr:`num_free_pages` counts."""
        if row is None:
            cached = 0 if prefix is None else len(prefix.pages) - prefix.unlocked_pages
            return self.table.pages_for(num_tokens) - cached + self.pages_per_admission
        return max(0, self.table.pages_for(num_tokens) - len(self.table.owned[row]))

    # -- prefix cache -------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch | None:
        """The cached prefix a new request prefilling ``tokens`` reuses (None without a cache).
        At least the last token is left to prefill: its logits give the first new token."""
        if self.prefix_cache is None:
            return None
        return self.prefix_cache.match(tokens, len(tokens) - 1)

    def cache_row(self, row: int, tokens: Sequence[int], num_valid: int) -> None:
        """Give the prefix cache the KV of ``tokens[:num_valid]`` (its whole pages) that
        ``row`` holds; ``tokens`` runs on past them where the sequence does (a lead-0 draft row
        was computed with the token after it). The pages the cache takes stay in the row,
        borrowed and locked until the row is released; the row's pages of positions the cache
        held already stay the row's."""
        cache = self.prefix_cache
        if cache is None:
            return
        self.table.check_row(row)
        P = self.page_size
        full = min(num_valid, len(self.table.owned[row]) * P, len(tokens) - cache.shift) // P
        if full == 0:
            return
        node, taken = cache.insert(tokens[: full * P + cache.shift], self.table.owned[row][:full])
        self.table.borrowed[row] |= taken
        cache.lock(node)
        if self.lock_node[row] is not None:
            cache.unlock(self.lock_node[row])
        self.lock_node[row] = node

    def clear_prefix_cache(self) -> int:
        """Free every cached page no running request borrows; returns how many."""
        if self.prefix_cache is None:
            return 0
        pages = self.prefix_cache.clear()
        self.allocator.free(pages)
        return len(pages)

    def _make_room(self, num_pages: int) -> None:
        """Evict cached pages until ``num_pages`` are free (as many as can go)."""
        short = num_pages - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            # a few pages more than asked: eviction walks the whole tree, and with a pool full
            # of cached pages every iteration that grows a row would otherwise walk it again
            evicted = self.prefix_cache.evict(max(short, self.allocator.total // EVICT_SHARE))
            self.allocator.free(evicted)
            self.cache_stats.evicted_pages += len(evicted)

    # -- lifecycle ----------------------------------------------------------------------------

    def admit(self, num_tokens: int, prefix: PrefixMatch | None = None) -> int:
        """Take a request row, its branch regions and pages for ``[0, num_tokens)``, the
        first ``prefix.length`` of them the cached prefix ``prefix`` (:meth:`match_prefix`,
        no cache change since).

        All-or-nothing: on :class:`OutOfKVPages`, :class:`OutOfRequestRows` or
        :class:`RequestTooLong` nothing stays allocated.
        """
        if num_tokens > self.table.max_tokens:
            raise RequestTooLong(num_tokens, self.table.max_tokens)
        need = self.pages_needed(num_tokens, prefix=prefix)
        if need > self.num_free_pages:
            raise OutOfKVPages(need, self.num_free_pages)
        row = self.table.alloc_row()
        if prefix is not None and prefix.pages:
            self.prefix_cache.lock(prefix.node)  # before any eviction
            self.lock_node[row] = prefix.node
            self.table.borrow(row, prefix.pages)
        self._make_room(self.pages_needed(num_tokens, row) + self.pages_per_admission)
        if self.pages_per_admission:
            pages = self.allocator.alloc(self.pages_per_admission)  # [K*R]
            self.region_pages[row] = pages.view(self.topk, self.region_len).to(self.device)
            self.region_owned[row] = pages.tolist()
        self.table.ensure_capacity(row, num_tokens)
        return row

    def ensure_capacity(self, row: int, num_tokens: int) -> None:
        self.ensure_capacity_many([row], [num_tokens])

    def ensure_capacity_many(self, rows: list[int], num_tokens: list[int], spare_tokens: int = 0) -> None:
        """:meth:`RequestTable.ensure_capacity_many`, evicting cached pages where the free ones
        are too few for the exact growth (spare pages never evict)."""
        if self.prefix_cache is not None:
            self._make_room(sum(self.pages_needed(n, r) for r, n in zip(rows, num_tokens, strict=True)))
        self.table.ensure_capacity_many(rows, num_tokens, spare_tokens)

    def trim(self, row: int, num_tokens: int) -> int:
        """Give back ``row``'s pages past positions ``[0, num_tokens)``; returns how many."""
        return self.table.trim(row, num_tokens)

    def release(self, row: int) -> None:
        """Free the row's pages, its branch regions and the row itself."""
        self.table.check_row(row)
        if self.region_owned[row]:
            self.allocator.free(self.region_owned[row])
            self.region_owned[row] = []
            self.region_pages[row].zero_()
        self.table.free_row(row)
        if self.lock_node[row] is not None:
            self.prefix_cache.unlock(self.lock_node[row])
            self.lock_node[row] = None

    # -- accounting ---------------------------------------------------------------------------

    def check(self) -> None:
        """Verify the page accounting; raise :class:`KVAccountingError` listing all problems."""
        problems: list[str] = []
        total = self.allocator.total
        free = self.allocator.free_pages()
        free_set = set(free)
        if len(free_set) != len(free):
            dups = sorted(p for p, n in Counter(free).items() if n > 1)
            problems.append(f"pages in the free list more than once: {dups}")
        if RESERVED_PAGE in free_set:
            problems.append("reserved page 0 is in the free list")
        owner: dict[int, str] = {}
        cached = self.prefix_cache.pages() if self.prefix_cache is not None else []
        for page in cached:
            if page in owner:
                problems.append(f"page {page} is in the prefix cache twice")
            owner[page] = "the prefix cache"
            if page in free_set:
                problems.append(f"page {page} of the prefix cache is also in the free list")
        if self.prefix_cache is not None:
            problems += self.prefix_cache.check([n for n in self.lock_node if n is not None])
        for row in range(self.table.max_reqs):
            in_use = self.table.is_in_use(row)
            borrowed = self.table.borrowed[row]
            if not borrowed <= set(self.table.owned[row]):
                problems.append(f"row {row} borrows pages it does not hold: {sorted(borrowed - set(self.table.owned[row]))}")
            if borrowed and self.lock_node[row] is None:
                problems.append(f"row {row} borrows cached pages without a lock")
            elif borrowed and not borrowed <= set(self.prefix_cache.path_pages(self.lock_node[row])):
                problems.append(f"row {row} borrows pages outside the cached path it locks")
            if self.lock_node[row] is not None and not in_use:
                problems.append(f"free row {row} holds a lock on the prefix cache")
            held = [(p, f"row {row}") for p in self.table.owned[row] if p not in borrowed]
            held += [(p, f"region of row {row}") for p in self.region_owned[row]]
            if held and not in_use:
                problems.append(f"free row {row} holds pages {[p for p, _ in held]}")
            if row == RESERVED_ROW and in_use:
                problems.append("reserved row 0 is in use")
            for page, who in held:
                if page == RESERVED_PAGE:
                    problems.append(f"{who} owns reserved page 0")
                if page in owner:
                    problems.append(f"page {page} owned twice ({owner[page]} and {who})")
                owner[page] = who
                if page in free_set:
                    problems.append(f"page {page} owned by {who} is also in the free list")
        n_owned = len(cached) + sum(
            len(self.table.owned[r]) - len(self.table.borrowed[r]) + len(self.region_owned[r])
            for r in range(self.table.max_reqs)
        )
        if len(free) + n_owned != total:
            problems.append(
                f"free ({len(free)}) + owned ({n_owned}) != total pages ({total}, page 0 excluded)"
            )
        problems += self._check_tables()
        if problems:
            raise KVAccountingError(problems)

    def _check_tables(self) -> list[str]:
        """The device page tables agree with the host ownership lists."""
        problems: list[str] = []
        table = self.table.req_to_page.cpu()
        regions = self.region_pages.cpu()
        for row in range(self.table.max_reqs):
            owned = self.table.owned[row]
            expect = torch.zeros(self.table.max_pages, dtype=torch.int64)
            expect[: len(owned)] = torch.tensor(owned, dtype=torch.int64)
            if not torch.equal(table[row], expect):
                problems.append(f"req_to_page row {row} disagrees with the pages it owns")
            if self.pages_per_admission:
                region = self.region_owned[row]
                expect_r = torch.zeros(self.pages_per_admission, dtype=torch.int64)
                expect_r[: len(region)] = torch.tensor(region, dtype=torch.int64)
                if not torch.equal(regions[row].reshape(-1), expect_r):
                    problems.append(f"region_pages row {row} disagrees with its region pages")
        return problems
