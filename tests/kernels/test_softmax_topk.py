"""phasegraph.kernels.softmax_topk on the CPU: the reference is softmax + topk (what tree drafts
computed before), the public name and ``topk_of_logits`` dispatch to it off CUDA, and bad input
fails by name. The Triton kernel is compared in tests/gpu/test_triton_layer_kernels.py (GPU, or
the interpreter with PHASEGRAPH_TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels.softmax_topk import _chunk_size, softmax_topk, softmax_topk_reference
from phasegraph.phases._common import topk_of_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_softmax_topk(dtype):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    probs, ids = softmax_topk(logits, 4)
    full = torch.softmax(logits.float(), dim=-1)
    assert probs.dtype == torch.float32 and ids.dtype == torch.int64 and probs.shape == ids.shape == (6, 4)
    assert torch.equal(probs, full.gather(1, ids))
    assert (probs[:, :-1] >= probs[:, 1:]).all()  # largest first
    assert torch.equal(ids[:, 0], logits.float().argmax(dim=-1))


def test_tree_drafts_take_it():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    for k in (2, 4, 50):
        assert all(torch.equal(a, b) for a, b in zip(topk_of_logits(logits, k), softmax_topk_reference(logits, k),
                                                        strict=True))


def test_chunks_stay_few_enough_for_the_merge_pass():
    for vocab in (5, 2048, 32000, 128256, 262144, 1_000_000):
        chunk = _chunk_size(vocab)
        assert chunk >= 2048 and chunk & (chunk - 1) == 0 and -(-vocab // chunk) <= 128


@pytest.mark.parametrize(("bad", "k", "match"), [
    (torch.zeros(4), 2, "expected 2-d"),
    (torch.zeros(2, 3, dtype=torch.int64), 2, "floating-point"),
    (torch.zeros(2, 3), 4, r"k = 4: expected 1 <= k <= vocabulary size 3"),
    (torch.zeros(2, 3), 0, r"k = 0"),
])
def test_bad_input_fails_by_name(bad, k, match):
    with pytest.raises(ValueError, match=match):
        softmax_topk(bad, k)


def test_the_triton_entry_takes_the_reference_where_its_kernels_do_not_apply():
    """k above MAX_TRITON_K and rows with a non-unit stride never reach a launch (so this runs
    without a GPU): both return the reference's values."""
    from phasegraph.kernels.softmax_topk import MAX_TRITON_K, softmax_topk_triton

    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(2))
    big_k = MAX_TRITON_K + 1
    assert all(torch.equal(a, b) for a, b in zip(softmax_topk_triton(logits, big_k),
                                                    softmax_topk_reference(logits, big_k), strict=True))
    strided = logits.t().contiguous().t()
    assert strided.stride(1) != 1
    assert all(torch.equal(a, b) for a, b in zip(softmax_topk_triton(strided, 4),
                                                    softmax_topk_reference(logits, 4), strict=True))


def test_ids_map_through_offsets_as_an_eagle3_head_maps_them():
    """``id_offsets`` (d2t) gives ``ids + d2t[ids]``, what ``to_target_ids`` computes after
    the plain top-k, for k > 1 and k == 1 alike."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 60, generator=gen)
    d2t = torch.randint(0, 500, (60,), generator=gen)
    for k in (1, 3):
        probs, ids = topk_of_logits(logits, k)
        mapped_p, mapped = topk_of_logits(logits, k, d2t)
        assert torch.equal(mapped_p, probs) and torch.equal(mapped, ids + d2t[ids])
    with pytest.raises(ValueError, match="id_offsets"):
        softmax_topk(logits, 2, d2t[:5])
