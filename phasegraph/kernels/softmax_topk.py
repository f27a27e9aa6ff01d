"""The k most probable tokens of softmax(logits) per row, and their probabilities: a tree draft's step.

A tree EAGLE draft step expands every beam by its ``topk`` most probable next tokens, scored by
their draft probabilities (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees", §4). The reference takes the full softmax and ``topk``, as every path did
before (SGLang #26358: no shortcut that changes what is computed). On a GPU that is a softmax kernel
and a radix select, ~30 µs per call over a 32k draft vocabulary at batch 1, four times an
iteration. The Triton path makes two passes of small programs instead:

1. every (row, chunk of ``CHUNK`` logits) program finds its chunk's maximum, the sum of
   ``exp(x - max)`` over the chunk and the chunk's k largest logits;
2. one program per row combines the chunks' maxima and sums into the row's normaliser
   (Milakov & Gimelshein, 2018, "Online normalizer calculation for softmax") and picks the k
   largest of the chunks' candidates: ``p = exp(x - max) / sum_j exp(x_j - max)``.

The k largest of a row are among the union of each chunk's k largest, so pass 2 sees every
winner. Values are picked largest first through an order-preserving integer key of the float32
logit (NaN above +inf, as ``torch.topk`` orders it); among equal logits the smaller index comes
first, and a picked candidate's key drops below every other, so no index is picked twice even
where logits are -inf. Probabilities equal the reference's up to the order of the float32 sum;
where rounding makes two probabilities equal but not their logits, the reference may order
them either way and the kernel puts the larger logit first. A draft only proposes (verify
decides), so such an order changes at most an acceptance, never an output.

The same passes give top logprobs (:mod:`phasegraph.kernels.logprobs`): with ``LOGPROBS`` the
merge pass stores ``logit - logsumexp(row)`` for the k largest logits, and the chosen token's
logprob, instead of probabilities (which would underflow where a logprob is far below 0).
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect_float, expect_id_offsets
from phasegraph.kernels._dispatch import jit, pdl_enter, pdl_options, tl, use_triton

MAX_TRITON_K = 32  # larger k run the reference (a tree's topk is 1-10 in practice)
MIN_CHUNK = 2048  # logits per pass-1 program
MAX_CHUNKS = 128  # pass 2 holds a row's chunk statistics and candidates in registers


def _check(logits: torch.Tensor, k: int) -> None:
    expect_float(logits, "logits", 2)
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k = {k}: expected 1 <= k <= vocabulary size {logits.shape[1]}")


def softmax_topk_reference(
    logits: torch.Tensor,  # [R, V]
    k: int,
    id_offsets: torch.Tensor | None = None,  # [V] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # (probabilities [R, k] float32, ids [R, k] int64)
    """``softmax(logits.float()).topk(k)``: largest first. ``id_offsets``: each id ``i`` comes
    back as ``i + id_offsets[i]`` (an EAGLE-3 head's draft-to-target vocabulary map)."""
    _check(logits, k)
    expect_id_offsets(id_offsets, logits)
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return probs, ids if id_offsets is None else ids + id_offsets[ids]


@jit
def _flip(bits):
    """Its own inverse: float32 bits to an order key (:func:`_order_key`) and back."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def _order_key(x):
    """An int32 that orders like the float32 ``x`` (-0.0 just below +0.0, NaN above +inf)."""
    return _flip(x.to(tl.int32, bitcast=True))


@jit
def _key_value(key):
    """The float32 whose :func:`_order_key` is ``key``: a picked value without a second reduction."""
    return _flip(key).to(tl.float32, bitcast=True)


@jit
def _chunk_topk_kernel(
    logits_ptr,  # [R, V]
    chunk_max_ptr,  # [R, C] float32 out
    chunk_sum_ptr,  # [R, C] float32 out: sum of exp(x - chunk max)
    cand_val_ptr,  # [R, C, K] float32 out: the chunk's K largest logits, largest first
    cand_id_ptr,  # [R, C, K] int64 out: their vocabulary ids (>= V for padding past the row)
    vocab,
    stride_row,
    num_chunks,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = tl.arange(0, CHUNK)
    cols = chunk * CHUNK + offs
    x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)  # an all -inf chunk sums to 0, not NaN
    stat = row * num_chunks + chunk
    tl.store(chunk_max_ptr + stat, top)
    tl.store(chunk_sum_ptr + stat, tl.sum(tl.exp(x - shift), axis=0))
    key = _order_key(x)
    taken = -2147483647 - 1  # below every key
    for j in tl.static_range(K):
        best, at = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
        pick = offs == at
        tl.store(cand_val_ptr + stat * K + j, _key_value(best))
        tl.store(cand_id_ptr + stat * K + j, (chunk * CHUNK + at).to(tl.int64))
        key = tl.where(pick, taken, key)


@jit
def _merge_topk_kernel(
    chunk_max_ptr,  # [R, C]
    chunk_sum_ptr,  # [R, C]
    cand_val_ptr,  # [R, C, K]
    cand_id_ptr,  # [R, C, K]
    out_ptr,  # [R, K] float32 out: probabilities, or logprobs (LOGPROBS)
    id_ptr,  # [R, K] int64 out
    offsets_ptr,  # [V] int64: an id i is stored as i + offsets[i] (OFFSETS)
    logits_ptr,  # [R, V]: the chosen tokens' logits are read here (LOGPROBS)
    tokens_ptr,  # [R] int64: each row's chosen token (LOGPROBS)
    chosen_ptr,  # [R] float32 out: the chosen token's logprob (LOGPROBS)
    vocab,
    num_chunks,
    stride_row,
    stride_token,
    K: tl.constexpr,
    C_PAD: tl.constexpr,
    KC_PAD: tl.constexpr,
    OFFSETS: tl.constexpr,
    LOGPROBS: tl.constexpr,  # logit - logsumexp(row) instead of softmax probabilities
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    tops = tl.load(chunk_max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    sums = tl.load(chunk_sum_ptr + row * num_chunks + c, mask=c < num_chunks, other=0.0)
    top = tl.max(tops, axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    # a chunk's sum rescaled to the row's maximum; an all -inf chunk (sum 0) adds 0
    scaled = tl.where(sums == 0.0, 0.0, sums * tl.exp(tops - shift))
    total = tl.sum(scaled, axis=0)
    # torch.logsumexp's value: -inf for an all -inf row, +inf where a logit is +inf
    lse = tl.where(top == float("inf"), top, shift + tl.log(total))
    if LOGPROBS:
        token = tl.load(tokens_ptr + row * stride_token)
        token = tl.minimum(tl.maximum(token, 0), vocab - 1)  # as the reference clamps it
        chosen = tl.load(logits_ptr + row * stride_row + token).to(tl.float32)
        tl.store(chosen_ptr + row, chosen - lse)
    j = tl.arange(0, KC_PAD)
    valid = j < num_chunks * K
    vals = tl.load(cand_val_ptr + row * num_chunks * K + j, mask=valid, other=float("-inf"))
    ids = tl.load(cand_id_ptr + row * num_chunks * K + j, mask=valid, other=0)
    taken = -2147483647 - 1
    # candidates lie in chunk order and, within a chunk, largest first with smaller ids first
    # among equals: the first maximal position holds the smallest id of its value
    key = tl.where(valid & (ids < vocab), _order_key(vals), taken)
    for t in tl.static_range(K):
        best, at = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
        pick = j == at
        value = _key_value(best)
        if LOGPROBS:
            tl.store(out_ptr + row * K + t, value - lse)
        else:
            tl.store(out_ptr + row * K + t, tl.exp(value - shift) / total)
        picked = tl.sum(tl.where(pick, ids, 0), axis=0)
        if OFFSETS:
            picked += tl.load(offsets_ptr + picked)
        tl.store(id_ptr + row * K + t, picked)
        key = tl.where(pick, taken, key)


def _chunk_size(vocab: int) -> int:
    chunk = MIN_CHUNK
    while chunk * MAX_CHUNKS < vocab:
        chunk *= 2
    return chunk


def chunked_topk(
    logits: torch.Tensor,  # [R, V], unit stride along V, 1 <= k <= V
    k: int,
    id_offsets: torch.Tensor | None = None,  # [V] int64
    tokens: torch.Tensor | None = None,  # [R] int64: logprobs instead of probabilities
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The two launches, unchecked. Returns the k largest softmax probabilities ``[R, k]``
    float32 with their ids ``[R, k]`` int64 (through ``id_offsets``) and None; with ``tokens``,
    the k largest logprobs, their ids and each row's ``tokens`` logprob ``[R]`` float32."""
    rows, vocab = logits.shape
    dev = logits.device
    values = torch.empty((rows, k), dtype=torch.float32, device=dev)
    ids = torch.empty((rows, k), dtype=torch.int64, device=dev)
    chosen = None if tokens is None else torch.empty((rows,), dtype=torch.float32, device=dev)
    if rows == 0:
        return values, ids, chosen
    chunk = _chunk_size(vocab)
    num_chunks = -(-vocab // chunk)
    chunk_max = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    chunk_sum = torch.empty((rows, num_chunks), dtype=torch.float32, device=dev)
    cand_val = torch.empty((rows, num_chunks, k), dtype=torch.float32, device=dev)
    cand_id = torch.empty((rows, num_chunks, k), dtype=torch.int64, device=dev)
    _chunk_topk_kernel[(rows, num_chunks)](
        logits, chunk_max, chunk_sum, cand_val, cand_id, vocab, logits.stride(0), num_chunks,
        K=k, CHUNK=chunk, num_warps=4,
        **pdl_options(),
    )
    c_pad = max(2, 1 << (num_chunks - 1).bit_length())
    _merge_topk_kernel[(rows,)](
        chunk_max, chunk_sum, cand_val, cand_id, values, ids,
        ids if id_offsets is None else id_offsets.contiguous(),
        logits, ids if tokens is None else tokens, values if chosen is None else chosen,
        vocab, num_chunks, logits.stride(0), 0 if tokens is None else tokens.stride(0),
        K=k, C_PAD=c_pad, KC_PAD=max(16, 1 << (num_chunks * k - 1).bit_length()),
        OFFSETS=id_offsets is not None, LOGPROBS=tokens is not None, num_warps=4, **pdl_options(),
    )
    return values, ids, chosen


def softmax_topk_triton(
    logits: torch.Tensor,  # [R, V], unit stride along V
    k: int,
    id_offsets: torch.Tensor | None = None,  # [V] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # (probabilities [R, k] float32, ids [R, k] int64)
    """Triton ``softmax_topk``: a chunk pass and a merge pass, two launches; the merge pass
    maps the ids through ``id_offsets`` (no gather and add of their own)."""
    _check(logits, k)
    expect_id_offsets(id_offsets, logits)
    if logits.stride(1) != 1 or k > MAX_TRITON_K:
        return softmax_topk_reference(logits, k, id_offsets)
    probs, ids, _ = chunked_topk(logits, k, id_offsets)
    return probs, ids


def softmax_topk(
    logits: torch.Tensor,  # [R, V]
    k: int,
    id_offsets: torch.Tensor | None = None,  # [V] int64, id i -> i + id_offsets[i]
) -> tuple[torch.Tensor, torch.Tensor]:  # (probabilities [R, k] float32, ids [R, k] int64)
    """The ``k`` most probable tokens of ``softmax(logits)`` per row, largest first (Triton on CUDA)."""
    if use_triton(logits):
        return softmax_topk_triton(logits, k, id_offsets)
    return softmax_topk_reference(logits, k, id_offsets)
