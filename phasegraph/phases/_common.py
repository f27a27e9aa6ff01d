"""Small tensor helpers shared by several phases (no phase logic here)."""

from __future__ import annotations

import torch

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.cache_slots import row_slots
from phasegraph.kernels.softmax_top1 import softmax_top1
from phasegraph.kernels.softmax_topk import softmax_topk
from phasegraph.phases.protocols import KVMemory


def causal_extend_metadata(
    memory: KVMemory, rows: torch.Tensor, positions: torch.Tensor, one_query_per_row: bool = False
) -> AttentionMetadata:
    """Tokens at ``positions`` [T] of request rows ``rows`` [T], each attending causally up to
    itself. ``one_query_per_row``: the caller guarantees that ``rows`` has no repeats (decode)."""
    slots = row_slots(memory.page_table, rows, positions[:, None], memory.page_size)[:, 0]  # [T]
    return AttentionMetadata(
        write_slots=slots,
        page_table=memory.page_table,
        query_row=rows,
        kv_len=positions + 1,
        extra_mask=None,
        page_size=memory.page_size,
        one_query_per_row=one_query_per_row,
    )


def topk_of_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of softmax(logits) [R, V]: probabilities [R, k] float32 and ids [R, k].

    Always the full softmax's values, also for k == 1 (seed 002: a path-specific shortcut
    collapsed accuracy on one backend). The kernels keep softmax + ``max`` / ``topk`` as their
    references; on CUDA :func:`softmax_top1` (k == 1) streams a row once with an online
    normaliser and :func:`softmax_topk` (k > 1) takes each chunk's top k and merges them, in
    place of a softmax kernel and CUDA's radix top-k (~25-30 us per call over a 32k vocabulary).
    """
    if k == 1:
        return softmax_top1(logits)
    return softmax_topk(logits, k)
