"""transformers' Llama-family decoder layers, executed with merged projections and fused kernels.

Why model code here, where transformers' own modules work: under a CUDA graph they reach about
half the memory-bandwidth bound of a batch-1 decode step on an 8B model, because a layer is ~36
small kernels (separate q/k/v and gate/up products, RMSNorm as 8 float32 ops, rotary embedding
as 12). Speculative decoding's speedup is measured against that step. So for the same modules
and the same weights we run, per layer:

    add_rms_norm+qkv product -> rotary_write_kv -> paged_attention -> o product
    -> add_rms_norm+gate_up product -> silu_mul+down product

(6 kernels) when a step has one token (bf16/fp16, on CUDA); where every query token has its own
page-table row (decode, draft steps) rotary_write_kv and paged_attention are one kernel
(:mod:`phasegraph.kernels.rope_attention`), so 5 (plus the combine pass where attention splits): the skinny Triton product of
:mod:`phasegraph.kernels.linear` streams each weight once and applies the norm or the
activation to its operand as it loads it. With 2..16 tokens the products are still the skinny
Triton kernel but the norm and activation kernels stay separate (fusing them was slower
there). Otherwise (more tokens, fp32, CPU) the same public functions run the
unfused sequence

    add_rms_norm -> qkv product -> rotary_write_kv -> paged_attention -> o product
    -> add_rms_norm -> gate_up product -> silu_mul -> down product

(9 kernels, cuBLAS products), op for op as before. The merged weights are built once; the
modules' own parameters become views into them, so memory is not doubled and transformers'
forward still runs on the same numbers. Every kernel's torch reference follows transformers' op
order, so in fp32 this path equals the modules' output (tests/runtime/test_target_parity.py
checks both paths against transformers' own forward). Layers this does not recognise (another
activation, missing projections, partial rotary) are not fused: :func:`fuse_decoder` returns the
reason and the target keeps the modules.
"""

from __future__ import annotations

import attrs
import torch

from phasegraph.kernels.attention import AttentionMetadata, paged_attention, window_of
from phasegraph.kernels.linear import add_rms_norm_linear, linear, silu_mul_linear
from phasegraph.kernels.rms_norm import add_rms_norm
from phasegraph.kernels.rope_attention import rope_paged_attention
from phasegraph.kernels.rotary import rotary_write_kv
from phasegraph.kernels.split_sum import SplitSum
from phasegraph.runtime.errors import UnsupportedModel
from phasegraph.runtime.models.rotary_table import RotaryTable
from phasegraph.runtime.models.take_rows import embed

SILU_ACTIVATIONS = ("silu", "swish")
_CACHE_ATTR = "_phasegraph_fused_layers"


def _merge_rows(modules: list[torch.nn.Linear], name: str) -> torch.Tensor | None:
    """One contiguous ``[sum(out), in]`` tensor (or bias) of several linears; the modules'
    parameters are replaced by views into it."""
    parts = [getattr(m, name) for m in modules]
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("some projections have a bias and some do not")
    merged = torch.cat([p.detach() for p in parts], dim=0)
    start = 0
    for m, p in zip(modules, parts, strict=True):
        rows = p.shape[0]
        setattr(m, name, torch.nn.Parameter(merged[start : start + rows], requires_grad=False))
        start += rows
    return merged


@attrs.frozen(eq=False)
class FusedLayer:
    """The tensors one fused decoder layer reads (views of, or merged from, the module's own)."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    eps: float
    qkv_weight: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor  # [H, Hq D]
    o_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor  # [2 I, H]
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    q_norm: torch.nn.Module | None = None  # Qwen3: RMSNorm over each head before rotary
    k_norm: torch.nn.Module | None = None
    sliding_window: int | None = None  # Mistral / Qwen2 sliding-window layers (layer_window)

    def qkv_of(self, normed: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, (Hq + 2Hkv) D]
        """The qkv product of an input already normed (:meth:`norm_qkv` norms it too)."""
        return linear(normed, self.qkv_weight, self.qkv_bias, static_weight=True)

    def attention_from_qkv(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2Hkv) D], the qkv product of the normed input
        cos: torch.Tensor,  # [T, D], or [P, D] tables with rope_rows
        sin: torch.Tensor,  # [T, D], or [P, D] tables with rope_rows
        k_cache: torch.Tensor,  # [slots, Hkv, D]
        v_cache: torch.Tensor,  # [slots, Hkv, D]
        meta: AttentionMetadata,
        rope_rows: torch.Tensor | None = None,  # [T] i64: each token's row of the tables
        defer: bool = False,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | SplitSum:  # [T, H], before the residual add
        """Rotary, KV write, attention and the ``o`` product; ``defer``: a split-K ``o`` product
        comes back unsummed (:class:`SplitSum`), for the norm that follows to sum;
        ``out_dtype``: the ``o`` product's dtype (a rank's partial sums, kept in float32)."""
        tokens = qkv.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is None:  # one launch where every query has its own row (decode, draft)
            out = rope_paged_attention(qkv, hq, hkv, d, cos, sin, k_cache, v_cache, meta,
                                       self.scaling, rope_rows)  # [T, Hq, D]
            return linear(out.reshape(tokens, hq * d), self.o_weight, self.o_bias, defer=defer,
                          static_weight=True, out_dtype=out_dtype)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, meta.write_slots, rope_rows)  # [T, Hq, D]
        out = paged_attention(q, k_cache, v_cache, meta, self.scaling)  # [T, Hq, D]
        return linear(out.reshape(tokens, hq * d), self.o_weight, self.o_bias, defer=defer,
                      static_weight=True, out_dtype=out_dtype)

    def mlp(self, normed: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate_up = linear(normed, self.gate_up_weight, self.gate_up_bias, static_weight=True)  # [T, 2I]
        return silu_mul_linear(gate_up, self.down_weight, self.down_bias, static_weight=True)

    def norm_qkv(
        self, hidden: torch.Tensor | SplitSum, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (qkv [T, (Hq + 2Hkv) D], new residual [T, H])
        """The input norm of ``hidden + residual`` and the qkv product (one kernel at one row)."""
        return add_rms_norm_linear(
            hidden, residual, self.input_norm, self.eps, self.qkv_weight, self.qkv_bias,
            static_weight=True,
        )

    def norm_mlp(
        self, hidden: torch.Tensor | SplitSum, residual: torch.Tensor, defer: bool = False,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor | SplitSum, torch.Tensor]:  # (mlp output [T, H], new residual [T, H])
        """The post-attention norm, the gate/up product, SiLU x up and the down product;
        ``defer``: split-K ``gate_up`` and ``down`` products go on unsummed (the SwiGLU kernel
        and the next norm sum them); ``out_dtype``: the ``down`` product's dtype."""
        gate_up, residual = add_rms_norm_linear(
            hidden, residual, self.post_norm, self.eps, self.gate_up_weight, self.gate_up_bias,
            defer=defer, static_weight=True,
        )
        down = silu_mul_linear(gate_up, self.down_weight, self.down_bias, defer=defer,
                               static_weight=True, out_dtype=out_dtype)
        return down, residual


def fuse_layer(layer: torch.nn.Module, config) -> FusedLayer:
    """The :class:`FusedLayer` of one Llama-style decoder layer (merges its projections)."""
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    head_dim = getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_heads = q.out_features // head_dim
    num_kv_heads = k.out_features // head_dim
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm without k_norm")
    return FusedLayer(
        input_norm=layer.input_layernorm.weight.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        eps=float(layer.input_layernorm.variance_epsilon),
        qkv_weight=_merge_rows([q, k, v], "weight"),
        qkv_bias=_merge_rows([q, k, v], "bias"),
        o_weight=o.weight.detach(),
        o_bias=None if o.bias is None else o.bias.detach(),
        gate_up_weight=_merge_rows([mlp.gate_proj, mlp.up_proj], "weight"),
        gate_up_bias=_merge_rows([mlp.gate_proj, mlp.up_proj], "bias"),
        down_weight=mlp.down_proj.weight.detach(),
        down_bias=None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach(),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        scaling=float(getattr(attn, "scaling", head_dim**-0.5)),
        q_norm=q_norm,
        k_norm=k_norm,
        sliding_window=layer_window(layer, config),
    )


def layer_window(layer: torch.nn.Module, config) -> int | None:
    """The sliding window transformers' module of ``layer`` passes to its attention function:
    Qwen2/Qwen3 attention modules hold theirs (None on full-attention layers), Mistral's passes
    ``config.sliding_window`` from every layer."""
    attn = layer.self_attn
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    if getattr(config, "model_type", None) in ("mistral", "mixtral"):  # both pass the config's
        return getattr(config, "sliding_window", None)
    return None


def unfusable_config_reason(config) -> str | None:
    """Why layers with this config cannot take the fused path: activation and rotary (None: they
    can, as far as the config says)."""
    if getattr(config, "hidden_act", None) not in SILU_ACTIVATIONS:
        return f"activation {getattr(config, 'hidden_act', None)!r} is not SiLU"
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return "partial rotary embedding"
    return None


def unfusable_reason(model: torch.nn.Module) -> str | None:
    """Why the decoder layers of ``model`` cannot take the fused path (None: they can)."""
    reason = unfusable_config_reason(model.config)
    if reason is not None:
        return reason
    inner = model.model
    if not hasattr(inner, "rotary_emb") or not hasattr(inner.norm, "variance_epsilon"):
        return "no shared rotary module or RMSNorm final norm"
    for idx, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if hasattr(mlp, "experts") or hasattr(layer, "block_sparse_moe"):
            return f"layer {idx} is a mixture of experts (transformers' modules run it)"
        needed = [(attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                  (mlp, ("gate_proj", "up_proj", "down_proj")),
                  (layer, ("input_layernorm", "post_attention_layernorm"))]
        for owner, names in needed:
            if owner is None or not all(hasattr(owner, n) for n in names):
                return f"layer {layer.__class__.__name__} lacks {names}"
        if not hasattr(layer.input_layernorm, "variance_epsilon"):
            return "a layer norm is not RMSNorm"
    return None


def fuse_decoder(model: torch.nn.Module) -> list[FusedLayer] | str:
    """The fused layers of ``model`` (built once per model and cached on it), or the reason why
    it cannot be fused."""
    cached = getattr(model, _CACHE_ATTR, None)
    if cached is not None:
        return cached
    reason = unfusable_reason(model)
    if reason is not None:
        return reason
    with torch.no_grad():
        layers = [fuse_layer(layer, model.config) for layer in model.model.layers]
    setattr(model, _CACHE_ATTR, layers)
    return layers


def run_fused_decoder(
    model: torch.nn.Module,
    layers: list[FusedLayer],
    input_ids: torch.Tensor,  # [T] i64
    positions: torch.Tensor,  # [T] i64
    meta: AttentionMetadata,
    k_caches: list[torch.Tensor],  # per layer [slots, Hkv, D]
    v_caches: list[torch.Tensor],
    capture_layers: tuple[int, ...] = (),
    all_reduce=None,  # tensor parallel: sums [T, H] over the ranks in place
    reduce_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # ([T, H] after the final norm, {layer: [T, H]})
    """Every decoder layer, then the final norm; also the residual input of ``capture_layers``.
    Split-K products whose next kernel is a norm or SwiGLU hand on their slices unsummed
    (:mod:`phasegraph.kernels.split_sum`: the same bits, one reduction pass less).
    ``all_reduce``: the layers are a rank's row-parallel slices (runtime/tensor_parallel.py), so
    the ``o`` and ``down`` products are partial sums, summed over the ranks before the norms;
    ``reduce_dtype`` (default the model's): the dtype they are summed in, rounded to the model's
    after the sum (float32: each layer's output rounded once, as at one rank)."""
    inner = model.model
    hidden = embed(inner.embed_tokens, input_ids)  # [T, H]
    cos, sin, rope_rows = RotaryTable.of(inner.rotary_emb).lookup(hidden, positions, meta)
    residual: torch.Tensor | None = None
    captured: dict[int, torch.Tensor] = {}
    windowed: dict[int, AttentionMetadata] = {}  # one metadata per distinct window
    for idx, layer in enumerate(layers):
        qkv, residual = layer.norm_qkv(hidden, residual)
        if idx in capture_layers:
            captured[idx] = residual  # the hidden state entering layer idx
        layer_meta = meta
        if layer.sliding_window is not None:
            window = layer.sliding_window
            if window not in windowed:
                windowed[window] = window_of(meta, positions, window)
            layer_meta = windowed[window]
        hidden = layer.attention_from_qkv(qkv, cos, sin, k_caches[idx], v_caches[idx], layer_meta, rope_rows,
                                          defer=all_reduce is None, out_dtype=reduce_dtype)
        if all_reduce is not None:
            hidden = all_reduce(hidden).to(residual.dtype)
        hidden, residual = layer.norm_mlp(hidden, residual, defer=True, out_dtype=reduce_dtype)
        if all_reduce is not None:
            hidden = all_reduce(hidden.total() if isinstance(hidden, SplitSum) else hidden).to(residual.dtype)
    final = inner.norm
    out, _ = add_rms_norm(hidden, residual, final.weight, float(final.variance_epsilon))
    return out, captured


# -- tensor-parallel slices ------------------------------------------------------------------------
# A rank's slices, split the Megatron-LM way (Shoeybi et al. 2019): qkv by head group and gate_up
# by intermediate block (column parallel), o and down by the matching input columns (row
# parallel), so a rank's layer output is a partial sum its caller all-reduces after o and down.
# The target, a standalone draft (a causal LM too) and an EAGLE-3 head's layer split this way.


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


def unsplittable(what: str, reason: str) -> UnsupportedModel:
    """The error for a model that tensor parallelism, which splits the fused layers, cannot split."""
    return UnsupportedModel(f"tensor parallelism runs the fused decoder path, which this {what} cannot take: "
                            f"{reason}")


def shard_target(target, group, what: str = "target", layers=None) -> None:
    """Make ``target`` (an HFTarget loaded whole, on the CPU) ``group.rank``'s slice on
    ``group.device``: fused layers sharded, everything else (embedding, final norm, lm_head,
    rotary) replicated there, the modules' own decoder layers dropped (the whole model's
    weights are freed once the caller lets go of them). ``layers``: the whole fused layers to
    slice, in order, where not the target's own (an iterator reading one at a time)."""
    if target.fused_layers is None:
        raise unsplittable(what, target.fused_reason)
    rank, world, device = group.rank, group.world_size, group.device
    sliced = []
    with torch.no_grad():
        for layer in target.fused_layers if layers is None else layers:
            sliced.append(shard_layer(layer, rank, world, device))
            del layer  # a layer read for this: its host copy goes before the next is read
    inner = target.model.model
    inner.layers = torch.nn.ModuleList()  # the whole layers' weights; the fused slices replace them
    target.model.__dict__.pop("_phasegraph_fused_layers", None)
    target.model.to(device)
    target.fused_layers = sliced
    target.device = device
    target.kv_spec = attrs.evolve(target.kv_spec, num_kv_heads=sliced[0].num_kv_heads)
    target.tp = group
