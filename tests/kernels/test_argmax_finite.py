"""phasegraph.kernels.argmax.argmax_finite on the CPU (its reference): torch.argmax's index,
whether each row's maximum is finite, and the pick the host reads. The Triton kernels are
compared in tests/gpu/test_triton_layer_kernels.py."""

from __future__ import annotations

import torch

from phasegraph.kernels.argmax import NONFINITE_LOGITS, argmax_finite


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
