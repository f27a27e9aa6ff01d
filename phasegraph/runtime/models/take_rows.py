"""Rows of a table by index, in the torch form that launches the fastest kernel for the count
(a choice between two torch ops, so it lives with the models, not among the kernels with
references and Triton twins).

``index_select`` (and ``F.embedding``, which runs it) takes a kernel for few indices
(``indexSelectSmallIndex``) that is slow from two to a few dozen rows, up to 5x slower than the
element-wise gather of advanced indexing (``table[index]``) on a GPU; at one row it is the
faster. Both forms copy rows exactly, so the choice never changes a value; on the CPU the
``index_select`` form always runs.
"""

from __future__ import annotations

import torch

_INDEXING_ROWS = range(2, 64)  # row counts where ``table[index]`` was measured faster


def take_rows(
    table: torch.Tensor,  # [V, *]
    index: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, *]
    """``table.index_select(0, index)``."""
    if table.is_cuda and index.dim() == 1 and index.shape[0] in _INDEXING_ROWS:
        return table[index]
    return table.index_select(0, index)


def lookup_table(module: torch.nn.Module) -> torch.Tensor | None:
    """The weight of an embedding module whose lookup is a plain row gather (an
    ``nn.Embedding`` without max_norm renormalisation), else None (call the module)."""
    if type(module) is torch.nn.Embedding and module.max_norm is None:
        return module.weight
    return None


def embed(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, H]
    """``module(ids)`` for an embedding module; a plain ``nn.Embedding`` (no max_norm
    renormalisation) gathers its rows through :func:`take_rows`."""
    table = lookup_table(module)
    if table is not None and ids.dim() == 1:
        return take_rows(table, ids)
    return module(ids)
