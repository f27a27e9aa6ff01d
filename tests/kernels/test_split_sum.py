"""phasegraph.kernels.split_sum on the CPU: a deferred split-K product (SplitSum) stands for the
sum of its slices in slice order plus the bias, rounded once; every consumer takes it as it
would take that tensor; malformed partials are refused. The Triton producer and consumers are
compared bit for bit in tests/gpu/test_linear_gpu.py (GPU or interpreter)."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels import linear as lin
from phasegraph.kernels.activation import silu_mul
from phasegraph.kernels.rms_norm import add_rms_norm
from phasegraph.kernels.split_sum import SplitSum, materialize


def _split(dtype=torch.float32, slices=3, rows=5, padded=16, n=24, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    partials = torch.randn(slices, padded, n, generator=g)
    partials[:, rows:] = float("nan")  # padded rows are never read
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return SplitSum(partials, rows, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_total_sums_the_slices_in_order_then_adds_the_bias(dtype, bias):
    x = _split(dtype, bias=bias)
    want = x.partials[0, :5].clone()
    for s in (1, 2):
        want = want + x.partials[s, :5]
    if bias:
        want = want + x.bias.float()
    got = x.total()
    assert got.dtype == dtype and tuple(got.shape) == (5, 24) == tuple(x.shape)
    assert torch.equal(got, want.to(dtype))
    assert materialize(x) is not x and torch.equal(materialize(x), got)
    plain = torch.ones(2, 3)
    assert materialize(plain) is plain


def test_consumers_take_a_split_sum_as_its_total_on_the_cpu():
    x = _split(bias=True)
    total = x.total()
    residual = torch.randn(5, 24)
    norm_w = 1 + 0.1 * torch.randn(24)
    got, want = add_rms_norm(x, residual, norm_w, 1e-5), add_rms_norm(total, residual, norm_w, 1e-5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(silu_mul(x), silu_mul(total))
    w = torch.randn(7, 24)
    y, s = lin.add_rms_norm_linear(x, residual, norm_w, 1e-5, w, defer=True)
    y_want, s_want = lin.add_rms_norm_linear(total, residual, norm_w, 1e-5, w)
    assert torch.equal(y, y_want) and torch.equal(s, s_want)
    w_down = torch.randn(7, 12)
    assert torch.equal(lin.silu_mul_linear(x, w_down, defer=True), lin.silu_mul_linear(total, w_down))
    # off CUDA nothing is deferred: defer=True still returns the plain product
    a = torch.randn(5, 24)
    assert torch.equal(lin.linear(a, w, defer=True), lin.linear(a, w))


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: SplitSum(torch.zeros(2, 4, 8, dtype=torch.bfloat16), 4, None, torch.bfloat16),
         "float32"),
        (lambda: SplitSum(torch.zeros(4, 8), 4, None, torch.float32), "[S, R, N]"),
        (lambda: SplitSum(torch.zeros(2, 4, 8), 5, None, torch.float32), "at most 4"),
        (lambda: SplitSum(torch.zeros(2, 4, 8), 4, torch.zeros(7), torch.float32), "bias"),
        (lambda: SplitSum(torch.zeros(2, 8, 4).transpose(1, 2), 4, None, torch.float32),
         "contiguous"),
    ],
)
def test_malformed_partials_are_refused(make, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        make()
