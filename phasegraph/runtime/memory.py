"""The KV memory as the phases see it (:class:`phasegraph.phases.protocols.KVMemory`)."""

from __future__ import annotations

import torch

from phasegraph.runtime.kv_pool import KVCacheManager


class PhaseMemory:
    """Adapts a :class:`KVCacheManager` to the ``KVMemory`` protocol the phases use."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.page_size = kv.page_size

    @property
    def page_table(self) -> torch.Tensor:  # [max_reqs, max_pages]
        return self.kv.req_to_page

    @property
    def draft_regions(self) -> torch.Tensor:  # [max_reqs, K, R]
        return self.kv.region_pages

    def target_caches(self) -> list[torch.Tensor]:
        pool = self.kv.target_pool
        return [*pool.k, *pool.v]

    def draft_caches(self) -> list[torch.Tensor]:
        pool = self.kv.draft_pool
        return [] if pool is None else [*pool.k, *pool.v]

    def release_rows(self, rows: torch.Tensor) -> None:
        """Free each request row (host bookkeeping; reads ``rows`` once)."""
        for row in rows.tolist():
            self.kv.release(int(row))
