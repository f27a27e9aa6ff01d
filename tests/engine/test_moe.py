"""Mixture-of-experts targets (Qwen3-MoE, Mixtral) and ``SamplingParams(return_routed_experts=True)``.

Greedy outputs equal transformers' ``generate``, alone and under speculation (EAGLE-3 head and
standalone drafts, chain and tree). The routed experts of each generated token are those of the
forward row whose logits gave it: transformers' own routers over the generated sequence for the
target alone, and under speculation exactly the target alone's, token for token, over the tree
matrix (chain and tree, page sizes 1 and 16, CUDA graphs emulated, forced retraction, overlap).
The target as its own standalone draft accepts long paths that run through tree nodes out of node
order, so experts left in raw node order (SGLang #26866, planted below) fail the comparison.
"""

from __future__ import annotations

import functools

import pytest
import torch

from phasegraph.phases import finalize_tree_path as finalize_module
from phasegraph.runtime.errors import InvalidRequest
from phasegraph.statemachine import InvariantViolation
from tests.engine.support import (
    MOE_ARCHS,
    NEW_TOKENS,
    SHAPES,
    arch_bundle,
    assert_all_free,
    engine_for,
    greedy,
)
from tests.runtime.test_target_parity import hf_routed_experts as hf_router_rows

ROUTED = greedy(return_routed_experts=True)


@functools.cache
def _hf_model(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


def hf_routed_experts(target, ids: list[int]) -> list[list[list[int]]]:
    """Per row of ``ids``, the experts each MoE layer of transformers' model chooses, [len(ids)][M][k]."""
    return hf_router_rows(_hf_model(target), ids).tolist()


def _alone(bundle, page_size: int = 1):
    return engine_for(bundle, "none", page_size=page_size).generate([list(p) for p in bundle.prompts], ROUTED)


@functools.cache
def _alone_outputs(root: str, arch: str):
    from pathlib import Path

    return _alone(arch_bundle(Path(root), arch))


def assert_same_routes(got, want) -> None:
    """Same tokens, and the same experts per token, for every request."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i}: tokens differ"
        assert len(g.routed_experts) == len(g.token_ids)
        for t, (ge, we) in enumerate(zip(g.routed_experts, w.routed_experts, strict=True)):
            assert ge == we, f"request {i}, token {t}: experts {ge} != the target alone's {we}"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_target_alone_equals_transformers_with_its_routers(engine_root, arch, page_size):
    bundle = arch_bundle(engine_root, arch)
    engine = engine_for(bundle, "none", page_size=page_size)
    assert engine.target.fused_reason.startswith("layer 0 is a mixture of experts")
    assert engine.target.capture_reason is None
    outs = engine.generate([list(p) for p in bundle.prompts], ROUTED)
    layers = {"qwen3_moe": 2, "mixtral": 3}[arch]  # Qwen3-MoE's layer 1 is dense
    for p, o, want in zip(bundle.prompts, outs, bundle.reference, strict=True):
        assert o.token_ids == list(want)
        assert [len(e) for e in o.routed_experts] == [layers] * NEW_TOKENS
        assert all(len(x) == 2 for e in o.routed_experts for x in e)
        # token i came from the logits of row len(p) - 1 + i of the sequence
        rows = hf_routed_experts(bundle.target, list(p) + o.token_ids)
        assert o.routed_experts == rows[len(p) - 1 : len(p) - 1 + NEW_TOKENS]
    assert_all_free(engine)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["eagle3", "standalone", "self"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_speculation_equals_transformers(engine_root, arch, kind, shape):
    bundle = arch_bundle(engine_root, arch)
    method = "standalone" if kind == "self" else kind
    engine = engine_for(bundle, method, draft=kind, page_size=16 if shape == "tree" else 1, **SHAPES[shape])
    outs = engine.generate([list(p) for p in bundle.prompts], greedy())
    assert [o.token_ids for o in outs] == [list(r) for r in bundle.reference]
    assert all(o.routed_experts is None for o in outs)
    if kind == "self":  # multi-token paths were accepted
        assert max(n for o in outs for n in o.stats.accept_lengths) >= 3
    assert_all_free(engine)


@pytest.mark.parametrize("cuda_graphs", [None, "emulate"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["self", "eagle3"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_speculation_reports_the_routed_experts_of_the_target_alone(
    engine_root, arch, kind, shape, page_size, cuda_graphs
):
    bundle = arch_bundle(engine_root, arch)
    want = _alone_outputs(str(engine_root), arch)
    method = "standalone" if kind == "self" else kind
    engine = engine_for(bundle, method, draft=kind, page_size=page_size, cuda_graphs=cuda_graphs,
                        max_batch_size=4, graph_buckets=(1, 2, 4), **SHAPES[shape])
    for _ in range(2 if cuda_graphs else 1):  # emulated graphs: warm-up, then capture and replay
        assert_same_routes(engine.generate([list(p) for p in bundle.prompts], ROUTED), want)
    if cuda_graphs:
        assert sum(s.get("replays", 0) for s in engine.graph_runner.stats().values()) > 0
    assert_all_free(engine)


@pytest.mark.parametrize(("kind", "shape"), [("none", None), ("self", "tree"), ("eagle3", "tree"), ("self", "chain")])
def test_sampled_requests_report_the_routers_of_the_rows_that_gave_their_tokens(engine_root, kind, shape):
    """Sampled outputs differ between runs, so each is checked against transformers' routers over
    its own sequence: token i's experts are those of row len(prompt) - 1 + i."""
    bundle = arch_bundle(engine_root, "qwen3_moe")
    method = {"none": "none", "self": "standalone", "eagle3": "eagle3"}[kind]
    engine = engine_for(bundle, method, draft=None if kind == "none" else kind, page_size=4,
                        **({} if shape is None else SHAPES[shape]))
    params = [greedy(return_routed_experts=True, temperature=0.9, top_k=20, seed=40 + i) for i in range(4)]
    outs = engine.generate([list(p) for p in bundle.prompts], params)
    for p, o in zip(bundle.prompts, outs, strict=True):
        rows = hf_routed_experts(bundle.target, list(p) + o.token_ids)
        assert o.routed_experts == rows[len(p) - 1 : len(p) - 1 + len(o.token_ids)]
    if kind == "self":
        assert max(n for o in outs for n in o.stats.accept_lengths) >= 3


def test_step_deltas_carry_the_routed_experts_through_forced_retraction_and_overlap(engine_root):
    """Deltas add up to the output; a request retracted twice mid-run and resumed (its prefill
    recomputes its committed rows) reports the experts of the run that was never retracted, and
    a request that did not ask gets none."""
    bundle = arch_bundle(engine_root, "qwen3_moe")
    want = _alone_outputs(str(engine_root), "qwen3_moe")
    engine = engine_for(bundle, "standalone", draft="self", page_size=16, overlap=True,
                        check_every_step=True, **SHAPES["tree"])
    for i, p in enumerate(bundle.prompts):
        engine.add_request(f"r{i}", list(p), ROUTED if i != 3 else greedy())
    streamed = {f"r{i}": [] for i in range(4)}
    outputs, steps = {}, 0
    while engine.has_unfinished():
        for d in engine.step():
            if d.request_id == "r3":
                assert d.routed_experts is None
            else:
                assert len(d.routed_experts) == len(d.new_token_ids)
                streamed[d.request_id] += [[list(x) for x in e] for e in d.routed_experts]
            if d.output is not None:
                outputs[d.request_id] = d.output
        steps += 1
        if steps in (2, 4):
            assert engine.retract("r1")
    assert outputs["r1"].stats.retractions == 2
    assert outputs["r3"].routed_experts is None and outputs["r3"].token_ids == want[3].token_ids
    got = [outputs[f"r{i}"] for i in range(3)]
    assert_same_routes(got, want[:3])
    for i in range(3):
        assert streamed[f"r{i}"] == outputs[f"r{i}"].routed_experts
    assert_all_free(engine)


def _raw_node_order(real):
    """finalize's compaction, except the routed experts stay in raw node order: the path's i-th
    entry is node i of the request, not node accept_index[b, i] (SGLang #26866)."""

    def compact(x, accept_index):
        if x.dtype != torch.int64 or x.dim() != 3:  # [B*N, M, Ke] routed experts only
            return real(x, accept_index)
        B, W = accept_index.shape
        return x.view(B, -1, *x.shape[1:])[:, :W].reshape(B * W, *x.shape[1:])

    return compact


def test_experts_left_in_raw_node_order_fail_the_comparison(engine_root, monkeypatch):
    bundle = arch_bundle(engine_root, "mixtral")
    want = _alone_outputs(str(engine_root), "mixtral")
    monkeypatch.setattr(finalize_module, "compact_to_front", _raw_node_order(finalize_module.compact_to_front))
    # boundary validation skips the FinalizedPath invariant that catches it first (below)
    engine = engine_for(bundle, "standalone", draft="self", validate="boundary", **SHAPES["tree"])
    got = engine.generate([list(p) for p in bundle.prompts], ROUTED)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]  # only the experts moved
    with pytest.raises(AssertionError, match="experts .* != the target alone's"):
        assert_same_routes(got, want)
    strict = engine_for(bundle, "standalone", draft="self", validate="strict", **SHAPES["tree"])
    with pytest.raises(InvariantViolation, match="accepted_routed_experts is not compacted"):
        strict.generate([list(p) for p in bundle.prompts], ROUTED)


def test_a_dense_target_refuses_routed_experts_before_anything_runs(engine_root):
    bundle = arch_bundle(engine_root, "llama")
    engine = engine_for(bundle, "eagle3", **SHAPES["tree"])
    prompts = [list(p) for p in bundle.prompts[:2]]
    with pytest.raises(InvalidRequest, match="return_routed_experts=True needs a mixture-of-experts target"):
        engine.generate(prompts, [greedy(), ROUTED])
    assert not engine.has_unfinished()
    engine.add_request("good", prompts[0], greedy())
    with pytest.raises(InvalidRequest, match="llama target routes no token"):
        engine.add_request("bad", prompts[1], ROUTED)
    outs = []
    while engine.has_unfinished():
        outs += [d.output for d in engine.step() if d.output is not None]
    assert [o.request_id for o in outs] == ["good"]
    assert outs[0].token_ids == list(bundle.reference[0])
    assert_all_free(engine)


def test_return_routed_experts_must_be_a_bool():
    from phasegraph.runtime.config import SamplingParams

    with pytest.raises(InvalidRequest, match="return_routed_experts must be True or False"):
        SamplingParams(return_routed_experts="yes")


def test_layers_that_cannot_be_captured_refuse_cuda_graphs(engine_root, monkeypatch):
    """A transformers without the experts interface loops over the experts hit on the host:
    cuda_graphs=True is refused naming why (emulated graphs, which capture nothing, still run)."""
    from phasegraph.runtime.errors import InvalidConfig
    from phasegraph.runtime.models import target as target_module

    monkeypatch.setattr(target_module, "capture_experts", lambda model: (None, "no experts interface"))
    bundle = arch_bundle(engine_root, "mixtral")
    with pytest.raises(InvalidConfig, match="cannot capture the target's layers: no experts interface"):
        engine_for(bundle, "none", cuda_graphs=True)
    with pytest.raises(InvalidConfig, match="cannot capture the target's layers"):
        engine_for(bundle, "standalone", draft="self", cuda_graphs=True, **SHAPES["chain"])
    engine = engine_for(bundle, "none", cuda_graphs="emulate")
    assert engine.target.capture_reason == "no experts interface"
    assert engine.generate([list(bundle.prompts[0])], greedy())[0].token_ids == list(bundle.reference[0])
