"""finalize-tree-path on hand-made verify results: schema-driven compaction and the KV move."""

from __future__ import annotations

import pytest
import torch
from jaxtyping import Int64

from phasegraph.phases import NODE, FinalizedPath, SpecContext, TreeShape, VerifyResult
from phasegraph.phases.finalize_tree_path import finalize_tree_path
from phasegraph.runtime.kv_pool import KVCacheManager, KVSpec
from phasegraph.runtime.memory import PhaseMemory
from phasegraph.statemachine import InvalidSchema, schema, tensor
from phasegraph.testing import synthetic as syn


@schema
class VerifyWithExperts(VerifyResult):
    """A verify result with a side output finalize has never heard of (as SGLang #26866's routed experts were)."""

    expert_scores: Int64[torch.Tensor, "B*N E"] = tensor(role=NODE, pad=0)


@schema
class VerifyWithRolelessExperts(VerifyResult):
    """The same side output declared without its role: SGLang #26866's forgotten field."""

    expert_scores: Int64[torch.Tensor, "B*N E"] = tensor()


def _setup(B=3, N=5, S=3, P=4, seq_len=6, accept=2):
    kv = KVCacheManager(
        num_pages=64, page_size=P, max_reqs=8, max_pages_per_req=16,
        target=KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32),
    )
    rows = [kv.admit(seq_len + max(N, S + 1)) for _ in range(B)]
    draft = syn.draft_state(B, K=2, seq_len=seq_len, start_row=rows[0])
    assert draft.params.req_pool_idx.tolist() == rows
    result = syn.verify_result(syn.tree_proposal(draft, N=N, S=S), accept=accept)
    ctx = SpecContext(target=None, memory=PhaseMemory(kv), tree=TreeShape(2, S, N))
    return kv, result, ctx


def _slot(kv, row, pos):
    P = kv.page_size
    return int(kv.req_to_page[row, pos // P]) * P + pos % P


def test_a_new_per_node_side_output_is_compacted_without_code_changes():
    kv, base, ctx = _setup()
    B, N = base.proposal.depth.shape
    experts = torch.arange(B * N * 2).view(B * N, 2) + 1000
    result = VerifyWithExperts(**{f: getattr(base, f) for f in ("proposal", "predict", "features",
                                  "logprobs", "accept_index", "accept_lens", "bonus_tokens",
                                  "logits_finite")},
                               expert_scores=experts)
    out = finalize_tree_path(result, ctx)
    out.validate("strict")
    assert isinstance(out, FinalizedPath) and type(out) is not FinalizedPath
    W = result.accept_index.shape[1]
    got = out.accepted_expert_scores.view(B, W, 2)
    for b in range(B):
        for i in range(int(out.accept_lens[b])):
            node = int(result.accept_index[b, i])
            assert torch.equal(got[b, i], experts[node])
    # the fields VerifyResult declares are compacted the same way
    for b in range(B):
        n = int(out.accept_lens[b])
        want = [int(result.predict[int(result.accept_index[b, i])]) for i in range(n)]
        assert out.emitted[b, :n].tolist() == want
        assert (out.emitted[b, n:] == -1).all()


def test_a_per_node_side_output_without_the_node_role_is_refused_by_name():
    """A ``B*N`` field without ``role=NODE`` would stay in node order, uncompacted and unseen
    (SGLang #26866); finalize refuses the schema instead, naming the field and the role to declare."""
    kv, base, ctx = _setup()
    B, N = base.proposal.depth.shape
    result = VerifyWithRolelessExperts(
        **{f: getattr(base, f) for f in ("proposal", "predict", "features", "logprobs",
                                         "accept_index", "accept_lens", "bonus_tokens", "logits_finite")},
        expert_scores=torch.zeros(B * N, 2, dtype=torch.int64))
    with pytest.raises(InvalidSchema, match=r"field 'expert_scores' has shape 'B\*N E', whose "
                                            r"first dim 'B\*N' is the node role's: declare "
                                            r"tensor\(role=NODE\)") as err:
        finalize_tree_path(result, ctx)
    assert err.value.schema == "VerifyWithRolelessExperts" and len(err.value.problems) == 1


def test_accepted_kv_moves_behind_the_prefix_every_layer():
    kv, result, ctx = _setup(P=4, seq_len=6)
    B, N = result.proposal.depth.shape
    seq = result.proposal.draft.seq_lens.tolist()
    rows = result.proposal.draft.params.req_pool_idx.tolist()
    pool = kv.target_pool
    # give every tree node's KV a recognisable value: 100*b + node, per layer offset
    for b in range(B):
        for j in range(N):
            s = _slot(kv, rows[b], seq[b] + j)
            for layer in range(pool.num_layers):
                pool.k[layer][s] = 100 * b + j + 0.5 * layer
                pool.v[layer][s] = -(100 * b + j) - 0.5 * layer
    out = finalize_tree_path(result, ctx)
    for b in range(B):
        for i in range(int(out.accept_lens[b])):
            node = int(result.accept_index[b, i]) - b * N
            s = _slot(kv, rows[b], seq[b] + i)
            for layer in range(pool.num_layers):
                assert torch.all(pool.k[layer][s] == 100 * b + node + 0.5 * layer)
                assert torch.all(pool.v[layer][s] == -(100 * b + node) - 0.5 * layer)
    assert out.seq_lens.tolist() == [a + n for a, n in zip(seq, out.accept_lens.tolist(), strict=True)]


def test_path_is_cut_at_a_stop_token_and_at_the_budget():
    kv, result, ctx = _setup(B=2, accept=3)
    B, N = result.proposal.depth.shape
    # request 0 stops on its second emitted token; request 1 may emit only 2 tokens
    emitted1 = int(result.predict[int(result.accept_index[0, 1])])
    params = result.proposal.draft.params.replace(stop_ids=torch.tensor([[emitted1], [-1]]))
    draft = result.proposal.draft.replace(params=params, remaining=torch.tensor([16, 2]))
    proposal = result.proposal.replace(draft=draft)
    result = result.replace(proposal=proposal)
    out = finalize_tree_path(result, ctx)
    assert int(result.accept_lens[0]) >= 2
    raw = [int(result.predict[int(result.accept_index[0, i])]) for i in range(int(result.accept_lens[0]))]
    assert out.accept_lens.tolist()[0] == raw.index(emitted1) + 1  # cut after the first stop
    assert out.emitted[0, : raw.index(emitted1) + 1].tolist() == raw[: raw.index(emitted1) + 1]
    assert bool(out.finished[0])
    assert out.accept_lens.tolist()[1] == min(2, int(result.accept_lens[1]))
    assert bool(out.finished[1]) == (int(result.accept_lens[1]) >= 2)
    assert out.remaining.tolist()[1] == 2 - out.accept_lens.tolist()[1]


def test_a_full_path_from_a_draft_that_was_not_finite_is_cut_to_carry_the_mark():
    """The host learns that a draft was not finite from DRAFT_NONFINITE in the emitted row's
    padding; a path of all W nodes is cut by one so that the row always has that padding, and a
    row without the mark is an invariant violation."""
    from phasegraph.kernels.commit_path import DRAFT_NONFINITE
    from phasegraph.statemachine import InvariantViolation
    from phasegraph.statemachine.schema import check_invariants

    def own_invariants(path):  # strict validation also flags the nested proposal's own
        check_invariants(path, type(path).__schema__)

    kv, result, ctx = _setup(B=2, N=5, S=2, accept=2)
    W = result.accept_index.shape[1]
    assert result.accept_lens.tolist() == [W, W]  # every draft accepted
    proposal = result.proposal.replace(draft_finite=torch.tensor([False, True]))
    result = result.replace(proposal=proposal)
    out = finalize_tree_path(result, ctx)
    out.validate("boundary")
    own_invariants(out)
    assert out.accept_lens.tolist() == [W - 1, W]
    want = [int(result.predict[int(result.accept_index[0, i])]) for i in range(W - 1)]
    assert out.emitted[0].tolist() == [*want, DRAFT_NONFINITE]
    assert out.bonus_tokens.tolist()[0] == want[-1] and not bool(out.finished[0])
    assert (out.emitted[1] >= 0).all()  # the finite draft's full path stays whole

    # the bug the cut prevents: the whole path committed, and no padding left for the mark
    finite = result.replace(proposal=proposal.replace(draft_finite=torch.tensor([True, True])))
    unmarked = finalize_tree_path(finite, ctx).replace(verified=result)
    assert unmarked.accept_lens.tolist() == [W, W]
    with pytest.raises(InvariantViolation, match="draft not finite"):
        own_invariants(unmarked)
