"""Where a Triton program stands: the lane arithmetic most kernels start with.

Called right after :func:`~phasegraph.kernels._dispatch.pdl_enter` (which stays a kernel's
first statement); the results are plain index arithmetic, no memory is touched.
"""

from __future__ import annotations

from phasegraph.kernels._dispatch import jit, tl


@jit
def row_lanes(BLOCK: tl.constexpr, n):
    """A kernel's usual start after ``pdl_enter(PDL)``: its program index on grid axis 0
    (int64, so that row offsets past 2**31 elements stay exact), the lanes ``0 .. BLOCK-1`` and
    the mask ``lanes < n``."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    return row, lanes, lanes < n


@jit
def row_block(BLOCK: tl.constexpr, n):
    """:func:`row_lanes` on a 2-d grid: the row on axis 0 (int64), the lanes of block
    ``program_id(1)`` (``BLOCK`` wide) and the mask ``lanes < n``."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return row, lanes, lanes < n
