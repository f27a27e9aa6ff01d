"""The fused EAGLE-3 head path on the GPU (Triton products, norms, rotary, attention) against
the same head through transformers' modules, on the same inputs and pool contents.

    python -m pytest -m gpu tests/gpu/test_eagle3_fused_gpu.py -q

Scenario: draft-extend over an 11-token prompt (from the target's features), then three draft
steps of ``rows`` tokens each (one token per request is the decode shape whose norm fuses into
the next product; 5 rows take the multi-row kernels). fp32 must agree to 1e-4; bf16 within
rounding (relative error < 1e-2, top-1 equal on most rows).
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.runtime.kv_pool import KVPool
from phasegraph.runtime.models.eagle3 import Eagle3Draft
from phasegraph.runtime.models.target import HFTarget
from phasegraph.testing.checkpoints import write_eagle3_draft, write_hf_target

pytestmark = pytest.mark.gpu

PROMPT = 11


def _meta(query_rows: torch.Tensor, positions: torch.Tensor, requests: int) -> AttentionMetadata:
    """Page size 1; request r owns slots [64 r, 64 r + 64): position p of it is slot 64 r + p."""
    table = torch.arange(requests * 64, device=positions.device).view(requests, 64)  # [R, 64]
    return AttentionMetadata(
        write_slots=query_rows * 64 + positions, page_table=table, query_row=query_rows,
        kv_len=positions + 1, extra_mask=None, page_size=1,
    )


def _run(draft: Eagle3Draft, target: HFTarget, features, tokens, requests: int, steps: int):
    """Extend over the prompt (request 0), copy its KV to every request, then draft steps."""
    dev = features.device
    pool = KVPool(draft.kv_spec, requests * 64, dev)
    draft.attach_kv(pool)
    positions = torch.arange(PROMPT, device=dev)
    prompt_meta = _meta(torch.zeros_like(positions), positions, requests)
    out = draft.forward(tokens[:PROMPT], features, positions, prompt_meta, from_target=True)
    for r in range(1, requests):  # every request starts from the same prefix
        for cache in (pool.k[0], pool.v[0]):
            cache[r * 64 : r * 64 + PROMPT] = cache[:PROMPT]
    logits, hidden = [out.logits], out.hidden[-1:].repeat(requests, 1)
    for i in range(steps):
        positions = torch.full((requests,), PROMPT + i, device=dev)
        step_tokens = tokens[PROMPT + i : PROMPT + i + 1].repeat(requests)
        meta = _meta(torch.arange(requests, device=dev), positions, requests)
        out = draft.forward(step_tokens, hidden, positions, meta, from_target=False, step=i)
        logits.append(out.logits)
        hidden = out.hidden
    return torch.cat(logits)


@pytest.mark.parametrize("requests", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_head_matches_modules(tmp_path, dtype, requests):
    target_dir = write_hf_target(tmp_path / "target", "llama")
    target = HFTarget.from_pretrained(target_dir, dtype=dtype, device="cuda", feature_mode="eagle3")
    head_dir = write_eagle3_draft(tmp_path / "e3", target_dir)
    fused = Eagle3Draft.from_pretrained(head_dir, target, dtype=dtype, device="cuda", fused=True)
    modules = Eagle3Draft.from_pretrained(head_dir, target, dtype=dtype, device="cuda", fused=False)
    assert fused.fused_layer is not None and modules.fused_layer is None
    g = torch.Generator(device="cuda").manual_seed(0)
    features = torch.randn(PROMPT, target.feature_size, generator=g, device="cuda").to(dtype)
    tokens = torch.randint(0, target.vocab_size, (PROMPT + 3,), generator=g, device="cuda")
    got = _run(fused, target, features, tokens, requests, 3)
    want = _run(modules, target, features, tokens, requests, 3)
    assert got.shape == want.shape == (PROMPT + 3 * requests, fused.vocab_size)
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    else:
        rel = (got - want).norm() / want.norm()
        assert rel < 1e-2, rel
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
