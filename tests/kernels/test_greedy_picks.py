"""phasegraph.kernels.softmax_top1 on the CPU: the reference is softmax + max (what chain drafts
computed before), the public name dispatches to it off CUDA, and bad input fails by name. The
Triton kernel is compared in tests/gpu/test_triton_layer_kernels.py (GPU, or the interpreter).

phasegraph.kernels.argmax.argmax_finite on the CPU (its reference): torch.argmax's index,
whether each row's maximum is finite, and the pick the host reads. The Triton kernels are
compared in tests/gpu/test_triton_layer_kernels.py."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels.argmax import NONFINITE_LOGITS, argmax_finite
from phasegraph.kernels.softmax_top1 import softmax_top1
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


def test_chain_drafts_take_the_top_token_and_trees_the_top_k_of_the_softmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    full = torch.softmax(logits, dim=-1)
    prob, ids = topk_of_logits(logits, 1)
    assert torch.equal(ids[:, 0], full.argmax(dim=-1))
    assert torch.allclose(prob[:, 0], full.amax(dim=-1), atol=1e-7)
    probs, ids = topk_of_logits(logits, 4)
    want = full.topk(4, dim=-1)
    assert torch.equal(ids, want.indices) and torch.allclose(probs, want.values, atol=1e-7)


@pytest.mark.parametrize(("bad", "match"), [
    (torch.zeros(4), "expected 2-d"),
    (torch.zeros(2, 3, dtype=torch.int64), "floating-point"),
    (torch.zeros(2, 0), "empty vocabulary"),
])
def test_bad_input_fails_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        softmax_top1(bad)


def test_greedy_pick_flags_rows_whose_maximum_is_not_finite():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [0.5, 2.0, -1.0],  # finite
        [0.5, nan, 9.0],  # a NaN
        [0.5, inf, 1.0],  # +inf
        [-inf, -inf, -inf],  # nothing finite
        [-inf, 3.0, -inf],  # masked entries are fine
    ])
    pick = argmax_finite(logits)
    assert pick.tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert pick.finite.tolist() == [True, False, False, False, True]
    assert pick.emitted.tolist() == [1, NONFINITE_LOGITS, NONFINITE_LOGITS, NONFINITE_LOGITS, 1]
