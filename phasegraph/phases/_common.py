"""Small tensor helpers shared by several phases (no phase logic here)."""

from __future__ import annotations

import torch

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.cache_slots import row_slots
from phasegraph.kernels.softmax_top1 import softmax_top1
from phasegraph.phases.protocols import KVMemory


def causal_extend_metadata(memory: KVMemory, rows: torch.Tensor, positions: torch.Tensor) -> AttentionMetadata:
    """Tokens at ``positions`` [T] of request rows ``rows`` [T], each attending causally up to itself."""
    slots = row_slots(memory.page_table, rows, positions[:, None], memory.page_size)[:, 0]  # [T]
    return AttentionMetadata(
        write_slots=slots,
        page_table=memory.page_table,
        query_row=rows,
        kv_len=positions + 1,
        extra_mask=None,
        page_size=memory.page_size,
    )


def topk_of_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of softmax(logits) [R, V]: probabilities [R, k] float32 and ids [R, k].

    Always the full softmax's values, also for k == 1 (seed 002: a path-specific shortcut
    collapsed accuracy on one backend). For k == 1 :func:`softmax_top1` returns the same value
    and a maximal index (softmax + ``max`` as reference; on CUDA one pass with an online
    normaliser instead of two single-row kernels; CUDA's radix top-k costs ~25 us per call over
    a 32k vocabulary).
    """
    if k == 1:
        return softmax_top1(logits)
    probs = torch.softmax(logits.float(), dim=-1)  # [R, V]
    return probs.topk(k, dim=-1)
