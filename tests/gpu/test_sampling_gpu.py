"""Penalties, logit bias, min_p and top logprobs on the GPU with CUDA graphs (issue 61), fp32.

    python -m pytest -m gpu tests/gpu/test_sampling_gpu.py -q

The per-node penalties of a random tree on CUDA tensors equal the CPU reference's; greedy
decoding with penalties under a tree, with graphs of the iteration (or of each phase) and of
prefill, equals the target alone without graphs, and its top and prompt logprobs agree within
1e-5.

On the GPU (Triton kernels, CUDA graphs, overlap scheduling): a target whose logits stop being
finite fails only the request that reached them, which keeps its clean prefix, and a draft
whose logits are not finite only lowers tau, and says so once (tests/engine/test_nonfinite_logits.py is the CPU
version, with the torch references)."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels import build_tree
from phasegraph.kernels.penalties import apply_penalties
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import RequestFailed
from tests.engine import support
from tests.engine.test_nonfinite_logits import (
    CLEAN_TOKENS,
    GREEDY,
    LONG,
    POISON_AT,
    SAMPLED,
    SHORT,
    generate_warned,
    poison_draft,
    poisoned_forward,
)
from tests.gpu.test_cuda_graphs import _noisy_self_draft, _prompts, _target

pytestmark = pytest.mark.gpu

TOL = 1e-5


def test_per_node_penalties_on_cuda_equal_the_cpu():
    g = torch.Generator().manual_seed(0)
    B, N, V = 8, 12, 1000
    parents = torch.stack([
        torch.cat([torch.tensor([-1]), (torch.rand(N - 1, generator=g) * torch.arange(1, N)).long()])
        for _ in range(B)
    ])
    tree = build_tree(torch.randint(0, 20, (B,), generator=g), torch.randint(0, 20, (B, N - 1), generator=g),
                      parents, torch.zeros(B, dtype=torch.int64))  # tokens below 20: they repeat
    args = (
        torch.randn(B * N, V, generator=g) * 5,
        torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32),
        torch.rand(B, V, generator=g) > 0.9,
        0.5 + torch.rand(B, generator=g),
        4 * torch.rand(B, generator=g) - 2,
        4 * torch.rand(B, generator=g) - 2,
        torch.randn(B, V, generator=g),
        tree.draft_tokens,
        tree.tree_mask,
    )
    cpu = apply_penalties(*args)
    gpu = apply_penalties(*(x.cuda() for x in args))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-6, atol=1e-5)  # the GPU may fuse a multiply-add


def _assert_top_close(got, want):
    for g, w in zip(got, want, strict=True):
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=TOL)
        for k in range(len(w)):  # the same ids wherever neighbours are not within rounding
            gaps = [abs(w[k][1] - w[j][1]) for j in (k - 1, k + 1) if 0 <= j < len(w)]
            if min(gaps, default=1.0) > 1e-4:
                assert g[k][0] == w[k][0]


@pytest.mark.parametrize("graph_scope", ["iteration", "phase"])
def test_greedy_penalties_and_logprobs_with_graphs_equal_the_target_alone(graph_scope):
    target = _target()
    prompts = _prompts(3, seed=5)
    params = [
        SamplingParams(max_new_tokens=48, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5,
                       presence_penalty=0.2, logprobs=5, prompt_logprobs=3),
        SamplingParams(max_new_tokens=48, ignore_eos=True, logit_bias={3: -100.0, 7: 2.0}, logprobs=20),
        SamplingParams(max_new_tokens=48, ignore_eos=True, logprobs=True, min_p=0.2),  # greedy: min_p inert
    ]
    alone = Engine(target, spec=SpecConfig(method="none"), max_batch_size=3, kv_pool_tokens=16384,
                   cuda_graphs=False).generate(prompts, params)
    eng = Engine(target, _noisy_self_draft(target),
                 spec=SpecConfig(method="standalone", adaptive=False, topk=4, num_steps=3, num_draft_tokens=12),
                 max_batch_size=3, kv_pool_tokens=16384, cuda_graphs=True, graph_scope=graph_scope,
                 prefill_graphs=True, check_every_step=True)
    for _ in range(3):  # eager warm-up, capture, replay
        outs = eng.generate(prompts, params)
        for o, want in zip(outs, alone, strict=True):
            assert o.token_ids == want.token_ids
            assert o.logprobs == pytest.approx(want.logprobs, abs=TOL)
            if want.top_logprobs is not None:
                _assert_top_close(o.top_logprobs, want.top_logprobs)
        assert outs[0].prompt_logprobs[1:] == pytest.approx(alone[0].prompt_logprobs[1:], abs=TOL)
    assert sum(p["replays"] for p in eng.graph_runner.stats().values()) > 0



CONFIGS = {
    "baseline": ("none", {}),
    "eagle3-tree": ("eagle3", dict(topk=2, num_steps=3, num_draft_tokens=6)),
    "standalone-chain": ("standalone", dict(topk=1, num_steps=3)),
}


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_non_finite_logits_fail_one_request_under_graphs_and_overlap(tmp_path_factory, monkeypatch,
                                                                     config, params):
    method, spec = CONFIGS[config]
    bundle = support.arch_bundle(tmp_path_factory.mktemp("nonfinite"), "llama")
    prompts = support.make_prompts([LONG, SHORT], seed=5)
    clean = support.engine_for(bundle, method, page_size=4, **spec).generate(prompts, params)
    engine = support.engine_for(bundle, method, page_size=4, **spec)
    assert engine.device.type == "cuda" and engine.overlap
    monkeypatch.setattr(engine.target, "forward", poisoned_forward(engine.target.forward, POISON_AT))
    with pytest.raises(RequestFailed) as err:
        engine.generate(prompts, params)
    long, short = err.value.outputs
    assert long.finish_reason == "error"
    assert long.token_ids == clean[0].token_ids[:CLEAN_TOKENS]
    assert short.token_ids == clean[1].token_ids and short.finish_reason == "length"
    support.assert_all_free(engine)
    # the captured graphs serve on: the short prompt alone, clean
    assert engine.generate([prompts[1]], params)[0].token_ids == clean[1].token_ids


@pytest.mark.parametrize("steps_only", [False, True], ids=["every-forward", "draft-steps-only"])
@pytest.mark.parametrize("config", ["eagle3-tree", "standalone-chain"])
def test_a_draft_with_non_finite_logits_costs_speed_not_output_under_graphs(tmp_path_factory, monkeypatch,
                                                                           config, steps_only):
    """The Triton top-k kernels given NaN rows still pick in-range tokens; verify rejects them;
    the Triton tree selection flags the NaN scores and the host warns once (boundary mode)."""
    method, spec = CONFIGS[config]
    bundle = support.arch_bundle(tmp_path_factory.mktemp("nonfinite-draft"), "llama")
    prompts = support.make_prompts([LONG, SHORT], seed=5)
    baseline = support.engine_for(bundle, "none", page_size=4).generate(prompts, GREEDY)
    healthy, said = generate_warned(support.engine_for(bundle, method, page_size=4, **spec), prompts, GREEDY)
    assert not said and all(o.stats.nonfinite_drafts == 0 for o in healthy)
    engine = support.engine_for(bundle, method, page_size=4, validate="boundary", **spec)
    assert engine.device.type == "cuda" and engine.overlap
    poison_draft(monkeypatch, engine, steps_only)
    outs, said = generate_warned(engine, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline]
    assert len(said) == 1
    for o in outs:
        assert o.finish_reason == "length"
        assert o.stats.nonfinite_drafts == len(o.stats.accept_lengths) > 0
        if not steps_only:
            assert o.stats.accept_lengths == [1] * (GREEDY.max_new_tokens - 1)
    support.assert_all_free(engine)
