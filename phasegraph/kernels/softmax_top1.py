"""The most probable token of softmax(logits) per row, and its probability: a chain draft's step.

A chain (``topk == 1``) EAGLE draft step keeps one candidate per row: the argmax and its softmax
probability, which scores the path (Li et al., 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty", §3). The reference takes the full softmax and its ``max``, as
every path did before (SGLang #26358: no shortcut that changes what is computed). On a GPU those are
two single-row kernels, ~10 µs each over a 32k draft vocabulary at batch 1, three times an
iteration. The Triton kernel streams the row once with an online maximum and normaliser
(Milakov & Gimelshein, 2018, "Online normalizer calculation for softmax"):
``p_max = exp(x_max - x_max) / sum_j exp(x_j - x_max) = 1 / sum_j exp(x_j - x_max)``.

The values equal the reference's up to the order of the float32 sum; the index is the first
maximal logit. Where rounding makes two probabilities equal but not their logits, the reference
may pick either; the kernel picks the larger logit. A draft only proposes (verify decides), so
such a pick changes at most an acceptance, never an output.
"""

from __future__ import annotations

import torch

from phasegraph.kernels._checks import expect_float, expect_id_offsets
from phasegraph.kernels._dispatch import jit, pdl_enter, pdl_options, tl, use_triton

BLOCK_V = 4096  # logits per loop step of a program


def _check(logits: torch.Tensor) -> None:
    expect_float(logits, "logits", 2)
    if logits.shape[1] == 0:
        raise ValueError("logits: an empty vocabulary has no top token")


def softmax_top1_reference(
    logits: torch.Tensor,  # [R, V]
    id_offsets: torch.Tensor | None = None,  # [V] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # (probability [R, 1] float32, id [R, 1] int64)
    """``softmax(logits.float()).max(-1, keepdim=True)``. ``id_offsets``: the id ``i`` comes
    back as ``i + id_offsets[i]`` (an EAGLE-3 head's draft-to-target vocabulary map)."""
    _check(logits)
    expect_id_offsets(id_offsets, logits)
    prob, ids = torch.softmax(logits.float(), dim=-1).max(dim=-1, keepdim=True)
    return prob, ids if id_offsets is None else ids + id_offsets[ids]


@jit
def _softmax_top1_kernel(
    logits_ptr,  # [R, V]
    prob_ptr,  # [R] float32 out
    id_ptr,  # [R] int64 out
    offsets_ptr,  # [V] int64: the id i is stored as i + offsets[i] (OFFSETS)
    vocab,
    stride_row,
    BLOCK: tl.constexpr,
    OFFSETS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)  # running maximum
    best_id = tl.full((), 0, tl.int64)
    total = tl.full((), 0.0, tl.float32)  # sum of exp(x - best)
    for start in range(0, vocab, BLOCK):
        idx = start + cols
        x = tl.load(logits_ptr + row * stride_row + idx, mask=idx < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        block_max, block_arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        new_best = tl.maximum(best, block_max)
        # rescale what was summed under the old maximum (exp(-inf) = 0 on the first block);
        # while every logit so far is -inf, shift by 0 so that the sum stays 0, not NaN
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
        take = block_max > best  # strictly: the first maximal index across blocks wins
        best_id = tl.where(take, start + block_arg.to(tl.int64), best_id)
        best = new_best
    shift = tl.where(best == float("-inf"), 0.0, best)
    tl.store(prob_ptr + row, tl.exp(best - shift) / total)  # 1 / total; NaN for an all -inf row
    if OFFSETS:
        best_id += tl.load(offsets_ptr + best_id)
    tl.store(id_ptr + row, best_id)


def softmax_top1_triton(
    logits: torch.Tensor,  # [R, V], unit stride along V
    id_offsets: torch.Tensor | None = None,  # [V] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # (probability [R, 1] float32, id [R, 1] int64)
    """Triton ``softmax_top1``: one program per row, one pass over it; the id is mapped
    through ``id_offsets`` as it is stored."""
    _check(logits)
    expect_id_offsets(id_offsets, logits)
    if logits.stride(1) != 1:
        return softmax_top1_reference(logits, id_offsets)
    rows, vocab = logits.shape
    prob = torch.empty((rows, 1), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, 1), dtype=torch.int64, device=logits.device)
    if rows == 0:
        return prob, ids
    _softmax_top1_kernel[(rows,)](
        logits, prob, ids, ids if id_offsets is None else id_offsets.contiguous(), vocab,
        logits.stride(0), BLOCK=BLOCK_V, OFFSETS=id_offsets is not None, num_warps=8,
        **pdl_options(),
    )
    return prob, ids


def softmax_top1(
    logits: torch.Tensor,  # [R, V]
    id_offsets: torch.Tensor | None = None,  # [V] int64, id i -> i + id_offsets[i]
) -> tuple[torch.Tensor, torch.Tensor]:  # (probability [R, 1] float32, id [R, 1] int64)
    """The top token of ``softmax(logits)`` per row and its probability (Triton on CUDA)."""
    if use_triton(logits):
        return softmax_top1_triton(logits, id_offsets)
    return softmax_top1_reference(logits, id_offsets)
