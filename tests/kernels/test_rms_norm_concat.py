"""rms_norm_concat on the CPU: the EAGLE-3 head's input, both halves normed as add_rms_norm
normalises them and placed side by side; bad shapes fail naming the argument. The Triton kernel
is compared in tests/gpu/test_triton_layer_kernels.py."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels import rms_norm


def test_halves_are_the_two_norms_side_by_side():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 16, generator=g), 5 * torch.randn(3, 8, generator=g)
    a_w, b_w = torch.rand(16, generator=g), torch.rand(8, generator=g)
    out = rms_norm.rms_norm_concat(a, a_w, 1e-5, b, b_w, 1e-6)
    assert out.shape == (3, 24)
    assert torch.equal(out[:, :16], rms_norm.add_rms_norm(a, None, a_w, 1e-5)[0])
    assert torch.equal(out[:, 16:], rms_norm.add_rms_norm(b, None, b_w, 1e-6)[0])
    rms = out[:, 16:] / b_w  # each half is normalised on its own: unit root mean square
    assert torch.allclose(rms.pow(2).mean(-1), torch.ones(3), atol=1e-4)


def test_bad_shapes_fail_with_a_message():
    a, b = torch.randn(3, 16), torch.randn(3, 8)
    with pytest.raises(ValueError, match="b: expected 3 rows"):
        rms_norm.rms_norm_concat(a, torch.ones(16), 1e-5, b[:2], torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="b_weight"):
        rms_norm.rms_norm_concat(a, torch.ones(16), 1e-5, b, torch.ones(16), 1e-5)
    with pytest.raises(ValueError, match="b: expected 3 rows of torch.float32"):
        rms_norm.rms_norm_concat(a, torch.ones(16), 1e-5, b.double(), torch.ones(8), 1e-5)
