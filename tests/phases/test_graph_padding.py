"""CUDA-graph padding on the CPU: the graph runner's emulation mode pads every batch to its
bucket, fills the padded rows with neutral values, replays by rerunning the phase on the static
buffers and slices the outputs back. Outputs must equal target-only greedy for batch sizes that
sit exactly on a bucket and between buckets, and padded rows must never touch a real request.
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.cuda_graphs import (
    InputCopier,
    copy_inputs_in,
    copy_into_static,
    pad_schema,
)
from phasegraph.runtime.engine import Engine
from phasegraph.testing import synthetic as syn
from phasegraph.testing.drafters import NoisyOracleDraft
from tests.phases.lossless_support import prompts, reference, run_spec, tiny_target


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize(("topk", "steps", "nodes"), [(1, 3, 4), (4, 3, 12)])
def test_emulated_graphs_are_lossless_on_and_between_buckets(batch, topk, steps, nodes):
    spec = SpecConfig(method="eagle", num_steps=steps, topk=topk, num_draft_tokens=nodes)
    outs, ref, engine, _ = run_spec(
        NoisyOracleDraft, spec, 4, batch,
        engine_kw={"cuda_graphs": "emulate", "graph_buckets": (1, 2, 4, 8), "graph_scope": "phase"},
    )
    assert outs == list(ref)
    stats = engine.graph_runner.stats()
    assert stats["verify"]["replays"] > 0 and stats["draft"]["replays"] > 0
    assert stats["draft-extend"]["replays"] > 0  # after decode; prefill's ragged rows run eagerly
    assert stats["draft-extend"]["eager"] > 0
    # finalize moves KV (not idempotent): warmed up by one real eager call per bucket, then graphed
    assert stats["finalize-tree-path"]["replays"] > 0
    assert set(stats["finalize-tree-path"]["eager_reasons"]) == {"warm-up call"}


@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize(("topk", "steps", "nodes"), [(1, 3, 4), (4, 3, 12)])
def test_emulated_iteration_graph_is_lossless(batch, topk, steps, nodes):
    """One graph per iteration: every phase after the bucket's warm-up iteration is served from
    the replay, and the output still equals target-only greedy."""
    spec = SpecConfig(method="eagle", num_steps=steps, topk=topk, num_draft_tokens=nodes)
    outs, ref, engine, _ = run_spec(
        NoisyOracleDraft, spec, 4, batch,
        engine_kw={"cuda_graphs": "emulate", "graph_buckets": (1, 2, 4, 8), "graph_scope": "iteration"},
    )
    assert outs == list(ref)
    it = engine.graph_runner.stats()["iteration"]
    assert it["replays"] > 0 and it["graphs"] >= 1
    served = it["served"]
    assert served["draft"] == served["verify"] == served["finalize-tree-path"] == served["draft-extend"] > 0
    # phase by phase only: one warm-up iteration per bucket (and shape), draft-extend after prefill
    warmed = engine.graph_runner.iteration.warmed
    assert it["fallback"]["draft"] == len(warmed) >= it["graphs"]
    assert it["fallback"]["verify"] == it["fallback"]["draft"]


def test_iteration_graph_serves_only_the_object_it_returned():
    """verify, finalize and draft-extend are served from a replay only when their input is the
    object the previous phase of that replay returned; anything else takes the per-phase path."""
    from phasegraph.runtime.graph_runner import GraphRunner
    from phasegraph.runtime.iteration_graph import IterationGraph

    calls = []
    fallback = {n: (lambda s, c, n=n, **kw: calls.append(n) or f"fallback {n}")
                for n in ("draft", "verify", "finalize-tree-path", "draft-extend")}
    it = IterationGraph(GraphRunner((1,), emulate=True), {}, fallback)
    mine, other = object(), object()
    it._pending = ("verify", mine, None, 1)
    assert it.phase_fn("verify")(other, None) == "fallback verify"  # not the replay's object
    assert it._pending is None  # and the pending replay is dropped, never served later
    assert it.phase_fn("verify")(mine, None) == "fallback verify"
    it._pending = ("verify", mine, None, 1)
    assert it.phase_fn("draft-extend")(mine, None) == "fallback draft-extend"  # wrong phase
    assert calls == ["verify", "verify", "draft-extend"] and it.served["verify"] == 0


def test_emulated_graphs_baseline_decode():
    eng = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=8, kv_pool_tokens=8192,
                 cuda_graphs="emulate", graph_buckets=(1, 2, 4, 8), check_every_step=True)
    outs = eng.generate(prompts(3), SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert [tuple(o.token_ids) for o in outs] == list(reference(3))
    assert eng.graph_runner.stats()["decode"]["replays"] > 0


def test_padded_rows_are_neutral_and_overwrite_stale_garbage():
    d = syn.draft_state(3, K=4)
    static = pad_schema(d, 3, 8)
    assert torch.equal(static.seq_lens[:3], d.seq_lens)
    assert (static.params.req_pool_idx[3:] == 0).all()  # the reserved row: padded rows write page 0
    assert (static.seq_lens[3:] == 1).all() and torch.isfinite(static.topk_p).all()
    # garbage left by an earlier batch is replaced on the next copy
    static.topk_p[3:].fill_(float("nan"))
    static.bonus_tokens[3:].fill_(10**9)
    static.params.req_pool_idx[3:].fill_(5)
    copy_into_static(static, d, 3, 8)
    assert torch.isfinite(static.topk_p).all()
    assert (static.bonus_tokens[3:] == 0).all() and (static.params.req_pool_idx[3:] == 0).all()


def test_a_planned_input_copier_copies_each_new_input_and_refills_the_padding():
    """The copier a replay uses is planned on the first input of a batch size and then serves
    every later input of that size: it copies *their* values (nested params included), into the
    first rows only, and refills the padded rows each time."""
    first, second = syn.draft_state(3, K=4), syn.draft_state(3, K=4)
    second.seq_lens.add_(7)
    second.topk_p.mul_(0.5)
    second.params.req_pool_idx.add_(3)
    static = pad_schema(first, 3, 8)
    copiers: dict[int, InputCopier] = {}
    copy_inputs_in(copiers, static, first, 3, 8)
    planned = copiers[3]
    static.topk_p[3:].fill_(float("nan"))  # stale rows of an earlier, bigger batch
    static.params.req_pool_idx[3:].fill_(5)
    copy_inputs_in(copiers, static, second, 3, 8)
    assert copiers[3] is planned  # planned once per batch size
    assert torch.equal(static.seq_lens[:3], second.seq_lens) and (static.seq_lens[3:] == 1).all()
    assert torch.equal(static.topk_p[:3], second.topk_p) and torch.isfinite(static.topk_p).all()
    assert torch.equal(static.params.req_pool_idx[:3], second.params.req_pool_idx)
    assert (static.params.req_pool_idx[3:] == 0).all()
    # the same result as copying field by field
    reference = pad_schema(first, 3, 8)
    copy_into_static(reference, second, 3, 8)
    for (name, got), (_, want) in zip(static.tensors(), reference.tensors(), strict=True):
        assert torch.equal(got, want), name
    # another batch size in the same bucket gets its own plan
    copy_inputs_in(copiers, static, syn.draft_state(2, K=4), 2, 8)
    assert set(copiers) == {2, 3} and (static.params.req_pool_idx[2:] == 0).all()


def test_padded_tree_rows_see_only_themselves():
    d = syn.draft_state(2, K=2)
    tree = syn.tree_proposal(d, N=5, S=3)
    static = pad_schema(tree, 2, 4)
    assert torch.equal(static.tree_mask[:2], tree.tree_mask)
    eye = torch.eye(5, dtype=torch.bool)
    assert all(torch.equal(static.tree_mask[b], eye) for b in (2, 3))
    assert (static.draft.params.req_pool_idx[2:] == 0).all()


def test_every_batch_the_engine_can_form_has_a_bucket():
    for max_batch in (1, 5, 13, 64, 100):
        eng = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=max_batch,
                     kv_pool_tokens=4096, cuda_graphs="emulate")
        runner = eng.graph_runner
        assert all(runner.bucket_for(b) is not None for b in range(1, max_batch + 1))
        assert runner.buckets[-1] == max_batch
