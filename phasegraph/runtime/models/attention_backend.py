"""The "phasegraph" attention implementation for transformers' modeling code.

transformers' attention modules (``LlamaAttention`` and relatives) project q/k/v, apply RoPE and
then call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)``.
We register :func:`phasegraph_attention` under the name ``"phasegraph"``: it writes the layer's
key/value into the paged pool at ``meta.write_slots`` and attends with
:func:`phasegraph.kernels.attention.paged_attention`.

What to read and write comes from the *forward context*, a small object the model adapter sets
around one forward with :func:`forward_context`: the :class:`AttentionMetadata`, the
:class:`KVPool`, and how ``module.layer_idx`` maps to pool layers. The context is plain Python
state read while the forward is traced, so it works unchanged under CUDA-graph capture (the
captured kernels reference the tensors the context held at capture time: a runner must keep the
metadata in static buffers and refill them in place before replay).

A no-op mask function is registered under the same name through ``AttentionMaskInterface`` so
that a full ``model(...)`` call builds no mask; our adapters drive the decoder layers directly
and never ask for one.

Token layout: batch dim 1, T flattened tokens, ``position_ids [1, T]``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import attrs
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from phasegraph.kernels.attention import AttentionMetadata, paged_attention, window_of, write_kv
from phasegraph.runtime.errors import NoForwardContext
from phasegraph.runtime.kv_pool import KVPool

ATTN_IMPLEMENTATION = "phasegraph"


@attrs.frozen(eq=False)
class ForwardContext:
    """What the attention function of every layer reads during one forward."""

    meta: AttentionMetadata
    pool: KVPool
    layer_map: tuple[int, ...] | None = None  # module.layer_idx -> pool layer; None = identity
    positions: torch.Tensor | None = None  # [T] int64: what a sliding-window layer masks by

    def pool_layer(self, layer_idx: int) -> int:
        layer = layer_idx if self.layer_map is None else self.layer_map[layer_idx]
        if not 0 <= layer < self.pool.num_layers:
            raise IndexError(
                f"attention layer {layer_idx} maps to pool layer {layer}, but the pool has "
                f"{self.pool.num_layers} layers"
            )
        return layer


_STACK: list[ForwardContext] = []


@contextmanager
def forward_context(
    meta: AttentionMetadata,
    pool: KVPool,
    layer_map: Sequence[int] | None = None,
    positions: torch.Tensor | None = None,
) -> Iterator[ForwardContext]:
    """Make ``meta``/``pool`` current for the attention layers run inside the block;
    ``positions`` (the query tokens' positions) let sliding-window layers mask by them."""
    ctx = ForwardContext(meta, pool, tuple(layer_map) if layer_map is not None else None, positions)
    _STACK.append(ctx)
    try:
        yield ctx
    finally:
        _STACK.pop()


def current_forward_context() -> ForwardContext:
    if not _STACK:
        raise NoForwardContext(
            "the 'phasegraph' attention ran outside forward_context(meta, pool); "
            "call the model through a phasegraph adapter (HFTarget, a draft head)"
        )
    return _STACK[-1]


def phasegraph_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, T, H, D], None), the layout sdpa_attention_forward returns
    """Write this layer's K/V into the pool, then paged attention over the pool.

    ``attention_mask`` is ignored (the metadata says what each query reads), and so is
    ``dropout`` (inference only). ``sliding_window`` (Mistral and Qwen2 layers pass it) narrows
    each query's prefix to the window ending at its position (:func:`window_of`), which needs
    the positions in the forward context.
    """
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("the phasegraph attention does not implement logit softcapping")
    if query.shape[0] != 1:
        raise ValueError(
            f"phasegraph attention expects batch dim 1 (flattened), got {query.shape}"
        )
    ctx = current_forward_context()
    layer = ctx.pool_layer(module.layer_idx)
    k_cache, v_cache = ctx.pool.k[layer], ctx.pool.v[layer]
    write_kv(
        k_cache, v_cache, ctx.meta.write_slots, key[0].transpose(0, 1), value[0].transpose(0, 1)
    )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    meta = ctx.meta
    window = kwargs.get("sliding_window")
    if window is not None:
        if ctx.positions is None:
            raise NoForwardContext(
                f"layer {module.layer_idx} attends a sliding window of {window} tokens, but the "
                "forward context holds no positions: pass forward_context(..., positions=...)"
            )
        meta = window_of(meta, ctx.positions, int(window))
    out = paged_attention(query[0].transpose(0, 1), k_cache, v_cache, meta, scale)  # [T,H,D]
    return out.unsqueeze(0), None


def no_mask(*args, **kwargs) -> None:
    """Mask function for the "phasegraph" implementation: build nothing."""
    return None


def register() -> None:
    """Register the attention and mask functions (idempotent; done on import)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, phasegraph_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_mask)


register()
