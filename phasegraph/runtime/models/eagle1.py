"""EAGLE-1 draft head (SafeAILab/EAGLE ``eagle/model/cnets1.py`` layout, and the
vllm-project/speculators ``eagle`` layout of the same head).

Math, per token (``H`` = target hidden = draft hidden)::

    e   = embedding_layernorm(target_embed(token))        speculators ``layernorms`` only
    x   = fc(concat(e, feature))                          fc: Linear(2H -> H), bias per config
    out = decoder_layers(x)                               Llama layers; layer 0 has no
                                                          input_layernorm (unless ``layernorms``)
    logits = target_lm_head(pre_lm_head_layernorm(out))   the norm: ``layernorms`` only
    next hidden = out

The feature is the target's last hidden state *after* its final norm (HFTarget
``feature_mode="last"``), i.e. exactly what the target's lm_head consumes. The head is trained to
predict the next such feature, so the target lm_head is applied to the layer output directly,
with no extra norm: the cnets1 layout has no ``norm.weight`` and the reference computes
``base_model.lm_head(ea_layer(...))``. ``from_target`` does not change the math (feature and
draft hidden live in the same space).

Switches of ``config.json`` (read as the reference reads them):

- ``bias`` (default true, as EAGLE's loader): ``fc.bias`` present or not (Yuhuili's LLaMA-3
  heads say false and carry none);
- ``qkv_bias`` (Qwen2 heads): q/k/v projections with biases, o_proj without;
- ``num_hidden_layers``: the decoder layers ``layers.{i}``, every one but the first with its
  ``input_layernorm``;
- speculators: ``fusion_bias`` (the fc bias) and ``layernorms`` (the three extra norms above).

Checkpoint (cnets1): ``fc.weight [H, 2H]``, ``fc.bias [H]`` (with ``bias``),
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.post_attention_layernorm.weight``, and often ``embed_tokens.weight``: EAGLE's
loader (``load_state_dict(strict=False)`` after copying the target's embedding) lets it win, so
it is used where it differs from the target's and dropped where it is a copy.
Speculators: ``fusion_fc.*`` for ``fc.*``, ``transformer.*`` for ``layers.0.*``, plus
``embedding_layernorm.weight`` and ``pre_lm_head_layernorm.weight`` with ``layernorms``.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from phasegraph.phases.protocols import DraftOutput
from phasegraph.runtime.models.draft_base import FeatureDraft, run_decoder_layer
from phasegraph.runtime.models.draft_layouts import is_speculators, switch
from phasegraph.runtime.models.target import HFTarget, head_dim_of


@attrs.frozen
class Eagle1Layout:
    """What an EAGLE-1 config says about its head's tensors."""

    fc_bias: bool = True
    qkv_bias: bool = False
    speculators: bool = False  # fusion_fc / transformer names, one layer
    layernorms: bool = False  # speculators: embedding, first-layer input and pre-lm_head norms

    @classmethod
    def of(cls, raw: dict, where: str) -> Eagle1Layout:
        if is_speculators(raw):
            return cls(
                fc_bias=switch(raw, "fusion_bias", False, where),
                qkv_bias=switch(raw, "qkv_bias", False, where),
                speculators=True,
                layernorms=switch(raw, "layernorms", False, where),
            )
        return cls(fc_bias=switch(raw, "bias", True, where), qkv_bias=switch(raw, "qkv_bias", False, where))


def eagle1_layer(config: LlamaConfig, index: int, layout: Eagle1Layout) -> LlamaDecoderLayer:
    """Decoder layer ``index`` of the head (pool layer ``index``), with the layout's biases."""
    layer = LlamaDecoderLayer(config, layer_idx=index)
    if layout.qkv_bias:  # EAGLE's cnets: q/k/v biased by qkv_bias, o_proj never
        attn, hidden, head_dim = layer.self_attn, config.hidden_size, head_dim_of(config)
        attn.q_proj = nn.Linear(hidden, config.num_attention_heads * head_dim, bias=True)
        attn.k_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=True)
        attn.v_proj = nn.Linear(hidden, config.num_key_value_heads * head_dim, bias=True)
    if index == 0 and not layout.layernorms:
        layer.input_layernorm = nn.Identity()
    return layer


class Eagle1Head(nn.Module):
    """The EAGLE-1 weights: ``fc`` and the decoder layers, named as the checkpoint names them."""

    def __init__(self, config: LlamaConfig, layout: Eagle1Layout | None = None, *,
                 with_embed: bool = False) -> None:
        super().__init__()
        self.layout = layout = layout or Eagle1Layout()
        hidden = config.hidden_size
        fc = nn.Linear(2 * hidden, hidden, bias=layout.fc_bias)
        layers = [eagle1_layer(config, i, layout) for i in range(config.num_hidden_layers)]
        if layout.speculators:
            self.fusion_fc = fc
            self.transformer = layers[0]
        else:
            self.fc = fc
            self.layers = nn.ModuleList(layers)
        if layout.layernorms:
            self.embedding_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.pre_lm_head_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        if with_embed:  # EAGLE's loader lets the checkpoint's embedding replace the target's
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)

    @property
    def projection(self) -> nn.Linear:
        return self.fusion_fc if self.layout.speculators else self.fc

    @property
    def decoder_layers(self) -> list[nn.Module]:
        return [self.transformer] if self.layout.speculators else list(self.layers)


class Eagle1Draft(FeatureDraft):
    """:class:`DraftModel` for an EAGLE-1 head; one draft pool layer per decoder layer."""

    def __init__(self, target: HFTarget, config: LlamaConfig, head: Eagle1Head) -> None:
        super().__init__(target, config, head, num_pool_layers=len(head.decoder_layers))
        self.vocab_size: int = target.vocab_size

    @classmethod
    def check_config(cls, where: str, config: LlamaConfig, raw: dict, target: HFTarget) -> None:
        Eagle1Layout.of(raw, where)  # every switch readable before any weight is
        super().check_config(where, config, raw, target)

    @classmethod
    def build_head(cls, config: LlamaConfig, raw: dict, checkpoint) -> Eagle1Head:
        return Eagle1Head(config, Eagle1Layout.of(raw, str(checkpoint.directory)),
                          with_embed="embed_tokens.weight" in checkpoint.shapes)

    @classmethod
    def ignored_keys(cls, config, raw, checkpoint) -> dict[str, tuple[int, ...]]:
        return {}  # an embed_tokens.weight the checkpoint holds is the head's own (Eagle1Head)

    @torch.no_grad()
    def _forward(self, input_ids, hidden, positions, attn, from_target, step, logits_index) -> DraftOutput:
        # hidden: [T, H], the target feature or the previous draft hidden (the same space)
        head: Eagle1Head = self.head
        embeds = self._embed(input_ids).to(self.dtype)  # [T, H]
        if head.layout.layernorms:
            embeds = head.embedding_layernorm(embeds)
        out = head.projection(torch.cat([embeds, hidden.to(self.dtype)], dim=-1))  # [T, H]
        position_embeddings = self._rope(out, positions)
        with self._context(attn, positions):
            for layer in head.decoder_layers:
                out = run_decoder_layer(layer, out, position_embeddings, positions)  # [T, H]
        rows = self._rows(out, logits_index)  # [R, H]
        normed = head.pre_lm_head_layernorm(rows) if head.layout.layernorms else rows
        logits = self.target.lm_head(normed.to(self.target.dtype)).float()  # [R, V]
        return DraftOutput(logits=logits, hidden=out, hidden_rows=None if logits_index is None else rows)
