"""Attention over the paged KV pool, with an optional tree block (verify, draft, extend).

See ``docs/internals.md`` ("Attention metadata"). The torch reference below is the CPU path and
the oracle for the Triton kernel.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Where the T query tokens of one forward write their KV and what each of them reads.

    Query t writes its key/value into ``write_slots[t]`` and attends logical positions
    ``[0, kv_len[t])`` of page-table row ``query_row[t]``, plus ``kv_len[t] + e`` for every
    ``e`` with ``extra_mask[t, e]`` (the tree block behind the prefix).
    """

    write_slots: torch.Tensor  # [T] int64
    page_table: torch.Tensor  # [R, max_pages] int64
    query_row: torch.Tensor  # [T] int64, row of page_table
    kv_len: torch.Tensor  # [T] int64
    extra_mask: torch.Tensor | None  # [T, E] bool, or None
    page_size: int


# Upper bound on gathered key elements per chunk of queries (keeps the reference's memory bounded
# while every shape stays a function of tensor shapes only).
_GATHER_BUDGET = 1 << 24


def write_kv(
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    slots: torch.Tensor,  # [T] int64; negative entries go to the sink slot 0
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """Write one layer's key/value of T tokens into the pool, in place."""
    slots = slots.clamp(min=0)  # [T]
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def attention_allowed_mask(meta: AttentionMetadata, length: int) -> torch.Tensor:
    """``[T, length]`` bool: which logical positions of its row each query attends.

    Position ``l`` is allowed when ``l < kv_len[t]`` (the prefix) or when
    ``0 <= l - kv_len[t] < E`` and ``extra_mask[t, l - kv_len[t]]`` (the tree block).
    """
    device = meta.kv_len.device
    pos = torch.arange(length, device=device, dtype=torch.int64)  # [L]
    kv_len = meta.kv_len[:, None]  # [T, 1]
    allowed = pos[None, :] < kv_len  # [T, L]
    extra = meta.extra_mask
    if extra is not None and extra.shape[1] > 0:
        num_extra = extra.shape[1]
        rel = pos[None, :] - kv_len  # [T, L] offset into the tree block
        in_block = (rel >= 0) & (rel < num_extra)  # [T, L]
        tree = torch.gather(extra, 1, rel.clamp(0, num_extra - 1))  # [T, L]
        allowed = allowed | (in_block & tree)
    return allowed


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D], dtype of q
    """Reference paged attention with an optional tree block (see ``docs/internals.md``).

    Every query gathers the whole logical range of its page-table row,
    ``L = page_table.shape[1] * page_size`` positions (the tree block ``[kv_len, kv_len + E)``
    lies inside the row, so it needs no separate gather), and masks it with
    :func:`attention_allowed_mask`. Scores, softmax and the weighted sum run in float32. A query
    that attends nothing (a padded row with ``kv_len == 0`` and no tree bits) returns zeros.
    Shapes depend only on tensor shapes; there are no host syncs. Queries are processed in
    chunks sized from the shapes so the gathered keys stay below ``_GATHER_BUDGET`` elements.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    page_size = meta.page_size
    length = meta.page_table.shape[1] * page_size
    device = q.device

    pos = torch.arange(length, device=device, dtype=torch.int64)  # [L]
    page_of = pos // page_size  # [L]
    offset_of = pos % page_size  # [L]
    allowed = attention_allowed_mask(meta, length)  # [T, L]

    out = torch.empty_like(q)  # [T, H, D]
    chunk = max(1, _GATHER_BUDGET // max(1, length * num_kv_heads * head_dim))
    for start in range(0, num_tokens, chunk):
        end = min(num_tokens, start + chunk)
        rows = meta.query_row[start:end]  # [c]
        pages = meta.page_table.index_select(0, rows)  # [c, max_pages]
        slots = pages[:, page_of] * page_size + offset_of  # [c, L]
        k = k_cache[slots].float()  # [c, L, Hkv, D]
        v = v_cache[slots].float()  # [c, L, Hkv, D]
        qc = q[start:end].float().view(end - start, num_kv_heads, group, head_dim)  # [c,Hkv,G,D]
        scores = torch.einsum("chgd,clhd->chgl", qc, k) * scale  # [c, Hkv, G, L]
        mask = allowed[start:end, None, None, :]  # [c, 1, 1, L]
        scores = scores.masked_fill(~mask, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)  # [c, Hkv, G, 1]
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        probs = torch.exp(scores - row_max)  # [c, Hkv, G, L], 0 where masked
        denom = probs.sum(dim=-1, keepdim=True)  # [c, Hkv, G, 1]
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))
        ctx = torch.einsum("chgl,clhd->chgd", probs, v) / denom  # [c, Hkv, G, D]
        out[start:end] = ctx.reshape(end - start, num_heads, head_dim).to(q.dtype)
    return out
