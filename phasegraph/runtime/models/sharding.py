"""A rank's slices of fused decoder layers, split the Megatron-LM way (Shoeybi et al. 2019).

The merged qkv product by head group and the merged gate_up product by intermediate block
(column parallel), ``o`` and ``down`` by the matching input columns (row parallel): the layer's
output on a rank is a partial sum, which the caller all-reduces after ``o`` and after ``down``.
The target (:func:`shard_target`), a standalone draft (the same code: it is a causal LM) and an
EAGLE-3 head's fused layer (:func:`shard_layer`) are split this way; ``group`` is a
:class:`~phasegraph.runtime.tensor_parallel.TensorParallelGroup` (its rank, size and device).
"""

from __future__ import annotations

import attrs
import torch

from phasegraph.runtime.errors import UnsupportedModel
from phasegraph.runtime.models.fused_decoder import FusedLayer


def head_split(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first kv head, kv heads) of ``rank``: query heads split
    evenly; kv heads too where ``world_size`` divides them, else each rank takes the one kv head
    its query heads share (``world_size`` a multiple of the kv heads)."""
    if num_heads % world_size:
        raise UnsupportedModel(f"tensor_parallel_size={world_size} does not divide the {num_heads} attention heads")
    q_n = num_heads // world_size
    if num_kv_heads % world_size == 0:
        kv_n = num_kv_heads // world_size
        return rank * q_n, q_n, rank * kv_n, kv_n
    if world_size % num_kv_heads:
        raise UnsupportedModel(f"tensor_parallel_size={world_size} neither divides nor is a multiple of the "
                               f"{num_kv_heads} kv heads")
    return rank * q_n, q_n, rank * q_n // (num_heads // num_kv_heads), 1


def _rows(w: torch.Tensor | None, spans: list[tuple[int, int]], device) -> torch.Tensor | None:
    if w is None:
        return None
    return torch.cat([w[a:b] for a, b in spans], dim=0).to(device).contiguous()


def shard_layer(layer: FusedLayer, rank: int, world_size: int, device: torch.device) -> FusedLayer:
    """``rank``'s slice of one fused decoder layer, on ``device``."""
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q0, qn, k0, kn = head_split(hq, hkv, rank, world_size)
    qkv = [(q0 * d, (q0 + qn) * d), ((hq + k0) * d, (hq + k0 + kn) * d),
           ((hq + hkv + k0) * d, (hq + hkv + k0 + kn) * d)]
    inter = layer.gate_up_weight.shape[0] // 2
    if inter % world_size:
        raise UnsupportedModel(f"tensor_parallel_size={world_size} does not divide the intermediate size {inter}")
    i0, i_n = rank * inter // world_size, inter // world_size
    gate_up = [(i0, i0 + i_n), (inter + i0, inter + i0 + i_n)]
    # row-parallel biases are added once, by rank 0, before the sum
    first = rank == 0

    def cols(w, a, b):
        return w[:, a:b].to(device).contiguous()

    def move(m):
        return None if m is None else m.to(device)

    return attrs.evolve(
        layer,
        input_norm=layer.input_norm.to(device), post_norm=layer.post_norm.to(device),
        qkv_weight=_rows(layer.qkv_weight, qkv, device),  # [(qn + 2kn) D, H]
        qkv_bias=_rows(layer.qkv_bias, qkv, device),
        o_weight=cols(layer.o_weight, q0 * d, (q0 + qn) * d),  # [H, qn D]
        o_bias=layer.o_bias.to(device) if first and layer.o_bias is not None else None,
        gate_up_weight=_rows(layer.gate_up_weight, gate_up, device),  # [2 I/N, H]
        gate_up_bias=_rows(layer.gate_up_bias, gate_up, device),
        down_weight=cols(layer.down_weight, i0, i0 + i_n),  # [H, I/N]
        down_bias=layer.down_bias.to(device) if first and layer.down_bias is not None else None,
        num_heads=qn, num_kv_heads=kn, q_norm=move(layer.q_norm), k_norm=move(layer.k_norm),
    )


def shard_target(target, group, what: str = "target") -> None:
    """Make ``target`` (an HFTarget loaded whole, on the CPU) ``group.rank``'s slice on
    ``group.device``: fused layers sharded, everything else (embedding, final norm, lm_head,
    rotary) replicated there, the modules' own decoder layers dropped (the whole model's
    weights are freed once the caller lets go of them)."""
    if target.fused_layers is None:
        raise UnsupportedModel(f"tensor parallelism runs the fused decoder path, which this {what} cannot take: "
                               f"{target.fused_reason}")
    rank, world, device = group.rank, group.world_size, group.device
    with torch.no_grad():
        layers = [shard_layer(layer, rank, world, device) for layer in target.fused_layers]
    inner = target.model.model
    inner.layers = torch.nn.ModuleList()  # the whole layers' weights; the fused slices replace them
    target.model.__dict__.pop("_phasegraph_fused_layers", None)
    target.model.to(device)
    target.fused_layers = layers
    target.device = device
    target.kv_spec = attrs.evolve(target.kv_spec, num_kv_heads=layers[0].num_kv_heads)
    target.tp = group
