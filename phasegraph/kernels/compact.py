"""Accepted-path compaction: per-node rows and KV moved to the front of each request, reference.

After tree verification the accepted nodes of request b sit anywhere in its block of N nodes.
Finalize moves them to the front: node ``accept_index[b, i]`` becomes row ``b*W + i`` of every
per-node tensor, and its target KV moves to logical position ``seq_len + i``
(``docs/internals.md``, "Where each phase writes KV").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from phasegraph.kernels._checks import expect, expect_shape


def compact_to_front(
    x: torch.Tensor,  # [B*N, ...] per-node tensor
    accept_index: torch.Tensor,  # [B, W] i64, node rows of the accepted path, -1 padded
) -> torch.Tensor:  # [B*W, ...]
    """Gather the accepted rows of ``x`` to the front; padded entries repeat the root row b*N."""
    expect(accept_index, "accept_index", 2, torch.int64)
    batch, width = accept_index.shape
    if batch == 0:
        return x[:0]
    if x.shape[0] % batch != 0:
        raise ValueError(f"x has {x.shape[0]} rows, not a multiple of B = {batch}")
    num_nodes = x.shape[0] // batch
    roots = torch.arange(batch, dtype=torch.int64, device=accept_index.device) * num_nodes
    rows = torch.where(accept_index >= 0, accept_index, roots[:, None])
    return x.index_select(0, rows.reshape(batch * width))


def accepted_kv_moves(
    accept_index: torch.Tensor,  # [B, W] i64
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
    node_slots: torch.Tensor,  # [B*N] i64, KV slot of every tree node (logical seq_len + j)
    front_slots: torch.Tensor,  # [B*W] i64, KV slot of logical seq_len + i
) -> tuple[torch.Tensor, torch.Tensor]:  # src [B*W], dst [B*W]
    """KV moves that put accepted node i of each request into front slot i.

    Entries past ``accept_lens`` (and padded ones) are self-copies of their front slot, so the
    shape is fixed at B*W. Apply them with ``move_kv`` (gather first), since sources and
    destinations overlap.
    """
    expect(accept_index, "accept_index", 2, torch.int64)
    expect(accept_lens, "accept_lens", 1, torch.int64)
    expect(node_slots, "node_slots", 1, torch.int64)
    expect(front_slots, "front_slots", 1, torch.int64)
    batch, width = accept_index.shape
    expect_shape(accept_lens, "accept_lens", (batch,))
    expect_shape(front_slots, "front_slots", (batch * width,))
    cols = torch.arange(width, dtype=torch.int64, device=accept_index.device)
    moving = (cols[None, :] < accept_lens[:, None]) & (accept_index >= 0)  # [B, W]
    src = torch.where(
        moving, node_slots[accept_index.clamp(min=0)], front_slots.view(batch, width)
    )
    return src.reshape(batch * width), front_slots.clone()


def move_kv(
    caches: Sequence[torch.Tensor],  # each [slots, ...], e.g. k[layer] and v[layer] of a pool
    src: torch.Tensor,  # [M] i64 source slots
    dst: torch.Tensor,  # [M] i64 destination slots, pairwise distinct
) -> None:
    """Copy ``cache[src[m]]`` to ``cache[dst[m]]`` in place for every cache.

    Every source is gathered before anything is written, so overlapping sources and destinations
    (and permutations) are safe. Destinations must be distinct, except for entries that copy
    equal values.
    """
    expect(src, "src", 1, torch.int64)
    expect(dst, "dst", 1, torch.int64)
    expect_shape(dst, "dst", tuple(src.shape))
    for cache in caches:
        cache.index_copy_(0, dst, cache.index_select(0, src))
