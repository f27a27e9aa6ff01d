"""Greedy tree verification on hand-built tables (reliability.md §7 test 2).

Each request is written by hand: the tree (parents), the node tokens (node 0 = bonus of the last
step), the target's argmax after each node, the accepted path and the emitted tokens. The test
checks predict, accept_index, accept_lens, the emitted tokens, the bonus token and the
compacted predictions with ``torch.equal``.

Simulated acceptance (benchmark mode) accepts exactly the requested number of drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from phasegraph import kernels as K
from phasegraph.kernels import (
    build_tree,
    compact_to_front,
    fill_bonus_tokens,
    gather_accepted_tokens,
    verify_tree_greedy,
)
from phasegraph.kernels.simulated_accept import verify_tree_simulated
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.testing import synthetic as syn
from phasegraph.testing.drafters import RandomDraft

X = 0  # target prediction of a node the case never reaches (any valid token)


@dataclass
class Req:
    parents: list[int]
    tokens: list[int]  # node 0 = bonus token of the previous step
    target: list[int]  # target argmax after each node
    path: list[int]  # expected accepted nodes, root first
    emitted: list[int]  # expected emitted tokens (the last one is the new bonus)
    next_token: list[int] | None = None  # hand-written retrieve lists (else from build_tree)
    next_sibling: list[int] | None = None


@dataclass
class Case:
    name: str
    num_steps: int
    reqs: list[Req] = field(default_factory=list)


CHAIN4 = [-1, 0, 1, 2]
CHAIN4_TOKENS = [10, 11, 12, 13]
# root -> 1, 2; 1 -> 3; 2 -> 4; 3 -> 5   (topk 2, S = 3)
TREE6 = [-1, 0, 0, 1, 2, 3]
TREE6_TOKENS = [1, 20, 21, 30, 31, 40]
# root -> 1..4; 3 -> 5, 6; 4 -> 7; 6 -> 8, 9   (topk 4, S = 3)
TREE10 = [-1, 0, 0, 0, 0, 3, 3, 4, 6, 6]
TREE10_TOKENS = [2, 11, 12, 13, 14, 21, 22, 21, 31, 32]
# root -> 8 children 1..8; 5 -> 9, 10, 11   (topk 8, S = 2)
TREE12 = [-1, 0, 0, 0, 0, 0, 0, 0, 0, 5, 5, 5]
TREE12_TOKENS = [3, 100, 101, 102, 103, 104, 105, 106, 107, 200, 201, 202]

CASES = [
    Case(
        "chain_topk1_full_accept",
        3,
        [Req(CHAIN4, CHAIN4_TOKENS, [11, 12, 13, 14], [0, 1, 2, 3], [11, 12, 13, 14])],
    ),
    Case(
        "chain_topk1_first_token_reject",
        3,
        [Req(CHAIN4, CHAIN4_TOKENS, [20, 12, 13, 14], [0], [20])],
    ),
    Case(
        "chain_topk1_partial_accept",
        3,
        [Req(CHAIN4, CHAIN4_TOKENS, [11, 12, 30, 14], [0, 1, 2], [11, 12, 30])],
    ),
    Case("empty_draft_bonus_only", 0, [Req([-1], [10], [7], [0], [7])]),
    Case(
        "chain_topk1_batch_mixed_lengths",
        3,
        [
            Req(CHAIN4, CHAIN4_TOKENS, [11, 12, 13, 14], [0, 1, 2, 3], [11, 12, 13, 14]),
            Req(CHAIN4, [5, 6, 7, 8], [9, X, X, X], [0], [9]),
            Req(CHAIN4, [5, 6, 7, 8], [6, 7, 1, X], [0, 1, 2], [6, 7, 1]),
            Req(CHAIN4, [5, 6, 7, 8], [6, 2, X, X], [0, 1], [6, 2]),
        ],
    ),
    Case(
        "tree_topk2_second_sibling",
        1,
        [Req([-1, 0, 0], [5, 8, 9], [9, X, 2], [0, 2], [9, 2])],
    ),
    Case(
        "tree_topk2_path_through_second_branch_stops_at_leaf",
        3,
        [Req(TREE6, TREE6_TOKENS, [21, X, 31, X, 50, X], [0, 2, 4], [21, 31, 50])],
    ),
    Case(
        "tree_topk2_full_accept",
        3,
        [Req(TREE6, TREE6_TOKENS, [20, 30, X, 40, X, 77], [0, 1, 3, 5], [20, 30, 40, 77])],
    ),
    Case(
        "tree_topk2_empty_accept",
        3,
        [Req(TREE6, TREE6_TOKENS, [22, X, X, X, X, X], [0], [22])],
    ),
    Case(
        "tree_topk4_first_token_reject",
        1,
        [Req([-1, 0, 0, 0, 0], [0, 3, 4, 5, 6], [7, X, X, X, X], [0], [7])],
    ),
    Case(
        "tree_topk4_depth3_non_first_children",
        3,
        [
            Req(
                TREE10,
                TREE10_TOKENS,
                [13, X, X, 22, X, X, 32, X, X, 99],
                [0, 3, 6, 9],
                [13, 22, 32, 99],
            )
        ],
    ),
    Case(
        "tree_topk4_reject_below_non_first_child",
        3,
        [Req(TREE10, TREE10_TOKENS, [14, X, X, X, 5, X, X, X, X, X], [0, 4], [14, 5])],
    ),
    Case(
        "tree_topk8_last_child",
        1,
        [
            Req(
                [-1] + [0] * 8,
                [3, 100, 101, 102, 103, 104, 105, 106, 107],
                [107, X, X, X, X, X, X, X, 55],
                [0, 8],
                [107, 55],
            )
        ],
    ),
    Case(
        "tree_topk8_depth2_last_grandchild",
        2,
        [
            Req(
                TREE12,
                TREE12_TOKENS,
                [104, X, X, X, X, 202, X, X, X, X, X, 300],
                [0, 5, 11],
                [104, 202, 300],
            )
        ],
    ),
    Case(
        "duplicate_sibling_tokens_first_in_order_wins_no_backtracking",
        2,
        # root -> 1 (7), 2 (7); 2 -> 3 (8). Node 1 matches first and is a leaf.
        [Req([-1, 0, 0, 2], [1, 7, 7, 8], [7, 8, 8, X], [0, 1], [7, 8])],
    ),
    Case(
        "matching_cousin_is_not_accepted",
        2,
        # root -> 1 (5), 2 (6); 2 -> 3 (9). After node 1 the target wants 9: node 3 is not a child.
        [Req([-1, 0, 0, 2], [1, 5, 6, 9], [5, 9, X, X], [0, 1], [5, 9])],
    ),
    Case(
        "shallow_tree_padding_minus_one",
        3,
        [Req([-1, 0, 0], [4, 5, 6], [5, 8, X], [0, 1], [5, 8])],
    ),
    Case(
        "invalid_draft_token_never_matches",
        1,
        [Req([-1, 0, 0], [4, -1, 6], [6, X, 1], [0, 2], [6, 1])],
    ),
    Case(
        "retrieve_lists_order_not_node_order",
        1,
        # Hand-written lists visit node 2 before node 1; both hold token 5.
        [Req([-1, 0, 0], [4, 5, 5], [5, 1, 2], [0, 2], [5, 2], [2, -1, -1], [-1, -1, 1])],
    ),
    Case(
        "tree_topk2_batch_different_accept_lengths",
        2,
        # root -> 1, 2; 1 -> 3, 4; 2 -> 5   (N = 6 > W = 3: the SGLang #26866 stride case)
        [
            Req(
                [-1, 0, 0, 1, 1, 2],
                [1, 10, 11, 20, 21, 22],
                [10, 21, X, X, 60, X],
                [0, 1, 4],
                [10, 21, 60],
            ),
            Req([-1, 0, 0, 1, 1, 2], [2, 10, 11, 20, 21, 22], [12, X, X, X, X, X], [0], [12]),
            Req(
                [-1, 0, 0, 1, 1, 2],
                [3, 10, 11, 20, 21, 22],
                [11, X, 23, X, X, X],
                [0, 2],
                [11, 23],
            ),
        ],
    ),
]


def run_case(case: Case):
    batch = len(case.reqs)
    seq_lens = torch.arange(batch, dtype=torch.int64) * 10 + 3
    tree = build_tree(
        torch.tensor([r.tokens[0] for r in case.reqs]),
        torch.tensor([r.tokens[1:] for r in case.reqs], dtype=torch.int64).view(batch, -1),
        torch.tensor([r.parents for r in case.reqs]),
        seq_lens,
    )
    next_token, next_sibling = tree.retrieve_next_token, tree.retrieve_next_sibling
    if case.reqs[0].next_token is not None:
        next_token = torch.tensor([r.next_token for r in case.reqs])
        next_sibling = torch.tensor([r.next_sibling for r in case.reqs])
    target = torch.tensor([r.target for r in case.reqs]).view(-1)
    out = verify_tree_greedy(tree.draft_tokens, next_token, next_sibling, target, case.num_steps)
    return tree, target, out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_greedy_table(case: Case):
    width = case.num_steps + 1
    batch, num_nodes = len(case.reqs), len(case.reqs[0].parents)
    tree, target, out = run_case(case)

    def pad(xs):
        return xs + [-1] * (width - len(xs))

    expected_index = torch.tensor(
        [pad([b * num_nodes + j for j in r.path]) for b, r in enumerate(case.reqs)]
    )
    expected_emitted = torch.tensor([pad(r.emitted) for r in case.reqs])
    expected_lens = torch.tensor([len(r.path) for r in case.reqs])
    assert torch.equal(out.predict, target)
    assert torch.equal(out.accept_index, expected_index)
    assert torch.equal(out.accept_lens, expected_lens)
    assert torch.equal(gather_accepted_tokens(out.predict, out.accept_index), expected_emitted)
    bonus = fill_bonus_tokens(out.predict, out.accept_index, out.accept_lens)
    assert torch.equal(bonus, torch.tensor([r.emitted[-1] for r in case.reqs]))
    # Compacted predictions: emitted tokens first, then the root row's value as padding.
    compacted = compact_to_front(out.predict, out.accept_index).view(batch, width)
    root_value = torch.tensor([r.target[0] for r in case.reqs])[:, None].expand(batch, width)
    cols = torch.arange(width)[None]
    expected_front = torch.where(cols < expected_lens[:, None], expected_emitted, root_value)
    assert torch.equal(compacted, expected_front)
    # The tokens a request commits this step and its next root position.
    new_seq_lens = torch.arange(batch) * 10 + 3 + out.accept_lens
    assert torch.equal(new_seq_lens, tree.positions.view(batch, num_nodes)[:, 0] + expected_lens)


def test_table_has_enough_cases():
    assert len(CASES) >= 16
    topks = {
        max([r.parents.count(p) for p in range(len(r.parents))] + [0])
        for c in CASES
        for r in c.reqs
    }
    assert {1, 2, 4, 8} <= topks


def test_seed000_stride_case_discriminates():
    """fill_bonus_tokens with stride N (SGLang's bug) gives a different answer on this batch."""
    case = next(c for c in CASES if c.name == "tree_topk2_batch_different_accept_lengths")
    _, _, out = run_case(case)
    batch, width = out.accept_index.shape
    num_nodes = out.predict.shape[0] // batch
    assert num_nodes != width
    tokens = gather_accepted_tokens(out.predict, out.accept_index).reshape(-1)
    rows = torch.arange(batch)
    wrong_index = rows * num_nodes + out.accept_lens - 1
    wrong = torch.where(
        wrong_index < tokens.shape[0], tokens[wrong_index.clamp(max=tokens.shape[0] - 1)], -2
    )
    right = fill_bonus_tokens(out.predict, out.accept_index, out.accept_lens)
    assert torch.equal(right, torch.tensor([60, 12, 23]))
    assert not torch.equal(wrong, right)


def test_greedy_equals_sequential_greedy_decoding_on_random_trees():
    """Emitted tokens are what the target's argmax chain produces from the root."""
    g = torch.Generator().manual_seed(0)
    vocab, batch, num_nodes, num_steps = 6, 64, 7, 3
    # next-token table of a deterministic "target": argmax after token t is table[t]
    table = torch.randint(0, vocab, (vocab,), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3]).expand(batch, -1)
    node_tokens = torch.randint(0, vocab, (batch, num_nodes - 1), generator=g)
    roots = torch.randint(0, vocab, (batch,), generator=g)
    tree = build_tree(roots, node_tokens, parents, torch.zeros(batch, dtype=torch.int64))
    out = verify_tree_greedy(
        tree.draft_tokens,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        table[tree.draft_tokens],
        num_steps,
    )
    emitted = gather_accepted_tokens(out.predict, out.accept_index)
    for b in range(batch):
        n = int(out.accept_lens[b])
        chain, t = [], int(roots[b])
        for _ in range(n):
            t = int(table[t])
            chain.append(t)
        assert emitted[b, :n].tolist() == chain
        # the path stops because no child of the last node holds the next greedy token
        last = int(out.accept_index[b, n - 1]) - b * num_nodes
        if n <= num_steps:
            kids = [j for j in range(num_nodes) if int(parents[b, j]) == last]
            assert all(int(node_tokens[b, j - 1]) != chain[-1] for j in kids)


def test_empty_batch_flows_through_every_kernel():
    """B = 0 (every request finished): shapes stay consistent, nothing fails."""
    topk, num_steps, num_nodes, vocab = 2, 3, 6, 10
    empty = torch.zeros(0, dtype=torch.int64)
    first = K.first_step_candidates(torch.zeros(0, topk), torch.zeros(0, topk, dtype=torch.int64))
    steps = [first]
    for step in range(1, num_steps):
        steps.append(
            K.expand_step(
                steps[-1].beam_scores,
                steps[-1].beam_cand,
                torch.zeros(0, topk, topk),
                torch.zeros(0, topk, topk, dtype=torch.int64),
                step,
                topk,
            )
        )
    node_tokens, node_parents, _ = K.select_tree_nodes(
        *K.concat_candidates(steps[0], steps[1:]), num_nodes
    )
    tree = K.build_tree(empty, node_tokens, node_parents, empty)
    lists = (tree.draft_tokens, tree.retrieve_next_token, tree.retrieve_next_sibling)
    greedy = K.verify_tree_greedy(*lists, tree.draft_tokens, num_steps)
    probs = K.target_probs(torch.zeros(0, vocab), torch.zeros(0), empty, torch.zeros(0), num_nodes)
    coins = torch.zeros(0, num_steps + 1)
    sampled = K.verify_tree_sampling(*lists, probs, coins, coins, num_steps)
    for out in (greedy, sampled):
        assert out.accept_index.shape == (0, num_steps + 1)
        assert K.fill_bonus_tokens(out.predict, out.accept_index, out.accept_lens).shape == (0,)
        assert K.compact_to_front(torch.zeros(0, 4), out.accept_index).shape == (0, 4)


def test_chain_of_first_children_is_accepted():
    d = syn.draft_state(3, K=2)
    tree = syn.tree_proposal(d, N=7, S=3)  # first children: 0 -> 1 -> 3 -> 5
    predict = torch.arange(3 * 7) + 100
    for a in range(0, 4):
        out = verify_tree_simulated(tree.draft_tokens, tree.retrieve_next_token, predict, 3, a)
        assert out.accept_lens.tolist() == [a + 1] * 3
        emitted = gather_accepted_tokens(out.predict, out.accept_index)
        chain = [0, 1, 3, 5][: a + 1]
        for b in range(3):
            toks = tree.draft_tokens.view(3, 7)[b]
            assert emitted[b, :a].tolist() == [int(toks[j]) for j in chain[1:]]
        bonus = fill_bonus_tokens(out.predict, out.accept_index, out.accept_lens)
        assert bonus.tolist() == [int(predict[b * 7 + chain[-1]]) for b in range(3)]


def test_engine_in_simulated_mode_accepts_the_chosen_length():
    from tests.phases.lossless_support import VOCAB, prompts, tiny_target

    ps = prompts(3)
    drafter = RandomDraft({tuple(p): [0] * 64 for p in ps}, VOCAB)
    eng = Engine(tiny_target(), drafter, spec=SpecConfig(method="eagle", num_steps=3, topk=2, num_draft_tokens=6),
                 max_batch_size=4, kv_pool_tokens=4096, simulate_accept_length=3)
    drafter.engine = eng
    outs = eng.generate(ps, SamplingParams(max_new_tokens=30, ignore_eos=True))
    for o in outs:
        assert set(o.stats.accept_lengths[:-1]) == {3}
    assert eng.simulated
