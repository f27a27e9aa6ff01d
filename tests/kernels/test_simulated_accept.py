"""Simulated acceptance (benchmark mode) accepts exactly the requested number of drafts."""

from __future__ import annotations

import torch

from phasegraph.kernels.bonus import fill_bonus_tokens, gather_accepted_tokens
from phasegraph.kernels.simulated_accept import verify_tree_simulated
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.testing import synthetic as syn
from phasegraph.testing.drafters import RandomDraft


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
