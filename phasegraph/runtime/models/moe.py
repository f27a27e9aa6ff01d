"""Mixture-of-experts targets (Qwen3-MoE, Mixtral) through transformers' modules: which experts
each layer's router chose, and an experts implementation a CUDA graph can capture.

The routed experts are read from each MoE layer's router (``mlp.gate``) by a forward hook that
exists only for the forward that asks for them (:func:`recording_routes`). Recent transformers
routers return ``(logits, scores, indices)``; older ones are a plain linear returning logits,
whose top-k of the softmax is what the block then routes by.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# transformers' experts implementations that run without a host synchronisation ("eager"
# loops over ``nonzero()`` of the hit experts, which a CUDA graph cannot capture), best first
CAPTURE_SAFE_EXPERTS = ("grouped_mm", "batched_mm")


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


def use_capture_safe_experts(model: torch.nn.Module) -> str | None:
    """Switch a model whose experts run transformers' ``"eager"`` loop to an implementation
    without host synchronisation; returns why CUDA graphs cannot capture its layers (None: they
    can)."""
    current = getattr(model.config, "_experts_implementation", None)
    setter = getattr(model, "set_experts_implementation", None)
    if current in CAPTURE_SAFE_EXPERTS:
        return None
    if setter is None:
        return ("this transformers version runs the experts in a loop over the experts hit, which "
                "synchronises with the host")
    for name in CAPTURE_SAFE_EXPERTS:
        try:
            setter(name)
        except (ValueError, ImportError, RuntimeError):
            continue
        return None
    return f"no experts implementation of {CAPTURE_SAFE_EXPERTS} is available"
