"""Emitted and bonus tokens: -1 padding and the accept_index.shape[1] stride (SGLang #26866)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasegraph.kernels import fill_bonus_tokens, gather_accepted_tokens


def test_gather_accepted_tokens_pads_with_minus_one():
    predict = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23])  # B = 2, N = 4
    accept_index = torch.tensor([[0, 2, 3], [4, -1, -1]])
    out = gather_accepted_tokens(predict, accept_index)
    assert torch.equal(out, torch.tensor([[10, 12, 13], [20, -1, -1]]))


def test_fill_bonus_tokens_uses_accept_width_not_num_nodes():
    # B = 3, N = 8, W = 2: the stride-N bug reads row 1 at 8 and row 2 at 16, past B*W = 6.
    predict = torch.arange(24) + 100
    accept_index = torch.tensor([[0, 5], [8, -1], [16, 23]])
    accept_lens = torch.tensor([2, 1, 2])
    assert torch.equal(
        fill_bonus_tokens(predict, accept_index, accept_lens), torch.tensor([105, 108, 123])
    )


def test_fill_bonus_tokens_with_width_equal_to_num_nodes():
    # NGRAM-style accept width N: the stride is still accept_index.shape[1].
    predict = torch.tensor([1, 2, 3, 4, 5, 6])
    accept_index = torch.tensor([[0, 1, 2], [3, 5, -1]])
    out = fill_bonus_tokens(predict, accept_index, torch.tensor([3, 2]))
    assert torch.equal(out, torch.tensor([3, 6]))


def test_empty_batch():
    out = fill_bonus_tokens(
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, 4, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
    )
    assert out.shape == (0,)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_bonus_is_the_last_emitted_token(data):
    batch = data.draw(st.integers(1, 5))
    num_nodes = data.draw(st.integers(1, 9))
    width = data.draw(st.integers(1, num_nodes))
    predict = torch.tensor(
        data.draw(
            st.lists(st.integers(0, 999), min_size=batch * num_nodes, max_size=batch * num_nodes)
        )
    )
    rows, lens = [], []
    for b in range(batch):
        n = data.draw(st.integers(1, width))
        nodes = (
            [0]
            + sorted(
                data.draw(st.sets(st.integers(1, num_nodes - 1), min_size=n - 1, max_size=n - 1))
            )
            if num_nodes > 1
            else [0]
        )
        n = len(nodes)
        rows.append([b * num_nodes + j for j in nodes] + [-1] * (width - n))
        lens.append(n)
    accept_index, accept_lens = torch.tensor(rows), torch.tensor(lens)
    emitted = gather_accepted_tokens(predict, accept_index)
    bonus = fill_bonus_tokens(predict, accept_index, accept_lens)
    for b in range(batch):
        want = [int(predict[i]) for i in rows[b][: lens[b]]]
        assert emitted[b].tolist() == want + [-1] * (width - lens[b])
        assert int(bonus[b]) == want[-1]
