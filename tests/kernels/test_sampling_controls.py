"""Logit bias and repetition / frequency / presence penalties (kernels/penalties.py).

The definitions are checked on hand-made rows; the per-node form (a tree node penalised with
the request's counts plus the tokens drafted on its own path) against a plain reference that
walks each node's ancestors one by one, on random trees with repeated tokens.

The target's logprobs of chosen tokens and of each row's top k (kernels/logprobs.py); its
Triton path is compared in tests/gpu/test_triton_layer_kernels.py (GPU, or the interpreter with
PHASEGRAPH_TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phasegraph.kernels import build_tree
from phasegraph.kernels.logprobs import (
    MAX_TOP_LOGPROBS,
    token_logprobs,
    token_logprobs_reference,
    token_logprobs_triton,
)
from phasegraph.kernels.penalties import (
    FLOAT32_MAX,
    apply_penalties,
    count_tokens,
    prefill_token_counts,
)


def _one(logits, counts, prompt, rep=1.0, freq=0.0, pres=0.0, bias=None):
    """apply_penalties of one request with one row."""
    f = torch.tensor
    return apply_penalties(
        f([logits], dtype=torch.float32), f([counts], dtype=torch.int32), f([prompt]),
        f([rep]), f([freq]), f([pres]), None if bias is None else f([bias], dtype=torch.float32),
    )[0].tolist()


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # token 0: output, 1: prompt, 2: output (negative logit), 3: unseen
    out = _one([4.0, 3.0, -2.0, 1.0], [1, 0, 2, 0], [False, True, False, False], rep=2.0)
    assert out == [2.0, 1.5, -4.0, 1.0]
    # a penalty below 1 rewards them instead
    assert _one([4.0, -2.0], [1, 1], [False, False], rep=0.5) == [8.0, -1.0]


def test_frequency_counts_and_presence_once_over_the_output_only():
    out = _one([1.0, 1.0, 1.0], [3, 0, 1], [False, True, False], freq=0.5, pres=0.25)
    assert out == [1.0 - 1.5 - 0.25, 1.0, 1.0 - 0.5 - 0.25]  # the prompt token is not penalised


def test_the_bias_comes_first_so_the_repetition_penalty_sees_it():
    # logit -1 biased to +3 is then divided (positive), not multiplied
    assert _one([-1.0, 0.0], [1, 0], [False, False], rep=2.0, bias=[4.0, -1.0]) == [1.5, -1.0]


def test_all_off_is_the_identity_and_processed_rows_stay_finite():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, generator=g)
    counts = torch.randint(0, 3, (3, 9), generator=g, dtype=torch.int32)
    prompt = torch.rand(3, 9, generator=g) > 0.5
    ones, zeros = torch.ones(3), torch.zeros(3)
    assert torch.equal(apply_penalties(logits, counts, prompt, ones, zeros, zeros), logits)
    # a tiny repetition penalty would divide a positive logit past float32's range
    big = apply_penalties(torch.tensor([[30.0, -30.0, float("nan")]]), torch.ones(1, 3, dtype=torch.int32),
                          torch.zeros(1, 3, dtype=torch.bool), torch.tensor([1e-38]), torch.zeros(1), torch.zeros(1))
    assert big[0, 0] == FLOAT32_MAX and bool(torch.isfinite(big[0, :2]).all())
    assert torch.isnan(big[0, 2])  # a NaN logit stays NaN: the row is reported, not hidden


def test_count_tokens_skips_pads_and_marks():
    counts = torch.zeros(2, 5, dtype=torch.int32)
    tokens = torch.tensor([[1, 1, 4, -1], [-2, -3, 0, -1]])  # -2 / -3: the non-finite marks
    assert count_tokens(counts, tokens).tolist() == [[0, 2, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert count_tokens(counts, torch.tensor([3, -1])).tolist() == [[0, 0, 0, 1, 0], [0] * 5]


def test_prefill_counts_split_the_prompt_from_the_output_of_a_resumed_request():
    # request 0: prompt [2, 2, 3]; request 1 resumes: prompt [1], then emitted 4, 4 (its bonus is forced)
    ids = torch.tensor([2, 2, 3, 1, 4, 4])
    positions = torch.tensor([0, 1, 2, 0, 1, 2])
    token_req = torch.tensor([0, 0, 0, 1, 1, 1])
    counts, prompt = prefill_token_counts(ids, positions, token_req, torch.tensor([3, 1]), 6)
    assert counts.tolist() == [[0] * 6, [0, 0, 0, 0, 2, 0]]
    assert prompt.tolist() == [[False, False, True, True, False, False], [False, True] + [False] * 4]


# --------------------------------------------------------------------------- per tree node


def _random_tree(g, batch, nodes, vocab):
    parents = torch.stack([
        torch.cat([torch.tensor([-1]), (torch.rand(nodes - 1, generator=g) * torch.arange(1, nodes)).long()])
        for _ in range(batch)
    ])
    # a small vocabulary: tokens repeat along paths, across siblings and with the root
    tokens = torch.randint(0, vocab, (batch, nodes - 1), generator=g)
    roots = torch.randint(0, vocab, (batch,), generator=g)
    return build_tree(roots, tokens, parents, torch.zeros(batch, dtype=torch.int64)), parents


def _per_node_reference(logits, counts, prompt, rep, freq, pres, bias, tree, parents):
    """Each node on its own: walk its parents up to the root, add the drafted tokens seen on
    the way to the request's counts, and penalise that one row."""
    batch, nodes = parents.shape
    out = torch.empty_like(logits)
    for b in range(batch):
        for j in range(nodes):
            c = counts[b].clone()
            a = j
            while a > 0:  # the root (node 0, the bonus token) is counted already
                c[tree.draft_tokens[b * nodes + a]] += 1
                a = int(parents[b, a])
            row = b * nodes + j
            out[row] = apply_penalties(logits[row:row + 1], c[None], prompt[b:b + 1], rep[b:b + 1],
                                       freq[b:b + 1], pres[b:b + 1], None if bias is None else bias[b:b + 1])[0]
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 3), nodes=st.integers(2, 9),
       vocab=st.integers(2, 6), with_bias=st.booleans())
def test_every_node_is_penalised_from_its_own_ancestry(seed, batch, nodes, vocab, with_bias):
    g = torch.Generator().manual_seed(seed)
    tree, parents = _random_tree(g, batch, nodes, vocab)
    logits = torch.randn(batch * nodes, vocab, generator=g) * 3
    counts = torch.randint(0, 3, (batch, vocab), generator=g, dtype=torch.int32)
    prompt = torch.rand(batch, vocab, generator=g) > 0.6
    rep = 0.5 + 1.5 * torch.rand(batch, generator=g)
    freq = 4 * torch.rand(batch, generator=g) - 2
    pres = 4 * torch.rand(batch, generator=g) - 2
    bias = torch.randn(batch, vocab, generator=g) if with_bias else None
    got = apply_penalties(logits, counts, prompt, rep, freq, pres, bias, tree.draft_tokens, tree.tree_mask)
    want = _per_node_reference(logits, counts, prompt, rep, freq, pres, bias, tree, parents)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_node_counts_its_path_not_its_siblings_or_cousins():
    # root 0 -> node 1 (token 2) -> node 3 (token 2); root -> node 2 (token 3)
    tree = build_tree(torch.tensor([0]), torch.tensor([[2, 3, 2]]), torch.tensor([[-1, 0, 0, 1]]),
                      torch.tensor([0]))
    assert tree.draft_tokens.tolist() == [0, 2, 3, 2]
    logits = torch.zeros(4, 4)
    zeros = torch.zeros(1)
    out = apply_penalties(logits, torch.tensor([[1, 0, 0, 0]], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.bool),
                          torch.ones(1), torch.ones(1), zeros, None, tree.draft_tokens, tree.tree_mask)
    assert out.tolist() == [
        [-1.0, 0.0, 0.0, 0.0],  # the root: the request's counts (its bonus token 0)
        [-1.0, 0.0, -1.0, 0.0],  # node 1 drafted token 2
        [-1.0, 0.0, 0.0, -1.0],  # node 2 (token 3) does not see its sibling's token 2
        [-1.0, 0.0, -2.0, 0.0],  # node 3: token 2 twice on its path
    ]


def test_a_tree_needs_its_tokens_and_mask():
    with pytest.raises(ValueError, match="need node_tokens and tree_mask"):
        apply_penalties(torch.zeros(4, 3), torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.bool),
                        torch.ones(2), torch.zeros(2), torch.zeros(2))


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


def test_logprobs_run_the_reference_off_cuda_and_the_triton_entry_where_no_kernel_applies():
    """Every allowed k fits the Triton top-k; a CPU call and a call with a non-unit stride along
    the vocabulary (no launch, so this runs without a GPU) give the reference's tensors."""
    from phasegraph.kernels.softmax_topk import MAX_TRITON_K

    assert MAX_TOP_LOGPROBS <= MAX_TRITON_K
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 40, generator=g)
    tokens = torch.randint(0, 40, (3,), generator=g)
    want = token_logprobs_reference(logits, tokens, 5)
    strided = logits.t().contiguous().t()
    assert strided.stride(1) != 1
    for got in (token_logprobs(logits, tokens, 5), token_logprobs_triton(strided, tokens, 5)):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_logprobs_refuse_tokens_on_another_device():
    with pytest.raises(ValueError, match="expected one device"):
        token_logprobs(torch.zeros(2, 30), torch.zeros(2, dtype=torch.int64, device="meta"), 3)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_apply_token_bitmask_matches_xgrammar(vocab):
    """Bit j of word i allows token 32 i + j, as xgrammar packs its masks; every other token
    goes to -inf (xgrammar's own torch application is the reference)."""
    from phasegraph.kernels.penalties import apply_token_bitmask, token_bitmask_allows

    xgr = pytest.importorskip("xgrammar")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen)
    allowed = torch.rand(4, vocab, generator=gen) < 0.4
    bitmask = xgr.allocate_token_bitmask(4, vocab)  # [4, ceil(V/32)] int32, all allowed
    bits = torch.zeros(4, bitmask.shape[1] * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words = (bits.view(4, -1, 32) << torch.arange(32)).sum(dim=2)  # [4, Vw] as unsigned words
    bitmask.copy_(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, backend="torch_native")
    got = apply_token_bitmask(logits, bitmask)
    assert torch.equal(got, want)
    assert torch.equal(torch.isinf(got), ~allowed)
    rows = torch.arange(4).repeat_interleave(vocab)
    tokens = torch.arange(vocab).repeat(4)
    assert torch.equal(token_bitmask_allows(bitmask, rows, tokens), allowed.reshape(-1))
    with pytest.raises(ValueError, match="bitmask"):
        apply_token_bitmask(logits, bitmask[:, :0])
