"""phasegraph.kernels.decoder_tail on the CPU: the public function runs the unfused kernels in
sequence there, which must be the reference's ops exactly (with and without selected logits
rows and biases); bad inputs fail with a message naming the tensor. The one-launch Triton kernel
is compared in tests/gpu/test_decoder_tail.py (GPU, or the interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phasegraph.kernels import decoder_tail as tail
from phasegraph.kernels.activation import silu_mul_reference
from phasegraph.kernels.rms_norm import add_rms_norm_reference


def _case(dtype, rows=5, hidden=24, width=16, inner=20, vocab=30, seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(n, k):
        return (torch.randn(n, k, generator=g) / k**0.5).to(dtype)

    return dict(
        attn=torch.randn(rows, width, generator=g).to(dtype),
        h=torch.randn(rows, hidden, generator=g).to(dtype),
        o_weight=w(hidden, width),
        post_norm=(1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype),
        post_eps=1e-6,
        gate_up_weight=w(2 * inner, hidden),
        down_weight=w(hidden, inner),
        final_norm=(1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype),
        final_eps=1e-5,
        lm_weight=w(vocab, hidden),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("index", [None, [4, 0]], ids=["all-rows", "selected-rows"])
def test_public_equals_reference_on_cpu(dtype, index):
    args = _case(dtype)
    logits_index = None if index is None else torch.tensor(index)
    logits, out = tail.decoder_tail(**args, logits_index=logits_index)
    want_logits, want_out = tail.decoder_tail_reference(**args, logits_index=logits_index)
    assert torch.equal(out, want_out)
    assert torch.equal(logits, want_logits)
    assert logits.shape == (5 if index is None else 2, 30) and logits.dtype == dtype


def test_reference_is_the_layer_and_head_math():
    """Written out with the modules' formulas (transformers' RMSNorm rounding, SwiGLU)."""
    a = _case(torch.float32)

    def rms(x, w, eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    s1 = a["h"] + a["attn"] @ a["o_weight"].T
    gate, up = (rms(s1, a["post_norm"], a["post_eps"]) @ a["gate_up_weight"].T).chunk(2, dim=-1)
    out = s1 + (F.silu(gate) * up) @ a["down_weight"].T
    logits = rms(out, a["final_norm"], a["final_eps"]) @ a["lm_weight"].T
    got_logits, got_out = tail.decoder_tail_reference(**a)
    torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5)
    # and op for op the unfused references
    normed, summed = add_rms_norm_reference(F.linear(a["attn"], a["o_weight"]), a["h"],
                                            a["post_norm"], a["post_eps"])
    act = silu_mul_reference(F.linear(normed, a["gate_up_weight"]))
    assert torch.equal(got_out, summed + F.linear(act, a["down_weight"]))


def test_biases_take_the_unfused_path_with_the_biases_applied():
    args = _case(torch.float32)
    g = torch.Generator().manual_seed(1)
    biases = tuple(torch.randn(n, generator=g) for n in (24, 40, 24, 30))
    logits, out = tail.decoder_tail(**args, biases=biases)
    o_b, gu_b, down_b, lm_b = biases
    normed, s1 = add_rms_norm_reference(F.linear(args["attn"], args["o_weight"], o_b), args["h"],
                                        args["post_norm"], args["post_eps"])
    act = silu_mul_reference(F.linear(normed, args["gate_up_weight"], gu_b))
    final, want_out = add_rms_norm_reference(F.linear(act, args["down_weight"], down_b), s1,
                                             args["final_norm"], args["final_eps"])
    assert torch.equal(out, want_out)
    assert torch.equal(logits, F.linear(final, args["lm_weight"], lm_b))


def test_bad_inputs_fail_with_a_message():
    args = _case(torch.float32)
    with pytest.raises(ValueError, match=r"attn: expected 5 rows like h"):
        tail.decoder_tail(**{**args, "attn": args["attn"][:4]})
    with pytest.raises(ValueError, match=r"o_weight: expected shape \(24, 16\)"):
        tail.decoder_tail(**{**args, "o_weight": args["o_weight"][:, :15]})
    with pytest.raises(ValueError, match=r"gate_up_weight: expected shape \(2I, 24\)"):
        tail.decoder_tail(**{**args, "gate_up_weight": args["gate_up_weight"][:39]})
    with pytest.raises(ValueError, match=r"down_weight: expected shape \(24, 20\)"):
        tail.decoder_tail(**{**args, "down_weight": args["down_weight"][:, :19]})
    with pytest.raises(ValueError, match=r"lm_weight: expected dtype torch.float32"):
        tail.decoder_tail(**{**args, "lm_weight": args["lm_weight"].double()})
    with pytest.raises(ValueError, match=r"logits_index: expected a 1-d int64 tensor"):
        tail.decoder_tail(**args, logits_index=torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"the one-launch decoder tail takes 1..16 rows"):
        tail.decoder_tail_triton(**_case(torch.float32, rows=17))


def test_no_triton_path_off_cuda():
    args = _case(torch.bfloat16)
    weights = tuple(args[k] for k in ("o_weight", "gate_up_weight", "down_weight", "lm_weight"))
    assert not tail.decoder_tail_fits(args["attn"], args["h"], weights)


def test_the_one_launch_is_for_small_heads_only(monkeypatch):
    """Large heads (an 8B EAGLE-3 head's ~0.5 GB) keep the unfused products; so do biases,
    more than 16 rows and strided inputs."""
    monkeypatch.setenv("PHASEGRAPH_KERNELS", "triton")  # as if on a GPU: only the shape decides
    args = _case(torch.bfloat16)
    weights = tuple(args[k] for k in ("o_weight", "gate_up_weight", "down_weight", "lm_weight"))
    assert tail.decoder_tail_fits(args["attn"], args["h"], weights)
    big = torch.empty(tail.MAX_WEIGHT_BYTES // 2 + 1, dtype=torch.bfloat16).view(1, -1)
    assert not tail.decoder_tail_fits(args["attn"], args["h"], (*weights[:3], big))
    assert not tail.decoder_tail_fits(args["attn"], args["h"], weights, (None, args["h"][0]))
    rows17 = _case(torch.bfloat16, rows=17)
    assert not tail.decoder_tail_fits(rows17["attn"], rows17["h"], weights)
    assert not tail.decoder_tail_fits(args["attn"][:, ::2], args["h"], weights)
