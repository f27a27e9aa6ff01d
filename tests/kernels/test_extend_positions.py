"""Positions of fixed-width and ragged extend batches."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasegraph.kernels import extend_positions, extend_rows, ragged_extend_positions


def test_extend_positions_hand_case():
    out = extend_positions(torch.tensor([5, 0, 9]), 3)
    assert torch.equal(out, torch.tensor([5, 6, 7, 0, 1, 2, 9, 10, 11]))
    positions, token_req = extend_rows(torch.tensor([5, 0, 9]), 3)
    assert torch.equal(positions, out) and token_req.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_ragged_extend_positions_hand_case():
    # request 1 is empty; two padding tokens at the end
    positions, request = ragged_extend_positions(
        torch.tensor([10, 3, 0]), torch.tensor([2, 0, 3]), 7
    )
    assert torch.equal(positions, torch.tensor([10, 11, 0, 1, 2, 0, 0]))
    assert torch.equal(request, torch.tensor([0, 0, 2, 2, 2, -1, -1]))


def test_ragged_extend_positions_empty_batch():
    positions, request = ragged_extend_positions(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 2
    )
    assert torch.equal(positions, torch.tensor([0, 0]))
    assert torch.equal(request, torch.tensor([-1, -1]))


@settings(max_examples=150, deadline=None)
@given(
    starts=st.lists(st.integers(0, 100), min_size=1, max_size=6),
    data=st.data(),
)
def test_ragged_matches_loop(starts, data):
    lens = [data.draw(st.integers(0, 5)) for _ in starts]
    pad = data.draw(st.integers(0, 4))
    positions, request = ragged_extend_positions(
        torch.tensor(starts), torch.tensor(lens), sum(lens) + pad
    )
    want_pos = [s + j for s, n in zip(starts, lens, strict=True) for j in range(n)] + [0] * pad
    want_req = [b for b, n in enumerate(lens) for _ in range(n)] + [-1] * pad
    assert positions.tolist() == want_pos
    assert request.tolist() == want_req
    width = max(lens)
    fixed = extend_positions(torch.tensor(starts), width)
    assert fixed.tolist() == [s + j for s in starts for j in range(width)]
