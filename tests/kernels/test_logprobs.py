"""The target's logprobs of chosen tokens and of each row's top k (kernels/logprobs.py)."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels.logprobs import MAX_TOP_LOGPROBS, token_logprobs


def test_logprobs_are_log_softmax_of_the_raw_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 4
    tokens = torch.randint(0, 50, (5,), generator=g)
    out = token_logprobs(logits, tokens, 7)
    want = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.chosen, want[torch.arange(5), tokens], rtol=0, atol=1e-6)
    values, ids = want.topk(7, dim=-1)
    torch.testing.assert_close(out.top, values, rtol=0, atol=1e-6)
    assert torch.equal(out.top_ids, ids)
    assert bool((out.top[:, :-1] >= out.top[:, 1:]).all())  # most likely first


def test_no_top_without_k_and_half_precision_is_read_as_float32():
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.bfloat16)
    out = token_logprobs(logits, torch.tensor([2]))
    assert out.top is None and out.top_ids is None and out.chosen.dtype == torch.float32
    assert out.chosen.item() == pytest.approx(torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), -1)[2].item())


def test_k_past_the_vocabulary_gives_the_whole_row_and_k_past_the_bound_is_refused():
    out = token_logprobs(torch.tensor([[0.0, 1.0]]), torch.tensor([0]), 5)
    assert out.top_ids.tolist() == [[1, 0]]
    with pytest.raises(ValueError, match="top must be in"):
        token_logprobs(torch.zeros(1, 30), torch.tensor([0]), MAX_TOP_LOGPROBS + 1)
