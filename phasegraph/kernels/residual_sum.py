"""A residual add on its way into the RMSNorm after it, in one of two forms.

In a pre-norm decoder layer the ``o`` and ``down`` products are each followed by
``s = product + residual`` and an RMSNorm of ``s`` (Zhang & Sennrich, 2019), whose statistic
``mean(s^2)`` spans the whole row. Where the next product takes the norm as its operand
prologue, that statistic is what keeps the norm a kernel of its own at 2..16 rows: every
program of the consumer would need every column of its rows. The product that makes ``s`` has
them, spread over its column blocks: each block can add the residual to its own columns and
store, next to ``s``, the sums of squares of its rows over those columns. The consumer then adds
up a few numbers per row instead of reading the rows.

:class:`ResidualSum` carries either form: ``summed`` (the product wrote ``s`` and its
``squares``) or ``pending`` (the product and the residual, still apart, for the norm kernel to
add as it always did). Both give the same ``s``; the statistic of the summed form is added up in
another order than the norm kernel's, so it may differ from it in the last bit.
"""

from __future__ import annotations

import attrs
import torch

from phasegraph.kernels.split_sum import SplitSum, materialize


@attrs.frozen(eq=False)
class ResidualSum:
    """``x + residual`` for the RMSNorm that follows: summed (with row statistics) or pending."""

    summed: torch.Tensor | None = None  # [T, H] x + residual, rounded like the torch add
    squares: torch.Tensor | None = None  # [B, T] float32: sum of summed^2 over each column block
    pending: tuple[torch.Tensor | SplitSum, torch.Tensor] | None = None  # (x [T, H], residual)

    def __attrs_post_init__(self) -> None:
        if (self.summed is None) == (self.pending is None):
            raise ValueError("ResidualSum: give either summed (with squares) or pending")
        if self.summed is not None:
            s, sq = self.summed, self.squares
            if s.ndim != 2:
                raise ValueError(f"summed: expected a [T, H] tensor, got {tuple(s.shape)}")
            if sq is None or sq.ndim != 2 or sq.dtype != torch.float32 \
                    or sq.shape[1] != s.shape[0] or not sq.is_contiguous():
                got = None if sq is None else (tuple(sq.shape), sq.dtype)
                raise ValueError(f"squares: expected a contiguous [B, {s.shape[0]}] float32 "
                                 f"tensor beside summed, got {got}")
        else:
            x, residual = self.pending
            if self.squares is not None:
                raise ValueError("squares: a pending sum has no statistics yet")
            if tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype:
                raise ValueError(f"residual: expected {tuple(x.shape)} {x.dtype}, got "
                                 f"{tuple(residual.shape)} {residual.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.summed.shape if self.summed is not None else self.pending[1].shape

    @property
    def dtype(self) -> torch.dtype:
        return self.summed.dtype if self.summed is not None else self.pending[1].dtype

    def parts(self) -> tuple[torch.Tensor | SplitSum, torch.Tensor | None]:
        """``(x, residual)`` as a norm kernel takes them: ``(summed, None)`` or the pending pair."""
        return (self.summed, None) if self.summed is not None else self.pending

    def total(self) -> torch.Tensor:  # [T, H]
        """``x + residual`` in the model dtype (the torch reference of the sum)."""
        if self.summed is not None:
            return self.summed
        x, residual = self.pending
        return residual + materialize(x)

    def rstd(self, eps: float) -> torch.Tensor:  # [T] float32
        """``1 / sqrt(mean(summed^2) + eps)`` from the block statistics (summed form only)."""
        if self.squares is None:
            raise ValueError("rstd: a pending sum has no statistics")
        return torch.rsqrt(self.squares.sum(0) / self.summed.shape[1] + eps)


def residual_sum_reference(
    y: torch.Tensor,  # [T, H] a product
    residual: torch.Tensor,  # [T, H]
    block: int,  # columns per block of the statistics
) -> ResidualSum:
    """The summed form of ``y + residual``: the sum rounded like the torch add, and each row's
    sum of squares (in float32) over each ``block`` columns."""
    if block < 1:
        raise ValueError(f"block: expected a positive column count, got {block}")
    summed = residual + y  # [T, H]
    h = summed.to(torch.float32)
    tokens, hidden = h.shape
    blocks = -(-hidden // block)
    padded = torch.zeros(tokens, blocks * block, dtype=torch.float32, device=h.device)
    padded[:, :hidden] = h
    squares = padded.pow(2).view(tokens, blocks, block).sum(-1)  # [T, B]
    return ResidualSum(summed=summed, squares=squares.t().contiguous())
