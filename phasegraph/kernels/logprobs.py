"""Log-probabilities the target gives tokens: of a chosen token per row and of each row's top k.

Logprobs are ``log_softmax`` of the target's raw logits (before temperature, top-k/top-p,
min_p, bias and penalties: the model's own distribution, as vLLM reports by default), so they
depend only on the target and the position, never on the sampling settings or on speculation.
Computed as ``logit - logsumexp(row)``: the top k of a row's logprobs are the top k of its
logits, so no ``[R, V]`` float32 table of logprobs is made (a prompt's every row is one).
Torch only, on every device: one reduction, one gather and one ``topk`` per call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from phasegraph.kernels._checks import expect, expect_float, expect_shape

MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's default bound on top logprobs per position


class TokenLogprobs(NamedTuple):
    chosen: torch.Tensor  # [R] float32, logprob of the chosen token of each row
    top: torch.Tensor | None  # [R, k] float32, the k largest logprobs, most likely first
    top_ids: torch.Tensor | None  # [R, k] int64, their token ids


def token_logprobs(
    logits: torch.Tensor,  # [R, V] float, the target's raw logits
    tokens: torch.Tensor,  # [R] i64, the chosen token of each row
    top: int = 0,  # k: also the k most likely tokens of each row (0: none)
) -> TokenLogprobs:
    """The chosen tokens' logprobs, and with ``top`` the ``min(top, V)`` most likely tokens
    of every row and their logprobs (ties in ``topk``'s order)."""
    expect_float(logits, "logits", 2)
    expect(tokens, "tokens", 1, torch.int64)
    rows, vocab = logits.shape
    expect_shape(tokens, "tokens", (rows,))
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top must be in [0, {MAX_TOP_LOGPROBS}]; got {top}")
    x = logits.to(torch.float32)
    norm = torch.logsumexp(x, dim=-1)  # [R]
    chosen = x.gather(1, tokens.clamp(0, max(vocab - 1, 0))[:, None])[:, 0] - norm
    if top == 0:
        return TokenLogprobs(chosen, None, None)
    values, ids = x.topk(min(top, vocab), dim=-1)  # sorted, largest first
    return TokenLogprobs(chosen, values - norm[:, None], ids)
