"""Log-probabilities the target gives tokens: of a chosen token per row and of each row's top k.

Logprobs are ``log_softmax`` of the target's raw logits (before temperature, top-k/top-p,
min_p, bias and penalties: the model's own distribution, as vLLM reports by default), so they
depend only on the target and the position, never on the sampling settings or on speculation.
Computed as ``logit - logsumexp(row)``: the top k of a row's logprobs are the top k of its
logits, so no ``[R, V]`` float32 table of logprobs is made (a prompt's every row is one).

The reference is torch (one reduction, one gather and one ``topk``). On CUDA the Triton path
runs the chunked top-k of :mod:`phasegraph.kernels.softmax_topk` in its logprob mode: two
launches give the row's logsumexp, the chosen logprob and the top k, where torch's ``topk``
alone is a radix select and a sort. Among equal logits the Triton path puts the smaller id
first; the reference keeps ``topk``'s order, which torch leaves unspecified.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from phasegraph.kernels._checks import expect, expect_float, expect_shape
from phasegraph.kernels._dispatch import use_triton
from phasegraph.kernels.softmax_topk import chunked_topk

MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's default bound on top logprobs per position


class TokenLogprobs(NamedTuple):
    chosen: torch.Tensor  # [R] float32, logprob of the chosen token of each row
    top: torch.Tensor | None  # [R, k] float32, the k largest logprobs, most likely first
    top_ids: torch.Tensor | None  # [R, k] int64, their token ids


def _check(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> None:
    expect_float(logits, "logits", 2)
    expect(tokens, "tokens", 1, torch.int64)
    expect_shape(tokens, "tokens", (logits.shape[0],))
    if tokens.device != logits.device:
        raise ValueError(f"tokens on {tokens.device}, logits on {logits.device}: expected one device")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top must be in [0, {MAX_TOP_LOGPROBS}]; got {top}")


def token_logprobs_reference(
    logits: torch.Tensor,  # [R, V] float, the target's raw logits
    tokens: torch.Tensor,  # [R] i64, the chosen token of each row
    top: int = 0,  # k: also the k most likely tokens of each row (0: none)
) -> TokenLogprobs:
    """Torch ``token_logprobs``: ``logsumexp``, ``gather`` and ``topk`` (ties in its order)."""
    _check(logits, tokens, top)
    vocab = logits.shape[1]
    x = logits.to(torch.float32)
    norm = torch.logsumexp(x, dim=-1)  # [R]
    chosen = x.gather(1, tokens.clamp(0, max(vocab - 1, 0))[:, None])[:, 0] - norm
    if top == 0:
        return TokenLogprobs(chosen, None, None)
    values, ids = x.topk(min(top, vocab), dim=-1)  # sorted, largest first
    return TokenLogprobs(chosen, values - norm[:, None], ids)


def token_logprobs_triton(
    logits: torch.Tensor,  # [R, V] float, unit stride along V
    tokens: torch.Tensor,  # [R] i64
    top: int = 0,
) -> TokenLogprobs:
    """Triton ``token_logprobs``: the chunk and merge passes of ``softmax_topk`` in logprob
    mode (with ``top`` 0 they still pick one, unused); the reference where they do not apply."""
    _check(logits, tokens, top)
    vocab = logits.shape[1]
    if logits.stride(1) != 1 or vocab == 0:
        return token_logprobs_reference(logits, tokens, top)
    values, ids, chosen = chunked_topk(logits, max(1, min(top, vocab)), tokens=tokens)
    if top == 0:
        return TokenLogprobs(chosen, None, None)
    return TokenLogprobs(chosen, values, ids)


def token_logprobs(
    logits: torch.Tensor,  # [R, V] float, the target's raw logits
    tokens: torch.Tensor,  # [R] i64, the chosen token of each row
    top: int = 0,  # k: also the k most likely tokens of each row (0: none)
) -> TokenLogprobs:
    """The chosen tokens' logprobs, and with ``top`` the ``min(top, V)`` most likely tokens
    of every row and their logprobs, most likely first (Triton on CUDA)."""
    if use_triton(logits):
        return token_logprobs_triton(logits, tokens, top)
    return token_logprobs_reference(logits, tokens, top)
