"""Attention over the paged KV pool, with an optional tree block (verify, draft, extend).

See ``docs/internals.md`` ("Attention metadata"). The torch reference below is the CPU path and
the oracle for the Triton kernel.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Where the T query tokens of one forward write their KV and what each of them reads.

    Query t writes its key/value into ``write_slots[t]`` and attends logical positions
    ``[0, kv_len[t])`` of page-table row ``query_row[t]``, plus ``kv_len[t] + e`` for every
    ``e`` with ``extra_mask[t, e]`` (the tree block behind the prefix).
    """

    write_slots: torch.Tensor  # [T] int64
    page_table: torch.Tensor  # [R, max_pages] int64
    query_row: torch.Tensor  # [T] int64, row of page_table
    kv_len: torch.Tensor  # [T] int64
    extra_mask: torch.Tensor | None  # [T, E] bool, or None
    page_size: int
