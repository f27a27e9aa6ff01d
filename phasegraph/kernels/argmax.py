"""Greedy choice: the index of each row's largest logit, as ``torch.argmax(logits, dim=-1)``.

Every greedy decode step and verify takes it over the target's vocabulary. torch reduces one
row in a single thread block, which reads a 128k vocabulary's 0.5 MB of float32 logits on one
SM (27 µs of an 8B decode step on an H100). Here the row is cut into
blocks of up to ``BLOCK_MAX`` logits, one program each, and a second launch merges the blocks'
candidates; a row that fits one block is done in one launch.

Semantics are torch's: the first index of the maximum; NaN counts as larger than everything,
so a row with NaN gives its first NaN (tests/gpu/test_triton_layer_kernels.py checks ties across
blocks, NaN, infinities and all -inf rows against ``torch.argmax``).

:func:`argmax_finite` also says, per row, whether the row's largest logit is finite: False where
the row holds a NaN or +inf, or only -inf; and gives the pick as the host should see it, the
index or :data:`NONFINITE_LOGITS`. The kernels know the maximum already, so these are two more
stores, no extra pass or launch; the phases use them to fail a request whose target overflowed
instead of emitting token 0 forever.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from phasegraph.kernels import _dispatch
from phasegraph.kernels._checks import expect_float
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes

BLOCK_MAX = 8192  # logits per program
NONFINITE_LOGITS = -2  # a pick whose logits held NaN or +inf (never a token id)


def _check(logits: torch.Tensor) -> None:
    expect_float(logits, "logits", 2)
    if logits.shape[1] == 0:
        raise ValueError("logits: an empty vocabulary has no largest entry")


class TokenPick(NamedTuple):
    tokens: torch.Tensor  # [R] int64: each row's pick (torch.argmax's answer, or a sample)
    finite: torch.Tensor  # [R] bool: the row's maximum is finite (no NaN, no +inf, not all -inf)
    emitted: torch.Tensor  # [R] int64: tokens where finite, else NONFINITE_LOGITS (what the host reads)

    @classmethod
    def marked(cls, tokens: torch.Tensor, finite: torch.Tensor) -> TokenPick:
        """``tokens`` with ``emitted`` derived from ``finite`` in torch ops."""
        return cls(tokens, finite, torch.where(finite, tokens, NONFINITE_LOGITS))


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    _check(logits)
    return logits.argmax(dim=-1)


def row_max_finite(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] bool
    """Whether each row's largest logit is finite (``amax`` propagates NaN)."""
    _check(logits)
    return torch.isfinite(logits.amax(dim=-1))


def argmax_finite_reference(logits: torch.Tensor) -> TokenPick:
    return TokenPick.marked(argmax_reference(logits), row_max_finite(logits))


@jit
def _first_max(x, idx, BIG: tl.constexpr):
    """(value, index) of the first maximum of ``x`` (NaN above everything: the first NaN)."""
    nan = x != x
    first_nan = tl.min(tl.where(nan, idx, BIG), axis=0)
    best = tl.max(tl.where(nan, float("-inf"), x), axis=0)
    first_best = tl.min(tl.where((x == best) & ~nan, idx, BIG), axis=0)
    has_nan = first_nan < BIG
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@jit
def is_finite(x):
    """``x`` is finite (NaN != NaN; +-inf fail the bound): here the row maximum from
    :func:`_first_max`, in ``build_tree`` every candidate score."""
    return (x == x) & (tl.abs(x) < float("inf"))


@jit(do_not_specialize=["vocab"])
def _block_argmax_kernel(
    logits_ptr,  # [R, V]
    val_ptr,  # [R, NB] f32 out: each block's maximum (NaN if it holds one)
    idx_ptr,  # [R, NB] i64 out: its first index (the final answer when NB == 1)
    finite_ptr,  # [R] bool out when NB == 1 and STORE_FINITE
    emitted_ptr,  # [R] i64 out when NB == 1 and STORE_FINITE: the index or NONFINITE
    vocab,
    stride_r,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
    STORE_FINITE: tl.constexpr,
    NONFINITE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    idx = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    x = tl.load(logits_ptr + r * stride_r + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    best, first = _first_max(x, idx, 1 << 62)
    if NB > 1:
        tl.store(val_ptr + r * NB + b, best)
    elif STORE_FINITE:
        ok = is_finite(best)
        tl.store(finite_ptr + r, ok)
        tl.store(emitted_ptr + r, tl.where(ok, first, NONFINITE))
    tl.store(idx_ptr + r * NB + b, first)


@jit
def _merge_blocks_kernel(
    val_ptr,  # [R, NB] f32
    idx_ptr,  # [R, NB] i64
    out_ptr,  # [R] i64
    finite_ptr,  # [R] bool out when STORE_FINITE
    emitted_ptr,  # [R] i64 out when STORE_FINITE: the index or NONFINITE
    NB: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    STORE_FINITE: tl.constexpr,
    NONFINITE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    r, offs, ok = row_lanes(BLOCK_NB, NB)
    val = tl.load(val_ptr + r * NB + offs, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + r * NB + offs, mask=ok, other=1 << 62)
    # Blocks are in index order and each holds its own first maximum, so the smallest index of
    # the blocks that hold the maximum (or a NaN) is the row's first.
    best, first = _first_max(val, idx, 1 << 62)
    tl.store(out_ptr + r, first)
    if STORE_FINITE:
        ok = is_finite(best)
        tl.store(finite_ptr + r, ok)
        tl.store(emitted_ptr + r, tl.where(ok, first, NONFINITE))


def _argmax_launch(logits: torch.Tensor, checked: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Grid ``(R, cdiv(V, BLOCK))`` with ``BLOCK = min(next_pow2(V), BLOCK_MAX)``, then one
    program per row over the blocks' candidates (skipped with one block). Reads each logit once;
    stores each row's finiteness and host-side pick into ``checked`` ([R] bool, [R] int64) when
    given."""
    _check(logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    block = min(next_pow2(vocab), BLOCK_MAX)
    blocks = _dispatch.cdiv(vocab, block)
    val = idx = out  # one block: its first index is the answer (the kernel stores no value)
    if blocks > 1:
        val = torch.empty((rows, blocks), dtype=torch.float32, device=logits.device)
        idx = torch.empty((rows, blocks), dtype=torch.int64, device=logits.device)
    finite, emitted = (out, out) if checked is None else checked  # never written unless checked
    flags = dict(STORE_FINITE=checked is not None, NONFINITE=NONFINITE_LOGITS)
    _block_argmax_kernel[(rows, blocks)](logits, val, idx, finite, emitted, vocab, logits.stride(0),
                                         NB=blocks, BLOCK=block, **flags, num_warps=8, **pdl_options())
    if blocks > 1:
        _merge_blocks_kernel[(rows,)](val, idx, out, finite, emitted, NB=blocks,
                                      BLOCK_NB=next_pow2(blocks), **flags, num_warps=1, **pdl_options())
    return out


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """Triton ``argmax`` (:func:`_argmax_launch`)."""
    return _argmax_launch(logits, None)


def argmax_finite_triton(logits: torch.Tensor) -> TokenPick:
    """Triton :func:`argmax_finite`: the same launches, two more stores per row."""
    _check(logits)
    finite = torch.empty(logits.shape[0], dtype=torch.bool, device=logits.device)
    emitted = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    return TokenPick(_argmax_launch(logits, (finite, emitted)), finite, emitted)


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """``logits.argmax(dim=-1)`` (Triton on CUDA)."""
    if use_triton(logits):
        return argmax_triton(logits)
    return argmax_reference(logits)


def argmax_finite(logits: torch.Tensor) -> TokenPick:  # [R, V] -> [R] int64, [R] bool, [R] int64
    """``argmax``, whether each row's maximum is finite, and the pick or NONFINITE_LOGITS
    (Triton on CUDA)."""
    if use_triton(logits):
        return argmax_finite_triton(logits)
    return argmax_finite_reference(logits)
