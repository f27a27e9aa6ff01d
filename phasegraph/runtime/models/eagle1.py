"""EAGLE-1 draft head (SafeAILab/EAGLE branch ``v1``, ``eagle/model/cnets1.py`` layout).

Math, per token (``H`` = target hidden = draft hidden)::

    x   = fc(concat(target_embed(token), feature))      fc: Linear(2H -> H, bias)
    out = decoder_layer_0(x)                              Llama layer, no input_layernorm
    logits = target_lm_head(out)                          -> next hidden = out

The feature is the target's last hidden state *after* its final norm (HFTarget
``feature_mode="last"``), i.e. exactly what the target's lm_head consumes. The head is trained to
predict the next such feature, so the target lm_head is applied to the layer output directly,
with no extra norm: the cnets1 layout has no ``norm.weight`` and the reference computes
``base_model.lm_head(ea_layer(...))``. ``from_target`` does not change the math (feature and
draft hidden live in the same space).

Checkpoint: ``fc.weight [H, 2H]``, ``fc.bias [H]``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``
(``embed_tokens.weight`` accepted and ignored); ``config.json`` with Llama keys.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.phases.protocols import DraftOutput
from phasegraph.runtime.models.draft_base import FeatureDraft, run_decoder_layer
from phasegraph.runtime.models.target import HFTarget


class Eagle1Head(nn.Module):
    """The EAGLE-1 weights: ``fc`` and one decoder layer without ``input_layernorm``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])


class Eagle1Draft(FeatureDraft):
    """:class:`DraftModel` for an EAGLE-1 head; one draft pool layer."""

    def __init__(self, target: HFTarget, config: LlamaConfig, head: Eagle1Head) -> None:
        super().__init__(target, config, head, num_pool_layers=1)
        self.vocab_size: int = target.vocab_size

    @classmethod
    def build_head(cls, config: LlamaConfig, raw: dict, checkpoint) -> Eagle1Head:
        return Eagle1Head(config)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        hidden: torch.Tensor,  # [T, H] (target feature or previous draft hidden)
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        *,
        from_target: bool,
        step: int = 0,
        logits_index: torch.Tensor | None = None,  # [R] int64
    ) -> DraftOutput:
        head: Eagle1Head = self.head
        embeds = self._embed(input_ids).to(self.dtype)  # [T, H]
        x = head.fc(torch.cat([embeds, hidden.to(self.dtype)], dim=-1))  # [T, H]
        position_embeddings = self._rope(x, positions)
        with self._context(attn):
            out = run_decoder_layer(head.layers[0], x, position_embeddings, positions)  # [T, H]
        rows = self._rows(out, logits_index)  # [R, H]
        logits = self.target.lm_head(rows.to(self.target.dtype)).float()  # [R, V]
        return DraftOutput(logits=logits, hidden=out, hidden_rows=None if logits_index is None else rows)

    __call__ = forward
