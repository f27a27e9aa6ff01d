"""The offline speculative-decoding replay: batched tree drafting vs a one-beam-at-a-time
reference, greedy verification, and the standalone-draft chain."""

from __future__ import annotations

import pytest
import torch

from phasegraph.train.eagle3_head import Eagle3Config, Eagle3Head, eagle3_aux_layers
from phasegraph.train.eagle3_train import FrozenTarget
from phasegraph.train.presets import LMSpec
from phasegraph.train.simulate import (
    DraftTree,
    _pad_right,
    accept_lengths,
    draft_tree,
    greedy_generate,
    head_prefix,
    simulate_eagle3,
    simulate_standalone_chain,
)
from phasegraph.train.target import build_lm

VOCAB = 40


@pytest.fixture(scope="module")
def pair():
    spec = LMSpec(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, head_dim=8, context=128)
    target = build_lm(spec, VOCAB, 0, seed=3, role="target").eval()
    cfg = Eagle3Config(
        hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, vocab_size=VOCAB, draft_vocab_size=VOCAB,
        eagle_aux_layers=eagle3_aux_layers(4), max_position_embeddings=128,
    )
    head = Eagle3Head(cfg)
    head.init_weights(torch.Generator().manual_seed(5), std=0.3)  # peaky enough to matter
    return FrozenTarget(target), head.eval()


def _self_consistent_sequences(frozen, head, n_seq=3, prompt=6, length=30):
    """Sequences whose next token is mostly the head's own step-0 argmax (so drafts are often
    accepted), with a deterministic sprinkle of other tokens."""
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(1, VOCAB, (prompt + 1,), generator=g).tolist() for _ in range(n_seq)]
    for s in seqs:
        while len(s) < length:
            ids = torch.tensor([s])
            pre = head_prefix(head, frozen, ids)
            nxt = int(pre.logits[0, -1].argmax())  # row len-2 predicts position len
            if torch.rand((), generator=g) < 0.15:
                nxt = int(torch.randint(1, VOCAB, (), generator=g))
            s.append(nxt)
    return seqs, [prompt] * n_seq


@torch.no_grad()
def _reference_tree(head, frozen, ids, base, k_top, steps):
    """One sequence, one beam per call, python lists: the spec of draft_tree."""
    pre = head_prefix(head, frozen, ids[None])
    out0, k0, v0, logits0 = pre.out[0], pre.k, pre.v, pre.logits[0]
    tokens, scores, parents, depth = [], [], [], []
    p, tok = torch.softmax(logits0[base], -1).topk(k_top)
    frontier = []
    for c in range(k_top):
        tokens.append(int(tok[c]))
        scores.append(float(p[c]))
        parents.append(-1)
        depth.append(1)
        frontier.append((c, out0[base], [], []))
    for i in range(1, steps):
        children = []
        for cand, hidden, ak, av in frontier:
            ck = torch.cat([k0[:, :, : base + 1], *ak], dim=2)
            cv = torch.cat([v0[:, :, : base + 1], *av], dim=2)
            mask = torch.ones(1, 1, ck.shape[2], dtype=torch.bool)
            emb = frozen.embed(torch.tensor([[tokens[cand]]]))
            out, k, v = head.step(hidden[None, None], emb, torch.tensor([[base + i]]), ck, cv,
                                  mask)
            cp, ct = torch.softmax(head.logits(out)[0, 0].float(), -1).topk(k_top)
            for c in range(k_top):
                children.append((int(ct[c]), scores[cand] * float(cp[c]), cand, out[0, 0],
                                 ak + [k], av + [v]))
        first = len(tokens)
        for tok_c, score_c, parent_c, *_ in children:
            tokens.append(tok_c)
            scores.append(score_c)
            parents.append(parent_c)
            depth.append(i + 1)
        order = sorted(range(len(children)), key=lambda j: -children[j][1])[:k_top]
        frontier = [(first + j, children[j][3], children[j][4], children[j][5]) for j in order]
    return tokens, scores, parents, depth


def _reference_accept(tokens, scores, parents, depth, truth, nodes):
    keep = sorted(range(len(tokens)), key=lambda c: (-scores[c], c))[: nodes - 1]

    def on_path(c):
        ok = tokens[c] == truth[depth[c] - 1]
        return ok and (parents[c] < 0 or on_path(parents[c]))

    return 1 + max((depth[c] for c in keep if on_path(c)), default=0)


@pytest.mark.parametrize(("k_top", "steps"), [(1, 3), (2, 3), (3, 4)])
def test_batched_tree_equals_reference(pair, k_top, steps):
    frozen, head = pair
    seqs, _ = _self_consistent_sequences(frozen, head)
    ids, _ = _pad_right(seqs, 0)
    prefix = head_prefix(head, frozen, ids)
    base = torch.tensor([6, 10, 14])
    tree = draft_tree(head, frozen, prefix, base, k_top, steps)
    assert tree.tokens.shape == (3, k_top + (steps - 1) * k_top * k_top)
    for r in range(3):
        tokens, scores, parents, depth = _reference_tree(head, frozen, ids[r], int(base[r]),
                                                         k_top, steps)
        assert tree.tokens[r].tolist() == tokens
        assert tree.parents[r].tolist() == parents
        assert tree.depth[r].tolist() == depth
        torch.testing.assert_close(tree.scores[r], torch.tensor(scores), rtol=1e-5, atol=1e-7)


def test_accept_lengths_hand_made_tree():
    # root -> a(0) -> c(2) -> e(4); root -> b(1) -> d(3)
    tree = DraftTree(
        tokens=torch.tensor([[10, 11, 12, 13, 14]]),
        scores=torch.tensor([[0.5, 0.4, 0.3, 0.3, 0.1]]),
        parents=torch.tensor([[-1, -1, 0, 1, 2]]),
        depth=torch.tensor([[1, 1, 2, 2, 3]]),
    )
    truth = torch.tensor([[10, 12, 14]])
    assert accept_lengths(tree, truth, nodes=6).tolist() == [4]
    assert accept_lengths(tree, truth, nodes=4).tolist() == [3]  # keeps 0, 1, 2 (tie -> 2)
    assert accept_lengths(tree, truth, nodes=3).tolist() == [2]
    assert accept_lengths(tree, torch.tensor([[11, 13, 0]]), nodes=6).tolist() == [3]
    assert accept_lengths(tree, torch.tensor([[11, 12, 14]]), nodes=6).tolist() == [2]
    assert accept_lengths(tree, torch.tensor([[9, 12, 14]]), nodes=6).tolist() == [1]


@pytest.mark.parametrize(("k_top", "steps", "nodes"), [(1, 3, 4), (2, 3, 6), (3, 3, 10)])
def test_simulation_walk_equals_reference(pair, k_top, steps, nodes):
    frozen, head = pair
    seqs, prompt_lens = _self_consistent_sequences(frozen, head)
    stats = simulate_eagle3(head, frozen, seqs, prompt_lens, k_top, steps, nodes,
                            torch.device("cpu"))
    expected = []
    for s, n in zip(seqs, prompt_lens, strict=True):
        ids = torch.tensor(s)
        b = n - 1
        while b + 1 + steps <= len(s) - 1:
            tree = _reference_tree(head, frozen, ids, b, k_top, steps)
            a = _reference_accept(*tree, s[b + 2 : b + 2 + steps], nodes)
            expected.append(a)
            b += a
    # lockstep order differs from per-sequence order: compare the multisets
    assert sorted(expected) == sorted(
        length for length, count in enumerate(stats.histogram, 1) for _ in range(count)
    )
    assert stats.verify_steps == len(expected)
    assert stats.tau == pytest.approx(sum(expected) / len(expected))
    assert max(expected) > 1, "the fixture should accept some drafts"


def test_standalone_chain_equals_autoregressive_drafting():
    spec = LMSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=64, head_dim=8, context=128)
    draft = build_lm(spec, VOCAB, 0, seed=1, role="draft").eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, VOCAB, (2, 5), generator=g)
    own = greedy_generate(draft, prompt, torch.ones_like(prompt), 20)
    seqs = torch.cat([prompt, own], 1)
    seqs[0, 12] = (seqs[0, 12] + 1) % VOCAB  # a rejection point
    seqs = seqs.tolist()
    steps = 3
    stats = simulate_standalone_chain(draft, seqs, [5, 5], steps, torch.device("cpu"))
    expected = []
    for s in seqs:
        n = 5
        while n + steps <= len(s) - 1:
            drafted = greedy_generate(draft, torch.tensor([s[: n + 1]]),
                                      torch.ones(1, n + 1, dtype=torch.long), steps)[0].tolist()
            a = 0
            while a < steps and drafted[a] == s[n + 1 + a]:
                a += 1
            expected.append(a + 1)
            n += a + 1
    assert stats.verify_steps == len(expected)
    assert stats.tau == pytest.approx(sum(expected) / len(expected))
    assert 1 < stats.tau < steps + 1
