"""Chained multi-token-prediction (MTP) draft layers, and the public next-n layer
(:class:`NextNDraft`, DeepSeek-V3 / MiMo style, at the end of this module).

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

import importlib

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.phases.protocols import DraftOutput
from phasegraph.runtime.errors import DraftMismatch, UnsupportedDraftLayout
from phasegraph.runtime.models.attention_backend import ATTN_IMPLEMENTATION
from phasegraph.runtime.models.draft_base import FeatureDraft, check_fits_target, run_decoder_layer
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
    def ignored_keys(cls, config: LlamaConfig, raw: dict, checkpoint) -> dict[str, tuple[int, ...]]:
        return {}

    def layer(self, index: int) -> nn.Module:
        return self.head.layers[index]

    def logits_of(self, picked: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V] float32
        rows = self.head.norm(picked)  # [R, H]
        return self.target.lm_head(rows.to(self.target.dtype)).float()

    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self._embed(input_ids).to(self.dtype)

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
        layer = self.layer(index)
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
    def _forward(self, input_ids, hidden, positions, attn, from_target, step, logits_index) -> DraftOutput:
        # hidden: [T, H]
        if not from_target:
            attn = self.step_metadata(attn, step)
        embeds = self.embed_at(input_ids, positions)  # [T, H]
        prev = hidden.to(self.dtype)  # [T, H]
        position_embeddings = self._rope(embeds, positions)
        with self._context(attn, positions):
            if from_target:
                out = first = self._layer(0, embeds, prev, position_embeddings, positions)
                for index in range(1, self.num_layers):
                    out = self._layer(index, embeds, out, position_embeddings, positions)
                out = first
            else:
                index = self.layer_for_step(step)
                out = self._layer(index, embeds, prev, position_embeddings, positions)
        picked = self._rows(out, logits_index)  # [R, H]
        logits = self.logits_of(picked)  # [R, V]
        return DraftOutput(logits=logits, hidden=out,
                           hidden_rows=None if logits_index is None else picked)


# -- the public next-n layout (DeepSeek-V3 / MiMo style) ----------------------------------------

NEXTN_LAYER_CLASSES = {  # model_type -> transformers' decoder layer of that family
    "llama": "LlamaDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
    "mistral": "MistralDecoderLayer",
}


def nextn_index(raw: dict, keys) -> int | None:
    """``N`` = ``num_hidden_layers`` where the checkpoint holds the public next-n layer at
    ``model.layers.{N}`` (``num_nextn_predict_layers`` in the config), else None."""
    layers = raw.get("num_hidden_layers")
    if not raw.get("num_nextn_predict_layers") or not isinstance(layers, int):
        return None
    return layers if f"model.layers.{layers}.eh_proj.weight" in set(keys) else None


def check_nextn_config(raw: dict, where: str) -> None:
    """Refuse, by the key that says so, what the next-n loader does not implement."""
    count = raw.get("num_nextn_predict_layers")
    if count != 1:
        raise UnsupportedDraftLayout(
            f"{where}: num_nextn_predict_layers {count!r} is not supported (one next-n layer, "
            "reused at every draft step as vLLM's deepseek_mtp does)"
        )
    for key, what in (("kv_lora_rank", "multi-head latent attention"), ("q_lora_rank", "multi-head latent attention"),
                      ("n_routed_experts", "routed experts"), ("num_experts", "routed experts"),
                      ("num_local_experts", "routed experts")):
        if raw.get(key):
            raise UnsupportedDraftLayout(f"{where}: {key} {raw[key]!r}: {what} in the next-n layer is not supported")
    if raw.get("model_type") not in NEXTN_LAYER_CLASSES:
        raise UnsupportedDraftLayout(
            f"{where}: model_type {raw.get('model_type')!r} of a next-n layer is not supported "
            f"(supported: {', '.join(NEXTN_LAYER_CLASSES)})"
        )


def nextn_layer_config(raw: dict):
    """The config of the family the next-n layer belongs to (its attention biases, q/k norms),
    one layer, attending through the paged pool."""
    from transformers import AutoConfig

    values = {k: v for k, v in raw.items() if not k.startswith("_") and k != "model_type"}
    values["num_hidden_layers"] = 1
    values.pop("layer_types", None)
    config = AutoConfig.for_model(raw["model_type"], **values)
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config


class SharedHead(nn.Module):
    """``shared_head``: the next-n layer's own final norm and output projection."""

    def __init__(self, hidden: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.head = nn.Linear(hidden, vocab, bias=False)


class NextNHead(nn.Module):
    """The next-n layer at ``model.layers.{index}``: a decoder layer of the target's family plus
    ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.{norm,head}`` (and, where the checkpoint
    carries one, ``embed_tokens``)."""

    def __init__(self, raw: dict, index: int, with_embed: bool) -> None:
        super().__init__()
        config = nextn_layer_config(raw)
        family = raw["model_type"]
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        layer = getattr(module, NEXTN_LAYER_CLASSES[family])(config, layer_idx=0)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        layer.enorm = LlamaRMSNorm(hidden, eps=eps)
        layer.hnorm = LlamaRMSNorm(hidden, eps=eps)
        layer.shared_head = SharedHead(hidden, config.vocab_size, eps)
        if with_embed:
            layer.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.index = index
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(index): layer})

    @property
    def layer(self) -> nn.Module:
        return self.model.layers[str(self.index)]

    @property
    def layers(self) -> list[nn.Module]:
        return [self.layer]


class NextNDraft(MTPDraft):
    """:class:`DraftModel` for the public next-n layer (DeepSeek-V3 / MiMo style), after vLLM's
    ``deepseek_mtp``: ``h = layer(eh_proj(concat(enorm(e), hnorm(prev))))`` with the embedding
    zeroed at position 0, ``logits = shared_head.head(shared_head.norm(h))``, next hidden ``h``.
    The same layer runs at every draft step; the feature is the target's last hidden after its
    final norm. The target's own weights (``model.layers.{i < N}``, embedding, norm, lm_head),
    which the checkpoint may hold beside the layer, are shape-checked and ignored."""

    @classmethod
    def check_config(cls, where: str, config: LlamaConfig, raw: dict, target: HFTarget) -> None:
        check_nextn_config(raw, where)
        check_fits_target(where, config, target, feature_size=config.hidden_size)

    @classmethod
    def build_head(cls, config: LlamaConfig, raw: dict, checkpoint) -> NextNHead:
        index = raw["num_hidden_layers"]
        return NextNHead(raw, index, f"model.layers.{index}.embed_tokens.weight" in checkpoint.shapes)

    @classmethod
    def ignored_keys(cls, config: LlamaConfig, raw: dict, checkpoint) -> dict[str, tuple[int, ...]]:
        own = f"model.layers.{raw['num_hidden_layers']}."
        return {k: shape for k, shape in checkpoint.shapes.items() if not k.startswith(own)}

    @property
    def embedding(self) -> nn.Module:
        own = getattr(self.head.layer, "embed_tokens", None)
        return own if own is not None else self.target.embed_tokens

    def drop_copied_embedding(self) -> None:
        own = getattr(self.head.layer, "embed_tokens", None)
        theirs = self.target.embed_tokens.weight
        if own is not None and own.weight.shape == theirs.shape and torch.equal(own.weight.to(theirs.dtype), theirs):
            del self.head.layer.embed_tokens

    def layer(self, index: int) -> nn.Module:
        return self.head.layer

    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, H]
        embeds = self._embed(input_ids).to(self.dtype)
        return torch.where((positions == 0)[:, None], torch.zeros_like(embeds), embeds)

    def logits_of(self, picked: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V] float32
        shared = self.head.layer.shared_head
        return shared.head(shared.norm(picked)).float()
