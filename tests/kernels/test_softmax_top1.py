"""phasegraph.kernels.softmax_top1 on the CPU: the reference is softmax + max (what chain drafts
computed before), the public name dispatches to it off CUDA, and bad input fails by name. The
Triton kernel is compared in tests/gpu/test_triton_layer_kernels.py (GPU, or the interpreter)."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels.softmax_top1 import softmax_top1, softmax_top1_reference
from phasegraph.phases._common import topk_of_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_softmax_maximum(dtype):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    prob, ids = softmax_top1(logits)
    full = torch.softmax(logits.float(), dim=-1)
    assert prob.dtype == torch.float32 and ids.dtype == torch.int64 and prob.shape == ids.shape == (5, 1)
    assert torch.equal(ids[:, 0], logits.float().argmax(dim=-1))
    assert torch.equal(prob, full.gather(1, ids))
    assert torch.allclose(prob[:, 0], 1 / torch.exp(logits.float() - logits.float().amax(-1, keepdim=True)).sum(-1))


def test_chain_drafts_take_it_and_trees_take_topk():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(topk_of_logits(logits, 1), softmax_top1_reference(logits), strict=True))
    probs, ids = topk_of_logits(logits, 4)
    assert ids.shape == (3, 4) and torch.equal(ids[:, :1], softmax_top1_reference(logits)[1])


@pytest.mark.parametrize(("bad", "match"), [
    (torch.zeros(4), "expected 2-d"),
    (torch.zeros(2, 3, dtype=torch.int64), "floating-point"),
    (torch.zeros(2, 0), "empty vocabulary"),
])
def test_bad_input_fails_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        softmax_top1(bad)
