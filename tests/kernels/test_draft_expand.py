"""EAGLE-2 draft expansion: hand cases and properties of the candidate index space."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasegraph.kernels import (
    StepCandidates,
    concat_candidates,
    expand_step,
    first_step_candidates,
    select_tree_nodes,
)


def test_first_step_candidates_are_the_root_children():
    topk_p = torch.tensor([[0.5, 0.3], [0.9, 0.05]])
    topk_index = torch.tensor([[7, 3], [1, 2]])
    out = first_step_candidates(topk_p, topk_index)
    assert torch.equal(out.beam_scores, topk_p)
    assert torch.equal(out.beam_tokens, topk_index)
    assert torch.equal(out.beam_cand, torch.tensor([[0, 1], [0, 1]]))
    assert torch.equal(out.cand_tokens, topk_index)
    assert torch.equal(out.cand_scores, topk_p)
    assert torch.equal(out.cand_parents, torch.full((2, 2), -1))


def test_expand_step_hand_case():
    # K = 2, step 1: candidate ids 2..5 = K + 0*K*K + beam*K + child.
    beam_scores = torch.tensor([[0.6, 0.4]])
    beam_cand = torch.tensor([[0, 1]])
    step_p = torch.tensor([[[0.5, 0.3], [0.9, 0.1]]])
    step_i = torch.tensor([[[10, 11], [20, 21]]])
    out = expand_step(beam_scores, beam_cand, step_p, step_i, step=1, topk=2)
    assert torch.allclose(out.cand_scores, torch.tensor([[0.30, 0.18, 0.36, 0.04]]))
    assert torch.equal(out.cand_tokens, torch.tensor([[10, 11, 20, 21]]))
    assert torch.equal(out.cand_parents, torch.tensor([[0, 0, 1, 1]]))
    assert torch.equal(out.beam_parent, torch.tensor([[1, 0]]))
    assert torch.equal(out.beam_cand, torch.tensor([[4, 2]]))
    assert torch.equal(out.beam_tokens, torch.tensor([[20, 10]]))
    assert torch.allclose(out.beam_scores, torch.tensor([[0.36, 0.30]]))


def test_expand_step_second_step_ids_and_parents():
    # K = 2, step 2: ids start at K + K*K = 6; parents are the beams' candidate ids.
    beam_scores = torch.tensor([[0.36, 0.30]])
    beam_cand = torch.tensor([[4, 2]])
    step_p = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    step_i = torch.tensor([[[1, 2], [3, 4]]])
    out = expand_step(beam_scores, beam_cand, step_p, step_i, step=2, topk=2)
    assert torch.equal(out.cand_parents, torch.tensor([[4, 4, 2, 2]]))
    # scores 0.18, 0.18, 0.30, 0.0 -> beams: id 8 (0.30), then the tie 0.18 goes to id 6.
    assert torch.equal(out.beam_cand, torch.tensor([[8, 6]]))
    assert torch.equal(out.beam_parent, torch.tensor([[1, 0]]))
    assert torch.equal(out.beam_tokens, torch.tensor([[3, 1]]))


def test_expand_step_ties_go_to_the_lower_index():
    beam_scores = torch.tensor([[1.0, 1.0, 1.0]])
    beam_cand = torch.tensor([[0, 1, 2]])
    step_p = torch.full((1, 3, 3), 0.25)
    step_i = torch.arange(9).view(1, 3, 3)
    out = expand_step(beam_scores, beam_cand, step_p, step_i, step=1, topk=3)
    assert torch.equal(out.beam_cand, torch.tensor([[3, 4, 5]]))
    assert torch.equal(out.beam_parent, torch.tensor([[0, 0, 0]]))


def test_expand_step_rejects_bad_input():
    ok_p = torch.rand(1, 2, 2)
    ok_i = torch.zeros(1, 2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="step"):
        expand_step(torch.rand(1, 2), torch.zeros(1, 2, dtype=torch.int64), ok_p, ok_i, 0, 2)
    with pytest.raises(ValueError, match="step_topk_index"):
        expand_step(torch.rand(1, 2), torch.zeros(1, 2, dtype=torch.int64), ok_p, ok_i.int(), 1, 2)
    with pytest.raises(ValueError, match="beam_scores"):
        expand_step(torch.rand(1, 3), torch.zeros(1, 2, dtype=torch.int64), ok_p, ok_i, 1, 2)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    topk=st.integers(1, 4),
    num_steps=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_candidate_space_matches_a_loop_reference(batch, topk, num_steps, seed):
    g = torch.Generator().manual_seed(seed)
    # Coarse probabilities make ties frequent.
    p0 = torch.randint(0, 5, (batch, topk), generator=g).float() / 4
    first = first_step_candidates(p0, torch.randint(0, 50, (batch, topk), generator=g))
    steps, draws = [], []
    beam_scores, beam_cand = first.beam_scores, first.beam_cand
    for step in range(1, num_steps):
        sp = torch.randint(0, 5, (batch, topk, topk), generator=g).float() / 4
        si = torch.randint(0, 50, (batch, topk, topk), generator=g)
        draws.append((sp, si))
        out = expand_step(beam_scores, beam_cand, sp, si, step, topk)
        for b in range(batch):
            flat = [
                (float(beam_scores[b, i] * sp[b, i, c]), i * topk + c)
                for i in range(topk)
                for c in range(topk)
            ]
            best = sorted(flat, key=lambda sc: (-sc[0], sc[1]))[:topk]
            base = topk + (step - 1) * topk * topk
            assert out.beam_cand[b].tolist() == [base + idx for _, idx in best]
            assert out.beam_parent[b].tolist() == [idx // topk for _, idx in best]
            assert out.beam_tokens[b].tolist() == [
                int(si.view(batch, -1)[b, idx]) for _, idx in best
            ]
        steps.append(out)
        beam_scores, beam_cand = out.beam_scores, out.beam_cand

    tokens, scores, parents = concat_candidates(first, steps)
    num_cand = topk + (num_steps - 1) * topk * topk
    assert tokens.shape == scores.shape == parents.shape == (batch, num_cand)
    # Every parent is an earlier candidate whose score is at least the child's.
    ids = torch.arange(num_cand)
    assert bool((parents < ids).all())
    has = parents >= 0
    parent_score = scores.gather(1, parents.clamp(min=0))
    assert bool(((parent_score >= scores) | ~has).all())
    assert bool((has == (ids >= topk)).all())

    # the draft phase's form: every step into one table, step 1 from the step-0 beams given as
    # beam_cand None, the step-0 candidates handed to select_tree_nodes apart
    table = StepCandidates.empty(batch, topk, num_steps, torch.device("cpu"))
    beam_scores, beam_cand = first.beam_scores, None
    for step, ((sp, si), want) in enumerate(zip(draws, steps, strict=True), start=1):
        out = expand_step(beam_scores, beam_cand, sp, si, step, topk, table=table)
        for field in ("cand_tokens", "cand_scores", "cand_parents", "beam_scores", "beam_tokens",
                      "beam_parent", "beam_cand"):
            assert torch.equal(getattr(out, field), getattr(want, field)), field
        beam_scores, beam_cand = out.beam_scores, out.beam_cand
    assert torch.equal(table.tokens, tokens[:, topk:]) and torch.equal(table.scores, scores[:, topk:])
    assert torch.equal(table.parents, parents[:, topk:])
    for num_nodes in {1, num_cand + 1, min(num_cand + 1, 1 + 2 * topk)}:
        apart = select_tree_nodes(table.tokens, table.scores, table.parents, num_nodes,
                                  first_tokens=first.cand_tokens, first_scores=first.cand_scores)
        whole = select_tree_nodes(tokens, scores, parents, num_nodes)
        assert all(torch.equal(a, w) for a, w in zip(apart, whole, strict=True))
