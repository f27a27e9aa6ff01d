"""A split-K product handed on unsummed: its consumer adds the slices up as it loads them.

A skinny product whose K is split over several programs (``SkinnyConfig.split_k``) ends with
the last program of each column block summing the slices' partials in slice order: an atomic
counter, a fence and a second pass over the partials on the critical path of every such launch.
Where the next kernel reads the product's rows anyway (the norm after the attention's ``o``
product and after ``down``, SwiGLU after ``gate_up``), it can take the partials instead and do
that sum itself: the product's programs store their partial and stop. The consumer sums in the
same order, adds the bias and rounds to the model dtype exactly as the product's last program
would have, so either way the bits are the same.

:class:`SplitSum` carries the partials; :meth:`SplitSum.total` is the torch reference of the
sum, :func:`load_total` the Triton loader the consumer kernels share, and :func:`total_triton`
the sum as a kernel of its own (for a product whose consumer takes only a tensor).
"""

from __future__ import annotations

import attrs
import torch

from phasegraph.kernels._dispatch import cdiv, jit, pdl_enter, pdl_options, tl


@attrs.frozen(eq=False)
class SplitSum:
    """``rows`` rows of an ``[rows, N]`` product, still as ``S`` float32 partials."""

    partials: torch.Tensor  # [S, R >= rows, N] float32, slice s = the product over slice s of K
    rows: int
    bias: torch.Tensor | None  # [N] in ``dtype``, added after the slices
    dtype: torch.dtype  # the product's output dtype

    def __attrs_post_init__(self) -> None:
        p = self.partials
        if p.ndim != 3 or p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(f"partials: expected a contiguous [S, R, N] float32 tensor, got "
                             f"{tuple(p.shape)} {p.dtype}")
        if not 0 <= self.rows <= p.shape[1]:
            raise ValueError(f"rows: expected at most {p.shape[1]}, got {self.rows}")
        if self.bias is not None and tuple(self.bias.shape) != (p.shape[2],):
            raise ValueError(f"bias: expected shape ({p.shape[2]},), got {tuple(self.bias.shape)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.partials.shape[2]))

    @property
    def device(self) -> torch.device:
        return self.partials.device

    @property
    def slices(self) -> int:
        return self.partials.shape[0]

    def total(self) -> torch.Tensor:  # [rows, N] in ``dtype``
        """The product: the slices summed in slice order in float32, plus the bias, rounded."""
        total = self.partials[0, : self.rows].clone()
        for s in range(1, self.slices):
            total += self.partials[s, : self.rows]
        if self.bias is not None:
            total += self.bias.to(torch.float32)
        return total.to(self.dtype)


def materialize(x: torch.Tensor | SplitSum) -> torch.Tensor:
    """``x`` itself, or the summed product a :class:`SplitSum` stands for."""
    return x.total() if isinstance(x, SplitSum) else x


def split_args(x: torch.Tensor | SplitSum) -> tuple[torch.Tensor, int, int, torch.Tensor | None]:
    """Kernel arguments for :func:`load_total`: (base tensor, slices, slice stride, bias or None);
    a plain tensor is 0 slices (loaded as it is; its row stride is the caller's)."""
    if isinstance(x, SplitSum):
        p = x.partials
        return p, p.shape[0], p.shape[1] * p.shape[2], x.bias
    return x, 0, 0, None


@jit
def load_total(ptr, offs, mask, slice_stride, bias_ptr, bias_offs,
               SLICES: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """A tile of a product at ``offs``: loaded as it is (``SLICES`` 0), or summed over its
    ``SLICES`` float32 partials in slice order, plus the bias, rounded to ``OUT_DTYPE`` as the
    split-K product's last program rounds it. The slice loop is unrolled, so every slice's load
    is in flight at once."""
    if SLICES > 0:
        total = tl.zeros(offs.shape, dtype=tl.float32)
        for s in tl.static_range(SLICES):  # slice order, as the product's last program sums
            total += tl.load(ptr + s * slice_stride + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias_ptr + bias_offs, mask=mask, other=0.0).to(tl.float32)
        v = total.to(OUT_DTYPE)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0.0)
    return v


_TOTAL_BLOCK = 1024  # elements per program of _total_kernel


@jit
def _total_kernel(
    partials_ptr,  # [S, R, N] float32
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [rows, N] out
    numel,  # rows * N
    n,
    slice_stride,  # R * N
    SLICES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] of rows * N
    inside = offs < numel
    total = load_total(partials_ptr, offs, inside, slice_stride, bias_ptr, offs % n,
                       SLICES, HAS_BIAS, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, total, mask=inside)


def total_triton(x: SplitSum) -> torch.Tensor:  # [rows, N] in ``x.dtype``
    """:meth:`SplitSum.total` in one launch: the slices summed in slice order in float32, plus
    the bias, rounded (the same bits as the reference)."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    numel = rows * n
    if numel == 0:
        return out
    p = x.partials
    _total_kernel[(cdiv(numel, _TOTAL_BLOCK),)](
        p, out if x.bias is None else x.bias, out, numel, n, p.shape[1] * n,
        SLICES=x.slices, HAS_BIAS=x.bias is not None, BLOCK=_TOTAL_BLOCK, num_warps=4,
        **pdl_options(),
    )
    return out
