"""Greedy speculative decoding is token-identical to target-only greedy decoding (issue 3).

The n-gram (prompt-lookup) drafter runs the chain part of the same matrix (its own draft
phase, no scripted drafter): every chain shape, page size and batch size.

Every legal (topk, num_steps, num_draft_tokens) of topk ∈ {1,2,4,8}, num_steps ∈ {1,2,3,5},
num_draft_tokens ∈ {2, S+1, K·S, 16}, for page sizes {1,4,16} and batch sizes {1,3,8}, over 64
new tokens, in strict validation, with KV accounting checked after every step. The matrix
drafter ranks the right token at a pseudo-random place (or not at all), so acceptance stops at
every depth and on every branch; the oracle, adversary and random drafters pin the extremes.
"""

from __future__ import annotations

import pytest

from phasegraph.phases.context import check_tree_shape
from phasegraph.runtime.config import SpecConfig
from phasegraph.testing.drafters import (
    AdversaryDraft,
    HiddenChainOracleDraft,
    NoisyOracleDraft,
    OracleDraft,
    RandomDraft,
)
from tests.phases.lossless_support import NEW_TOKENS, prompts, reference, run_spec, tiny_target


def _tree_configs():
    for k in (1, 2, 4, 8):
        for s in (1, 2, 3, 5):
            for n in sorted({2, s + 1, k * s, 16}):
                if not check_tree_shape(k, s, n):
                    yield k, s, n


TREES = list(_tree_configs())


def _assert_all_free(engine):
    engine.check()
    assert engine.kv.num_free_pages == engine.kv.allocator.total
    assert engine.kv.table.rows_in_use() == []


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("topk", "steps", "nodes"), TREES, ids=[f"K{k}-S{s}-N{n}" for k, s, n in TREES])
def test_greedy_matrix_is_lossless(topk, steps, nodes, page_size):
    spec = SpecConfig(method="eagle", num_steps=steps, topk=topk, num_draft_tokens=nodes)
    most = min(steps, nodes - 1) + 1  # the longest path the tree holds, bonus included
    seen: set[int] = set()
    for batch in (1, 3, 8):
        outs, ref, engine, results = run_spec(NoisyOracleDraft, spec, page_size, batch)
        assert outs == list(ref), f"batch {batch}: speculative output differs from target greedy"
        assert all(len(o) == NEW_TOKENS for o in outs)
        _assert_all_free(engine)
        lens = [n for r in results for n in r.stats.accept_lengths]
        assert max(lens) <= most
        seen.update(lens)
    # the drafter makes acceptance stop at every depth: each accept length up to the longest
    # occurs, and the longest too unless it needs all N - 1 drafts on one path of a branching tree
    assert set(range(1, most)) <= seen, sorted(seen)
    assert most in seen or (topk > 1 and nodes - 1 == steps), sorted(seen)


def test_matrix_covers_the_issue_grid():
    assert len(TREES) == 47
    assert {k for k, _, _ in TREES} == {1, 2, 4, 8} and {s for _, s, _ in TREES} == {1, 2, 3, 5}


@pytest.mark.parametrize("drafter", [OracleDraft, HiddenChainOracleDraft], ids=["oracle", "hidden-chain"])
@pytest.mark.parametrize(("topk", "steps", "nodes"), [(1, 3, 4), (1, 5, 6), (4, 3, 12), (8, 5, 40), (2, 5, 4)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_oracle_accepts_every_draft_the_tree_holds(topk, steps, nodes, page_size, drafter):
    """Full acceptance, and with ``HiddenChainOracleDraft`` only if every draft step got the
    hidden state its parent row produced (SGLang #22041: a stale hidden state between steps)."""
    spec = SpecConfig(method="eagle", num_steps=steps, topk=topk, num_draft_tokens=nodes)
    outs, ref, engine, results = run_spec(drafter, spec, page_size, 3)
    assert outs == list(ref)
    most = min(steps, nodes - 1) + 1  # the whole chain fits when N - 1 >= S
    for r in results:
        lens = r.stats.accept_lengths
        assert lens[:-1] == [most] * (len(lens) - 1), lens  # the last step may be cut by the budget
        assert 1 <= lens[-1] <= most
    _assert_all_free(engine)


@pytest.mark.parametrize(("topk", "steps", "nodes"), [(2, 4, 15), (2, 5, 19), (3, 3, 22)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_hidden_states_move_with_their_beams(topk, steps, nodes, page_size):
    """The right path changes beam slots (its token ranked second at half the steps) and still
    gets full acceptance only if the hidden state of every beam moved with it (SGLang #22041). N - 1
    = K + (S-1) K^2 keeps every candidate in the tree, so only a lost right token cuts a path."""
    spec = SpecConfig(method="eagle", num_steps=steps, topk=topk, num_draft_tokens=nodes)
    outs, ref, engine, results = run_spec(HiddenChainOracleDraft, spec, page_size, 3, second_rate=0.5)
    assert outs == list(ref)
    for r in results:
        lens = r.stats.accept_lengths
        assert lens[:-1] == [steps + 1] * (len(lens) - 1), lens
    _assert_all_free(engine)


@pytest.mark.parametrize(("topk", "steps", "nodes"), [(1, 3, 4), (4, 3, 12), (8, 2, 16)])
@pytest.mark.parametrize("page_size", [1, 4])
def test_adversary_gets_only_the_bonus(topk, steps, nodes, page_size):
    spec = SpecConfig(method="eagle", num_steps=steps, topk=topk, num_draft_tokens=nodes)
    outs, ref, engine, results = run_spec(AdversaryDraft, spec, page_size, 3)
    assert outs == list(ref)
    for r in results:
        assert set(r.stats.accept_lengths) == {1}
    _assert_all_free(engine)


@pytest.mark.parametrize(("topk", "steps", "nodes"), [(1, 3, 4), (4, 3, 12), (2, 5, 10)])
def test_random_drafter_is_lossless(topk, steps, nodes):
    spec = SpecConfig(method="eagle", num_steps=steps, topk=topk, num_draft_tokens=nodes)
    outs, ref, engine, _ = run_spec(RandomDraft, spec, 16, 8)
    assert outs == list(ref)
    _assert_all_free(engine)


CHAINS = [(s, n) for k, s, n in TREES if k == 1]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("steps", "nodes"), CHAINS, ids=[f"S{s}-N{n}" for s, n in CHAINS])
def test_ngram_matrix_is_lossless(steps, nodes, page_size):
    from phasegraph.runtime.config import SamplingParams
    from phasegraph.runtime.engine import Engine

    spec = SpecConfig(method="ngram", num_steps=steps, num_draft_tokens=nodes)
    for batch in (1, 3, 8):
        engine = Engine(tiny_target(), spec=spec, max_batch_size=batch, page_size=page_size, kv_pool_tokens=8192,
                        check_every_step=True)
        outs = engine.generate(prompts(batch), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        assert [tuple(o.token_ids) for o in outs] == list(reference(batch)), f"batch {batch}"
        assert max(n for o in outs for n in o.stats.accept_lengths) == nodes  # the whole chain, at times
        _assert_all_free(engine)
