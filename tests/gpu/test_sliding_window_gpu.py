"""Sliding-window attention on the GPU under CUDA graphs: the Triton kernels (paged attention,
the one-launch decode/draft kernel, the verify kernel) mask the window as the reference does.

    python -m pytest -m gpu tests/gpu/test_sliding_window_gpu.py -q

Tiny Mistral and Qwen2 targets with an 8-token window, prompts of 30 to 41 tokens, 40 new
tokens: float32 greedy outputs equal transformers' generate (run on the CPU), for the target
alone and for EAGLE-3 and windowed standalone drafts, chain and tree, with CUDA graphs captured
and replayed; bfloat16 speculative outputs equal the bfloat16 target alone.
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.testing.checkpoints import (
    write_eagle3_draft,
    write_hf_target,
    write_standalone_draft,
)
from tests.runtime.test_sliding_window import SIZES, WINDOW, WINDOWED, hf_greedy

pytestmark = pytest.mark.gpu

NEW_TOKENS = 40
SHAPES = {"none": None, "chain": dict(topk=1, num_steps=3), "tree": dict(topk=4, num_steps=3, num_draft_tokens=8)}


def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (30, 41, 33, 37)]


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    target = write_hf_target(root / "target", arch, **SIZES, **WINDOWED[arch])
    drafts = {
        "eagle3": write_eagle3_draft(root / "eagle3", target),
        "standalone": write_standalone_draft(root / "standalone", target, arch, num_hidden_layers=2,
                                             **WINDOWED[arch]),
    }
    want = hf_greedy(target, prompts(), NEW_TOKENS)
    return target, drafts, want


def run(target, draft, method, shape, dtype, page_size=16):
    spec = SpecConfig(method="none") if shape is None else SpecConfig(method=method, **shape)
    engine = Engine.from_pretrained(target, None if shape is None else draft, spec=spec, dtype=dtype,
                                    device="cuda", page_size=page_size, kv_pool_tokens=8192,
                                    cuda_graphs=True, check_every_step=True)
    assert engine.target.sliding_window == WINDOW
    outs = engine.generate(prompts(), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert sum(p["replays"] for p in engine.graph_runner.stats().values()) > 0
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", ["eagle3", "standalone"])
def test_float32_equals_transformers_past_the_window_with_graphs(windowed, method, shape, page_size):
    target, drafts, want = windowed
    if shape == "none" and method == "standalone":
        pytest.skip("the target alone runs once, under the eagle3 id")
    assert run(target, drafts[method], method, SHAPES[shape], "float32", page_size) == want


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("method", ["eagle3", "standalone"])
def test_bfloat16_speculation_is_lossless_past_the_window_with_graphs(windowed, method, shape):
    target, drafts, _ = windowed
    alone = run(target, None, method, None, "bfloat16")
    assert run(target, drafts[method], method, SHAPES[shape], "bfloat16") == alone
