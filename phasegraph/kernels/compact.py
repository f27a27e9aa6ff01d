"""Accepted-path compaction: per-node rows and KV moved to the front of each request, reference.

After tree verification the accepted nodes of request b sit anywhere in its block of N nodes.
Finalize moves them to the front: node ``accept_index[b, i]`` becomes row ``b*W + i`` of every
per-node tensor, and its target KV moves to logical position ``seq_len + i``
(``docs/internals.md``, "Where each phase writes KV").

Each public function dispatches to a Triton version on CUDA tensors and to its ``*_reference``
torch version elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from phasegraph.kernels import _dispatch
from phasegraph.kernels._checks import expect, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes


def _front_shape(x: torch.Tensor, accept_index: torch.Tensor) -> tuple[int, int, int]:
    """Checks of :func:`compact_to_front`'s inputs; ``(B, W, N)``, N = 0 when B = 0."""
    expect(accept_index, "accept_index", 2, torch.int64)
    batch, width = accept_index.shape
    if batch == 0:
        return batch, width, 0
    if x.shape[0] % batch != 0:
        raise ValueError(f"x has {x.shape[0]} rows, not a multiple of B = {batch}")
    return batch, width, x.shape[0] // batch


def _check_moves(accept_index, accept_lens, node_slots, front_slots) -> tuple[int, int]:
    """Checks of :func:`accepted_kv_moves`'s inputs; ``(B, W)``."""
    expect(accept_index, "accept_index", 2, torch.int64)
    expect(accept_lens, "accept_lens", 1, torch.int64)
    expect(node_slots, "node_slots", 1, torch.int64)
    expect(front_slots, "front_slots", 1, torch.int64)
    batch, width = accept_index.shape
    expect_shape(accept_lens, "accept_lens", (batch,))
    expect_shape(front_slots, "front_slots", (batch * width,))
    return batch, width


def _check_slots(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Checks of :func:`move_kv`'s slot lists."""
    expect(src, "src", 1, torch.int64)
    expect(dst, "dst", 1, torch.int64)
    expect_shape(dst, "dst", tuple(src.shape))


def compact_to_front_reference(
    x: torch.Tensor,  # [B*N, ...] per-node tensor
    accept_index: torch.Tensor,  # [B, W] i64, node rows of the accepted path, -1 padded
) -> torch.Tensor:  # [B*W, ...]
    """Gather the accepted rows of ``x`` to the front; padded entries repeat the root row b*N."""
    batch, width, num_nodes = _front_shape(x, accept_index)
    if batch == 0:
        return x[:0]
    roots = torch.arange(batch, dtype=torch.int64, device=accept_index.device) * num_nodes
    rows = torch.where(accept_index >= 0, accept_index, roots[:, None])
    return x.index_select(0, rows.reshape(batch * width))


def accepted_kv_moves_reference(
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
    batch, width = _check_moves(accept_index, accept_lens, node_slots, front_slots)
    cols = torch.arange(width, dtype=torch.int64, device=accept_index.device)
    moving = (cols[None, :] < accept_lens[:, None]) & (accept_index >= 0)  # [B, W]
    src = torch.where(
        moving, node_slots[accept_index.clamp(min=0)], front_slots.view(batch, width)
    )
    return src.reshape(batch * width), front_slots.clone()


def move_kv_reference(
    caches: Sequence[torch.Tensor],  # each [slots, ...], e.g. k[layer] and v[layer] of a pool
    src: torch.Tensor,  # [M] i64 source slots
    dst: torch.Tensor,  # [M] i64 destination slots, pairwise distinct
) -> None:
    """Copy ``cache[src[m]]`` to ``cache[dst[m]]`` in place for every cache.

    Every source is gathered before anything is written, so overlapping sources and destinations
    (and permutations) are safe. Destinations must be distinct, except for entries that copy
    equal values.
    """
    _check_slots(src, dst)
    for cache in caches:
        cache.index_copy_(0, dst, cache.index_select(0, src))


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _compact_rows_kernel(
    x_ptr,  # [B*N, F]
    accept_index_ptr,  # [B, W] i64
    out_ptr,  # [B*W, F]
    num_nodes,
    width,
    features,
    BLOCK_F: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64)  # output row b*W + w
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    index = tl.load(accept_index_ptr + i)
    row = tl.where(index >= 0, index, (i // width) * num_nodes)  # padding repeats the root
    ok = f < features
    tl.store(out_ptr + i * features + f, tl.load(x_ptr + row * features + f, mask=ok), mask=ok)


def compact_to_front_triton(
    x: torch.Tensor,  # [B*N, ...]
    accept_index: torch.Tensor,  # [B, W] i64, -1 padded
) -> torch.Tensor:  # [B*W, ...]
    """Triton ``compact_to_front``: a row gather, one program per (output row, feature block).

    A plain copy (the reference's ``where`` + ``index_select`` fused into one launch); rows of
    any dtype and trailing shape, read through a contiguous [B*N, F] view."""
    batch, width, num_nodes = _front_shape(x, accept_index)
    if batch == 0:
        return x[:0]
    out = torch.empty((batch * width, *x.shape[1:]), dtype=x.dtype, device=x.device)
    features = x[0].numel() if x.shape[0] > 0 else 0
    if out.numel() == 0:
        return out
    block_f = min(1024, next_pow2(features))
    _compact_rows_kernel[(batch * width, _dispatch.cdiv(features, block_f))](
        _dispatch.as_bytes(x.contiguous()), accept_index.contiguous(), _dispatch.as_bytes(out),
        num_nodes, width, features,
        BLOCK_F=block_f,
        num_warps=4 if block_f >= 512 else 1, **pdl_options(),
    )
    return out


@jit
def _accepted_kv_moves_kernel(
    accept_index_ptr,  # [B, W] i64
    accept_lens_ptr,  # [B] i64
    node_slots_ptr,  # [B*N] i64
    front_slots_ptr,  # [B*W] i64
    src_ptr,  # [B*W] i64, out
    dst_ptr,  # [B*W] i64, out
    width,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, cols, ok = row_lanes(BLOCK_W, width)
    index = tl.load(accept_index_ptr + b * width + cols, mask=ok, other=-1)
    moving = (cols < tl.load(accept_lens_ptr + b)) & (index >= 0)
    front = tl.load(front_slots_ptr + b * width + cols, mask=ok)
    node = tl.load(node_slots_ptr + index, mask=ok & moving)
    tl.store(src_ptr + b * width + cols, tl.where(moving, node, front), mask=ok)
    tl.store(dst_ptr + b * width + cols, front, mask=ok)


def accepted_kv_moves_triton(
    accept_index: torch.Tensor,  # [B, W] i64
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
    node_slots: torch.Tensor,  # [B*N] i64
    front_slots: torch.Tensor,  # [B*W] i64
) -> tuple[torch.Tensor, torch.Tensor]:  # src [B*W], dst [B*W]
    """Triton ``accepted_kv_moves``: one program per request writes its W sources and
    destinations (a few elementwise ops fused into one launch)."""
    batch, width = _check_moves(accept_index, accept_lens, node_slots, front_slots)
    src = torch.empty(batch * width, dtype=torch.int64, device=accept_index.device)
    dst = torch.empty(batch * width, dtype=torch.int64, device=accept_index.device)
    if batch > 0 and width > 0:
        _accepted_kv_moves_kernel[(batch,)](
            accept_index.contiguous(), accept_lens.contiguous(), node_slots.contiguous(),
            front_slots.contiguous(), src, dst, width,
            BLOCK_W=next_pow2(width), num_warps=1, **pdl_options(),
        )
    return src, dst


@jit
def _gather_rows_kernel(
    caches,  # tuple of NUM [slots, F] caches
    src_ptr,  # [M] i64
    dst_ptr,  # [M] i64
    staged_ptr,  # [NUM, M, F], out
    num_moves,
    features,
    NUM: tl.constexpr,
    BLOCK_F: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    m = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cache = tl.program_id(2)  # one cache per program: NUM moves in flight, not one after another
    src = tl.load(src_ptr + m)
    ok = (f < features) & (src != tl.load(dst_ptr + m))  # self-copies stay where they are
    for i in tl.static_range(NUM):
        if i == cache:
            row = tl.load(caches[i] + src * features + f, mask=ok)
            tl.store(staged_ptr + (i * num_moves + m) * features + f, row, mask=ok)


@jit
def _scatter_rows_kernel(
    caches,  # tuple of NUM [slots, F] caches
    src_ptr,  # [M] i64
    dst_ptr,  # [M] i64
    staged_ptr,  # [NUM, M, F]
    num_moves,
    features,
    NUM: tl.constexpr,
    BLOCK_F: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    m = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cache = tl.program_id(2)
    dst = tl.load(dst_ptr + m)
    ok = (f < features) & (tl.load(src_ptr + m) != dst)
    for i in tl.static_range(NUM):
        if i == cache:
            row = tl.load(staged_ptr + (i * num_moves + m) * features + f, mask=ok)
            tl.store(caches[i] + dst * features + f, row, mask=ok)


_CACHES_PER_LAUNCH = 32


def move_kv_triton(
    caches: Sequence[torch.Tensor],  # each [slots, ...], same dtype and row shape
    src: torch.Tensor,  # [M] i64
    dst: torch.Tensor,  # [M] i64, pairwise distinct
) -> None:
    """Triton ``move_kv``: all caches in two launches (per 32 caches) instead of two per cache.
    Grid (move, feature block, cache): every row of every cache moves in its own program, so a
    launch costs one load's latency rather than one per cache (a program looping over the
    caches pays their loads one after another).

    The first kernel stages every moving row of every cache (rows passed as a tuple of tensor
    arguments, unrolled in the kernel), the second writes them back: gather before scatter is
    what makes overlapping sources and destinations safe, and it needs the grid-wide ordering
    between two launches. Entries with ``src == dst`` are skipped (their destination is written by
    no one else, since destinations are distinct, and sources are read before any write).
    Bytes: 2 x (moving rows) x row size per cache, read and written once each. Caches that
    differ in dtype or row shape, or are not contiguous, take the reference path.
    """
    _check_slots(src, dst)
    caches = list(caches)
    if not caches or src.shape[0] == 0:
        return
    first = caches[0]
    uniform = all(
        c.dtype == first.dtype and c.shape[1:] == first.shape[1:] and c.is_contiguous()
        for c in caches
    )
    if not uniform:
        move_kv_reference(caches, src, dst)
        return
    num_moves = src.shape[0]
    features = first[0].numel() if first.shape[0] > 0 else 0
    if features == 0:
        return
    src, dst = src.contiguous(), dst.contiguous()
    block_f = min(1024, next_pow2(features))
    for start in range(0, len(caches), _CACHES_PER_LAUNCH):
        group = tuple(_dispatch.as_bytes(c) for c in caches[start : start + _CACHES_PER_LAUNCH])
        staged = torch.empty(
            (len(group), num_moves, features), dtype=group[0].dtype, device=first.device
        )
        grid = (num_moves, _dispatch.cdiv(features, block_f), len(group))
        kw = dict(NUM=len(group), BLOCK_F=block_f, num_warps=4 if block_f >= 512 else 1,
                  **pdl_options())
        _gather_rows_kernel[grid](group, src, dst, staged, num_moves, features, **kw)
        _scatter_rows_kernel[grid](group, src, dst, staged, num_moves, features, **kw)


def compact_to_front(
    x: torch.Tensor,  # [B*N, ...] per-node tensor
    accept_index: torch.Tensor,  # [B, W] i64, node rows of the accepted path, -1 padded
) -> torch.Tensor:  # [B*W, ...]
    """Gather the accepted rows of ``x`` to the front; padded entries repeat the root row b*N."""
    if use_triton(x):
        return compact_to_front_triton(x, accept_index)
    return compact_to_front_reference(x, accept_index)


def accepted_kv_moves(
    accept_index: torch.Tensor,  # [B, W] i64
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
    node_slots: torch.Tensor,  # [B*N] i64, KV slot of every tree node (logical seq_len + j)
    front_slots: torch.Tensor,  # [B*W] i64, KV slot of logical seq_len + i
) -> tuple[torch.Tensor, torch.Tensor]:  # src [B*W], dst [B*W]
    """KV moves that put accepted node i of each request into front slot i (see
    :func:`accepted_kv_moves_reference`)."""
    impl = accepted_kv_moves_triton if use_triton(accept_index) else accepted_kv_moves_reference
    return impl(accept_index, accept_lens, node_slots, front_slots)


def move_kv(
    caches: Sequence[torch.Tensor],  # each [slots, ...], e.g. k[layer] and v[layer] of a pool
    src: torch.Tensor,  # [M] i64 source slots
    dst: torch.Tensor,  # [M] i64 destination slots, pairwise distinct
) -> None:
    """Copy ``cache[src[m]]`` to ``cache[dst[m]]`` in place for every cache (gather first, see
    :func:`move_kv_reference`)."""
    if use_triton(src):
        move_kv_triton(caches, src, dst)
    else:
        move_kv_reference(caches, src, dst)
