"""Whole engines with every kernel on its Triton path (PHASEGRAPH_KERNELS=triton) keep
transformers' greedy outputs: chain and tree EAGLE-3 and standalone drafting on a tiny Llama.

On the GPU (``-m gpu``) the kernels are compiled; on the CPU with
``PHASEGRAPH_TRITON_INTERPRET=1`` they run in Triton's interpreter (~6 minutes), which checks the
phases' kernels together (commit_path, softmax_topk, the float32 skinny products, ...) before a
GPU is at hand."""

from __future__ import annotations

import pytest

from tests.engine import support
from tests.gpu.test_triton_kernels import INTERPRET

pytestmark = [] if INTERPRET else [pytest.mark.gpu]
NEW_TOKENS = 12


@pytest.mark.parametrize(("method", "kw"), [
    ("eagle3", {"topk": 4, "num_steps": 3, "num_draft_tokens": 8}),
    ("eagle3", {"topk": 1, "num_steps": 3}),
    ("standalone", {"topk": 1, "num_steps": 3}),
], ids=["eagle3-tree", "eagle3-chain", "standalone"])
def test_greedy_outputs_with_every_kernel_on_triton(tmp_path, monkeypatch, method, kw):
    monkeypatch.setenv("PHASEGRAPH_KERNELS", "triton")
    bundle = support.arch_bundle(tmp_path, "llama")
    engine = support.engine_for(bundle, method, **kw)
    prompts = [list(p) for p in bundle.prompts[:3]]
    outs = engine.generate(prompts, support.greedy(max_new_tokens=NEW_TOKENS))
    assert [list(o.token_ids) for o in outs] == [list(r[:NEW_TOKENS]) for r in bundle.reference[:3]]
    support.assert_all_free(engine)
