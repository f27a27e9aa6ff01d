"""cos/sin of a transformers rotary embedding by table lookup on CUDA.

Rotary position embedding (Su et al., 2021, "RoFormer: Enhanced Transformer with Rotary Position
Embedding") rotates each query and key by angles ``position * inv_freq``. transformers' module
recomputes cos and sin on every forward: a float cast, a batched product, a concatenation, cos,
sin, two scalings and two casts, ~9 kernels, for the target's and for every draft forward (four
per chain iteration). For the rope types
whose angles depend on the position only, the table holds the module's own output for positions
``0 .. n-1`` (computed once, by the module). :meth:`RotaryTable.lookup` hands the tables and
the positions to :func:`~phasegraph.kernels.rotary.rotary_write_kv`, which reads each token's row
itself (no kernel of its own); calling the table gathers the rows (2 kernels).

A table is sized from the attention metadata's page table (no position can lie beyond the pages a
row owns, and the shape is host metadata, so no synchronisation) and rebuilt larger when a
forward's page table is wider; never inside a CUDA-graph capture (the warm-up before every
capture builds it). Off CUDA, and for rope types that update their frequencies with the sequence
length ("dynamic", "longrope"), the module runs as before: on the CPU an elementwise cos may
round a tail element differently from the vectorised body, so only on CUDA is the gathered row
bit for bit the module's.
"""

from __future__ import annotations

import torch

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.runtime.models.take_rows import take_rows

STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
_ROUND = 1024  # table lengths are multiples of this (a few rebuilds at most)
_ATTR = "_phasegraph_rotary_table"


class RotaryTable:
    """cos/sin rows of ``rotary`` (a transformers rotary embedding) per position."""

    devices = ("cuda",)  # where the table is used (tests add "cpu")

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.static = getattr(rotary, "rope_type", "default") in STATIC_ROPE_TYPES
        self.cos: torch.Tensor | None = None  # [n, D]
        self.sin: torch.Tensor | None = None
        self.builds = 0

    @classmethod
    def of(cls, rotary: torch.nn.Module) -> RotaryTable:
        """The table cached on ``rotary`` (built once per module)."""
        table = getattr(rotary, _ATTR, None)
        if table is None:
            table = cls(rotary)
            setattr(rotary, _ATTR, table)  # a plain attribute: not a parameter or buffer
        return table

    def module(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's own cos, sin [T, D] in ``like``'s dtype."""
        cos, sin = self.rotary(like, positions[None])  # [1, T, D] each
        return cos[0], sin[0]

    def lookup(
        self,
        like: torch.Tensor,  # any tensor of the forward's dtype and device
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(cos, sin, rows)`` for ``rotary_write_kv``: the tables [n, D] and ``rows =
        positions`` where the table serves them, else the module's rows [T, D] and None."""
        if not self.static or positions.device.type not in self.devices:
            return (*self.module(like, positions), None)
        need = meta.page_table.shape[1] * meta.page_size  # every position of the rows' pages
        fits = self.cos is not None and self.cos.shape[0] >= need and self.cos.dtype == like.dtype \
            and self.cos.device == positions.device
        if not fits:
            if positions.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return (*self.module(like, positions), None)  # building would record, not compute
            self._build(like, positions.device, need)
        return self.cos, self.sin, positions

    def __call__(
        self,
        like: torch.Tensor,  # any tensor of the forward's dtype and device
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [T, D] each, ``like``'s dtype
        cos, sin, rows = self.lookup(like, positions, meta)
        if rows is None:
            return cos, sin
        return take_rows(cos, rows), take_rows(sin, rows)

    def _build(self, like: torch.Tensor, device: torch.device, need: int) -> None:
        n = -(-need // _ROUND) * _ROUND
        self.cos, self.sin = self.module(like, torch.arange(n, device=device))
        self.builds += 1
