"""Helpers shared by the runtime tests: metadata builders and naive (dense, per-row) math."""

from __future__ import annotations

import math

import torch

from phasegraph.kernels.attention import AttentionMetadata


def slots_of(req_to_page: torch.Tensor, page_size: int, rows, positions) -> torch.Tensor:
    """KV slot of logical ``positions[t]`` of page-table row ``rows[t]``."""
    rows = torch.as_tensor(rows, dtype=torch.int64, device=req_to_page.device)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=req_to_page.device)
    pages = req_to_page[rows, positions // page_size]
    return pages * page_size + positions % page_size


def make_meta(
    req_to_page: torch.Tensor,
    page_size: int,
    rows,
    write_pos,
    kv_len,
    extra_mask: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Metadata for queries writing logical ``write_pos`` of ``rows`` and reading ``kv_len``."""
    device = req_to_page.device
    rows = torch.as_tensor(rows, dtype=torch.int64, device=device)
    return AttentionMetadata(
        write_slots=slots_of(req_to_page, page_size, rows, write_pos),
        page_table=req_to_page,
        query_row=rows,
        kv_len=torch.as_tensor(kv_len, dtype=torch.int64, device=device),
        extra_mask=None if extra_mask is None else extra_mask.to(device),
        page_size=page_size,
    )


def causal_meta(req_to_page, page_size, rows, positions) -> AttentionMetadata:
    """Causal extend: query at logical ``p`` writes ``p`` and reads ``[0, p]``."""
    positions = torch.as_tensor(positions, dtype=torch.int64)
    return make_meta(req_to_page, page_size, rows, positions, positions + 1)


# ---------------------------------------------------------------------------------------------
# Naive float64 Llama math (independent of transformers' modules and of the paged kernel)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [n, heads, D] rotated at positions pos [n] (rotate-half convention)."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = pos.double()[:, None] * inv[None]  # [n, D/2]
    emb = torch.cat([freqs, freqs], -1)[:, None, :]  # [n, 1, D]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * emb.cos() + rotated * emb.sin()


def rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = config.rope_parameters["rope_theta"]
    return float(theta)


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    out = x.double() @ layer.weight.double().T
    if layer.bias is not None:
        out = out + layer.bias.double()
    return out


def naive_attention(
    attn: torch.nn.Module,  # a LlamaAttention-like module (q/k/v/o_proj)
    x: torch.Tensor,  # [n, Din] inputs of every row of the history
    pos: torch.Tensor,  # [n] RoPE positions
    visible: torch.Tensor,  # [n, n] bool, query row i sees key row j
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    theta: float,
) -> torch.Tensor:  # [n, Dout] float64
    n = x.shape[0]
    q = rope(linear(x, attn.q_proj).view(n, heads, head_dim), pos, theta)
    k = rope(linear(x, attn.k_proj).view(n, kv_heads, head_dim), pos, theta)
    v = linear(x, attn.v_proj).view(n, kv_heads, head_dim)
    rep = heads // kv_heads
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = scores.softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * head_dim)
    return linear(out, attn.o_proj)


def naive_mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate = linear(x, mlp.gate_proj)
    return linear(torch.nn.functional.silu(gate) * linear(x, mlp.up_proj), mlp.down_proj)


def assert_conforms(obj, protocol) -> None:
    """``obj`` has the protocol's attributes and methods with the same parameters."""
    import inspect

    for name in getattr(protocol, "__annotations__", {}):
        assert hasattr(obj, name), f"{type(obj).__name__} lacks attribute {name}"
    for name, member in vars(protocol).items():
        if name.startswith("_") or not callable(member):
            continue
        want = inspect.signature(member).parameters
        got = inspect.signature(getattr(type(obj), name)).parameters
        assert [(p.name, p.kind) for p in want.values()] == [
            (p.name, p.kind) for p in got.values()
        ], f"{type(obj).__name__}.{name} signature differs from {protocol.__name__}"
