"""The one-launch decoder tail (o -> norm -> gate/up SiLU -> down -> norm -> lm_head) against its
reference, on fresh random inputs and poisoned allocations, with no host sync on CUDA.

The logits and the new hidden state must be within the products' rounding of the reference
(bf16 1e-2, fp32 1e-5 relative); the launch must leave its counters at zero (else the next launch
would read stale tickets), and on the GPU a CUDA-graph replay must equal the eager call bit for
bit (every item computes its columns in a fixed order, whatever order the items run in). Same
modes as test_triton_kernels.py: GPU with ``-m gpu``; CPU through the interpreter with
``PHASEGRAPH_TRITON_INTERPRET=1`` (tiny shapes; programs run one after another in ticket order).
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels import decoder_tail as tail
from tests.gpu.test_triton_kernels import INTERPRET, ON_GPU, assert_equal, rel_err, run_triton

pytestmark = [] if INTERPRET else [pytest.mark.gpu]
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
# (H, A, I, V): the bench pair's EAGLE-3 head, and a ragged one; tiny in the interpreter
SHAPES = [(768, 768, 2560, 8192), (200, 256, 344, 1000)] if ON_GPU else [(48, 64, 40, 100)]


def _inputs(gen, device, dtype, rows, shape):
    hidden, width, inner, vocab = shape

    def w(n, k):
        return (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)

    return dict(
        attn=torch.randn(rows, width, generator=gen).to(dtype).to(device),
        h=torch.randn(rows, hidden, generator=gen).to(dtype).to(device),
        o_weight=w(hidden, width),
        post_norm=(1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device),
        post_eps=1e-6,
        gate_up_weight=w(2 * inner, hidden),
        down_weight=w(hidden, inner),
        final_norm=(1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device),
        final_eps=1e-5,
        lm_weight=w(vocab, hidden),
    )


def _close(out, ref, name):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (name, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{name}: non-finite (unwritten) elements"
    err = rel_err(out.float(), ref.float())
    assert err <= TOL[ref.dtype], f"{name}: relative error {err:.2e}"


def _counters_zero(device):
    counters = tail._SYNC[device]
    assert_equal(torch.zeros_like(counters), counters, "counters after the launch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 4, 5, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_decoder_tail_matches_reference(device, gen, dtype, rows, shape):
    args = _inputs(gen, device, dtype, rows, shape)
    tail._sync_counters(device)  # allocated outside the poisoned region (they must start at zero)
    logits, out = run_triton(device, tail.decoder_tail_triton, **args)
    ref_logits, ref_out = tail.decoder_tail_reference(**args)
    _close(out, ref_out, "out")
    _close(logits, ref_logits, "logits")
    _counters_zero(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decoder_tail_selected_rows(device, gen, dtype):
    """``logits_index`` picks the rows that get logits (draft-extend: each request's last row);
    ``out`` still holds every row."""
    rows = 5
    args = _inputs(gen, device, dtype, rows, SHAPES[0])
    index = torch.tensor([4, 1], dtype=torch.int64, device=device)
    tail._sync_counters(device)
    logits, out = run_triton(device, tail.decoder_tail_triton, **args, logits_index=index)
    ref_logits, ref_out = tail.decoder_tail_reference(**args, logits_index=index)
    assert logits.shape == (2, SHAPES[0][3])
    _close(out, ref_out, "out")
    _close(logits, ref_logits, "logits")
    _counters_zero(device)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need the GPU")
def test_decoder_tail_graph_replay_is_bitwise_eager(device, gen):
    args = _inputs(gen, device, torch.bfloat16, 4, SHAPES[0])
    eager_logits, eager_out = tail.decoder_tail_triton(**args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, out = tail.decoder_tail_triton(**args)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert_equal(eager_logits, logits, "logits")
        assert_equal(eager_out, out, "out")
        _counters_zero(device)
