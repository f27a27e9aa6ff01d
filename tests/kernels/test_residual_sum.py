"""ResidualSum, the residual add on its way into an RMSNorm, on the CPU: its two forms, its
reference statistics, and the public products and norms that take it (their GPU kernels:
tests/gpu/test_linear_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels import linear as lin
from phasegraph.kernels.residual_sum import ResidualSum, residual_sum_reference
from phasegraph.kernels.rms_norm import add_rms_norm, add_rms_norm_reference
from phasegraph.kernels.split_sum import SplitSum


def _rand(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_statistics_are_block_sums_of_squares(dtype):
    gen = torch.Generator().manual_seed(0)
    y, residual = _rand(gen, 3, 10, dtype=dtype), _rand(gen, 3, 10, dtype=dtype)
    summed = residual_sum_reference(y, residual, block=4)  # blocks of 4, 4 and 2 columns
    assert torch.equal(summed.summed, residual + y)
    h = (residual + y).float()
    want = torch.stack([h[:, :4].pow(2).sum(1), h[:, 4:8].pow(2).sum(1), h[:, 8:].pow(2).sum(1)])
    assert summed.squares.shape == (3, 3)
    torch.testing.assert_close(summed.squares, want, rtol=1e-6, atol=0)
    variance = h.pow(2).mean(-1)
    torch.testing.assert_close(summed.rstd(1e-5), torch.rsqrt(variance + 1e-5), rtol=1e-6, atol=0)
    assert summed.parts() == (summed.summed, None) and summed.total() is summed.summed


def test_pending_form_is_the_pair_the_norm_adds():
    gen = torch.Generator().manual_seed(1)
    x, residual = _rand(gen, 2, 6), _rand(gen, 2, 6)
    pending = ResidualSum(pending=(x, residual))
    assert pending.parts() == (x, residual)
    assert pending.shape == (2, 6) and pending.dtype == torch.float32
    assert torch.equal(pending.total(), residual + x)
    split = SplitSum(_rand(gen, 3, 2, 6), 2, None, torch.float32)
    assert torch.equal(ResidualSum(pending=(split, residual)).total(), residual + split.total())
    with pytest.raises(ValueError, match="no statistics"):
        pending.rstd(1e-5)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({}, "either summed"),
    ({"summed": torch.zeros(2, 6), "pending": (torch.zeros(2, 6), torch.zeros(2, 6))}, "either summed"),
    ({"summed": torch.zeros(2, 6)}, "squares: expected"),
    ({"summed": torch.zeros(2, 6), "squares": torch.zeros(3, 5)}, "squares: expected"),
    ({"summed": torch.zeros(2, 6), "squares": torch.zeros(3, 2, dtype=torch.float64)}, "squares: expected"),
    ({"pending": (torch.zeros(2, 6), torch.zeros(2, 5))}, "residual: expected"),
    ({"pending": (torch.zeros(2, 6), torch.zeros(2, 6)), "squares": torch.zeros(1, 2)}, "no statistics"),
])
def test_malformed_sums_are_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ResidualSum(**kwargs)
    with pytest.raises(ValueError, match="positive column count"):
        residual_sum_reference(torch.zeros(1, 2), torch.zeros(1, 2), 0)


def test_public_names_take_the_residual_on_the_cpu():
    """On the CPU the products hand the residual on pending, and the norms that take a
    ResidualSum give what they give for the pair: the layer's ops, unchanged."""
    gen = torch.Generator().manual_seed(2)
    x, w, b = _rand(gen, 5, 12), _rand(gen, 8, 12), _rand(gen, 8)
    residual, norm_w, w_next = _rand(gen, 5, 8), 1 + 0.1 * _rand(gen, 8), _rand(gen, 4, 8)
    summed = lin.linear(x, w, b, residual=residual)
    assert isinstance(summed, ResidualSum) and summed.squares is None
    y = torch.nn.functional.linear(x, w, b)
    assert torch.equal(summed.total(), residual + y)
    normed, want_summed = add_rms_norm_reference(y, residual, norm_w, 1e-5)
    out, got_summed = lin.add_rms_norm_linear(summed, None, norm_w, 1e-5, w_next)
    assert torch.equal(got_summed, want_summed)
    assert torch.equal(out, torch.nn.functional.linear(normed, w_next))
    assert all(torch.equal(a, b) for a, b in zip(add_rms_norm(summed, None, norm_w, 1e-5),
                                                 (normed, want_summed), strict=True))
    gate_up = _rand(gen, 5, 24)
    act_sum = lin.silu_mul_linear(gate_up, w, b, residual=residual)
    assert torch.equal(act_sum.total(), residual + lin.silu_mul_linear_reference(gate_up, w, b))
    with pytest.raises(ValueError, match="carries its residual"):
        lin.add_rms_norm_linear(summed, residual, norm_w, 1e-5, w_next)
    with pytest.raises(ValueError, match="carries its residual"):
        add_rms_norm(summed, residual, norm_w, 1e-5)
    with pytest.raises(ValueError, match="residual: expected shape"):
        lin.linear(x, w, b, residual=residual[:, :3])
