"""Sampling one token per row from processed target distributions (prefill and decode).

Torch only, on every device: ``inverse_cdf_sample`` is defined by a float32 ``cumsum`` and
``searchsorted``; a Triton scan adds in another order, so its picks would differ from these
wherever a coin lands within float32 rounding of a boundary, and there is little to gain (three
ops per row). ``sample_tokens`` is ``argmax`` or ``target_probs`` (see tree_sampling.py) plus
this, and says which rows' logits were finite (argmax.py).
"""

from __future__ import annotations

import torch

from phasegraph.kernels.argmax import TokenPick, argmax, argmax_finite, row_max_finite
from phasegraph.kernels.tree_sampling import target_probs


def inverse_cdf_sample(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] (need not be normalised) drawn with ``coins`` [R] in
    [0, 1): the first id whose cumulative mass exceeds ``coin * total``. Never returns an id of
    zero mass: rounding at the top end falls back to the last id with mass."""
    cdf = probs.float().cumsum(dim=-1)  # [R, V]
    total = cdf[:, -1:]
    target = coins.float()[:, None] * total
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]  # [R]
    last_nonzero = (probs > 0).float().cumsum(dim=-1).argmax(dim=-1)  # first index reaching the max count
    return torch.minimum(idx, last_nonzero)


def sample_tokens(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # [R] float32, 0 = greedy
    top_k: torch.Tensor,  # [R] int64, 0 = off
    top_p: torch.Tensor,  # [R] float32, 1 = off
    coins: torch.Tensor,  # [R] uniform in [0, 1)
    greedy_only: bool = False,
    min_p: torch.Tensor | None = None,  # [R] float, 0 = off; None: off for all
    raw_logits: torch.Tensor | None = None,  # [R, V]: the logits before bias and penalties
) -> TokenPick:
    """Next token per row: argmax when every row is greedy, else a sample from the target's
    temperature / top-k / top-p / min_p processed distribution (greedy rows stay exact
    argmax); and whether each row's logits were finite (a NaN or +inf row samples nothing
    meaningful). Where ``logits`` were processed (bias, penalties: clamped to finite values),
    ``raw_logits`` are the model's, which say whether the row was finite."""
    if greedy_only and raw_logits is None:
        return argmax_finite(logits)  # the pick and finiteness in one pass
    if greedy_only:
        tokens = argmax(logits)
    else:
        tokens = inverse_cdf_sample(target_probs(logits, temperature, top_k, top_p, 1, min_p), coins)
    return TokenPick.marked(tokens, row_max_finite(logits if raw_logits is None else raw_logits))
