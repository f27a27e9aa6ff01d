"""KV slot assignment over the paged pool, including page-aware draft branches, torch reference.

See ``docs/internals.md`` ("KV pool and pages", "Draft branches with P > 1"). Logical position
``p`` of page-table row ``r`` lives in slot ``page_table[r, p // P] * P + p % P``.

Draft branches cannot share the prefix's partly filled last page, so with
``full = seq_len // P`` and ``tail = seq_len % P`` each of the K branches of a request owns a
page-aligned region of R pages. The branch's virtual page-table row is the request's first
``full`` pages followed by its region; its logical position ``seq_len + i`` is region offset
``tail + i``. The prefix tail is copied into every region before draft step 0, and a region is
copied to a new beam that descends from it (SGLang ``assign_draft_cache_locs``, PR #7725).

``row_slots``, ``span_slots``, ``span_slots_and_rows``, ``extend_slots``,
``assign_draft_cache_locs`` and ``reorder_branches`` dispatch to
Triton on CUDA tensors (index arithmetic, one small launch each instead of 4-20 torch ops) and
to their ``*_reference`` torch versions elsewhere; ``draft_region_pages`` is host arithmetic.
Beside the slots, they write the small per-row tensors the attention metadata and the draft
beams need (repeated rows and lengths, branch rows, beam hidden rows), which would otherwise
each be a torch launch of their own.
"""

from __future__ import annotations

import attrs
import torch

from phasegraph.kernels._checks import expect, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_block


@attrs.frozen(eq=False)
class DraftCacheLayout:
    """Where the K draft branches of B requests read and write draft KV."""

    branch_page_table: torch.Tensor  # [B*K, max_pages + R] i64, row b*K + k, unused entries 0
    step_slots: torch.Tensor  # [max(S-1, 0), B*K] i64, slot written by draft step i, branch k
    tail_src: torch.Tensor  # [B*K*(P-1)] i64, prefix tail slots (self-copies past the tail)
    tail_dst: torch.Tensor  # [B*K*(P-1)] i64, the matching slots of each branch region
    step_positions: torch.Tensor  # [max(S-1, 0), B*K] i64, logical position seq_len + i of step i
    step_kv_len: torch.Tensor  # [max(S-1, 0), B*K] i64, seq_len + i + 1: KV a step-i query sees
    region_pages: torch.Tensor  # [B, K, R] i64, the pages of each branch region
    branch_rows: torch.Tensor  # [B*K] i64, b*K + k: the branch row of every beam
    beam_hidden: torch.Tensor | None  # [B*K, Hd], hidden[b] for every beam of request b

    @property
    def draft_positions(self) -> torch.Tensor:
        """[B, max(S-1, 0), K] i64: ``step_positions`` by request, a view and not a copy, so
        that the positions the phase records (and strict mode checks, SGLang #25015) are the ones
        the draft forwards were given."""
        batch, topk = self.region_pages.shape[:2]
        return self.step_positions.view(self.step_positions.shape[0], batch, topk).permute(1, 0, 2)


@attrs.frozen(eq=False)
class BranchReorder:
    """What follows a beam reorder: KV moves between branch regions and the beams' hidden rows."""

    src: torch.Tensor  # [B*K*R*P] i64, every slot of region beam_parent[b, k]
    dst: torch.Tensor  # [B*K*R*P] i64, the matching slot of region k
    hidden: torch.Tensor | None  # [B*K, Hd], row b*K + k = hidden[b*K + beam_parent[b, k]]


@attrs.frozen(eq=False)
class SpanRows:
    """Slots of a span per request and the request's row and start repeated per position."""

    slots: torch.Tensor  # [B, count] i64
    rows: torch.Tensor  # [B*count] i64, rows[b] at b*count + j
    starts: torch.Tensor  # [B*count] i64, starts[b] at b*count + j


@attrs.frozen(eq=False)
class ExtendSlots:
    """Where the tokens of a causal extend write KV, and what each attends."""

    slots: torch.Tensor  # [T] i64, KV slot of each token's position
    rows: torch.Tensor  # [T] i64, page-table row of each token
    kv_len: torch.Tensor  # [T] i64, position + 1


def row_slots_reference(
    page_table: torch.Tensor,  # [R, max_pages] i64
    rows: torch.Tensor,  # [B] i64, page-table row of each request
    positions: torch.Tensor,  # [B, X] i64, logical positions in [0, max_pages * P)
    page_size: int,
) -> torch.Tensor:  # [B, X] i64
    """KV slot of logical position ``positions[b, x]`` of page-table row ``rows[b]``."""
    expect(page_table, "page_table", 2, torch.int64)
    expect(rows, "rows", 1, torch.int64)
    expect(positions, "positions", 2, torch.int64)
    expect_shape(positions, "positions", (rows.shape[0], positions.shape[1]))
    pages = page_table.index_select(0, rows).gather(
        1, torch.div(positions, page_size, rounding_mode="floor")
    )
    return pages * page_size + positions % page_size


def span_slots_reference(
    page_table: torch.Tensor,  # [R, max_pages] i64
    rows: torch.Tensor,  # [B] i64, page-table row of each request
    starts: torch.Tensor,  # [B] i64, first logical position of each request's span
    count: int,  # positions per span
    page_size: int,
) -> torch.Tensor:  # [B, count] i64
    """KV slots of logical positions ``starts[b] + 0 .. count-1`` of row ``rows[b]``: a tree's
    nodes at ``seq_len + j``, or the accepted path's front."""
    expect(starts, "starts", 1, torch.int64)
    expect_shape(starts, "starts", (rows.shape[0],))
    positions = starts[:, None] + torch.arange(count, device=starts.device)  # [B, count]
    return row_slots_reference(page_table, rows, positions, page_size)


def span_slots_and_rows_reference(
    page_table: torch.Tensor,  # [R, max_pages] i64
    rows: torch.Tensor,  # [B] i64
    starts: torch.Tensor,  # [B] i64
    count: int,
    page_size: int,
) -> SpanRows:
    """``span_slots`` and ``rows``, ``starts`` repeated ``count`` times each (a tree's nodes:
    the query rows and prefix lengths of its attention)."""
    return SpanRows(
        slots=span_slots_reference(page_table, rows, starts, count, page_size),
        rows=rows.repeat_interleave(count),
        starts=starts.repeat_interleave(count),
    )


def _check_extend(page_table, req_rows, token_req, positions) -> None:
    expect(page_table, "page_table", 2, torch.int64)
    expect(req_rows, "req_rows", 1, torch.int64)
    expect(positions, "positions", 1, torch.int64)
    if token_req is None:
        expect_shape(req_rows, "req_rows", tuple(positions.shape))
    else:
        expect(token_req, "token_req", 1, torch.int64)
        expect_shape(token_req, "token_req", tuple(positions.shape))


def extend_slots_reference(
    page_table: torch.Tensor,  # [R, max_pages] i64
    req_rows: torch.Tensor,  # [B] i64, page-table row of each request
    token_req: torch.Tensor | None,  # [T] i64, request of each token; None: token t is request t
    positions: torch.Tensor,  # [T] i64
    page_size: int,
) -> ExtendSlots:
    """Tokens at ``positions`` of requests ``token_req``, each attending causally up to itself:
    their page-table rows, KV slots and ``kv_len = position + 1``."""
    _check_extend(page_table, req_rows, token_req, positions)
    rows = req_rows if token_req is None else req_rows[token_req]  # [T]
    slots = row_slots_reference(page_table, rows, positions[:, None], page_size)[:, 0]  # [T]
    return ExtendSlots(slots=slots, rows=rows, kv_len=positions + 1)


def draft_region_pages(page_size: int, num_steps: int) -> int:
    """R = ceil((P - 1 + S - 1) / P), at least 1: pages of one branch region.

    A region holds the prefix tail (at most P-1 slots) and the S-1 draft steps that write KV.
    """
    if page_size < 1 or num_steps < 0:
        raise ValueError(f"need page_size >= 1 and num_steps >= 0, got {page_size}, {num_steps}")
    slots = page_size - 1 + max(num_steps - 1, 0)
    return max(1, -(-slots // page_size))


def _check_region(region: int, page_size: int, num_steps: int) -> None:
    if region != draft_region_pages(page_size, num_steps):
        raise ValueError(
            f"region_pages holds {region} pages per branch, expected "
            f"draft_region_pages({page_size}, {num_steps}) = "
            f"{draft_region_pages(page_size, num_steps)}"
        )


def _check_layout_args(page_table, rows, seq_lens, region_pages, page_size, num_steps,
                       region_table, hidden) -> tuple[int, int, int]:
    """Check ``assign_draft_cache_locs``' inputs; returns ``(B, K, R)``."""
    expect(page_table, "page_table", 2, torch.int64)
    expect(rows, "rows", 1, torch.int64)
    expect(seq_lens, "seq_lens", 1, torch.int64)
    expect(region_pages, "region_pages", 3, torch.int64)
    batch = rows.shape[0]
    _, topk, region = region_pages.shape
    if not region_table:
        expect_shape(region_pages, "region_pages", (batch, topk, region))
    expect_shape(seq_lens, "seq_lens", (batch,))
    if hidden is not None:
        expect_shape(hidden, "hidden", (batch, hidden.shape[1]))
    _check_region(region, page_size, num_steps)
    return batch, topk, region


def assign_draft_cache_locs_reference(
    page_table: torch.Tensor,  # [R_rows, max_pages] i64, req_to_page
    rows: torch.Tensor,  # [B] i64, page-table row of each request
    seq_lens: torch.Tensor,  # [B] i64, committed tokens
    region_pages: torch.Tensor,  # [B, K, R] i64 (or [R_rows, K, R] with region_table)
    page_size: int,
    num_steps: int,
    *,
    region_table: bool = False,
    hidden: torch.Tensor | None = None,  # [B, Hd]
) -> DraftCacheLayout:
    """Virtual page-table rows, per-step write slots and prefix-tail copies of every branch.

    ``region_table``: ``region_pages`` is the pool's table of every page-table row, request b's
    regions at ``rows[b]``. ``hidden``: also each request's hidden row repeated for its K beams.
    """
    batch, topk, region = _check_layout_args(page_table, rows, seq_lens, region_pages, page_size,
                                             num_steps, region_table, hidden)
    if region_table:
        region_pages = region_pages[rows]  # [B, K, R]
    max_pages = page_table.shape[1]
    device = page_table.device
    full = torch.div(seq_lens, page_size, rounding_mode="floor")  # [B]
    tail = seq_lens % page_size  # [B]
    req_pages = page_table.index_select(0, rows)  # [B, max_pages]

    # Virtual rows: request pages [0, full) then region pages [full, full + R).
    cols = torch.arange(max_pages + region, dtype=torch.int64, device=device)
    prefix = torch.cat([req_pages, req_pages.new_zeros(batch, region)], dim=1)  # [B, M+R]
    prefix = torch.where(cols[None, :] < full[:, None], prefix, 0)
    in_region = cols[None, :] - full[:, None]  # [B, M+R]
    region_col = in_region.clamp(0, region - 1)[:, None, :].expand(batch, topk, -1)
    from_region = region_pages.gather(2, region_col)  # [B, K, M+R]
    is_region = ((in_region >= 0) & (in_region < region))[:, None, :]
    branch_page_table = torch.where(is_region, from_region, prefix[:, None, :])

    # Draft step i of branch k writes region offset tail + i.
    steps = torch.arange(max(num_steps - 1, 0), dtype=torch.int64, device=device)
    offset = tail[None, :] + steps[:, None]  # [S-1, B]
    page_col = torch.div(offset, page_size, rounding_mode="floor")
    page = region_pages.permute(2, 0, 1).gather(
        0, page_col[:, :, None].expand(-1, -1, topk)
    )  # [S-1, B, K]
    step_slots = page * page_size + (offset % page_size)[:, :, None]

    # Prefix tail (logical [full*P, seq_len)) -> first `tail` slots of every region.
    within = torch.arange(page_size - 1, dtype=torch.int64, device=device)  # [P-1]
    tail_page = req_pages.gather(1, full.clamp(max=max_pages - 1)[:, None])  # [B, 1]
    src = (tail_page * page_size + within[None, :])[:, None, :]  # [B, 1, P-1]
    dst = region_pages[:, :, :1] * page_size + within[None, None, :]  # [B, K, P-1]
    src = torch.where(within[None, None, :] < tail[:, None, None], src, dst)

    step_positions = (seq_lens[None, :] + steps[:, None]).repeat_interleave(topk, dim=1)  # [S-1, B*K]
    return DraftCacheLayout(
        branch_page_table=branch_page_table.reshape(batch * topk, max_pages + region),
        step_slots=step_slots.reshape(steps.shape[0], batch * topk),
        tail_src=src.reshape(-1),
        tail_dst=dst.reshape(-1),
        step_positions=step_positions,
        step_kv_len=step_positions + 1,
        region_pages=region_pages,
        branch_rows=torch.arange(batch * topk, device=device),
        beam_hidden=None if hidden is None else hidden.repeat_interleave(topk, dim=0),
    )


def _check_reorder(region_pages, beam_parent, hidden) -> tuple[int, int, int]:
    expect(region_pages, "region_pages", 3, torch.int64)
    expect(beam_parent, "beam_parent", 2, torch.int64)
    batch, topk, region = region_pages.shape
    expect_shape(beam_parent, "beam_parent", (batch, topk))
    if hidden is not None:
        expect_shape(hidden, "hidden", (batch * topk, hidden.shape[1]))
    return batch, topk, region


def reorder_branches_reference(
    region_pages: torch.Tensor,  # [B, K, R] i64
    beam_parent: torch.Tensor,  # [B, K] i64 in [0, K), old beam of each new beam
    page_size: int,
    hidden: torch.Tensor | None = None,  # [B*K, Hd], the old beams' hidden rows
) -> BranchReorder:
    """Moves copying region ``beam_parent[b, k]`` into region k, every slot of the region, and
    (with ``hidden``) the hidden row of old beam ``beam_parent[b, k]`` as new beam k's.

    A beam that stays in place copies onto itself. Apply the moves with ``move_kv`` (gather
    first), since regions are permuted among themselves.
    """
    batch, topk, region = _check_reorder(region_pages, beam_parent, hidden)
    within = torch.arange(page_size, dtype=torch.int64, device=region_pages.device)
    src_pages = region_pages.gather(1, beam_parent[:, :, None].expand(-1, -1, region))
    src = src_pages[..., None] * page_size + within  # [B, K, R, P]
    dst = region_pages[..., None] * page_size + within
    new_hidden = None
    if hidden is not None:
        hd = hidden.shape[1]
        parent = beam_parent[:, :, None].expand(batch, topk, hd)  # [B, K, Hd]
        new_hidden = hidden.view(batch, topk, hd).gather(1, parent).view(batch * topk, hd)
    return BranchReorder(src=src.reshape(-1), dst=dst.reshape(-1), hidden=new_hidden)


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _row_slots_kernel(
    page_table_ptr,  # [R, max_pages] i64
    rows_ptr,  # [B] i64
    positions_ptr,  # [B, X] i64, or [B] span starts (SPAN)
    slots_ptr,  # [B, X] i64, out
    rows_out_ptr,  # [B*X] i64, out: rows[b] at every position (REPEAT)
    starts_out_ptr,  # [B*X] i64, out: positions[b] at every position (REPEAT, with SPAN)
    num_positions,
    stride_pr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_X: tl.constexpr,
    SPAN: tl.constexpr,  # position x of request b is positions[b] + x
    REPEAT: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, x, ok = row_block(BLOCK_X, num_positions)
    if SPAN:
        start = tl.load(positions_ptr + b)
        pos = start + x
    else:
        pos = tl.load(positions_ptr + b * num_positions + x, mask=ok, other=0)
    row = tl.load(rows_ptr + b)
    page = tl.load(page_table_ptr + row * stride_pr + pos // PAGE_SIZE, mask=ok, other=0)
    out = b * num_positions + x
    tl.store(slots_ptr + out, page * PAGE_SIZE + pos % PAGE_SIZE, mask=ok)
    if REPEAT:
        tl.store(rows_out_ptr + out, row + x * 0, mask=ok)
        if SPAN:
            tl.store(starts_out_ptr + out, start + x * 0, mask=ok)


def row_slots_triton(
    page_table: torch.Tensor,  # [R, max_pages] i64
    rows: torch.Tensor,  # [B] i64
    positions: torch.Tensor,  # [B, X] i64, logical positions in [0, max_pages * P)
    page_size: int,
) -> torch.Tensor:  # [B, X] i64
    """Triton ``row_slots``: one program per (request, block of positions), one page lookup per
    position (the reference's index_select + gather + arithmetic in one launch)."""
    expect(page_table, "page_table", 2, torch.int64)
    expect(rows, "rows", 1, torch.int64)
    expect(positions, "positions", 2, torch.int64)
    batch, num_positions = positions.shape
    expect_shape(positions, "positions", (rows.shape[0], num_positions))
    return _launch_row_slots(page_table, rows, positions, num_positions, page_size, span=False)


def _launch_row_slots(page_table, rows, positions, num_positions: int, page_size: int,
                      span: bool, repeat: bool = False):
    """The slots [B, X]; with ``repeat`` also rows and (span) starts repeated X times each."""
    batch = rows.shape[0]
    device = positions.device
    slots = torch.empty((batch, num_positions), dtype=torch.int64, device=device)
    rows_out = starts_out = slots  # unwritten stand-ins without ``repeat`` (no allocation)
    if repeat:
        rows_out = torch.empty(batch * num_positions, dtype=torch.int64, device=device)
        starts_out = torch.empty(batch * num_positions, dtype=torch.int64, device=device)
    if slots.numel() > 0:
        page_table = page_table if page_table.stride(1) == 1 else page_table.contiguous()
        block = min(1024, next_pow2(num_positions))
        _row_slots_kernel[(batch, -(-num_positions // block))](
            page_table, rows.contiguous(), positions.contiguous(), slots, rows_out, starts_out,
            num_positions, page_table.stride(0),
            PAGE_SIZE=page_size, BLOCK_X=block, SPAN=span, REPEAT=repeat,
            num_warps=1 if block <= 128 else 4, **pdl_options(),
        )
    return (slots, rows_out, starts_out) if repeat else slots


def _check_span(page_table, rows, starts) -> None:
    expect(page_table, "page_table", 2, torch.int64)
    expect(rows, "rows", 1, torch.int64)
    expect(starts, "starts", 1, torch.int64)
    expect_shape(starts, "starts", (rows.shape[0],))


def span_slots_triton(
    page_table: torch.Tensor,  # [R, max_pages] i64
    rows: torch.Tensor,  # [B] i64
    starts: torch.Tensor,  # [B] i64
    count: int,
    page_size: int,
) -> torch.Tensor:  # [B, count] i64
    """Triton ``span_slots``: the row_slots kernel computing each position from its span start
    (the reference's arange and add need no launch of their own)."""
    _check_span(page_table, rows, starts)
    return _launch_row_slots(page_table, rows, starts, count, page_size, span=True)


def span_slots_and_rows_triton(
    page_table: torch.Tensor,  # [R, max_pages] i64
    rows: torch.Tensor,  # [B] i64
    starts: torch.Tensor,  # [B] i64
    count: int,
    page_size: int,
) -> SpanRows:
    """Triton ``span_slots_and_rows``: the span_slots launch also stores each request's row and
    start at its ``count`` positions (in place of two ``repeat_interleave`` copies)."""
    _check_span(page_table, rows, starts)
    slots, rows_out, starts_out = _launch_row_slots(page_table, rows, starts, count, page_size,
                                                    span=True, repeat=True)
    return SpanRows(slots=slots, rows=rows_out, starts=starts_out)


@jit
def _extend_slots_kernel(
    page_table_ptr,  # [R, max_pages] i64
    req_rows_ptr,  # [B] i64 ([T] without GATHER)
    token_req_ptr,  # [T] i64 (GATHER)
    positions_ptr,  # [T] i64
    slots_ptr,  # [T] i64, out
    rows_ptr,  # [T] i64, out (GATHER)
    kv_len_ptr,  # [T] i64, out
    num_tokens,
    stride_pr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GATHER: tl.constexpr,  # token t is of request token_req[t] (else of request t)
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < num_tokens
    if GATHER:
        req = tl.load(token_req_ptr + t, mask=ok, other=0)
        row = tl.load(req_rows_ptr + req, mask=ok, other=0)
        tl.store(rows_ptr + t, row, mask=ok)
    else:
        row = tl.load(req_rows_ptr + t, mask=ok, other=0)
    pos = tl.load(positions_ptr + t, mask=ok, other=0)
    page = tl.load(page_table_ptr + row * stride_pr + pos // PAGE_SIZE, mask=ok, other=0)
    tl.store(slots_ptr + t, page * PAGE_SIZE + pos % PAGE_SIZE, mask=ok)
    tl.store(kv_len_ptr + t, pos + 1, mask=ok)


def extend_slots_triton(
    page_table: torch.Tensor,  # [R, max_pages] i64
    req_rows: torch.Tensor,  # [B] i64
    token_req: torch.Tensor | None,  # [T] i64, or None (token t is request t)
    positions: torch.Tensor,  # [T] i64
    page_size: int,
) -> ExtendSlots:
    """Triton ``extend_slots``: one launch for the rows, slots and kv_len of every token (the
    reference's index, page lookup and add). Without ``token_req``, ``rows`` is ``req_rows``."""
    _check_extend(page_table, req_rows, token_req, positions)
    num_tokens = positions.shape[0]
    device = positions.device
    slots = torch.empty(num_tokens, dtype=torch.int64, device=device)
    rows = req_rows if token_req is None else torch.empty(num_tokens, dtype=torch.int64,
                                                           device=device)
    kv_len = torch.empty(num_tokens, dtype=torch.int64, device=device)
    if num_tokens > 0:
        page_table = page_table if page_table.stride(1) == 1 else page_table.contiguous()
        block = min(128, next_pow2(num_tokens))
        req_rows = req_rows.contiguous()
        _extend_slots_kernel[(-(-num_tokens // block),)](
            page_table, req_rows, req_rows if token_req is None else token_req.contiguous(),
            positions.contiguous(), slots, rows if token_req is not None else slots, kv_len,
            num_tokens, page_table.stride(0),
            PAGE_SIZE=page_size, BLOCK_T=block, GATHER=token_req is not None, num_warps=1,
            **pdl_options(),
        )
    return ExtendSlots(slots=slots, rows=rows, kv_len=kv_len)


@jit
def _copy_rows(src_ptr, dst_ptr, src_row, dst_row, hidden, block, BLOCK_H: tl.constexpr):
    """Row ``src_row`` of ``src`` [*, hidden] to row ``dst_row`` of ``dst``, columns of block
    ``block`` (of BLOCK_H)."""
    cols = block * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < hidden
    tl.store(dst_ptr + dst_row * hidden + cols, tl.load(src_ptr + src_row * hidden + cols, mask=ok),
             mask=ok)


@jit
def _draft_cache_locs_kernel(
    page_table_ptr,  # [R_rows, max_pages] i64
    rows_ptr,  # [B] i64
    seq_lens_ptr,  # [B] i64
    region_pages_ptr,  # [B, K, R] i64, or [R_rows, K, R] (REGION_TABLE)
    hidden_ptr,  # [B, Hd] (HIDDEN)
    branch_table_ptr,  # [B*K, max_pages + R] i64, out
    step_slots_ptr,  # [S-1, B*K] i64, out
    tail_src_ptr,  # [B*K*(P-1)] i64, out
    tail_dst_ptr,  # [B*K*(P-1)] i64, out
    step_positions_ptr,  # [S-1, B*K] i64, out
    step_kv_len_ptr,  # [S-1, B*K] i64, out
    region_out_ptr,  # [B, K, R] i64, out (REGION_TABLE)
    branch_rows_ptr,  # [B*K] i64, out
    beam_hidden_ptr,  # [B*K, Hd], out (HIDDEN)
    max_pages,
    num_branches,  # B*K
    stride_pr,
    hidden_size,
    TOPK: tl.constexpr,
    REGION: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_WRITES: tl.constexpr,  # S-1 draft steps that write KV
    BLOCK_COLS: tl.constexpr,
    BLOCK_STEPS: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    REGION_TABLE: tl.constexpr,
    HIDDEN: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    branch = tl.program_id(0).to(tl.int64)  # b*K + k
    b = branch // TOPK
    if HIDDEN:  # block program_id(1) of the request's hidden row, for this beam
        _copy_rows(hidden_ptr, beam_hidden_ptr, b, branch, hidden_size, tl.program_id(1), BLOCK_H)
    if tl.program_id(1) == 0:
        row = tl.load(rows_ptr + b)
        seq_len = tl.load(seq_lens_ptr + b)
        full = seq_len // PAGE_SIZE
        tail = seq_len % PAGE_SIZE
        if REGION_TABLE:
            region_ptr = region_pages_ptr + (row * TOPK + branch % TOPK) * REGION
            r = tl.arange(0, BLOCK_R)
            tl.store(region_out_ptr + branch * REGION + r, tl.load(region_ptr + r, mask=r < REGION),
                     mask=r < REGION)
        else:
            region_ptr = region_pages_ptr + branch * REGION
        tl.store(branch_rows_ptr + branch, branch)

        # Virtual row: request pages [0, full), then the branch region [full, full + R), then 0.
        width = max_pages + REGION
        for start in range(0, width, BLOCK_COLS):
            cols = start + tl.arange(0, BLOCK_COLS)
            ok = cols < width
            in_region = cols - full
            is_region = (in_region >= 0) & (in_region < REGION)
            region_page = tl.load(region_ptr + in_region, mask=ok & is_region, other=0)
            prefix = tl.load(page_table_ptr + row * stride_pr + cols,
                             mask=ok & (cols < full) & (cols < max_pages), other=0)
            tl.store(branch_table_ptr + branch * width + cols,
                     tl.where(is_region, region_page, prefix), mask=ok)

        # Draft step i writes region offset tail + i.
        steps = tl.arange(0, BLOCK_STEPS)
        steps_ok = steps < NUM_WRITES
        offset = tail + steps
        page = tl.load(region_ptr + offset // PAGE_SIZE, mask=steps_ok, other=0)
        tl.store(step_slots_ptr + steps * num_branches + branch,
                 page * PAGE_SIZE + offset % PAGE_SIZE, mask=steps_ok)
        tl.store(step_positions_ptr + steps * num_branches + branch, seq_len + steps, mask=steps_ok)
        tl.store(step_kv_len_ptr + steps * num_branches + branch, seq_len + steps + 1,
                 mask=steps_ok)

        # Prefix tail (logical [full*P, seq_len)) -> first `tail` slots of the region.
        if PAGE_SIZE > 1:
            within = tl.arange(0, BLOCK_TAIL)
            tail_ok = within < PAGE_SIZE - 1
            tail_page = tl.load(page_table_ptr + row * stride_pr + tl.minimum(full, max_pages - 1))
            dst = tl.load(region_ptr) * PAGE_SIZE + within
            src = tl.where(within < tail, tail_page * PAGE_SIZE + within, dst)
            tl.store(tail_src_ptr + branch * (PAGE_SIZE - 1) + within, src, mask=tail_ok)
            tl.store(tail_dst_ptr + branch * (PAGE_SIZE - 1) + within, dst, mask=tail_ok)


def _hidden_rows_copy(hidden: torch.Tensor | None, out_rows: int):
    """What a kernel that copies rows of ``hidden`` [*, Hd] needs: the contiguous source, an
    empty ``[out_rows, Hd]`` destination, Hd, the columns one program copies and how many such
    blocks (the second grid axis); ``(None, None, 0, 16, 1)`` without ``hidden``."""
    if hidden is None:
        return None, None, 0, 16, 1
    hidden = hidden.contiguous()
    size = hidden.shape[1]
    block = min(1024, next_pow2(size))
    out = torch.empty((out_rows, size), dtype=hidden.dtype, device=hidden.device)
    return hidden, out, size, block, max(1, -(-size // block))


def assign_draft_cache_locs_triton(
    page_table: torch.Tensor,  # [R_rows, max_pages] i64, req_to_page
    rows: torch.Tensor,  # [B] i64
    seq_lens: torch.Tensor,  # [B] i64
    region_pages: torch.Tensor,  # [B, K, R] i64 (or [R_rows, K, R] with region_table)
    page_size: int,
    num_steps: int,
    *,
    region_table: bool = False,
    hidden: torch.Tensor | None = None,  # [B, Hd]
) -> DraftCacheLayout:
    """Triton ``assign_draft_cache_locs``: one program per branch writes its virtual page-table
    row, its S-1 step slots and positions, its P-1 tail copies, its branch row and (with
    ``region_table``) its region pages (about 25 torch ops and an index in the reference);
    with ``hidden``, programs along a second grid axis copy the request's hidden row to the
    beam, one block of columns each."""
    batch, topk, region = _check_layout_args(page_table, rows, seq_lens, region_pages, page_size,
                                             num_steps, region_table, hidden)
    max_pages = page_table.shape[1]
    device = page_table.device
    branches = batch * topk
    writes = max(num_steps - 1, 0)
    branch_table = torch.empty((branches, max_pages + region), dtype=torch.int64, device=device)
    step_slots = torch.empty((writes, branches), dtype=torch.int64, device=device)
    tail_src = torch.empty(branches * (page_size - 1), dtype=torch.int64, device=device)
    tail_dst = torch.empty(branches * (page_size - 1), dtype=torch.int64, device=device)
    step_positions = torch.empty((writes, branches), dtype=torch.int64, device=device)
    step_kv_len = torch.empty((writes, branches), dtype=torch.int64, device=device)
    region_out = torch.empty((batch, topk, region), dtype=torch.int64, device=device) \
        if region_table else region_pages
    branch_rows = torch.empty(branches, dtype=torch.int64, device=device)
    hidden, beam_hidden, hidden_size, block_h, blocks_h = _hidden_rows_copy(hidden, branches)
    if branches > 0:
        page_table = page_table if page_table.stride(1) == 1 else page_table.contiguous()
        _draft_cache_locs_kernel[(branches, blocks_h)](
            page_table, rows.contiguous(), seq_lens.contiguous(), region_pages.contiguous(),
            branch_table if hidden is None else hidden,
            branch_table, step_slots, tail_src, tail_dst, step_positions, step_kv_len,
            region_out, branch_rows,
            branch_table if beam_hidden is None else beam_hidden,
            max_pages, branches,
            page_table.stride(0), hidden_size,
            TOPK=topk,
            REGION=region,
            PAGE_SIZE=page_size,
            NUM_WRITES=writes,
            BLOCK_COLS=min(1024, next_pow2(max_pages + region)),
            BLOCK_STEPS=next_pow2(writes),
            BLOCK_TAIL=next_pow2(page_size - 1),
            BLOCK_R=next_pow2(region),
            BLOCK_H=block_h,
            REGION_TABLE=region_table,
            HIDDEN=hidden is not None,
            num_warps=1, **pdl_options(),
        )
    return DraftCacheLayout(
        branch_page_table=branch_table,
        step_slots=step_slots,
        tail_src=tail_src,
        tail_dst=tail_dst,
        step_positions=step_positions,
        step_kv_len=step_kv_len,
        region_pages=region_out,
        branch_rows=branch_rows,
        beam_hidden=beam_hidden,
    )


@jit
def _branch_reorder_kernel(
    region_pages_ptr,  # [B, K, R] i64
    beam_parent_ptr,  # [B, K] i64
    hidden_ptr,  # [B*K, Hd] (HIDDEN)
    src_ptr,  # [B*K*R*P] i64, out
    dst_ptr,  # [B*K*R*P] i64, out
    new_hidden_ptr,  # [B*K, Hd], out (HIDDEN)
    hidden_size,
    TOPK: tl.constexpr,
    REGION: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two of R*P
    BLOCK_H: tl.constexpr,
    HIDDEN: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    branch = tl.program_id(0).to(tl.int64)  # b*K + k
    b = branch // TOPK
    parent = tl.load(beam_parent_ptr + branch)
    if HIDDEN:  # block program_id(1) of old beam parent's hidden row
        _copy_rows(hidden_ptr, new_hidden_ptr, b * TOPK + parent, branch, hidden_size,
                   tl.program_id(1), BLOCK_H)
    if tl.program_id(1) == 0:
        offs = tl.arange(0, BLOCK)
        ok = offs < REGION * PAGE_SIZE
        r = offs // PAGE_SIZE
        within = offs % PAGE_SIZE
        src_page = tl.load(region_pages_ptr + (b * TOPK + parent) * REGION + r, mask=ok, other=0)
        dst_page = tl.load(region_pages_ptr + branch * REGION + r, mask=ok, other=0)
        out = branch * (REGION * PAGE_SIZE) + offs
        tl.store(src_ptr + out, src_page * PAGE_SIZE + within, mask=ok)
        tl.store(dst_ptr + out, dst_page * PAGE_SIZE + within, mask=ok)


def reorder_branches_triton(
    region_pages: torch.Tensor,  # [B, K, R] i64
    beam_parent: torch.Tensor,  # [B, K] i64 in [0, K)
    page_size: int,
    hidden: torch.Tensor | None = None,  # [B*K, Hd]
) -> BranchReorder:
    """Triton ``reorder_branches``: one program per branch writes its R*P moves; with
    ``hidden``, programs along a second grid axis copy the parent beam's hidden row, one block
    of columns each (in place of a gather launch)."""
    batch, topk, region = _check_reorder(region_pages, beam_parent, hidden)
    device = region_pages.device
    total = batch * topk * region * page_size
    src = torch.empty(total, dtype=torch.int64, device=device)
    dst = torch.empty(total, dtype=torch.int64, device=device)
    hidden, new_hidden, hidden_size, block_h, blocks_h = _hidden_rows_copy(hidden, batch * topk)
    if total > 0:
        _branch_reorder_kernel[(batch * topk, blocks_h)](
            region_pages.contiguous(), beam_parent.contiguous(),
            src if hidden is None else hidden, src, dst,
            src if new_hidden is None else new_hidden, hidden_size,
            TOPK=topk, REGION=region, PAGE_SIZE=page_size,
            BLOCK=next_pow2(region * page_size), BLOCK_H=block_h, HIDDEN=hidden is not None,
            num_warps=1, **pdl_options(),
        )
    return BranchReorder(src=src, dst=dst, hidden=new_hidden)


def row_slots(
    page_table: torch.Tensor,  # [R, max_pages] i64
    rows: torch.Tensor,  # [B] i64, page-table row of each request
    positions: torch.Tensor,  # [B, X] i64, logical positions in [0, max_pages * P)
    page_size: int,
) -> torch.Tensor:  # [B, X] i64
    """KV slot of logical position ``positions[b, x]`` of page-table row ``rows[b]``."""
    impl = row_slots_triton if use_triton(positions) else row_slots_reference
    return impl(page_table, rows, positions, page_size)


def span_slots(
    page_table: torch.Tensor,  # [R, max_pages] i64
    rows: torch.Tensor,  # [B] i64, page-table row of each request
    starts: torch.Tensor,  # [B] i64, first logical position of each request's span
    count: int,  # positions per span
    page_size: int,
) -> torch.Tensor:  # [B, count] i64
    """KV slots of logical positions ``starts[b] + 0 .. count-1`` of page-table row ``rows[b]``."""
    impl = span_slots_triton if use_triton(starts) else span_slots_reference
    return impl(page_table, rows, starts, count, page_size)


def span_slots_and_rows(
    page_table: torch.Tensor,  # [R, max_pages] i64
    rows: torch.Tensor,  # [B] i64, page-table row of each request
    starts: torch.Tensor,  # [B] i64, first logical position of each request's span
    count: int,  # positions per span
    page_size: int,
) -> SpanRows:
    """:func:`span_slots`, and ``rows``, ``starts`` repeated ``count`` times each."""
    impl = span_slots_and_rows_triton if use_triton(starts) else span_slots_and_rows_reference
    return impl(page_table, rows, starts, count, page_size)


def extend_slots(
    page_table: torch.Tensor,  # [R, max_pages] i64
    req_rows: torch.Tensor,  # [B] i64, page-table row of each request
    token_req: torch.Tensor | None,  # [T] i64, request of each token; None: token t is request t
    positions: torch.Tensor,  # [T] i64
    page_size: int,
) -> ExtendSlots:
    """Page-table rows, KV slots and ``kv_len = position + 1`` of the tokens of a causal
    extend (see :func:`extend_slots_reference`)."""
    impl = extend_slots_triton if use_triton(positions) else extend_slots_reference
    return impl(page_table, req_rows, token_req, positions, page_size)


def assign_draft_cache_locs(
    page_table: torch.Tensor,  # [R_rows, max_pages] i64, req_to_page
    rows: torch.Tensor,  # [B] i64, page-table row of each request
    seq_lens: torch.Tensor,  # [B] i64, committed tokens
    region_pages: torch.Tensor,  # [B, K, R] i64 (or [R_rows, K, R] with region_table)
    page_size: int,
    num_steps: int,
    *,
    region_table: bool = False,
    hidden: torch.Tensor | None = None,  # [B, Hd]
) -> DraftCacheLayout:
    """Virtual page-table rows, per-step write slots and positions, and prefix-tail copies of
    every branch (see :func:`assign_draft_cache_locs_reference`)."""
    impl = (
        assign_draft_cache_locs_triton
        if use_triton(seq_lens)
        else assign_draft_cache_locs_reference
    )
    return impl(page_table, rows, seq_lens, region_pages, page_size, num_steps,
                region_table=region_table, hidden=hidden)


def reorder_branches(
    region_pages: torch.Tensor,  # [B, K, R] i64
    beam_parent: torch.Tensor,  # [B, K] i64 in [0, K), old beam of each new beam
    page_size: int,
    hidden: torch.Tensor | None = None,  # [B*K, Hd], the old beams' hidden rows
) -> BranchReorder:
    """KV moves from region ``beam_parent[b, k]`` into region k and (with ``hidden``) the new
    beams' hidden rows (see :func:`reorder_branches_reference`)."""
    impl = reorder_branches_triton if use_triton(region_pages) else reorder_branches_reference
    return impl(region_pages, beam_parent, page_size, hidden)
