"""KV slot assignment over the paged pool, including page-aware draft branches, torch reference.

See ``docs/internals.md`` ("KV pool and pages", "Draft branches with P > 1"). Logical position
``p`` of page-table row ``r`` lives in slot ``page_table[r, p // P] * P + p % P``.

Draft branches cannot share the prefix's partly filled last page, so with
``full = seq_len // P`` and ``tail = seq_len % P`` each of the K branches of a request owns a
page-aligned region of R pages. The branch's virtual page-table row is the request's first
``full`` pages followed by its region; its logical position ``seq_len + i`` is region offset
``tail + i``. The prefix tail is copied into every region before draft step 0, and a region is
copied to a new beam that descends from it (SGLang ``assign_draft_cache_locs``, PR #7725).
"""

from __future__ import annotations

import attrs
import torch

from phasegraph.kernels._checks import expect, expect_shape


@attrs.frozen(eq=False)
class DraftCacheLayout:
    """Where the K draft branches of B requests read and write draft KV."""

    branch_page_table: torch.Tensor  # [B*K, max_pages + R] i64, row b*K + k, unused entries 0
    step_slots: torch.Tensor  # [max(S-1, 0), B*K] i64, slot written by draft step i, branch k
    tail_src: torch.Tensor  # [B*K*(P-1)] i64, prefix tail slots (self-copies past the tail)
    tail_dst: torch.Tensor  # [B*K*(P-1)] i64, the matching slots of each branch region


def row_slots(
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


def draft_region_pages(page_size: int, num_steps: int) -> int:
    """R = ceil((P - 1 + S - 1) / P), at least 1: pages of one branch region.

    A region holds the prefix tail (at most P-1 slots) and the S-1 draft steps that write KV.
    """
    if page_size < 1 or num_steps < 0:
        raise ValueError(f"need page_size >= 1 and num_steps >= 0, got {page_size}, {num_steps}")
    slots = page_size - 1 + max(num_steps - 1, 0)
    return max(1, -(-slots // page_size))


def assign_draft_cache_locs(
    page_table: torch.Tensor,  # [R_rows, max_pages] i64, req_to_page
    rows: torch.Tensor,  # [B] i64, page-table row of each request
    seq_lens: torch.Tensor,  # [B] i64, committed tokens
    region_pages: torch.Tensor,  # [B, K, R] i64, the pages of each branch region
    page_size: int,
    num_steps: int,
) -> DraftCacheLayout:
    """Virtual page-table rows, per-step write slots and prefix-tail copies of every branch."""
    expect(page_table, "page_table", 2, torch.int64)
    expect(rows, "rows", 1, torch.int64)
    expect(seq_lens, "seq_lens", 1, torch.int64)
    expect(region_pages, "region_pages", 3, torch.int64)
    batch, topk, region = region_pages.shape
    expect_shape(rows, "rows", (batch,))
    expect_shape(seq_lens, "seq_lens", (batch,))
    if region != draft_region_pages(page_size, num_steps):
        raise ValueError(
            f"region_pages holds {region} pages per branch, expected "
            f"draft_region_pages({page_size}, {num_steps}) = "
            f"{draft_region_pages(page_size, num_steps)}"
        )
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

    return DraftCacheLayout(
        branch_page_table=branch_page_table.reshape(batch * topk, max_pages + region),
        step_slots=step_slots.reshape(steps.shape[0], batch * topk),
        tail_src=src.reshape(-1),
        tail_dst=dst.reshape(-1),
    )


def branch_reorder_moves(
    region_pages: torch.Tensor,  # [B, K, R] i64
    beam_parent: torch.Tensor,  # [B, K] i64 in [0, K), old beam of each new beam
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # src [B*K*R*P], dst [B*K*R*P]
    """Moves copying region ``beam_parent[b, k]`` into region k, every slot of the region.

    A beam that stays in place copies onto itself. Apply with ``move_kv`` (gather first), since
    regions are permuted among themselves.
    """
    expect(region_pages, "region_pages", 3, torch.int64)
    expect(beam_parent, "beam_parent", 2, torch.int64)
    batch, topk, region = region_pages.shape
    expect_shape(beam_parent, "beam_parent", (batch, topk))
    within = torch.arange(page_size, dtype=torch.int64, device=region_pages.device)
    src_pages = region_pages.gather(1, beam_parent[:, :, None].expand(-1, -1, region))
    src = src_pages[..., None] * page_size + within  # [B, K, R, P]
    dst = region_pages[..., None] * page_size + within
    return src.reshape(-1), dst.reshape(-1)
