"""EAGLE-3 draft head, in the public layouts of SafeAILab/EAGLE (``cnets.py``), SpecForge,
vLLM (``llama_eagle3.py``) and vllm-project/speculators (flattened by ``draft_layouts``).

Math, per token (``Hd`` draft hidden, ``Ht`` target hidden)::

    f  = input_norm(feature [3*Ht])                 ``norm_before_fc`` only
    f  = concat(fc_norm_i(f_i) for the 3 chunks)    ``fc_norm`` only (EAGLE 3.1)
    h  = fc(f)   if from_target  else hidden        [Hd]
    e  = embed(token)                               the head's own embed_tokens where it
                                                    differs from the target's, else the target's
    x  = concat(input_layernorm(e), hidden_norm(h)) [2*Hd]
    r  = hidden_norm(h) if norm_before_residual else h
    h1 = r + o_proj(attn(q/k/v_proj(x)))            RoPE at ``positions``
    out = h1 + mlp(post_attention_layernorm(h1))
    out = layer_i(out)  for i = 1..n-1              plain pre-norm Llama layers (multi-layer heads)
    logits = lm_head(norm(out))                     [Vd]; the target's lm_head where the
                                                    checkpoint has none
    next hidden = norm(out) if norm_output else out

``to_target_ids(d) = d + d2t[d]`` when the checkpoint carries ``d2t`` (always when
``draft_vocab_size < vocab_size``), identity otherwise.

Checkpoint (``model.safetensors`` or ``pytorch_model.bin``): ``fc.weight [Hd, 3*Ht]``, the
decoder layers under ``midlayer.`` (one layer), ``midlayers.{i}.`` or ``layers.{i}.`` (the
first with ``self_attn.{q,k,v}_proj.weight [*, 2*Hd]`` and ``hidden_norm``), ``norm.weight``,
``lm_head.weight [Vd, Hd]`` (optional), ``d2t [Vd] int64``, ``t2d [V] bool`` (optional,
unused), ``embed_tokens.weight [V, Hd]`` (optional; required where ``Hd != Ht``),
``input_norm.weight [3*Ht]`` and ``fc_norm.{0,1,2}.weight [Ht]`` with their switches.
``config.json``: Llama keys + ``draft_vocab_size`` (+ ``target_hidden_size``, the switches).
``num_hidden_layers`` must count the layers the checkpoint holds; a switch whose value is not
implemented (``bias: true``, ``use_aux_hidden_state: false``, ``num_aux_hidden_states`` other
than 3) raises :class:`UnsupportedDraftLayout`.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
)

from phasegraph.kernels.linear import add_rms_norm_linear, linear, silu_mul_linear
from phasegraph.kernels.rms_norm import rms_norm_concat
from phasegraph.phases.protocols import DraftOutput
from phasegraph.runtime.errors import UnsupportedDraftLayout, UnsupportedModel
from phasegraph.runtime.models.draft_base import FeatureDraft, require, run_decoder_layer
from phasegraph.runtime.models.draft_layouts import layer_indices, require_layers, switch
from phasegraph.runtime.models.fused_decoder import (
    FusedLayer,
    fuse_layer,
    shard_layer,
    unfusable_config_reason,
)
from phasegraph.runtime.models.rotary_table import RotaryTable
from phasegraph.runtime.models.take_rows import lookup_table, take_rows
from phasegraph.runtime.models.target import HFTarget, declared_eagle3_layers, head_dim_of


class Eagle3Midlayer(nn.Module):
    """The single decoder layer whose attention reads concat(embedding, hidden) [2*Hd]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        head_dim = head_dim_of(config)
        bias = config.attention_bias
        self.self_attn = LlamaAttention(config, layer_idx=0)
        self.self_attn.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * head_dim, bias)
        self.self_attn.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias)
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)


@attrs.frozen
class Eagle3Layout:
    """What an EAGLE-3 config and its tensor names say about the head (see the module doc)."""

    prefix: str = "midlayer"  # "midlayer" (one layer) | "midlayers" | "layers"
    num_layers: int = 1
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    own_lm_head: bool = True
    own_embed: bool = False

    @classmethod
    def of(cls, raw: dict, config: LlamaConfig, keys: list[str], where: str) -> Eagle3Layout:
        single = any(k.startswith("midlayer.") for k in keys)
        lists = {p: layer_indices(keys, p) for p in ("midlayers", "layers")}
        found = [p for p, ids in lists.items() if ids] + (["midlayer"] if single else [])
        if len(found) != 1:
            raise UnsupportedDraftLayout(
                f"{where}: an EAGLE-3 head holds its decoder layers under one of midlayer.*, "
                f"midlayers.{{i}}.*, layers.{{i}}.*; this checkpoint holds {found or 'none'}"
            )
        prefix = found[0]
        require_layers([0] if single else lists[prefix], config.num_hidden_layers, prefix, where)
        eagle_config = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        switch(eagle_config, "use_aux_hidden_state", True, where, supported=(True,))
        aux = raw.get("num_aux_hidden_states")
        if aux is not None and aux != 3:
            raise UnsupportedDraftLayout(
                f"{where}: num_aux_hidden_states {aux!r} is not supported (the target provides 3)"
            )
        # SGLang reads ``bias`` as an fc bias, vLLM as an o_proj bias: no reading is safe
        switch(raw, "bias", False, where, supported=(False,))
        return cls(
            prefix=prefix,
            num_layers=config.num_hidden_layers,
            fc_norm=switch(raw, "fc_norm", False, where),
            norm_before_fc=switch(eagle_config, "norm_before_fc", switch(raw, "norm_before_fc", False, where), where),
            norm_before_residual=switch(raw, "norm_before_residual", False, where),
            norm_output=switch(raw, "norm_output", False, where),
            own_lm_head="lm_head.weight" in keys,
            own_embed="embed_tokens.weight" in keys,
        )

    @property
    def plain(self) -> bool:
        """The EAGLE reference's head: one layer, no extra norms, its own lm_head."""
        return (self.num_layers == 1 and not self.fc_norm and not self.norm_before_fc
                and not self.norm_output and self.own_lm_head)


class Eagle3Head(nn.Module):
    """The EAGLE-3 weights, named as in the public checkpoints of ``layout``."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        target_hidden_size: int,
        draft_vocab_size: int,
        with_d2t: bool,
        with_t2d: bool,
        layout: Eagle3Layout | None = None,
    ) -> None:
        super().__init__()
        self.layout = layout = layout or Eagle3Layout()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if layout.norm_before_fc:
            self.input_norm = LlamaRMSNorm(3 * target_hidden_size, eps=eps)
        if layout.fc_norm:
            self.fc_norm = nn.ModuleList([LlamaRMSNorm(target_hidden_size, eps=eps) for _ in range(3)])
        self.fc = nn.Linear(3 * target_hidden_size, hidden, bias=False)
        layers = [Eagle3Midlayer(config)] + [
            LlamaDecoderLayer(config, layer_idx=i) for i in range(1, layout.num_layers)
        ]
        if layout.prefix == "midlayer":
            self.midlayer = layers[0]
        else:
            setattr(self, layout.prefix, nn.ModuleList(layers))
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        if layout.own_lm_head:
            self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        if layout.own_embed:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        if with_d2t:
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        if with_t2d:
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def decoder_layers(self) -> list[nn.Module]:
        if self.layout.prefix == "midlayer":
            return [self.midlayer]
        return list(getattr(self, self.layout.prefix))

    @property
    def first_layer(self) -> Eagle3Midlayer:
        return self.decoder_layers[0]

    def fuse_features(self, feature: torch.Tensor) -> torch.Tensor:  # [T, 3Ht] -> [T, Hd]
        """``fc`` of the target features, after ``norm_before_fc`` (one norm over the three)
        and ``fc_norm`` (one norm per feature), in the order vLLM applies them."""
        if self.layout.norm_before_fc:
            feature = self.input_norm(feature)
        if self.layout.fc_norm:
            chunks = feature.chunk(3, dim=-1)
            feature = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], -1)
        return self.fc(feature)


def eagle3_dims(config: LlamaConfig) -> tuple[int, int]:
    """(target_hidden_size, draft_vocab_size) from an EAGLE-3 config."""
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
    return target_hidden, draft_vocab


class Eagle3Draft(FeatureDraft):
    """:class:`DraftModel` for an EAGLE-3 head; one draft pool layer.

    ``fused``: run the midlayer with merged projections and the fused kernels of
    :mod:`~phasegraph.runtime.models.fused_decoder` (the default where the config allows it;
    :attr:`fused_reason` says why not otherwise), or through transformers' modules (False).
    Both compute the same math; the fused path is ~16 kernels per forward instead of ~75
    (transformers' RMSNorm alone is 8), which is most of a small draft's step time under a
    CUDA graph.
    """

    def __init__(
        self, target: HFTarget, config: LlamaConfig, head: Eagle3Head, fused: bool | None = None
    ) -> None:
        super().__init__(target, config, head, num_pool_layers=head.layout.num_layers)
        self.target_hidden_size, self.vocab_size = eagle3_dims(config)  # vocab_size = Vd
        self.d2t: torch.Tensor | None = getattr(head, "d2t", None)  # [Vd] int64
        self.fused_layer: FusedLayer | None = None
        self.fused_reason: str | None = "switched off (fused=False)"
        self.tp = None  # a TensorParallelGroup once split() kept this rank's slice of the layer
        if fused is not False:
            self.fused_reason = unfusable_config_reason(config) or (
                None if head.layout.plain else f"the head's layout ({head.layout}) has no fused path"
            )
            if self.fused_reason is not None and fused:
                raise UnsupportedModel(f"the fused EAGLE-3 path cannot run this head: {self.fused_reason}")
            if self.fused_reason is None:
                with torch.no_grad():
                    self.fused_layer = fuse_layer(head.first_layer, config)

    def split(self, group) -> None:
        """Keep ``group.rank``'s slice of the fused layer, split as the target's layers are
        (``draft_tensor_parallel_size``); fc, norms, embedding and lm_head stay replicated."""
        if self.fused_layer is None:
            raise UnsupportedModel(f"draft_tensor_parallel_size={group.world_size} splits the fused EAGLE-3 layer, "
                                   f"which this head does not take: {self.fused_reason}")
        with torch.no_grad():
            self.fused_layer = shard_layer(self.fused_layer, group.rank, group.world_size, group.device)
        mid = self.head.first_layer
        del mid.self_attn, mid.mlp  # the whole layer's weights: the fused slice replaces them
        self.kv_spec = attrs.evolve(self.kv_spec, num_kv_heads=self.fused_layer.num_kv_heads)
        self.tp = group

    @classmethod
    def check_config(cls, where: str, config: LlamaConfig, raw: dict, target: HFTarget) -> None:
        target_hidden, draft_vocab = eagle3_dims(config)
        require(
            draft_vocab <= config.vocab_size,
            f"{where}: draft_vocab_size {draft_vocab} > vocab_size {config.vocab_size}",
        )
        require(
            config.vocab_size == target.vocab_size,
            f"{where}: draft vocab_size {config.vocab_size} != target vocab_size {target.vocab_size}",
        )
        require(
            target_hidden == target.hidden_size and target.feature_size == 3 * target_hidden,
            f"{where}: the head consumes features of width {3 * target_hidden} "
            f"(target_hidden_size {target_hidden}), but the target provides "
            f"{target.feature_size} (feature_mode={target.feature_mode!r}, hidden_size "
            f"{target.hidden_size})",
        )
        layers = declared_eagle3_layers(raw, target.num_layers, where)
        if layers is not None:
            target.use_feature_layers(layers)

    @classmethod
    def check_layout(cls, where, config, raw, checkpoint, target) -> None:
        layout = Eagle3Layout.of(raw, config, checkpoint.keys(), where)
        _, draft_vocab = eagle3_dims(config)
        if not layout.own_lm_head:  # SGLang's and vLLM's loaders then take the target's lm_head
            require(
                draft_vocab == config.vocab_size and "d2t" not in checkpoint.shapes
                and config.hidden_size == target.hidden_size,
                f"{where}: the head has no lm_head.weight, so it uses the target's, which needs "
                f"draft_vocab_size == vocab_size, no d2t and the target's hidden_size "
                f"({draft_vocab}, {config.vocab_size}, hidden_size {config.hidden_size} vs "
                f"{target.hidden_size})",
            )
        if config.hidden_size != target.hidden_size:
            require(
                layout.own_embed,
                f"{where}: draft hidden_size {config.hidden_size} != target hidden_size "
                f"{target.hidden_size}, so the head needs its own embed_tokens.weight "
                f"[{config.vocab_size}, {config.hidden_size}], which the checkpoint lacks",
            )

    @classmethod
    def build_head(cls, config: LlamaConfig, raw: dict, checkpoint) -> Eagle3Head:
        target_hidden, draft_vocab = eagle3_dims(config)
        return Eagle3Head(
            config,
            target_hidden_size=target_hidden,
            draft_vocab_size=draft_vocab,
            with_d2t=draft_vocab < config.vocab_size or "d2t" in checkpoint.shapes,
            with_t2d="t2d" in checkpoint.shapes,
            layout=Eagle3Layout.of(raw, config, checkpoint.keys(), str(checkpoint.directory)),
        )

    @classmethod
    def ignored_keys(cls, config, raw, checkpoint) -> dict[str, tuple[int, ...]]:
        return {}  # an embed_tokens.weight the checkpoint holds is the head's own (Eagle3Layout)

    def check_loaded(self, where: str) -> None:
        self.check_d2t(where)

    def check_d2t(self, where: str) -> None:
        if self.d2t is None:
            return
        mapped = torch.arange(self.vocab_size, device=self.d2t.device) + self.d2t  # [Vd]
        bad = (mapped < 0) | (mapped >= self.target.vocab_size)
        require(
            not bool(bad.any()),
            f"{where}: d2t maps draft ids {bad.nonzero().flatten()[:8].tolist()} outside the "
            f"target vocabulary [0, {self.target.vocab_size})",
        )

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    @property
    def target_id_offsets(self) -> torch.Tensor | None:
        """``d2t`` [Vd] int64 (or None): the draft phases map the top-k ids in its kernel,
        as :meth:`to_target_ids` does."""
        return self.d2t

    @torch.no_grad()
    def _forward(self, input_ids, hidden, positions, attn, from_target, step, logits_index) -> DraftOutput:
        # hidden: [T, 3*Ht] when from_target else [T, Hd]
        if self.fused_layer is not None:
            return self._forward_fused(input_ids, hidden, positions, attn, from_target, logits_index)
        head: Eagle3Head = self.head
        first, *rest = head.decoder_layers
        embeds = self._embed(input_ids).to(self.dtype)  # [T, Hd]
        h = head.fuse_features(hidden.to(self.dtype)) if from_target else hidden  # [T, Hd]
        normed_h = first.hidden_norm(h)  # [T, Hd]
        x = torch.cat([first.input_layernorm(embeds), normed_h], dim=-1)  # [T, 2Hd]
        residual = normed_h if head.layout.norm_before_residual else h  # vLLM's two orders
        position_embeddings = self._rope(x, positions)
        with self._context(attn, positions):
            attn_out, _ = first.self_attn(
                hidden_states=x[None], position_embeddings=position_embeddings, attention_mask=None
            )  # [1, T, Hd]
            h1 = residual + attn_out[0]  # [T, Hd]
            out = h1 + first.mlp(first.post_attention_layernorm(h1))  # [T, Hd]
            for layer in rest:  # plain pre-norm layers over the hidden alone
                out = run_decoder_layer(layer, out, position_embeddings, positions)
        rows = self._rows(out, logits_index)  # [R, Hd]
        normed = head.norm(rows)  # [R, Hd]
        if head.layout.own_lm_head:
            logits = head.lm_head(normed)  # [R, Vd], head dtype
        else:
            logits = self.target.lm_head(normed.to(self.target.dtype)).float()  # [R, V]
        if head.layout.norm_output:  # the next step is fed the normed hidden (vLLM norm_output)
            out = head.norm(out)
            rows = normed
        return DraftOutput(logits=logits, hidden=out, hidden_rows=None if logits_index is None else rows)

    def _forward_fused(self, input_ids, hidden, positions, attn, from_target, logits_index) -> DraftOutput:
        """The same math as the modules path, through the fused kernels (one token: the norm
        is the prologue of the next product, so ``norm -> lm_head`` is one kernel)."""
        head: Eagle3Head = self.head
        mid, layer = head.first_layer, self.fused_layer
        pool = self._attached_pool()
        tp = self.tp
        if tp is not None:
            tp.start_forward()
        h = (linear(hidden.to(self.dtype), head.fc.weight, head.fc.bias, static_weight=True)
             if from_target else hidden)  # [T, Hd]
        table = lookup_table(self.embedding)
        if table is not None:  # the lookup and its cast to the head's dtype inside the norm kernel
            embeds, rows = table, input_ids  # [V, Hd], [T]
        else:
            embeds, rows = self._embed(input_ids).to(self.dtype), None  # [T, Hd]
        x = rms_norm_concat(  # [T, 2Hd] = [input_layernorm(embeds) | hidden_norm(h)]
            embeds, layer.input_norm, layer.eps,
            h, mid.hidden_norm.weight, float(mid.hidden_norm.variance_epsilon), a_rows=rows,
        )
        cos, sin, rope_rows = RotaryTable.of(self.rotary).lookup(x, positions, attn)
        reduce_dtype = None if tp is None else tp.reduce_dtype
        attn_out = layer.attention_from_qkv(layer.qkv_of(x), cos, sin, pool.k[0], pool.v[0], attn, rope_rows,
                                            out_dtype=reduce_dtype)  # [T, Hd]
        if tp is not None:  # a rank's o product is a partial sum (row parallel)
            attn_out = tp.all_reduce_(attn_out).to(self.dtype)
        if head.layout.norm_before_residual:  # the residual is hidden_norm(h), x's second half
            h = x[:, self.hidden_size:].contiguous()
        # h1 = h + attn_out; gate_up = post_attention_layernorm(h1) @ gate_up
        gate_up, h1 = add_rms_norm_linear(
            attn_out, h, layer.post_norm, layer.eps, layer.gate_up_weight, layer.gate_up_bias,
            static_weight=True,
        )
        mlp_out = silu_mul_linear(gate_up, layer.down_weight, layer.down_bias,
                                  static_weight=True, out_dtype=reduce_dtype)  # [T, Hd]
        if tp is not None:  # so is its down product
            mlp_out = tp.all_reduce_(mlp_out).to(self.dtype)
        norm_eps = float(head.norm.variance_epsilon)
        rows = None  # [R, Hd] the rows of out at logits_index
        if logits_index is None:  # out = h1 + mlp_out; logits = lm_head(norm(out))
            logits, out = add_rms_norm_linear(
                mlp_out, h1, head.norm.weight, norm_eps, head.lm_head.weight, head.lm_head.bias,
                static_weight=True,
            )
        else:
            out = h1 + mlp_out  # [T, Hd]
            rows = take_rows(out, logits_index)
            logits, _ = add_rms_norm_linear(
                rows, None, head.norm.weight, norm_eps, head.lm_head.weight, head.lm_head.bias,
                static_weight=True,
            )
        # the head's dtype: the draft's top-k reads logits in float32 (an exact cast), so a
        # bfloat16 head's logits need no cast kernel of their own
        return DraftOutput(logits=logits, hidden=out, hidden_rows=rows)
