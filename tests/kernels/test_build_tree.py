"""select_tree_nodes and build_tree: hand-written trees and hypothesis properties."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasegraph.kernels import (
    build_tree,
    concat_candidates,
    expand_step,
    first_step_candidates,
    select_tree_nodes,
)

T, F = True, False


def test_select_tree_nodes_hand_case():
    # K = 2, S = 2: candidates 0, 1 (step 0) and 2..5 (step 1, beam-major).
    tokens = torch.tensor([[10, 11, 20, 21, 22, 23]])
    scores = torch.tensor([[0.6, 0.4, 0.3, 0.18, 0.36, 0.04]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    node_tokens, node_parents, finite = select_tree_nodes(tokens, scores, parents, num_nodes=5)
    # best 4 by score: ids 0, 1, 4, 2 -> sorted 0, 1, 2, 4 = nodes 1..4
    assert torch.equal(node_tokens, torch.tensor([[10, 11, 20, 22]]))
    assert torch.equal(node_parents, torch.tensor([[-1, 0, 0, 1, 2]]))
    assert torch.equal(finite, torch.tensor([True]))


def test_select_tree_nodes_ties_keep_lower_ids():
    tokens = torch.arange(6).view(1, 6) + 100
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    node_tokens, node_parents, _ = select_tree_nodes(tokens, scores, parents, num_nodes=4)
    assert torch.equal(node_tokens, torch.tensor([[100, 101, 102]]))
    assert torch.equal(node_parents, torch.tensor([[-1, 0, 0, 1]]))


def test_select_tree_nodes_root_only():
    tokens = torch.tensor([[5, 6]])
    node_tokens, node_parents, _ = select_tree_nodes(
        tokens, torch.tensor([[0.5, 0.5]]), torch.tensor([[-1, -1]]), num_nodes=1
    )
    assert node_tokens.shape == (1, 0)
    assert torch.equal(node_parents, torch.tensor([[-1]]))


def test_build_tree_hand_tree():
    # root(0) -> 1, 2; 1 -> 3, 4; 2 -> 5; 5 -> 6
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 5]])
    node_tokens = torch.tensor([[11, 12, 13, 14, 15, 16]])
    tree = build_tree(torch.tensor([9]), node_tokens, parents, torch.tensor([100]))
    assert torch.equal(tree.draft_tokens, torch.tensor([9, 11, 12, 13, 14, 15, 16]))
    assert torch.equal(tree.depth, torch.tensor([[0, 1, 1, 2, 2, 2, 3]]))
    assert torch.equal(tree.positions, torch.tensor([100, 101, 101, 102, 102, 102, 103]))
    expected_mask = torch.tensor(
        [
            [T, F, F, F, F, F, F],
            [T, T, F, F, F, F, F],
            [T, F, T, F, F, F, F],
            [T, T, F, T, F, F, F],
            [T, T, F, F, T, F, F],
            [T, F, T, F, F, T, F],
            [T, F, T, F, F, T, T],
        ]
    )
    assert torch.equal(tree.tree_mask, expected_mask[None])
    assert torch.equal(tree.retrieve_index, torch.arange(7)[None])
    assert torch.equal(tree.retrieve_next_token, torch.tensor([[1, 3, 5, -1, -1, 6, -1]]))
    assert torch.equal(tree.retrieve_next_sibling, torch.tensor([[-1, 2, -1, 4, -1, -1, -1]]))


def test_build_tree_chain_and_batch():
    # request 0: chain of 4 nodes; request 1: star (root with 3 children)
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 0, 0]])
    node_tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    tree = build_tree(torch.tensor([7, 8]), node_tokens, parents, torch.tensor([5, 0]))
    assert torch.equal(tree.draft_tokens, torch.tensor([7, 1, 2, 3, 8, 4, 5, 6]))
    assert torch.equal(tree.depth, torch.tensor([[0, 1, 2, 3], [0, 1, 1, 1]]))
    assert torch.equal(tree.positions, torch.tensor([5, 6, 7, 8, 0, 1, 1, 1]))
    chain_mask = torch.tensor([[T, F, F, F], [T, T, F, F], [T, T, T, F], [T, T, T, T]])
    star_mask = torch.tensor([[T, F, F, F], [T, T, F, F], [T, F, T, F], [T, F, F, T]])
    assert torch.equal(tree.tree_mask, torch.stack([chain_mask, star_mask]))
    assert torch.equal(tree.retrieve_index, torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]))
    assert torch.equal(tree.retrieve_next_token, torch.tensor([[1, 2, 3, -1], [1, -1, -1, -1]]))
    assert torch.equal(
        tree.retrieve_next_sibling, torch.tensor([[-1, -1, -1, -1], [-1, 2, 3, -1]])
    )


def test_build_tree_deep_chain_needs_every_doubling_round():
    n = 17  # depth 16: 4 doubling rounds
    parents = torch.arange(-1, n - 1)[None]
    tree = build_tree(torch.tensor([0]), torch.arange(1, n)[None], parents, torch.tensor([3]))
    assert torch.equal(tree.depth, torch.arange(n)[None])
    assert torch.equal(tree.tree_mask[0], torch.ones(n, n, dtype=torch.bool).tril())


def _naive_tree(parents):
    """Per-node loops: depth, ancestor mask, first child, next sibling."""
    n = len(parents)
    depth, mask = [], [[False] * n for _ in range(n)]
    for j in range(n):
        a, d = j, 0
        while a >= 0:
            mask[j][a] = True
            a = parents[a]
            d += 1
        depth.append(d - 1)
    first = [next((c for c in range(n) if parents[c] == j), -1) for j in range(n)]
    sib = [
        next((s for s in range(j + 1, n) if parents[j] >= 0 and parents[s] == parents[j]), -1)
        for j in range(n)
    ]
    return depth, mask, first, sib


probability = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]) | st.floats(0.0, 1.0, width=32)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), topk=st.integers(1, 4), num_steps=st.integers(1, 4))
def test_selected_tree_is_well_formed(data, topk, num_steps):
    """Parents come first and are always kept, ties and p = 1.0 included."""
    batch = data.draw(st.integers(1, 3))
    num_cand = topk + (num_steps - 1) * topk * topk
    num_nodes = data.draw(st.integers(1, num_cand + 1))

    def probs(*shape):
        size = int(torch.Size(shape).numel())
        values = data.draw(st.lists(probability, min_size=size, max_size=size))
        return torch.tensor(values, dtype=torch.float32).view(*shape)

    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    vocab = 20
    first = first_step_candidates(
        probs(batch, topk), torch.randint(0, vocab, (batch, topk), generator=g)
    )
    steps, beam_scores, beam_cand = [], first.beam_scores, first.beam_cand
    for step in range(1, num_steps):
        out = expand_step(
            beam_scores,
            beam_cand,
            probs(batch, topk, topk),
            torch.randint(0, vocab, (batch, topk, topk), generator=g),
            step,
            topk,
        )
        steps.append(out)
        beam_scores, beam_cand = out.beam_scores, out.beam_cand
    tokens, scores, cand_parents = concat_candidates(first, steps)
    node_tokens, node_parents, finite = select_tree_nodes(tokens, scores, cand_parents, num_nodes)
    assert bool(finite.all())

    assert node_parents.shape == (batch, num_nodes)
    nodes = torch.arange(num_nodes)
    assert bool((node_parents[:, 0] == -1).all())
    assert bool((node_parents[:, 1:] >= 0).all())
    assert bool((node_parents[:, 1:] < nodes[1:]).all())

    # Recover the kept candidate ids and check each node's parent candidate is its parent node.
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : num_nodes - 1]
    kept = torch.sort(best, dim=1).values
    for b in range(batch):
        kept_b = kept[b].tolist()
        for j in range(1, num_nodes):
            parent_cand = int(cand_parents[b, kept_b[j - 1]])
            if parent_cand < 0:
                assert int(node_parents[b, j]) == 0
            else:
                assert parent_cand in kept_b, "a kept candidate's parent was dropped"
                assert int(node_parents[b, j]) == kept_b.index(parent_cand) + 1
        assert node_tokens[b].tolist() == [int(tokens[b, c]) for c in kept_b]

    seq_lens = torch.randint(0, 50, (batch,), generator=g)
    tree = build_tree(
        torch.randint(0, vocab, (batch,), generator=g), node_tokens, node_parents, seq_lens
    )
    for b in range(batch):
        depth, mask, first_child, sib = _naive_tree(node_parents[b].tolist())
        assert tree.depth[b].tolist() == depth
        assert tree.tree_mask[b].tolist() == mask
        assert tree.retrieve_next_token[b].tolist() == first_child
        assert tree.retrieve_next_sibling[b].tolist() == sib
        assert tree.positions.view(batch, -1)[b].tolist() == [int(seq_lens[b]) + d for d in depth]
        assert max(depth) <= num_steps


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_build_tree_random_parent_arrays(data):
    """Any parent array with parent < child (not only EAGLE trees) matches the loop reference."""
    num_nodes = data.draw(st.integers(1, 12))
    parents = [-1] + [data.draw(st.integers(0, j - 1)) for j in range(1, num_nodes)]
    tree = build_tree(
        torch.tensor([1]),
        torch.arange(num_nodes - 1)[None] + 2,
        torch.tensor([parents]),
        torch.tensor([7]),
    )
    depth, mask, first_child, sib = _naive_tree(parents)
    assert tree.depth[0].tolist() == depth
    assert tree.tree_mask[0].tolist() == mask
    assert tree.retrieve_next_token[0].tolist() == first_child
    assert tree.retrieve_next_sibling[0].tolist() == sib
