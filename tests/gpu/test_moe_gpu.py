"""MoE targets on the GPU under real CUDA graphs: routed experts under speculation equal the
target alone's, token for token.

    python -m pytest -m gpu tests/gpu/test_moe_gpu.py -q

Tiny Qwen3-MoE (layer 1 dense) and Mixtral targets, float32: the target alone with CUDA graphs
equals transformers' generate (run on the CPU); speculation (the target as its own standalone
draft, whose accepted tree paths run through nodes out of node order, and an EAGLE-3 head; chain
and tree; page sizes 1 and 16; one graph per iteration or per phase) reports the same tokens and
exactly the target alone's routed experts (SGLang #26866). A capture runs the experts through
``batched_mm`` in float32 and ``grouped_mm`` in bfloat16 (transformers' eager loop and torch's
float32 grouped product synchronise with the host); the bfloat16 run checks that it captures.
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.testing.checkpoints import write_eagle3_draft, write_hf_target
from tests.engine.support import SHAPES, SMALL, hf_greedy, small_config

pytestmark = pytest.mark.gpu

ARCHS = ("qwen3_moe", "mixtral")
NEW_TOKENS = 32
ROUTED = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, return_routed_experts=True)


def prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, SMALL["vocab_size"], (n,), generator=gen).tolist() for n in (1, 9, 23, 14)]


@pytest.fixture(scope="module", params=ARCHS)
def moe(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    target = write_hf_target(root / "target", arch, **small_config(arch))
    drafts = {"self": target, "eagle3": write_eagle3_draft(root / "eagle3", target)}
    want = hf_greedy(target, prompts(), NEW_TOKENS)
    alone = run(target, None, "none", None, "float32")
    assert [o.token_ids for o in alone] == want
    return target, drafts, alone


def run(target, draft, method, shape, dtype, page_size=16, scope="iteration"):
    """Two generate calls of the routed batch with CUDA graphs (the first warms each bucket up,
    the second captures and replays); the second's outputs, each token's experts checked in range."""
    spec = SpecConfig(method="none") if shape is None else SpecConfig(method=method, **SHAPES[shape])
    engine = Engine.from_pretrained(target, draft, spec=spec, dtype=dtype, device="cuda", page_size=page_size,
                                    kv_pool_tokens=8192, cuda_graphs=True, graph_scope=scope,
                                    check_every_step=True)
    config = engine.target.model.config
    before = getattr(config, "_experts_implementation", None)
    outs = []
    for _ in range(2):
        outs = engine.generate(prompts(), ROUTED)
    assert sum(p["replays"] for p in engine.graph_runner.stats().values()) > 0
    assert getattr(config, "_experts_implementation", None) == before  # switched for captures only
    experts = torch.tensor([o.routed_experts for o in outs])  # [4, NEW_TOKENS, M, k]
    assert experts.shape == (4, NEW_TOKENS, engine.target.num_moe_layers, config.num_experts_per_tok)
    assert 0 <= int(experts.min()) and int(experts.max()) < config.num_experts
    return outs


@pytest.mark.parametrize("scope", ["iteration", "phase"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["self", "eagle3"])
def test_graphed_speculation_reports_the_routed_experts_of_the_target_alone(moe, kind, shape, page_size, scope):
    target, drafts, alone = moe
    outs = run(target, drafts[kind], "standalone" if kind == "self" else kind, shape, "float32", page_size, scope)
    for i, (got, want) in enumerate(zip(outs, alone, strict=True)):
        assert got.token_ids == want.token_ids, f"request {i}: tokens differ"
        assert got.routed_experts == want.routed_experts, f"request {i}: routed experts differ"
    if kind == "self":
        assert max(n for o in outs for n in o.stats.accept_lengths) >= 3


def test_bfloat16_captures_the_grouped_experts(moe):
    target, drafts, _ = moe
    run(target, None, "none", None, "bfloat16")
    run(target, drafts["self"], "standalone", "tree", "bfloat16")
