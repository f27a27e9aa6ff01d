"""Mixture-of-experts targets (Qwen3-MoE, Mixtral) through transformers' modules: which experts
each layer's router chose, and an experts implementation a CUDA graph can capture
(:func:`capture_experts`; eager calls keep transformers' own choice).

The routed experts are read from each MoE layer's router (``mlp.gate``) by a forward hook that
exists only for the forward that asks for them (:func:`recording_routes`). Recent transformers
routers return ``(logits, scores, indices)``; older ones are a plain linear returning logits,
whose top-k of the softmax is what the block then routes by.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def moe_block(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The sparse MoE block of a decoder layer (``mlp``, or Mixtral's older ``block_sparse_moe``),
    None for a dense layer."""
    for name in ("mlp", "block_sparse_moe"):
        block = getattr(layer, name, None)
        if block is not None and hasattr(block, "experts") and hasattr(block, "gate"):
            return block
    return None


def moe_routers(model: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The router of every MoE layer of a causal LM, in layer order (dense layers, e.g. Qwen3-MoE's
    ``mlp_only_layers``, have none)."""
    blocks = (moe_block(layer) for layer in model.model.layers)
    return tuple(block.gate for block in blocks if block is not None)


def experts_per_token(config) -> int:
    """k: how many experts each token of an MoE layer is routed to."""
    return int(config.num_experts_per_tok)


def router_choice(output, top_k: int) -> torch.Tensor:  # [T, k] int64
    """The expert ids a router's ``output`` chose: the integer tensor of a ``(logits, scores,
    indices)`` tuple, else the top-k of the softmax of its logits (as the block computes it)."""
    if isinstance(output, (tuple, list)):
        chosen = [x for x in output if isinstance(x, torch.Tensor) and not x.is_floating_point()]
        if chosen:
            return chosen[-1].reshape(-1, top_k).to(torch.int64)
        output = output[0]
    logits = output.reshape(-1, output.shape[-1])  # [T, E]
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.topk(probs, top_k, dim=-1).indices  # [T, k]


@contextlib.contextmanager
def recording_routes(routers: tuple[torch.nn.Module, ...], top_k: int) -> Iterator[list[torch.Tensor]]:
    """Hooks on ``routers`` for the block: the yielded list receives each router's choice
    ([T, k] int64) in call order, which is layer order."""
    chosen: list[torch.Tensor] = []

    def hook(_module, _args, output) -> None:
        chosen.append(router_choice(output, top_k))

    handles = [router.register_forward_hook(hook) for router in routers]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


def capture_experts(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The experts implementation to capture the layers of ``model`` with, and why none can be
    (one of the two is None).

    transformers' ``"eager"`` experts loop over ``nonzero()`` of the experts hit, and torch's
    grouped product outside its bfloat16 fast path loops over the group offsets on the host:
    both synchronise, which a capture refuses. ``"batched_mm"`` gathers each token's experts'
    weights and never synchronises; bfloat16 keeps ``"grouped_mm"``, whose fast path does not
    either and does not copy the weights per token."""
    if getattr(model, "set_experts_implementation", None) is None:
        return None, ("this transformers version runs the experts in a loop over the experts hit, "
                      "which synchronises with the host")
    dtype = next(model.parameters()).dtype
    return ("grouped_mm" if dtype == torch.bfloat16 else "batched_mm"), None


@contextlib.contextmanager
def experts_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """``model``'s experts run transformers' implementation ``name`` inside the block."""
    previous = getattr(model.config, "_experts_implementation", None)
    if previous == name:
        yield
        return
    model.set_experts_implementation(name)
    try:
        yield
    finally:
        model.set_experts_implementation(previous)
