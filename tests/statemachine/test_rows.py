"""Row operations driven by the schema declarations: select (filter, retract), concatenate
(merge) and pad (CUDA graph buckets). A field added to a schema is carried by every one of them
with no other edit (SGLang #26866: a per-request side output copied field by field, and
forgotten in one place)."""

from __future__ import annotations

import pytest
import torch
from jaxtyping import Float32, Int64

from phasegraph.phases.filter import filter_batch
from phasegraph.phases.merge import merge
from phasegraph.phases.retract import retract
from phasegraph.phases.schemas import NODE, REQUEST, DraftState
from phasegraph.runtime.cuda_graphs import fill_neutral, pad_schema
from phasegraph.statemachine import (
    InvalidSchema,
    Pad,
    PaddingViolation,
    PhaseGraphError,
    Schema,
    schema,
    tensor,
)
from phasegraph.statemachine.rows import check_padding, concat_rows, select_rows
from phasegraph.testing import synthetic as syn

Tensor = torch.Tensor


@schema
class DraftStateWithAdapter(DraftState):
    """A user's extension of the persistent state: one new per-request field, nothing else."""

    adapter: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=-1, doc="LoRA adapter of the request")
    scores: Float32[Tensor, "B A"] | None = tensor(role=REQUEST, pad=0.0, default=None)


def with_adapter(d: DraftState, first: int) -> DraftStateWithAdapter:
    fields = {t.name: getattr(d, t.name) for t in DraftState.__schema__.tensors}
    B = d.seq_lens.shape[0]
    return DraftStateWithAdapter(params=d.params, adapter=torch.arange(first, first + B), **fields)


def test_a_new_per_request_field_is_carried_by_merge_filter_retract_and_padding():
    ctx = syn.SyntheticContext()
    a = with_adapter(syn.draft_state(3, K=2), 100)
    b = with_adapter(syn.draft_state(2, K=2, start_row=10), 200)
    merged = merge.fn(a, ctx, other=b)
    assert type(merged) is DraftStateWithAdapter
    assert merged.adapter.tolist() == [100, 101, 102, 200, 201]
    kept = filter_batch.fn(merged, ctx, keep=syn.rows([0, 3, 4]))
    assert kept.adapter.tolist() == [100, 200, 201]
    assert kept.params.req_pool_idx.tolist() == [1, 10, 11]
    left = retract.fn(kept, ctx, rows=syn.rows([1]))
    assert left.adapter.tolist() == [100, 201] and ctx.memory.released == [2, 3, 10]
    static = pad_schema(left, 2, 4)
    assert static.adapter.tolist() == [100, 201, -1, -1]  # the declared pad
    assert static.params.req_pool_idx.tolist()[2:] == [0, 0]


def test_select_and_concat_keep_every_field_and_nested_params():
    d = syn.draft_state(4, K=3, hd=5)
    d = d.replace(emitted=d.bonus_tokens.clone(), bonus_logprobs=torch.rand(4),
                  bonus_top_logprobs=torch.rand(4, 3), bonus_top_ids=torch.randint(0, 32, (4, 3)),
                  output_counts=torch.randint(0, 3, (4, 32), dtype=torch.int32),
                  prompt_mask=torch.rand(4, 32) > 0.5, bonus_routed_experts=torch.randint(0, 8, (4, 2, 2)))
    picked = select_rows(d, torch.tensor([2, 0]))
    for t in DraftState.__schema__.tensors:
        assert torch.equal(getattr(picked, t.name), getattr(d, t.name)[[2, 0]]), t.name
    assert torch.equal(picked.params.seed, d.params.seed[[2, 0]])
    again = concat_rows(picked, select_rows(d, torch.tensor([1, 3])))
    for t in DraftState.__schema__.tensors:
        assert torch.equal(getattr(again, t.name), getattr(d, t.name)[[2, 0, 1, 3]]), t.name


def test_concat_widens_a_private_width_with_the_pad_and_refuses_a_shared_one():
    a = syn.draft_state(2, K=2)
    b = syn.draft_state(1, K=2, start_row=5)
    b = b.replace(params=b.params.replace(stop_ids=torch.tensor([[7, 8, 9]])))
    merged = concat_rows(a, b)
    assert merged.params.stop_ids.tolist() == [[-1, -1, -1], [-1, -1, -1], [7, 8, 9]]
    with pytest.raises(PhaseGraphError, match=r"topk_p \[B K\] differ: \[2\] and \[4\]"):
        concat_rows(a, syn.draft_state(1, K=4))


def test_concat_of_optional_fields_set_on_one_side():
    a, b = syn.draft_state(2, K=2), syn.draft_state(1, K=2, hd=None, start_row=5)
    with pytest.raises(PhaseGraphError, match="hidden is set in one batch and not in the other"):
        concat_rows(a, b)
    empty = select_rows(b, torch.tensor([], dtype=torch.int64))
    assert torch.equal(concat_rows(empty, a).hidden, a.hidden)  # the empty side lacks it: fine
    decoded = a.replace(emitted=a.bonus_tokens.clone())
    assert concat_rows(decoded, syn.draft_state(1, K=2)).emitted is None  # per_step: dropped


@schema
class DraftStateWithCounts(DraftState):
    """State of a feature some batches use: absent means its pad in every row."""

    counts: Int64[Tensor, "B C"] | None = tensor(role=REQUEST, pad=0, absent_is_pad=True, default=None)


def test_concat_fills_an_absent_is_pad_field_with_its_pad_on_the_side_that_lacks_it():
    def with_counts(d: DraftState, counts: Tensor | None) -> DraftStateWithCounts:
        fields = {t.name: getattr(d, t.name) for t in DraftState.__schema__.tensors}
        return DraftStateWithCounts(params=d.params, counts=counts, **fields)

    a = with_counts(syn.draft_state(2, K=2), torch.tensor([[1, 2, 3], [4, 5, 6]]))
    b = with_counts(syn.draft_state(1, K=2, start_row=5), None)
    assert concat_rows(a, b).counts.tolist() == [[1, 2, 3], [4, 5, 6], [0, 0, 0]]
    assert concat_rows(b, a).counts.tolist() == [[0, 0, 0], [1, 2, 3], [4, 5, 6]]
    assert concat_rows(b, b).counts is None  # absent on both sides: still absent
    none = select_rows(a, torch.tensor([], dtype=torch.int64))
    assert concat_rows(none, b).counts is None  # the empty side's field says nothing of b's rows


def test_absent_is_pad_needs_an_optional_field_with_a_constant_pad():
    with pytest.raises(InvalidSchema, match="absent_is_pad but is not optional"):
        @schema
        class Required(Schema):
            x: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=0, absent_is_pad=True)
    with pytest.raises(InvalidSchema, match="absent_is_pad needs a constant pad"):
        @schema
        class Uniform(Schema):
            x: Float32[Tensor, "B K"] | None = tensor(role=REQUEST, pad=Pad.UNIFORM, absent_is_pad=True,
                                                     default=None)


def test_row_numbers_are_renumbered_by_select_and_concat():
    """A field of row numbers (Pad.index) points into its own request's block wherever the
    request moves."""
    d = syn.draft_state(3, K=2)
    ext = syn.finalized_path(syn.verify_result(syn.tree_proposal(d, N=5, S=3), accept=2))
    picked = select_rows(ext, torch.tensor([2]))
    assert picked.token_req.tolist() == [0] * 4
    assert picked.select_index.tolist() == [int(ext.select_index[2]) - 2 * 4]
    assert picked.accept_index[0, 0].item() == 0  # request 2's root, node row 10, is row 0 now
    both = concat_rows(picked, picked)
    assert both.token_req.tolist() == [0] * 4 + [1] * 4
    assert both.accept_index[:, 0].tolist() == [0, 5]


def test_padding_points_row_numbers_into_the_padded_requests_own_rows():
    d = syn.draft_state(3, K=2)
    tree = syn.tree_proposal(d, N=5, S=3)
    path = syn.finalized_path(syn.verify_result(tree, accept=2))
    static = pad_schema(path, 3, 5)  # W = 4 rows per request, N = 5 nodes
    assert static.token_req[12:].tolist() == [3] * 4 + [4] * 4
    assert static.select_index[3:].tolist() == [12, 16]
    assert static.accept_index[3:].tolist() == [[15, 16, 17, 18], [20, 21, 22, 23]]
    assert static.params.req_pool_idx[3:].tolist() == [0, 0]
    padded_tree = pad_schema(tree, 3, 4)
    assert padded_tree.retrieve_index[3].tolist() == [15, 16, 17, 18, 19]
    assert torch.equal(padded_tree.tree_mask[3], torch.eye(5, dtype=torch.bool))
    assert torch.allclose(pad_schema(d, 3, 4).topk_p[3], torch.full((2,), 0.5))
    fill_neutral(static)  # every row padded: each request numbers only its own rows
    assert static.token_req.tolist() == torch.arange(5).repeat_interleave(4).tolist()
    assert (static.params.req_pool_idx == 0).all()


def test_check_padding_names_a_padded_row_that_addresses_a_live_request():
    d = syn.draft_state(3, K=2)
    path = syn.finalized_path(syn.verify_result(syn.tree_proposal(d, N=5, S=3), accept=2))
    static = pad_schema(path, 3, 4)
    check_padding(static, 3)
    static.token_req[12:].fill_(0)  # a neutral fill of 0 is request 0, a live one
    with pytest.raises(PaddingViolation, match=r"FinalizedPath\.token_req.*request row 0, one of the 3 live"):
        check_padding(static, 3, "graph input")
    static = pad_schema(path, 3, 4)
    static.accept_index[3, 0] = 2  # node 2 of request 0
    with pytest.raises(PaddingViolation, match="accept_index"):
        check_padding(static, 3)
    static = pad_schema(path, 3, 4)
    static.params.req_pool_idx[3] = 2  # a padded request on a live KV row
    with pytest.raises(PaddingViolation, match="req_pool_idx.*not the reserved row 0"):
        check_padding(static, 3)


def test_a_role_field_must_declare_its_padding():
    with pytest.raises(InvalidSchema, match="'nodes' has role 'node' but declares no pad="):
        @schema
        class _Forgot(Schema):
            nodes: Int64[Tensor, "B*N"] = tensor(role=NODE)

    with pytest.raises(InvalidSchema, match="declares pad= but no role"):
        @schema
        class _NoRole(Schema):
            x: Int64[Tensor, "B"] = tensor(pad=0)

    with pytest.raises(InvalidSchema, match="Pad.IDENTITY needs two dims"):
        @schema
        class _FlatMask(Schema):
            x: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=Pad.IDENTITY)
