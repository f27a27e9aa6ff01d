"""Target probabilities and lossless tree rejection sampling (reliability.md §7 test 3).

The distribution test runs the real kernels end to end on a Markov-chain "target" p(next | prev)
over V = 32 tokens and a draft table q, with 1e5 independent trials as the batch, and compares the
emitted tokens with the exact Markov marginals by Pearson chi-square (bins under 5 expected counts
merged) and total variation. Five deliberately broken samplers must fail the same check.
"""

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasegraph.kernels import (
    VerifyOutcome,
    build_tree,
    concat_candidates,
    expand_step,
    fill_bonus_tokens,
    first_step_candidates,
    gather_accepted_tokens,
    select_tree_nodes,
    target_probs,
    verify_tree_greedy,
    verify_tree_sampling,
)

# --------------------------------------------------------------------------- target_probs


def _probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    logits = torch.as_tensor(logits, dtype=torch.float32).view(1, -1)
    return target_probs(
        logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), 1
    )[0]


BASE = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def test_target_probs_plain_softmax_with_temperature():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    assert torch.allclose(_probs(logits), torch.softmax(logits, -1))
    assert torch.allclose(_probs(logits, temperature=0.5), torch.softmax(logits / 0.5, -1))


def test_target_probs_top_k():
    out = _probs(BASE, top_k=2)
    assert torch.allclose(out, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.equal(out[2:], torch.zeros(2))
    assert torch.allclose(_probs(BASE, top_k=9), _probs(BASE))  # k >= V is off


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.0, 1), (0.4, 1), (0.75, 2), (0.85, 3), (0.99, 4), (1.0, 4)],
)
def test_target_probs_top_p_keeps_smallest_prefix(top_p, kept):
    out = _probs(BASE, top_p=top_p)
    assert int((out > 0).sum()) == kept
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05])[:kept]
    assert torch.allclose(out[:kept], expected / expected.sum())


def test_target_probs_top_p_is_relative_to_the_top_k_mass():
    # top-k 3 renormalises to 0.526, 0.316, 0.158: top-p 0.82 keeps two tokens (over the full
    # distribution it would keep three, since 0.5 + 0.3 < 0.82).
    out = _probs(BASE, top_k=3, top_p=0.82)
    assert torch.allclose(out, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_target_probs_top_p_off_keeps_tiny_tail():
    logits = torch.tensor([0.0, -30.0, 5.0])
    out = _probs(logits, top_p=1.0)
    assert bool((out > 0).all())


def test_target_probs_greedy_is_one_hot_on_first_argmax():
    out = _probs(torch.tensor([1.0, 3.0, 3.0, -2.0]), temperature=0.0, top_k=1, top_p=0.5)
    assert torch.equal(out, torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize(("min_p", "kept"), [(0.0, 4), (0.09, 4), (0.2, 3), (0.5, 2), (0.7, 1), (1.0, 1)])
def test_target_probs_min_p_keeps_tokens_within_a_factor_of_the_most_likely(min_p, kept):
    logits = BASE.view(1, -1)  # 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps p >= 0.1
    one = torch.ones(1)
    out = target_probs(logits, one, torch.zeros(1, dtype=torch.int64), one, 1, torch.tensor([min_p]))[0]
    expected = torch.tensor([0.5, 0.3, 0.15, 0.05])[:kept]
    assert int((out > 0).sum()) == kept
    assert torch.allclose(out[:kept], expected / expected.sum())


def test_target_probs_min_p_comes_after_temperature_and_top_k():
    # at T = 2 the probabilities flatten to ~0.40, 0.31, 0.22, 0.13: min_p 0.5 keeps three
    logits = BASE.view(1, -1)
    one = torch.ones(1)
    flat = target_probs(logits, one * 2, torch.zeros(1, dtype=torch.int64), one, 1, torch.tensor([0.5]))[0]
    assert int((flat > 0).sum()) == 3
    # top-k 2 then min_p 0.7: 0.3 / 0.5 = 0.6 < 0.7 leaves the top token alone
    top2 = target_probs(logits, one, torch.tensor([2]), one, 1, torch.tensor([0.7]))[0]
    assert top2.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_target_probs_per_request_parameters_cover_their_nodes():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 10, generator=g)  # B = 2, N = 3
    out = target_probs(
        logits, torch.tensor([0.0, 0.5]), torch.tensor([0, 3]), torch.tensor([1.0, 1.0]), 3
    )
    assert torch.equal(out[:3], torch.nn.functional.one_hot(logits[:3].argmax(-1), 10).float())
    assert bool(((out[3:] > 0).sum(-1) == 3).all())
    assert torch.allclose(out.sum(-1), torch.ones(6))


# --------------------------------------------------------------------------- hand-made trees


def _tree(parents, tokens):
    n = len(parents)
    return build_tree(
        torch.tensor(tokens[:1]),
        torch.tensor([tokens[1:]], dtype=torch.int64).view(1, n - 1),
        torch.tensor([parents]),
        torch.tensor([0]),
    )


def _sample(tree, probs, coins, bonus_coins, num_steps):
    return verify_tree_sampling(
        tree.draft_tokens,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        probs,
        torch.tensor([coins]),
        torch.tensor([bonus_coins]),
        num_steps,
    )


# root (token 0) -> node 1 (token 1), node 2 (token 2); node 1 -> node 3 (token 3)
HAND_PARENTS, HAND_TOKENS = [-1, 0, 0, 1], [0, 1, 2, 3]
ROOT_ROW = [0.1, 0.2, 0.3, 0.4]  # p after the root
NODE1_ROW = [0.0, 0.0, 0.0, 1.0]  # p after node 1: always token 3
OTHER_ROW = [0.25, 0.25, 0.25, 0.25]
HAND_PROBS = torch.tensor([ROOT_ROW, NODE1_ROW, OTHER_ROW, [0.5, 0.0, 0.0, 0.5]])


@pytest.mark.parametrize(
    ("coin", "bonus_coin", "path", "emitted"),
    [
        # coin < p(1) = 0.2: accept node 1; then node 3 is certain; then bonus from node 3's row
        (0.1, 0.7, [0, 1, 3], [1, 3, 3]),
        (0.1, 0.2, [0, 1, 3], [1, 3, 0]),
        # 0.2 <= coin < p(1) + p(2) = 0.5: accept node 2 (a leaf), bonus from OTHER_ROW
        (0.45, 0.1, [0, 2], [2, 0]),
        # coin >= 0.5: reject both; the bonus comes from {0: 0.1, 3: 0.4} renormalised
        (0.6, 0.1, [0], [0]),
        (0.6, 0.3, [0], [3]),
        (0.999, 0.9999, [0], [3]),
    ],
)
def test_sampling_hand_cases(coin, bonus_coin, path, emitted):
    tree = _tree(HAND_PARENTS, HAND_TOKENS)
    out = _sample(tree, HAND_PROBS, [coin, 0.5, 0.5], [bonus_coin] * 3, 2)
    assert torch.equal(out.accept_index, torch.tensor([path + [-1] * (3 - len(path))]))
    assert torch.equal(out.accept_lens, torch.tensor([len(path)]))
    got = gather_accepted_tokens(out.predict, out.accept_index)[0, : len(path)]
    assert got.tolist() == emitted
    # off-path nodes predict the target's most likely token
    off = [j for j in range(4) if j not in path]
    assert out.predict[off].tolist() == HAND_PROBS[off].argmax(-1).tolist()


def test_sampling_zero_probability_child_is_never_accepted():
    tree = _tree([-1, 0, 0], [0, 1, 2])
    probs = torch.tensor([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    out = _sample(tree, probs, [0.0, 0.0], [0.0, 0.0], 1)
    assert out.accept_index.tolist() == [[0, 2]]  # node 1 has p = 0 even with coin 0


def test_sampling_bonus_coin_past_rounding_stays_in_support():
    # Vocabulary whose last tokens have zero mass; a coin just below 1 must not pick them.
    probs = torch.zeros(1, 8)
    probs[0, :3] = torch.tensor([0.2, 0.3, 0.5])
    tree = _tree([-1], [0])
    out = _sample(tree, probs, [0.99999994], [0.99999994], 0)
    assert out.predict.tolist() == [2]


def test_sampling_duplicate_sibling_adds_no_mass():
    tree = _tree([-1, 0, 0], [0, 1, 1])
    probs = torch.tensor([[0.0, 0.3, 0.7], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    out = _sample(tree, probs, [0.4, 0.0], [0.0, 0.0], 1)
    # coin 0.4 > p(1) = 0.3 and the duplicate does not count twice: bonus from {2: 0.7}
    assert out.accept_index.tolist() == [[0, -1]]
    assert out.predict.tolist()[0] == 2


def _random_trees(g, batch, num_nodes, vocab):
    parents = torch.stack(
        [
            torch.cat(
                [
                    torch.tensor([-1]),
                    (torch.rand(num_nodes - 1, generator=g) * torch.arange(1, num_nodes)).long(),
                ]
            )
            for _ in range(batch)
        ]
    )
    tokens = torch.randint(0, vocab, (batch, num_nodes - 1), generator=g)
    roots = torch.randint(0, vocab, (batch,), generator=g)
    return build_tree(roots, tokens, parents, torch.zeros(batch, dtype=torch.int64))


def test_sampling_at_temperature_zero_equals_greedy_verify():
    g = torch.Generator().manual_seed(3)
    batch, num_nodes, vocab, num_steps = 256, 9, 4, 4
    tree = _random_trees(g, batch, num_nodes, vocab)
    logits = torch.randint(0, 3, (batch * num_nodes, vocab), generator=g).float()  # many ties
    zeros = torch.zeros(batch)
    probs = target_probs(logits, zeros, zeros.long(), zeros + 1, num_nodes)
    coins = torch.rand(batch, num_steps + 1, generator=g)
    bonus_coins = torch.rand(batch, num_steps + 1, generator=g)
    sampled = verify_tree_sampling(
        tree.draft_tokens,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        probs,
        coins,
        bonus_coins,
        num_steps,
    )
    greedy = verify_tree_greedy(
        tree.draft_tokens,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        logits.argmax(-1),
        num_steps,
    )
    assert torch.equal(sampled.predict, greedy.predict)
    assert torch.equal(sampled.accept_index, greedy.accept_index)
    assert torch.equal(sampled.accept_lens, greedy.accept_lens)
    assert float(greedy.accept_lens.float().mean()) > 1.2  # the case exercises acceptance


row_value = st.sampled_from([0.0, 0.0, 1.0, 1e-30, 1e-8, 0.5]) | st.floats(0.0, 1.0, width=32)
ALMOST_ONE = float(torch.tensor(1.0).nextafter(torch.tensor(0.0)))  # largest float32 below 1
coin_value = st.sampled_from([0.0, ALMOST_ONE, 0.5]) | st.floats(0.0, ALMOST_ONE, width=32)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_sampling_outputs_are_always_valid(data):
    """Adversarial rows (zeros, unnormalised, tiny) and extreme coins never give bad ids."""
    batch = data.draw(st.integers(1, 3))
    num_nodes = data.draw(st.integers(1, 7))
    num_steps = data.draw(st.integers(0, 4))
    vocab = data.draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    tree = _random_trees(g, batch, num_nodes, vocab)
    rows = batch * num_nodes
    probs = torch.tensor(
        data.draw(st.lists(row_value, min_size=rows * vocab, max_size=rows * vocab)),
        dtype=torch.float32,
    ).view(rows, vocab)
    coins = torch.tensor(
        data.draw(
            st.lists(
                coin_value,
                min_size=2 * batch * (num_steps + 1),
                max_size=2 * batch * (num_steps + 1),
            )
        ),
        dtype=torch.float32,
    ).view(2, batch, num_steps + 1)
    out = verify_tree_sampling(
        tree.draft_tokens,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        probs,
        coins[0],
        coins[1],
        num_steps,
    )
    assert bool(((out.predict >= 0) & (out.predict < vocab)).all())
    assert bool(((out.accept_lens >= 1) & (out.accept_lens <= num_steps + 1)).all())
    parents = torch.stack([torch.tensor(p) for p in _parents_of(tree, batch, num_nodes)])
    for b in range(batch):
        n = int(out.accept_lens[b])
        path = out.accept_index[b].tolist()
        assert path[n:] == [-1] * (num_steps + 1 - n)
        assert path[0] == b * num_nodes
        nodes = [i - b * num_nodes for i in path[:n]]
        assert all(0 <= j < num_nodes for j in nodes)
        for prev, cur in zip(nodes, nodes[1:], strict=False):
            assert int(parents[b, cur]) == prev
            # an accepted child has positive mass under its parent's row
            row = probs[b * num_nodes + prev]
            assert float(row[int(tree.draft_tokens[b * num_nodes + cur])]) > 0
        last_row = probs[b * num_nodes + nodes[-1]]
        if bool((last_row > 0).any()):
            assert float(last_row[int(out.predict[b * num_nodes + nodes[-1]])]) > 0


def _parents_of(tree, batch, num_nodes):
    """Parent of every node, read back from the ancestor mask (depth - 1 ancestor)."""
    out = []
    for b in range(batch):
        mask, depth = tree.tree_mask[b], tree.depth[b]
        row = [-1]
        for j in range(1, num_nodes):
            anc = [
                a
                for a in range(num_nodes)
                if bool(mask[j, a]) and int(depth[a]) == int(depth[j]) - 1
            ]
            row.append(anc[0])
        out.append(row)
    return out


# --------------------------------------------------------------------------- mutant samplers


def reference_sampler(
    draft_tokens,
    next_token,
    next_sibling,
    probs,
    coins,
    bonus_coins,
    num_steps,
    *,
    mutant=None,
    draft_probs=None,
):
    """A second, plain implementation of target-only tree sampling with switchable bugs.

    mutant=None must equal ``verify_tree_sampling`` exactly (checked below); each mutant changes
    one thing, as in reliability.md §7 test 3:
    - "resample_full_p": the bonus is drawn from p without removing the rejected children;
    - "residual_abs": the bonus is drawn from |p - q| (q = the draft's distribution there);
    - "rows_shifted": node j reads the probabilities of row j+1;
    - "bonus_wrong_row": the bonus is drawn from the root's row at every depth;
    - "accept_wrong_node": a child is accepted with its own row's p(token), not its parent's.
    """
    batch, num_nodes = next_token.shape
    vocab = probs.shape[1]
    if mutant == "rows_shifted":
        probs = probs.roll(-1, dims=0)
    arange = torch.arange(batch)
    base = arange * num_nodes
    predict = probs.argmax(-1)
    accept_index = torch.full((batch, num_steps + 1), -1)
    accept_index[:, 0] = base
    accept_lens = torch.ones(batch, dtype=torch.int64)
    last = torch.zeros(batch, dtype=torch.int64)
    alive = torch.ones(batch, dtype=torch.bool)
    for depth in range(num_steps + 1):
        p = probs[base + last].double()
        threshold = coins[:, depth].double() * p.sum(-1)
        cum = torch.zeros(batch, dtype=torch.float64)
        tried = torch.zeros(batch, vocab, dtype=torch.float64)
        chosen = torch.full((batch,), -1)
        child = next_token[arange, last] if depth < num_steps else torch.full((batch,), -1)
        while bool((child >= 0).any()):
            valid = child >= 0
            node = base + child.clamp(min=0)
            token = draft_tokens[node]
            row = probs[node].double() if mutant == "accept_wrong_node" else p
            cum = cum + torch.where(valid, row[arange, token], 0.0)
            tried[arange, token] += valid.double()
            hit = valid & (threshold < cum)
            chosen = torch.where(hit, child, chosen)
            child = torch.where(valid & ~hit, next_sibling[arange, child.clamp(min=0)], -1)
        tried = tried > 0
        if mutant == "resample_full_p":
            weights = p
        elif mutant == "residual_abs":
            weights = (p - draft_probs[base + last].double()).abs()
        elif mutant == "bonus_wrong_row":
            weights = torch.where(tried, 0.0, probs[base].double())
        else:
            weights = torch.where(tried, 0.0, p)
        wcum = weights.cumsum(-1)
        bonus = (
            (wcum <= (bonus_coins[:, depth].double() * wcum[:, -1])[:, None])
            .sum(-1)
            .clamp(max=vocab - 1)
        )
        accepted = alive & (chosen >= 0)
        emitted = torch.where(accepted, draft_tokens[base + chosen.clamp(min=0)], bonus)
        predict[base + last] = torch.where(alive, emitted, predict[base + last])
        if depth < num_steps:
            accept_index[:, depth + 1] = torch.where(accepted, base + chosen, -1)
        accept_lens += accepted.long()
        last = torch.where(accepted, chosen, last)
        alive = accepted
    return VerifyOutcome(predict=predict, accept_index=accept_index, accept_lens=accept_lens)


MUTANTS = [
    "resample_full_p",
    "residual_abs",
    "rows_shifted",
    "bonus_wrong_row",
    "accept_wrong_node",
]

# --------------------------------------------------------------------------- distribution test

VOCAB = 32
TRIALS = 100_000
ROOT = 24  # its draft trees reach depth S and its chain is often fully accepted


def _markov_tables():
    rng = np.random.default_rng(20240611)
    p = rng.dirichlet(np.full(VOCAB, 0.5), size=VOCAB)
    d = rng.dirichlet(np.full(VOCAB, 0.5), size=VOCAB)
    # A sharpened draft that agrees with the target often, but not always: its peaked rows make
    # deep trees (depth S) as well as wide ones.
    q = (0.7 * p + 0.3 * d) ** 3
    q /= q.sum(axis=1, keepdims=True)
    logp = torch.from_numpy(np.log(np.maximum(p, 1e-30))).float()
    return logp, torch.from_numpy(q).float()


LOGP, Q = _markov_tables()


def speculative_step(roots, cfg, gen, sampler, probs_of=None):
    """One draft + verify step of every trial, through the real kernels. ``probs_of(tree)``:
    the target distribution of every node where it depends on more than the node's token."""
    topk, num_steps, num_nodes, temperature, top_p = cfg
    batch = roots.shape[0]
    q_p, q_i = Q.topk(topk, dim=-1)  # the draft's top-k after each token
    first = first_step_candidates(q_p[roots], q_i[roots])
    steps, beam_scores, beam_cand, beam_tokens = (
        [],
        first.beam_scores,
        first.beam_cand,
        first.beam_tokens,
    )
    for step in range(1, num_steps):
        out = expand_step(beam_scores, beam_cand, q_p[beam_tokens], q_i[beam_tokens], step, topk)
        steps.append(out)
        beam_scores, beam_cand, beam_tokens = out.beam_scores, out.beam_cand, out.beam_tokens
    node_tokens, node_parents, _ = select_tree_nodes(*concat_candidates(first, steps), num_nodes)
    tree = build_tree(roots, node_tokens, node_parents, torch.zeros(batch, dtype=torch.int64))
    # target_probs of every node's logits: the Markov target's row depends only on the node's
    # token, so the V processed rows are computed once and gathered (a CPU sort of 1e5*N rows
    # would dominate the test); test_gathered_rows_equal_per_node_target_probs checks this.
    probs = processed_table(temperature, top_p)[tree.draft_tokens] if probs_of is None else probs_of(tree)
    coins = torch.rand(batch, num_steps + 1, generator=gen)
    bonus_coins = torch.rand(batch, num_steps + 1, generator=gen)
    args = (
        tree.draft_tokens,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        probs,
        coins,
        bonus_coins,
    )
    out = sampler(*args, num_steps, draft_probs=Q[tree.draft_tokens])
    emitted = gather_accepted_tokens(out.predict, out.accept_index)
    return (
        emitted,
        out.accept_lens,
        fill_bonus_tokens(out.predict, out.accept_index, out.accept_lens),
    )


def first_two_tokens(cfg, sampler, seed):
    """Tokens at generated positions 0 and 1 of every trial (a second step where needed)."""
    gen = torch.Generator().manual_seed(seed)
    roots = torch.full((TRIALS,), ROOT, dtype=torch.int64)
    emitted, lens, bonus = speculative_step(roots, cfg, gen, sampler)
    emitted2, _, _ = speculative_step(bonus, cfg, gen, sampler)
    second = torch.where(lens >= 2, emitted[:, 1], emitted2[:, 0])
    return emitted[:, 0], second, lens


@functools.cache
def processed_table(temperature, top_p):
    """p(next | prev) after temperature and top-p (target_probs on the log p rows), [V, V]."""
    ones = torch.ones(VOCAB)
    return target_probs(
        LOGP, ones * temperature, torch.zeros(VOCAB, dtype=torch.int64), ones * top_p, 1
    )


def chi_square_pvalue(counts, expected):
    """Pearson chi-square p-value; bins with expected count < 5 are pooled (at least 5)."""
    order = torch.argsort(expected)
    e, o = expected[order].double(), counts[order].double()
    small = e < 5
    n_small = int(small.sum())
    if n_small and float(e[:n_small].sum()) < 5 and n_small < e.numel():
        n_small += 1  # the pooled bin borrows the smallest regular bin
    if n_small:
        e = torch.cat([e[:n_small].sum()[None], e[n_small:]])
        o = torch.cat([o[:n_small].sum()[None], o[n_small:]])
    stat = ((o - e) ** 2 / e).sum()
    dof = torch.tensor(float(e.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def check_against(samples, expected_probs):
    """(p-value, total variation, tokens outside the support) of samples vs a distribution."""
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    n = counts.sum()
    tv = 0.5 * float((counts / n - expected_probs).abs().sum())
    outside = int(counts[expected_probs == 0].sum())
    return chi_square_pvalue(counts, expected_probs * n), tv, outside


def distribution_report(cfg, sampler, seed):
    first, second, lens = first_two_tokens(cfg, sampler, seed)
    table = processed_table(cfg[3], cfg[4]).double()
    m0 = table[ROOT]
    joint = m0[:, None] * table  # P(first = a, second = b)
    return {
        "pos0": check_against(first, m0),
        "pos1": check_against(second, m0 @ table),
        "joint": check_against(first * VOCAB + second, joint.reshape(-1)),
        "accept_len_histogram": torch.bincount(lens, minlength=cfg[1] + 2)[1:].tolist(),
    }


def kernel_sampler(*args, draft_probs=None):
    del draft_probs
    return verify_tree_sampling(*args)


@pytest.fixture
def one_thread():
    """The distribution tests run ~1e3 small ops on 1e5-row tensors: one thread is faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_gathered_rows_equal_per_node_target_probs():
    topk, num_nodes = 4, 8
    roots = torch.randint(0, VOCAB, (512,), generator=torch.Generator().manual_seed(5))
    q_p, q_i = Q.topk(topk, dim=-1)
    first = first_step_candidates(q_p[roots], q_i[roots])
    second = expand_step(
        first.beam_scores, first.beam_cand, q_p[first.beam_tokens], q_i[first.beam_tokens], 1, topk
    )
    node_tokens, node_parents, _ = select_tree_nodes(*concat_candidates(first, [second]), num_nodes)
    tree = build_tree(roots, node_tokens, node_parents, torch.zeros(512, dtype=torch.int64))
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)]:
        per_node = target_probs(
            LOGP[tree.draft_tokens],
            torch.full((512,), temperature),
            torch.zeros(512, dtype=torch.int64),
            torch.full((512,), top_p),
            num_nodes,
        )
        gathered = processed_table(temperature, top_p)[tree.draft_tokens]
        assert torch.equal(per_node, gathered)


# (topk, num_steps, num_nodes, temperature, top_p)
DIST_CASES = {
    "chain_k1_t1.0": (1, 3, 4, 1.0, 1.0),
    "chain_k1_t0.7_p0.9": (1, 3, 4, 0.7, 0.9),
    "tree_k2_t0.7": (2, 3, 6, 0.7, 1.0),
    "tree_k2_t1.0_p0.9": (2, 3, 6, 1.0, 0.9),
    "tree_k4_t1.0": (4, 3, 8, 1.0, 1.0),
    "tree_k4_t0.7_p0.9": (4, 3, 8, 0.7, 0.9),
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("name", list(DIST_CASES))
def test_tree_sampling_is_lossless(name):
    cfg = DIST_CASES[name]
    report = distribution_report(cfg, kernel_sampler, seed=100 + list(DIST_CASES).index(name))
    # the drafts are really accepted, down to the last depth
    assert min(report["accept_len_histogram"]) >= 100, report
    for key in ("pos0", "pos1", "joint"):
        pvalue, tv, outside = report[key]
        assert outside == 0, (key, report)
        assert pvalue > 1e-4, (key, report)
        if key != "joint":  # 1024 joint bins: TV carries sampling noise of ~0.08 at 1e5 trials
            assert tv < 0.06, (key, report)


def test_reference_sampler_equals_kernel():
    """The mutant harness without a mutant is the kernel, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    cfg = DIST_CASES["tree_k4_t0.7_p0.9"]
    roots = torch.randint(0, VOCAB, (4096,), generator=gen)
    state = gen.get_state()
    a = speculative_step(roots, cfg, gen, kernel_sampler)
    gen.set_state(state)
    b = speculative_step(roots, cfg, gen, reference_sampler)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


MUTANT_CFG = (2, 3, 6, 1.0, 1.0)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mutant", MUTANTS)
def test_broken_samplers_fail_the_check(mutant):
    def sampler(*args, draft_probs=None):
        return reference_sampler(*args, mutant=mutant, draft_probs=draft_probs)

    report = distribution_report(MUTANT_CFG, sampler, seed=7)
    failed = [
        key
        for key in ("pos0", "pos1", "joint")
        if report[key][0] < 1e-12 or (key != "joint" and report[key][1] > 0.06)
    ]
    assert failed, report
