"""EAGLE-3 draft head (SafeAILab/EAGLE ``eagle/model/cnets.py`` checkpoint layout).

Math, per token (``Hd`` draft hidden, ``Ht`` target hidden, which must be equal here because the
target's embedding feeds the head)::

    e  = target_embed(token)                                  [Hd]
    h  = fc(feature [3*Ht])   if from_target  else hidden     [Hd]
    x  = concat(input_layernorm(e), hidden_norm(h))           [2*Hd]
    h1 = h + o_proj(attn(q/k/v_proj(x)))                      RoPE at ``positions``
    out = h1 + mlp(post_attention_layernorm(h1))              -> next hidden
    logits = lm_head(norm(out))                               [Vd], the draft vocabulary

``to_target_ids(d) = d + d2t[d]`` when the checkpoint carries ``d2t`` (always when
``draft_vocab_size < vocab_size``), identity otherwise.

Checkpoint (``model.safetensors`` or ``pytorch_model.bin``): ``fc.weight [Hd, 3*Ht]``,
``midlayer.self_attn.{q,k,v}_proj.weight [*, 2*Hd]``, ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``,
``midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight``, ``norm.weight``,
``lm_head.weight [Vd, Hd]``, ``d2t [Vd] int64``, ``t2d [V] bool`` (optional, unused). An
``embed_tokens.weight [V, Hd]`` some trainers save is accepted and ignored (the target's
embedding is used, as in the reference). ``config.json``: Llama keys + ``draft_vocab_size``
(+ optional ``target_hidden_size``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.linear import add_rms_norm_linear, linear, silu_mul_linear
from phasegraph.kernels.rms_norm import rms_norm_concat
from phasegraph.phases.protocols import DraftOutput
from phasegraph.runtime.errors import UnsupportedModel
from phasegraph.runtime.models.draft_base import FeatureDraft, check_fits_target, require
from phasegraph.runtime.models.fused_decoder import FusedLayer, fuse_layer, unfusable_config_reason
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


class Eagle3Head(nn.Module):
    """The EAGLE-3 weights, named as in the public checkpoints."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        target_hidden_size: int,
        draft_vocab_size: int,
        with_d2t: bool,
        with_t2d: bool,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(3 * target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3Midlayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        if with_d2t:
            self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        if with_t2d:
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))


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
        super().__init__(target, config, head, num_pool_layers=1)
        self.target_hidden_size, self.vocab_size = eagle3_dims(config)  # vocab_size = Vd
        self.d2t: torch.Tensor | None = getattr(head, "d2t", None)  # [Vd] int64
        self.fused_layer: FusedLayer | None = None
        self.fused_reason: str | None = "switched off (fused=False)"
        if fused is not False:
            self.fused_reason = unfusable_config_reason(config)
            if self.fused_reason is not None and fused:
                raise UnsupportedModel(f"the fused EAGLE-3 path cannot run this head: {self.fused_reason}")
            if self.fused_reason is None:
                with torch.no_grad():
                    self.fused_layer = fuse_layer(head.midlayer, config)

    @classmethod
    def check_config(cls, where: str, config: LlamaConfig, raw: dict, target: HFTarget) -> None:
        target_hidden, draft_vocab = eagle3_dims(config)
        require(
            draft_vocab <= config.vocab_size,
            f"{where}: draft_vocab_size {draft_vocab} > vocab_size {config.vocab_size}",
        )
        check_fits_target(where, config, target, feature_size=3 * target_hidden)
        layers = declared_eagle3_layers(raw, target.num_layers, where)
        if layers is not None:
            target.use_feature_layers(layers)

    @classmethod
    def build_head(cls, config: LlamaConfig, raw: dict, checkpoint) -> Eagle3Head:
        target_hidden, draft_vocab = eagle3_dims(config)
        return Eagle3Head(
            config,
            target_hidden_size=target_hidden,
            draft_vocab_size=draft_vocab,
            with_d2t=draft_vocab < config.vocab_size or "d2t" in checkpoint.shapes,
            with_t2d="t2d" in checkpoint.shapes,
        )

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
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, target vocabulary
        hidden: torch.Tensor,  # [T, 3*Ht] when from_target else [T, Hd]
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        *,
        from_target: bool,
        step: int = 0,
        logits_index: torch.Tensor | None = None,  # [R] int64
    ) -> DraftOutput:
        if self.fused_layer is not None:
            return self._forward_fused(input_ids, hidden, positions, attn, from_target, logits_index)
        head: Eagle3Head = self.head
        mid = head.midlayer
        embeds = self._embed(input_ids).to(self.dtype)  # [T, Hd]
        h = head.fc(hidden.to(self.dtype)) if from_target else hidden  # [T, Hd]
        x = torch.cat([mid.input_layernorm(embeds), mid.hidden_norm(h)], dim=-1)  # [T, 2Hd]
        position_embeddings = self._rope(x, positions)
        with self._context(attn):
            attn_out, _ = mid.self_attn(
                hidden_states=x[None], position_embeddings=position_embeddings, attention_mask=None
            )  # [1, T, Hd]
        h1 = h + attn_out[0]  # [T, Hd]
        out = h1 + mid.mlp(mid.post_attention_layernorm(h1))  # [T, Hd]
        rows = self._rows(out, logits_index)  # [R, Hd]
        logits = head.lm_head(head.norm(rows))  # [R, Vd], head dtype
        return DraftOutput(logits=logits, hidden=out, hidden_rows=None if logits_index is None else rows)

    def _forward_fused(self, input_ids, hidden, positions, attn, from_target, logits_index) -> DraftOutput:
        """The same math as the modules path, through the fused kernels (one token: the norm
        is the prologue of the next product, so ``norm -> lm_head`` is one kernel)."""
        head: Eagle3Head = self.head
        mid, layer = head.midlayer, self.fused_layer
        pool = self._attached_pool()
        h = (linear(hidden.to(self.dtype), head.fc.weight, head.fc.bias, static_weight=True)
             if from_target else hidden)  # [T, Hd]
        table = lookup_table(self.target.embed_tokens)
        if table is not None:  # the lookup and its cast to the head's dtype inside the norm kernel
            embeds, rows = table, input_ids  # [V, Hd], [T]
        else:
            embeds, rows = self._embed(input_ids).to(self.dtype), None  # [T, Hd]
        x = rms_norm_concat(  # [T, 2Hd] = [input_layernorm(embeds) | hidden_norm(h)]
            embeds, layer.input_norm, layer.eps,
            h, mid.hidden_norm.weight, float(mid.hidden_norm.variance_epsilon), a_rows=rows,
        )
        cos, sin, rope_rows = RotaryTable.of(self.rotary).lookup(x, positions, attn)
        attn_out = layer.attention(x, cos, sin, pool.k[0], pool.v[0], attn, rope_rows)  # [T, Hd]
        # h1 = h + attn_out; gate_up = post_attention_layernorm(h1) @ gate_up
        gate_up, h1 = add_rms_norm_linear(
            attn_out, h, layer.post_norm, layer.eps, layer.gate_up_weight, layer.gate_up_bias,
            static_weight=True,
        )
        mlp_out = silu_mul_linear(gate_up, layer.down_weight, layer.down_bias,
                                  static_weight=True)  # [T, Hd]
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

    __call__ = forward
