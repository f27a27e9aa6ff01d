"""Whole engines with every kernel on its Triton path (PHASEGRAPH_KERNELS=triton), float32:
chain and tree EAGLE-3 and standalone drafting on a tiny Llama emit exactly the baseline's
greedy tokens (the same engine with ``method="none"`` and the same kernels).

On the GPU (``-m gpu``) the kernels are compiled; on the CPU with
``PHASEGRAPH_TRITON_INTERPRET=1`` they run in Triton's interpreter (~21 minutes for the six on a
2-core machine), where the baseline must also equal transformers' own greedy continuation
(checked when it is built). That checks the phases' kernels
together (commit_path, softmax_topk, the float32 skinny products, ...) before a GPU is at hand."""

from __future__ import annotations

import pytest
import torch

from tests.engine import support
from tests.gpu.test_triton_kernels import INTERPRET

pytestmark = [] if INTERPRET else [pytest.mark.gpu]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bundle_and_baseline(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHASEGRAPH_KERNELS", "triton")
        bundle = support.arch_bundle(tmp_path_factory.mktemp("triton-engine"), "llama")
        engine = support.engine_for(bundle, "none", dtype=torch.float32)
        prompts = [list(p) for p in bundle.prompts[:3]]
        outs = engine.generate(prompts, support.greedy(max_new_tokens=NEW_TOKENS))
    baseline = [list(o.token_ids) for o in outs]
    if INTERPRET:  # the kernels on the CPU: the baseline is transformers' own greedy continuation
        # (on a GPU the compiled float32 kernels sum in other orders than transformers on the
        # CPU, and the claim there, as in test_gpu_lossless.py, is speculation == baseline)
        assert baseline == [list(r[:NEW_TOKENS]) for r in bundle.reference[:3]]
    return bundle, prompts, baseline


@pytest.mark.parametrize(("method", "kw"), [
    ("eagle3", {"topk": 4, "num_steps": 3, "num_draft_tokens": 8}),
    ("eagle3", {"topk": 1, "num_steps": 3}),
    ("standalone", {"topk": 1, "num_steps": 3}),
    # chained MTP layers under graph replay (SGLang #22041: the hidden state each step hands on)
    ("mtp", {"topk": 1, "num_steps": 3}),
    ("mtp", {"topk": 4, "num_steps": 3, "num_draft_tokens": 8}),
], ids=["eagle3-tree", "eagle3-chain", "standalone", "mtp-chain", "mtp-tree"])
@pytest.mark.parametrize("pdl", ["auto", "off"])
def test_speculation_on_triton_keeps_the_baseline_tokens(bundle_and_baseline, monkeypatch, method,
                                                         kw, pdl):
    """The baseline ran with the default launches (programmatic dependent launch on a Hopper
    GPU); speculation keeps its tokens with PHASEGRAPH_PDL at its default and off."""
    bundle, prompts, baseline = bundle_and_baseline
    monkeypatch.setenv("PHASEGRAPH_KERNELS", "triton")
    monkeypatch.setenv("PHASEGRAPH_PDL", pdl)
    engine = support.engine_for(bundle, method, dtype=torch.float32, **kw)
    outs = engine.generate(prompts, support.greedy(max_new_tokens=NEW_TOKENS))
    assert [list(o.token_ids) for o in outs] == baseline
    support.assert_all_free(engine)
