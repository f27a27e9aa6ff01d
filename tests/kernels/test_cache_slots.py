"""Page-aware slot assignment: request rows, draft branch regions, tail copies, beam reorder."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasegraph.kernels import (
    assign_draft_cache_locs,
    draft_region_pages,
    extend_slots,
    move_kv,
    reorder_branches,
    row_slots,
    span_slots,
    span_slots_and_rows,
)


def test_row_slots_hand_case():
    page_table = torch.tensor([[0, 0, 0], [7, 3, 9]])
    slots = row_slots(
        page_table, torch.tensor([1, 0]), torch.tensor([[0, 3, 4, 9], [0, 1, 2, 3]]), 4
    )
    assert torch.equal(slots, torch.tensor([[28, 31, 12, 37], [0, 1, 2, 3]]))


def test_span_slots_are_the_row_slots_of_consecutive_positions():
    page_table = torch.tensor([[0, 0, 0], [7, 3, 9], [5, 6, 2]])
    rows, starts = torch.tensor([1, 2, 0]), torch.tensor([2, 7, 0])
    spans = span_slots(page_table, rows, starts, 4, 4)
    positions = starts[:, None] + torch.arange(4)
    assert torch.equal(spans, row_slots(page_table, rows, positions, 4))
    assert torch.equal(spans[0], torch.tensor([30, 31, 12, 13]))  # crosses into the next page
    assert span_slots(page_table, rows, starts, 0, 4).shape == (3, 0)
    with pytest.raises(ValueError, match="starts"):
        span_slots(page_table, rows, starts[:2], 4, 4)


@pytest.mark.parametrize(
    ("page_size", "num_steps", "expected"),
    [
        (1, 0, 1),
        (1, 1, 1),
        (1, 2, 1),
        (1, 4, 3),
        (4, 1, 1),
        (4, 3, 2),
        (16, 2, 1),
        (16, 5, 2),
        (2, 4, 2),
    ],
)
def test_draft_region_pages(page_size, num_steps, expected):
    assert draft_region_pages(page_size, num_steps) == expected


def test_assign_draft_cache_locs_hand_case():
    # P = 4, S = 3, K = 2, R = 2; seq_len 6: one full page (5), tail 2 on page 9.
    page_table = torch.tensor([[0, 0, 0, 0], [5, 9, 0, 0]])
    region_pages = torch.tensor([[[11, 12], [13, 14]]])
    layout = assign_draft_cache_locs(
        page_table, torch.tensor([1]), torch.tensor([6]), region_pages, 4, 3
    )
    assert torch.equal(
        layout.branch_page_table, torch.tensor([[5, 11, 12, 0, 0, 0], [5, 13, 14, 0, 0, 0]])
    )
    assert torch.equal(layout.step_slots, torch.tensor([[46, 54], [47, 55]]))
    assert torch.equal(layout.tail_src, torch.tensor([36, 37, 46, 36, 37, 54]))
    assert torch.equal(layout.tail_dst, torch.tensor([44, 45, 46, 52, 53, 54]))
    # step i of both branches runs at logical position 6 + i and sees 6 + i + 1 KV entries
    assert torch.equal(layout.step_positions, torch.tensor([[6, 6], [7, 7]]))
    assert torch.equal(layout.step_kv_len, torch.tensor([[7, 7], [8, 8]]))
    assert torch.equal(layout.draft_positions, torch.tensor([[[6, 6], [7, 7]]]))  # [B, S-1, K]


def test_assign_draft_cache_locs_page_size_one():
    # P = 1: no tail, regions of S-1 slots; two requests.
    page_table = torch.tensor([[0, 0, 0], [4, 5, 6], [7, 8, 0]])
    region_pages = torch.tensor([[[20, 21], [22, 23]], [[30, 31], [32, 33]]])
    layout = assign_draft_cache_locs(
        page_table, torch.tensor([1, 2]), torch.tensor([3, 2]), region_pages, 1, 3
    )
    assert torch.equal(layout.step_positions, torch.tensor([[3, 3, 2, 2], [4, 4, 3, 3]]))
    assert torch.equal(layout.draft_positions, torch.tensor([[[3, 3], [4, 4]], [[2, 2], [3, 3]]]))
    assert torch.equal(
        layout.branch_page_table,
        torch.tensor(
            [
                [4, 5, 6, 20, 21],
                [4, 5, 6, 22, 23],
                [7, 8, 30, 31, 0],
                [7, 8, 32, 33, 0],
            ]
        ),
    )
    assert torch.equal(layout.step_slots, torch.tensor([[20, 22, 30, 32], [21, 23, 31, 33]]))
    assert layout.tail_src.shape == layout.tail_dst.shape == (0,)


def test_assign_draft_cache_locs_single_step_has_no_step_slots():
    layout = assign_draft_cache_locs(
        torch.tensor([[0, 0], [3, 6]]),
        torch.tensor([1]),
        torch.tensor([5]),
        torch.tensor([[[8]]]),
        4,
        1,
    )
    assert layout.step_slots.shape == (0, 1)
    # seq_len 5 = one full page (3) + a tail of 1 slot on page 6: one copy, two self-copies
    assert torch.equal(layout.tail_src, torch.tensor([24, 33, 34]))
    assert torch.equal(layout.tail_dst, torch.tensor([32, 33, 34]))


def test_assign_draft_cache_locs_rejects_wrong_region_size():
    with pytest.raises(ValueError, match="region_pages"):
        assign_draft_cache_locs(
            torch.tensor([[0, 0]]),
            torch.tensor([0]),
            torch.tensor([1]),
            torch.zeros(1, 1, 3, dtype=torch.int64),
            4,
            3,
        )


def _layout_problem(data):
    page_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    num_steps = data.draw(st.integers(1, 5))
    topk = data.draw(st.integers(1, 4))
    batch = data.draw(st.integers(1, 3))
    region = draft_region_pages(page_size, num_steps)
    seq_lens = [data.draw(st.integers(0, 30)) for _ in range(batch)]
    max_pages = max(seq_lens) // page_size + 2
    num_pages = 1 + batch * max_pages + batch * topk * region
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    pages = torch.randperm(num_pages - 1, generator=g) + 1  # page 0 reserved
    page_table = torch.zeros(batch + 2, max_pages, dtype=torch.int64)
    rows = torch.randperm(batch + 1, generator=g)[:batch] + 1  # rows in any order, row 0 reserved
    page_table[rows] = pages[: batch * max_pages].view(batch, max_pages)
    region_pages = pages[batch * max_pages :].view(batch, topk, region)
    return (
        page_size,
        num_steps,
        topk,
        batch,
        region,
        torch.tensor(seq_lens),
        page_table,
        rows,
        region_pages,
        num_pages,
    )


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_branches_see_the_prefix_and_write_their_own_region(data):
    (
        page_size,
        num_steps,
        topk,
        batch,
        region,
        seq_lens,
        page_table,
        rows,
        region_pages,
        num_pages,
    ) = _layout_problem(data)
    layout = assign_draft_cache_locs(
        page_table, rows, seq_lens, region_pages, page_size, num_steps
    )
    max_pages = page_table.shape[1]
    assert layout.branch_page_table.shape == (batch * topk, max_pages + region)
    assert layout.step_slots.shape == (num_steps - 1, batch * topk)
    assert layout.tail_src.shape == layout.tail_dst.shape == (batch * topk * (page_size - 1),)

    pool = torch.arange(num_pages * page_size, dtype=torch.float32)[:, None] * torch.ones(1, 2)
    before = pool.clone()
    move_kv([pool], layout.tail_src, layout.tail_dst)

    branch_rows = torch.arange(batch * topk)
    for b in range(batch):
        n = int(seq_lens[b])
        for k in range(topk):
            br = branch_rows[b * topk + k : b * topk + k + 1]
            region_set = set(region_pages[b, k].tolist())
            if n > 0:
                prefix = torch.arange(n)[None]
                branch_slots = row_slots(layout.branch_page_table, br, prefix, page_size)
                req_slots = row_slots(page_table, rows[b : b + 1], prefix, page_size)
                # the branch reads the request's prefix, through the copied tail
                assert torch.equal(pool[branch_slots[0]], before[req_slots[0]])
            steps = torch.arange(num_steps - 1)
            if num_steps > 1:
                via_row = row_slots(layout.branch_page_table, br, (n + steps)[None], page_size)[0]
                assert torch.equal(layout.step_slots[:, b * topk + k], via_row)
                assert {s // page_size for s in via_row.tolist()} <= region_set
    # copies write only inside region pages; the prefix pages are untouched
    assert {s // page_size for s in layout.tail_dst.tolist()} <= set(
        region_pages.view(-1).tolist()
    )
    region_slot = torch.zeros(pool.shape[0], dtype=torch.bool)
    for p in region_pages.view(-1).tolist():
        region_slot[p * page_size : (p + 1) * page_size] = True
    assert torch.equal(pool[~region_slot], before[~region_slot])
    # no two branches or steps share a slot
    assert layout.step_slots.unique().numel() == layout.step_slots.numel()


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_branch_reorder_copies_whole_regions(data):
    page_size, num_steps, topk, batch, region, _, _, _, region_pages, num_pages = _layout_problem(
        data
    )
    beam_parent = torch.tensor(
        [[data.draw(st.integers(0, topk - 1)) for _ in range(topk)] for _ in range(batch)]
    )
    pool = torch.randn(num_pages * page_size, 3)
    before = pool.clone()
    moves = reorder_branches(region_pages, beam_parent, page_size)
    src, dst = moves.src, moves.dst
    assert moves.hidden is None
    assert src.shape == dst.shape == (batch * topk * region * page_size,)
    move_kv([pool], src, dst)

    def region_rows(b, k):
        return torch.cat(
            [torch.arange(p * page_size, (p + 1) * page_size) for p in region_pages[b, k].tolist()]
        )

    for b in range(batch):
        for k in range(topk):
            old = region_rows(b, int(beam_parent[b, k]))
            assert torch.equal(pool[region_rows(b, k)], before[old])
    touched = torch.zeros(pool.shape[0], dtype=torch.bool)
    touched[dst] = True
    assert torch.equal(pool[~touched], before[~touched])


def test_extend_slots_are_the_rows_slots_and_lengths_of_each_token():
    page_table = torch.tensor([[0, 0, 0], [7, 3, 9], [5, 6, 2]])
    req_rows, token_req = torch.tensor([2, 1]), torch.tensor([0, 0, 1, 1, 1])
    positions = torch.tensor([3, 4, 0, 5, 8])
    ext = extend_slots(page_table, req_rows, token_req, positions, 4)
    assert torch.equal(ext.rows, req_rows[token_req])
    assert torch.equal(ext.slots, row_slots(page_table, ext.rows, positions[:, None], 4)[:, 0])
    assert torch.equal(ext.kv_len, positions + 1)
    one = extend_slots(page_table, req_rows, None, torch.tensor([6, 1]), 4)  # token b = request b
    assert one.rows is req_rows and torch.equal(one.slots, torch.tensor([26, 29]))


def test_span_slots_and_rows_repeat_each_request_per_position():
    page_table = torch.tensor([[0, 0, 0], [7, 3, 9], [5, 6, 2]])
    rows, starts = torch.tensor([1, 2]), torch.tensor([2, 7])
    span = span_slots_and_rows(page_table, rows, starts, 3, 4)
    assert torch.equal(span.slots, span_slots(page_table, rows, starts, 3, 4))
    assert span.rows.tolist() == [1, 1, 1, 2, 2, 2] and span.starts.tolist() == [2, 2, 2, 7, 7, 7]


def test_draft_layout_reads_the_region_table_and_repeats_hidden_rows():
    page_table = torch.tensor([[0, 0, 0, 0], [5, 9, 0, 0], [4, 8, 0, 0]])
    table = torch.zeros(3, 2, 2, dtype=torch.int64)
    table[1], table[2] = torch.tensor([[11, 12], [13, 14]]), torch.tensor([[15, 16], [17, 18]])
    rows, seq_lens = torch.tensor([2, 1]), torch.tensor([6, 5])
    hidden = torch.randn(2, 5)
    plain = assign_draft_cache_locs(page_table, rows, seq_lens, table[rows], 4, 3)
    layout = assign_draft_cache_locs(page_table, rows, seq_lens, table, 4, 3, region_table=True,
                                     hidden=hidden)
    for name in ("branch_page_table", "step_slots", "tail_src", "tail_dst", "step_positions",
                 "step_kv_len", "draft_positions", "region_pages", "branch_rows"):
        assert torch.equal(getattr(layout, name), getattr(plain, name)), name
    assert plain.beam_hidden is None and layout.branch_rows.tolist() == [0, 1, 2, 3]
    assert torch.equal(layout.region_pages, table[rows])
    assert torch.equal(layout.beam_hidden, hidden.repeat_interleave(2, dim=0))


def test_reorder_branches_moves_hidden_rows_with_their_regions():
    region_pages = torch.tensor([[[11], [12], [13]]])
    beam_parent = torch.tensor([[2, 2, 0]])
    hidden = torch.randn(3, 4)
    out = reorder_branches(region_pages, beam_parent, 1, hidden=hidden)
    assert (out.src.tolist(), out.dst.tolist()) == ([13, 13, 11], [11, 12, 13])
    assert torch.equal(out.hidden, hidden[[2, 2, 0]])
    assert reorder_branches(region_pages, beam_parent, 1).hidden is None
