"""Accepted-path compaction: gather-to-front and the KV moves (page-aware)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasegraph.kernels import accepted_kv_moves, compact_to_front, move_kv, row_slots


def test_compact_to_front_hand_case():
    # B = 2, N = 3, W = 3; features [B*N, 2]
    x = torch.arange(12.0).view(6, 2)
    accept_index = torch.tensor([[0, 2, -1], [3, 4, 5]])
    out = compact_to_front(x, accept_index)
    expected = torch.tensor([[0.0, 1], [4, 5], [0, 1], [6, 7], [8, 9], [10, 11]])
    assert torch.equal(out, expected)


def test_compact_to_front_keeps_trailing_dims_and_finite_padding():
    x = torch.randn(8, 3, 5)
    x[1] = float("nan")  # an unaccepted node may hold anything
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1]])
    out = compact_to_front(x, accept_index)
    assert out.shape == (6, 3, 5)
    assert torch.equal(out[2], x[0])
    assert torch.equal(out[4], x[4])
    assert torch.equal(out[5], x[4])
    assert bool(torch.isfinite(out).all())


def test_accepted_kv_moves_hand_case():
    # B = 2, N = 4, W = 3. Request 0 accepts nodes 0, 2, 3; request 1 only its root.
    accept_index = torch.tensor([[0, 2, 3], [4, -1, -1]])
    accept_lens = torch.tensor([3, 1])
    node_slots = torch.tensor([40, 41, 42, 43, 80, 81, 82, 83])
    front_slots = torch.tensor([40, 41, 42, 80, 81, 82])
    src, dst = accepted_kv_moves(accept_index, accept_lens, node_slots, front_slots)
    assert torch.equal(src, torch.tensor([40, 42, 43, 80, 81, 82]))
    assert torch.equal(dst, front_slots)


def test_move_kv_swaps_and_chains_safely():
    cache = torch.arange(6.0)[:, None].repeat(1, 2)
    other = torch.arange(6) * 10
    # swap 0 <-> 1 and the chain 2 -> 3 -> 4 (4 is overwritten by the old 3)
    move_kv([cache, other], torch.tensor([1, 0, 2, 3]), torch.tensor([0, 1, 3, 4]))
    assert cache[:, 0].tolist() == [1, 0, 2, 2, 3, 5]
    assert other.tolist() == [10, 0, 20, 20, 30, 50]


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_compact_to_front_matches_loop(data):
    batch = data.draw(st.integers(1, 4))
    num_nodes = data.draw(st.integers(1, 8))
    width = data.draw(st.integers(1, 6))
    x = torch.randn(batch * num_nodes, 3)
    rows = []
    for b in range(batch):
        n = data.draw(st.integers(1, width))
        nodes = [0] + [data.draw(st.integers(0, num_nodes - 1)) for _ in range(n - 1)]
        rows.append([b * num_nodes + j for j in nodes] + [-1] * (width - n))
    out = compact_to_front(x, torch.tensor(rows))
    for b in range(batch):
        for i in range(width):
            src = rows[b][i] if rows[b][i] >= 0 else b * num_nodes
            assert torch.equal(out[b * width + i], x[src])


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_move_kv_equals_snapshot_copy(data):
    num_slots = data.draw(st.integers(1, 24))
    m = data.draw(st.integers(0, num_slots))
    dst = data.draw(st.permutations(range(num_slots)))[:m]
    # sources may repeat and overlap the destinations arbitrarily
    src = [data.draw(st.integers(0, num_slots - 1)) for _ in range(m)]
    caches = [torch.randn(num_slots, 2, 3), torch.randint(0, 100, (num_slots, 4))]
    expected = []
    for cache in caches:
        snapshot, ref = cache.clone(), cache.clone()
        for s, d in zip(src, dst, strict=True):
            ref[d] = snapshot[s]
        expected.append(ref)
    move_kv(caches, torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))
    for cache, ref in zip(caches, expected, strict=True):
        assert torch.equal(cache, ref)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_accepted_path_kv_lands_behind_the_prefix(data):
    """Paged pool: after the moves, position seq_len + i holds accepted node i's KV."""
    page_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    batch = data.draw(st.integers(1, 3))
    num_steps = data.draw(st.integers(0, 4))
    width = num_steps + 1
    num_nodes = data.draw(st.integers(width, width + 6))
    seq_lens = [data.draw(st.integers(0, 40)) for _ in range(batch)]
    max_pages = (max(seq_lens) + num_nodes) // page_size + 2
    num_pages = 1 + batch * max_pages  # page 0 reserved
    perm = (
        torch.randperm(
            num_pages - 1, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
        )
        + 1
    )
    page_table = torch.zeros(batch + 1, max_pages, dtype=torch.int64)  # row 0 reserved
    page_table[1:] = perm.view(batch, max_pages)
    rows = torch.arange(1, batch + 1)
    seq = torch.tensor(seq_lens)
    node_slots = row_slots(page_table, rows, seq[:, None] + torch.arange(num_nodes), page_size)
    front_slots = row_slots(page_table, rows, seq[:, None] + torch.arange(width), page_size)

    accept, lens = [], []
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
        accept.append([b * num_nodes + j for j in nodes] + [-1] * (width - len(nodes)))
        lens.append(len(nodes))
    accept_index, accept_lens = torch.tensor(accept), torch.tensor(lens)

    k_pool = torch.randn(num_pages * page_size, 2, 4)
    v_pool = torch.randn(num_pages * page_size, 2, 4)
    before_k, before_v = k_pool.clone(), v_pool.clone()
    src, dst = accepted_kv_moves(
        accept_index, accept_lens, node_slots.view(-1), front_slots.view(-1)
    )
    assert src.shape == dst.shape == (batch * width,)
    move_kv([k_pool, v_pool], src, dst)

    written = set()
    for b in range(batch):
        for i in range(lens[b]):
            j = accept[b][i] - b * num_nodes
            slot, node = int(front_slots[b, i]), int(node_slots[b, j])
            assert torch.equal(k_pool[slot], before_k[node])
            assert torch.equal(v_pool[slot], before_v[node])
            written.add(slot)
    untouched = torch.ones(k_pool.shape[0], dtype=torch.bool)
    untouched[list(written)] = False
    assert torch.equal(k_pool[untouched], before_k[untouched])
    assert torch.equal(v_pool[untouched], before_v[untouched])
