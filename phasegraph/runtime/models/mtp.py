"""Chained multi-token-prediction (MTP) draft layers.

Checkpoint layout (phasegraph's own; ``n`` = ``config.json`` ``num_hidden_layers`` MTP layers,
Llama keys otherwise, ``H`` = target hidden = draft hidden)::

    layers.{i}.eh_proj.weight                      [H, 2H]   no bias
    layers.{i}.enorm.weight, layers.{i}.hnorm.weight          [H]
    layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight
    layers.{i}.self_attn.{q,k,v,o}_proj.weight     (+ biases if attention_bias)
    layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                                    shared final norm

Layer ``i``: ``h_i = decoder_layer_i(eh_proj_i(concat(enorm_i(embed(token)), hnorm_i(h_prev))))``;
logits of a layer = ``target_lm_head(norm(h_i))``. The target feature is its last hidden after
the final norm (HFTarget ``feature_mode="last"``).

Semantics (``DraftModel.forward``):
- ``from_target=True`` (draft-extend): every layer runs over all tokens; layer 0 is fed the
  target feature, layer ``i`` the output of layer ``i-1`` at the same rows; every layer writes
  its KV (draft pool layer ``i``), so each has a prefix history. Returns layer 0's logits/hidden.
- ``from_target=False``, ``step=s``: only layer ``min(s+1, n-1)`` runs, fed the previous hidden.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.phases.protocols import DraftOutput
from phasegraph.runtime.errors import DraftMismatch
from phasegraph.runtime.models.draft_base import FeatureDraft, run_decoder_layer
from phasegraph.runtime.models.target import HFTarget


def mtp_layer(config: LlamaConfig, index: int) -> LlamaDecoderLayer:
    """A Llama decoder layer (pool layer ``index``) plus the MTP input projection and norms."""
    hidden = config.hidden_size
    layer = LlamaDecoderLayer(config, layer_idx=index)
    layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
    layer.enorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
    layer.hnorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
    return layer


class MTPHead(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [mtp_layer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MTPDraft(FeatureDraft):
    """:class:`DraftModel` for chained MTP layers; one draft pool layer per MTP layer."""

    def __init__(self, target: HFTarget, config: LlamaConfig, head: MTPHead) -> None:
        super().__init__(target, config, head, num_pool_layers=len(head.layers))
        self.num_layers = len(head.layers)
        self.vocab_size: int = target.vocab_size

    @classmethod
    def check_config(cls, where: str, config: LlamaConfig, raw: dict, target: HFTarget) -> None:
        super().check_config(where, config, raw, target)
        if config.num_hidden_layers < 1:
            raise DraftMismatch(f"{where}: an MTP draft needs at least one layer")

    @classmethod
    def build_head(cls, config: LlamaConfig, raw: dict, checkpoint) -> MTPHead:
        return MTPHead(config)

    @classmethod
    def ignored_keys(cls, config: LlamaConfig) -> dict[str, tuple[int, ...]]:
        return {}

    def layer_for_step(self, step: int) -> int:
        return min(step + 1, self.num_layers - 1)

    def _layer(
        self,
        index: int,
        embeds: torch.Tensor,  # [T, H]
        prev: torch.Tensor,  # [T, H]
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,  # [T]
    ) -> torch.Tensor:  # [T, H]
        layer = self.head.layers[index]
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(prev)], dim=-1))  # [T, H]
        return run_decoder_layer(layer, x, position_embeddings, positions)

    def step_metadata(self, attn: AttentionMetadata, step: int) -> AttentionMetadata:
        """Draft step ``step`` attends the prefix plus only those ancestors (draft steps
        ``0..step``, the block behind ``kv_len - step - 1``) that ran the same MTP layer: a
        layer never wrote the KV of steps another layer ran."""
        # steps j <= step that ran layer_for_step(step): j == step alone, or every j >= L-2 once
        # the steps reach the last layer. Built on the device (no host list to copy), so a CUDA
        # graph can capture it.
        first = step if step + 1 < self.num_layers - 1 else max(self.num_layers - 2, 0)
        same = torch.arange(step + 1, device=attn.kv_len.device) >= first  # [step+1]
        return AttentionMetadata(
            write_slots=attn.write_slots,
            page_table=attn.page_table,
            query_row=attn.query_row,
            kv_len=attn.kv_len - (step + 1),
            extra_mask=same.expand(attn.kv_len.shape[0], step + 1),
            page_size=attn.page_size,
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        hidden: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        *,
        from_target: bool,
        step: int = 0,
        logits_index: torch.Tensor | None = None,  # [R] int64
    ) -> DraftOutput:
        if not from_target:
            attn = self.step_metadata(attn, step)
        embeds = self._embed(input_ids).to(self.dtype)  # [T, H]
        prev = hidden.to(self.dtype)  # [T, H]
        position_embeddings = self._rope(embeds, positions)
        with self._context(attn):
            if from_target:
                out = first = self._layer(0, embeds, prev, position_embeddings, positions)
                for index in range(1, self.num_layers):
                    out = self._layer(index, embeds, out, position_embeddings, positions)
                out = first
            else:
                index = self.layer_for_step(step)
                out = self._layer(index, embeds, prev, position_embeddings, positions)
        picked = self._rows(out, logits_index)  # [R, H]
        rows = self.head.norm(picked)  # [R, H]
        logits = self.target.lm_head(rows.to(self.target.dtype)).float()  # [R, V]
        return DraftOutput(logits=logits, hidden=out,
                           hidden_rows=None if logits_index is None else picked)

    __call__ = forward
