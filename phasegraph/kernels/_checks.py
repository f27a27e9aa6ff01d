"""Entry checks shared by the kernel references.

They read only host metadata (ndim, dtype, shape), so they never synchronise with the device and
are safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch


def expect(t: torch.Tensor, name: str, ndim: int, dtype: torch.dtype | None = None) -> None:
    """Raise ``ValueError`` unless ``t`` has ``ndim`` dimensions (and ``dtype`` when given)."""
    if t.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-d tensor, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def expect_float(t: torch.Tensor, name: str, ndim: int) -> None:
    """Raise ``ValueError`` unless ``t`` is a floating-point tensor with ``ndim`` dimensions."""
    expect(t, name, ndim)
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")


def expect_shape(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless ``t.shape == shape``."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def expect_id_offsets(id_offsets: torch.Tensor | None, logits: torch.Tensor) -> None:
    """``id_offsets`` of the top-k kernels: None, or [V] int64 for ``logits`` [R, V] (id ``i``
    comes back as ``i + id_offsets[i]``)."""
    if id_offsets is not None:
        expect(id_offsets, "id_offsets", 1, torch.int64)
        expect_shape(id_offsets, "id_offsets", (logits.shape[1],))
