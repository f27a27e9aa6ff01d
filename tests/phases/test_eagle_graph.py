"""The declared EAGLE graph: legal flow, SGLang #24859 rejections, schema compaction coverage."""

from __future__ import annotations

import pytest
import torch
from jaxtyping import Int64

from phasegraph.phases import (
    EAGLE_GRAPH,
    NODE,
    DraftState,
    FinalizedPath,
    VerifyResult,
    finalized_schema_for,
    node_fields,
)
from phasegraph.phases.schemas import accepted_name
from phasegraph.statemachine import (
    IllegalTransition,
    Machine,
    PhaseContractViolation,
    SchemaViolation,
    schema,
    tensor,
)
from phasegraph.testing import synthetic as syn

EXPECTED_PHASES = {
    "prefill-extend", "draft-extend", "draft", "verify", "finalize-tree-path",
    "decode", "merge", "filter", "retract", "split",
}


def test_graph_declares_every_phase_of_the_design():
    assert set(EAGLE_GRAPH.phases) == EXPECTED_PHASES
    assert EAGLE_GRAPH.entry == "prefill-extend"
    assert EAGLE_GRAPH.allowed("verify") == ("finalize-tree-path",)
    assert EAGLE_GRAPH.allowed("finalize-tree-path") == ("draft-extend",)
    assert set(EAGLE_GRAPH.allowed("draft-extend")) == {"draft", "decode", "merge", "filter", "retract", "split"}


def _machine_at(phase_name: str) -> tuple[Machine, syn.SyntheticContext]:
    graph = syn.synthetic_eagle_graph()
    m = Machine(graph, validate="strict")
    ctx = syn.SyntheticContext()
    m.advance("prefill-extend", ctx, state=syn.prefill_input([3, 5]))
    m.advance("draft-extend", ctx)
    path = {"draft": ["draft"], "verify": ["draft", "verify"],
            "finalize-tree-path": ["draft", "verify", "finalize-tree-path"]}
    for p in path.get(phase_name, []):
        m.advance(p, ctx)
    return m, ctx


@pytest.mark.parametrize("stuck_in", ["verify", "finalize-tree-path", "draft"])
def test_verify_side_state_handed_to_merge_is_illegal(stuck_in):
    """Seed 004: a stale verify input reached merge_batch. Here it cannot."""
    m, ctx = _machine_at(stuck_in)
    phase_before, state_before = m.phase, m.state
    with pytest.raises(IllegalTransition) as err:
        m.advance("merge", ctx, other=syn.draft_state(1, start_row=9))
    e = err.value
    assert (e.current, e.requested) == (stuck_in, "merge")
    assert e.allowed == EAGLE_GRAPH.allowed(stuck_in)
    assert f"Can't run 'merge' when in {stuck_in!r}; allowed:" in str(e)
    assert m.phase == phase_before and m.state is state_before


def test_merge_rejects_a_verify_result_as_its_other_input():
    m, ctx = _machine_at("draft-extend")
    _, other_ctx = _machine_at("verify")
    stale = syn.verify_result(syn.tree_proposal(syn.draft_state(2)))
    with pytest.raises(SchemaViolation) as err:
        m.advance("merge", ctx, other=stale)
    assert err.value.schema == "DraftState" and err.value.actual == "VerifyResult"
    assert "extra input 'other'" in str(err.value)
    assert m.phase == "draft-extend"


def test_full_iteration_then_finish_everything_then_merge(phase_trace):
    """When every request finishes in one verify no phase is skipped; filter leaves B=0 and a
    later merge works on the empty draft state."""
    m, ctx = _machine_at("finalize-tree-path")
    m.advance("draft-extend", ctx)
    empty = m.advance("filter", ctx, keep=syn.rows([]))
    assert empty.batch_size == 0
    assert sorted(ctx.memory.released) == [1, 2]
    merged = m.advance("merge", ctx, other=syn.draft_state(3, start_row=5))
    assert merged.batch_size == 3
    phase_trace.assert_followed_by("verify", "finalize-tree-path")
    phase_trace.assert_followed_by("finalize-tree-path", "draft-extend")


def test_retract_frees_rows_and_keeps_the_rest():
    m, ctx = _machine_at("draft-extend")
    out = m.advance("retract", ctx, rows=syn.rows([0]))
    assert out.batch_size == 1 and ctx.memory.released == [1]
    assert out.params.req_pool_idx.tolist() == [2]


def test_split_keeps_rows_and_frees_nothing():
    m, ctx = _machine_at("draft-extend")
    out = m.advance("split", ctx, keep=syn.rows([1]))
    assert out.batch_size == 1 and ctx.memory.released == []
    assert out.params.req_pool_idx.tolist() == [2]


def test_every_node_field_of_verify_result_has_a_compacted_counterpart():
    have = {t.name for t in FinalizedPath.__schema__.tensors}
    for name in node_fields(VerifyResult):
        assert accepted_name(name) in have
    assert set(node_fields(VerifyResult)) == {"predict", "features", "logprobs", "top_logprobs", "top_logprob_ids",
                                              "routed_experts"}


def test_a_new_side_output_gets_a_compacted_field_without_code_changes():
    @schema
    class VerifyWithExperts(VerifyResult):
        expert_scores: Int64[torch.Tensor, "B*N E"] = tensor(role=NODE, pad=0)

    out_cls = finalized_schema_for(VerifyWithExperts)
    assert issubclass(out_cls, FinalizedPath)
    spec = {t.name: t for t in out_cls.__schema__.tensors}["accepted_expert_scores"]
    assert spec.dim_text == "B*W E" and spec.role.name == "accepted"
    assert finalized_schema_for(VerifyResult) is FinalizedPath


def test_phase_that_mutates_its_input_is_caught_in_strict_mode():
    import attrs

    from phasegraph.phases.eagle import EDGES
    from phasegraph.statemachine import PhaseGraph

    base = syn.synthetic_eagle_graph()

    def sloppy_decode(state: DraftState, ctx) -> DraftState:
        state.seq_lens.add_(1)  # the SGLang #25015 habit: mutate a shared buffer in place
        return state.replace()

    phases = [attrs.evolve(p, fn=sloppy_decode) if p.name == "decode" else p for p in base]
    g = PhaseGraph("sloppy", phases, EDGES, entry="prefill-extend")
    m = Machine(g, validate="strict")
    ctx = syn.SyntheticContext()
    m.advance("prefill-extend", ctx, state=syn.prefill_input([2]))
    m.advance("draft-extend", ctx)
    before = m.state
    with pytest.raises(PhaseContractViolation, match="mutated its input DraftState in place \\(fields \\['seq_lens'\\]\\)"):
        m.advance("decode", ctx)
    assert m.phase == "draft-extend" and m.state is before


def _one_beam_late(positions):
    late = positions.clone()
    late[1, -1, -1] += 1  # request 1, last step, last beam
    return late


@pytest.mark.parametrize(("corrupt", "shown"), [
    (lambda p: p + 1, "request 0: draft steps ran at [[5, 5], [6, 6]] (step by beam), want [4, 5]"),
    (_one_beam_late, "request 1: draft steps ran at [[6, 6], [7, 8]] (step by beam), want [6, 7]"),
], ids=["every-step", "one-beam"])
def test_seed_001_draft_positions_off_by_one_are_rejected(corrupt, shown):
    """A draft that runs step i at seq_len + i + 1 (SGLang PR #25015), on every beam or on one,
    fails strict validation."""
    import attrs

    from phasegraph.phases.eagle import EDGES
    from phasegraph.statemachine import InvariantViolation, PhaseGraph

    base = syn.synthetic_eagle_graph()

    def off_by_one_draft(state: DraftState, ctx):
        good = syn.tree_proposal(state, N=5, S=3)
        return good.replace(draft_positions=corrupt(good.draft_positions))

    phases = [attrs.evolve(p, fn=off_by_one_draft) if p.name == "draft" else p for p in base]
    m = Machine(PhaseGraph("buggy", phases, EDGES, entry="prefill-extend"), validate="strict")
    ctx = syn.SyntheticContext()
    m.advance("prefill-extend", ctx, state=syn.prefill_input([4, 6]))
    m.advance("draft-extend", ctx)
    with pytest.raises(InvariantViolation) as err:
        m.advance("draft", ctx)
    assert err.value.invariant == "draft step i runs at seq_len + lead + i (SGLang #25015)"
    assert shown in str(err.value)
    assert m.phase == "draft-extend"
    # boundary mode reads no values, so it lets the bug through: strict is what catches it
    m.validation = "boundary"
    m.advance("draft", ctx)


def test_seed_000_bonus_stride_bug_is_an_invariant_violation():
    from phasegraph.statemachine import InvariantViolation

    d = syn.draft_state(3, K=2)
    good = syn.verify_result(syn.tree_proposal(d, N=3, S=3), accept=2)
    B, W = good.accept_index.shape
    N = good.proposal.depth.shape[1]
    predict = torch.arange(B * N) + 100  # distinct tokens, so a wrong row shows
    last = good.accept_index.gather(1, (good.accept_lens - 1)[:, None])[:, 0]
    good = good.replace(predict=predict, bonus_tokens=predict[last])
    good.validate("strict")
    # the bug: bonus read from predict[accept_index] with row stride N instead of W
    flat = predict[good.accept_index.clamp(min=0)].reshape(-1)  # [B*W]
    wrong = flat[torch.arange(B) * N + good.accept_lens - 1]
    assert not torch.equal(wrong, good.bonus_tokens)
    with pytest.raises(InvariantViolation, match="stride W, SGLang #26866"):
        good.replace(bonus_tokens=wrong).validate("strict")


def _bent_depth(t):
    """Node 3 one level deeper than its parent allows, its position moved along (so that only
    the tree's structure is wrong)."""
    depth, positions = t.depth.clone(), t.positions.view(t.depth.shape).clone()
    depth[:, 3] += 1
    positions[:, 3] += 1
    return t.replace(depth=depth, positions=positions.reshape(-1))


def _swapped_siblings(t):
    sib = t.retrieve_next_sibling.clone()
    sib[:, 1], sib[:, 2] = -1, 1  # 2 before 1 among the root's children
    return t.replace(retrieve_next_sibling=sib)


def _second_child_first(t):
    nt = t.retrieve_next_token.clone()
    nt[:, 0] = 2  # the root's first child is 1
    return t.replace(retrieve_next_token=nt)


@pytest.mark.parametrize(("corrupt", "invariant"), [
    (lambda t: t.replace(tree_mask=torch.eye(5, dtype=torch.bool).expand(2, 5, 5).clone()), "tree_mask row j"),
    (_bent_depth, "depth[j] == depth[parent[j]] + 1"),
    (_swapped_siblings, "retrieve_next_sibling"),
    (_second_child_first, "retrieve_next_token"),
], ids=["mask-without-ancestors", "depth-off-its-parent", "siblings-out-of-order", "first-child-skipped"])
def test_a_tree_whose_links_disagree_with_its_parents_fails_strict_validation(corrupt, invariant):
    """The mask, depths and retrieve links verify reads must all say what ``parents`` says: a
    drafter that builds one of them wrong is stopped before the target verifies its tree."""
    from phasegraph.statemachine import InvariantViolation

    good = syn.tree_proposal(syn.draft_state(2, K=2), N=5, S=3)  # parents [-1, 0, 0, 1, 2]
    assert good.parents[0].tolist() == [-1, 0, 0, 1, 2]
    good.validate("strict")
    good.replace(retrieve_next_token=torch.full_like(good.retrieve_next_token, -1)).validate("strict")  # cuts
    with pytest.raises(InvariantViolation) as err:
        corrupt(good).validate("strict")
    assert invariant in err.value.invariant


def test_an_accepted_path_that_jumps_branches_fails_strict_validation():
    from phasegraph.statemachine import InvariantViolation

    good = syn.verify_result(syn.tree_proposal(syn.draft_state(2, K=2), N=5, S=3), accept=2)
    assert good.accept_index[0].tolist() == [0, 1, 3, -1]  # root, its first child, that child's child
    good.validate("strict")
    jumped = good.accept_index.clone()
    jumped[:, 1] += 1  # root -> 2 -> 3, but 3 hangs off 1
    predict_last = good.predict[jumped.gather(1, (good.accept_lens - 1)[:, None])[:, 0]]
    with pytest.raises(InvariantViolation, match="accepted nodes \\[0, 2, 3, -[0-9]+\\]") as err:
        good.replace(accept_index=jumped, bonus_tokens=predict_last).validate("strict")
    assert err.value.invariant == "the accepted path runs from the root, each node a child of the one before"


def _swap_rows(x, a: int, b: int):
    x = x.clone()
    x[a], x[b] = x[b].clone(), x[a].clone()
    return x


@pytest.mark.parametrize(("schema", "corrupt"), [
    ("prefill", lambda s: s.replace(positions=_swap_rows(s.positions, 5, 6))),  # request 1's positions 1 and 2
    ("prefill", lambda s: s.replace(token_req=_swap_rows(s.token_req, 2, 4))),  # a row of request 0 in request 1's
    ("draft-extend", lambda s: s.replace(positions=s.positions.index_add(0, torch.tensor([7]), torch.tensor([1])))),
], ids=["prefill-positions-scrambled", "prefill-row-of-another-request", "draft-extend-position-skipped"])
def test_ragged_rows_out_of_order_fail_strict_validation(schema, corrupt):
    """Only each request's selected row was checked: the positions of the rows before it (where
    a cached prefix starts the prompt's KV) and their requests are checked now too."""
    from phasegraph.statemachine import InvariantViolation

    good = syn.prefill_input([4, 6]) if schema == "prefill" else syn.draft_extend_input([4, 6])
    good.validate("strict")
    with pytest.raises(InvariantViolation, match="rows lie together"):
        corrupt(good).validate("strict")


def test_two_requests_on_one_page_table_row_are_an_invariant_violation():
    """Decode and the draft steps run rotary + attention as one kernel on the promise that every
    query has its own row (AttentionMetadata.one_query_per_row): a batch whose requests share a
    row would read keys before they are written, so strict mode rejects it."""
    from phasegraph.statemachine import InvariantViolation

    d = syn.draft_state(3, K=2)
    d.validate("strict")
    rows = d.params.req_pool_idx.clone()
    rows[2] = rows[0]
    bad = d.replace(params=d.params.replace(req_pool_idx=rows))
    with pytest.raises(InvariantViolation, match=f"row {int(rows[0])} is held by two requests"):
        bad.validate("strict")
    bad.validate("boundary")  # no value reads there


def test_a_phase_that_builds_params_with_a_shared_row_fails_strict_validation():
    """Nested schemas are checked where a phase builds a new one: a decode that hands back
    params whose requests share a row fails strict mode at its output."""
    import attrs

    from phasegraph.phases.eagle import EDGES
    from phasegraph.statemachine import InvariantViolation, PhaseGraph

    start = syn.draft_state(3, K=2)
    rows = start.params.req_pool_idx.clone()
    rows[1] = rows[2]
    shared = start.params.replace(req_pool_idx=rows)

    def decode_with_new_params(state: DraftState, ctx):
        return state.replace(params=shared)

    phases = [attrs.evolve(p, fn=decode_with_new_params) if p.name == "decode" else p
              for p in syn.synthetic_eagle_graph()]
    m = Machine(PhaseGraph("buggy", phases, EDGES, entry="prefill-extend"), validate="strict")
    m.reset("decode", start)
    with pytest.raises(InvariantViolation, match="held by two requests"):
        m.advance("decode", syn.SyntheticContext())
