"""What the feature-consuming draft heads (EAGLE-1, EAGLE-3, MTP) share.

A head is an ``nn.Module`` holding only the draft's own weights (its checkpoint keys); the
embedding (and for EAGLE-1/MTP the lm_head) stay in the target and are reached through it. The
adapter around the head implements :class:`phasegraph.phases.protocols.DraftModel`. Draft
attention layers are transformers modules using the ``"phasegraph"`` attention implementation;
their ``layer_idx`` is the draft pool layer they write.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.phases.protocols import DraftOutput
from phasegraph.runtime.errors import DraftMismatch
from phasegraph.runtime.kv_pool import KVPool, KVSpec, check_pool_fits
from phasegraph.runtime.models.attention_backend import ATTN_IMPLEMENTATION, forward_context
from phasegraph.runtime.models.draft_layouts import flat_config
from phasegraph.runtime.models.loading import (
    Checkpoint,
    check_model_parts,
    config_errors,
    load_into_module,
    read_config,
)
from phasegraph.runtime.models.take_rows import embed, take_rows
from phasegraph.runtime.models.target import HFTarget, head_dim_of, no_weight_init, resolve_dtype


def draft_config(directory: str | Path | None = None, raw: dict | None = None) -> LlamaConfig:
    """A :class:`LlamaConfig` from a draft directory's ``config.json`` (or a dict)."""
    if raw is None:
        raw = read_config(directory)
    with config_errors(directory):
        config = LlamaConfig.from_dict(dict(raw))
    check_model_parts(config, directory)
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config


@contextlib.contextmanager
def building(device: torch.device | str, init: bool) -> Iterator[None]:
    """Build modules on ``device``; skip random init when weights are loaded next."""
    with torch.device(device), contextlib.nullcontext() if init else no_weight_init():
        yield


def use_paged_attention(config: LlamaConfig, head: torch.nn.Module, who: str) -> None:
    """Make the head's attention modules attend over the paged pool (transformers reads
    ``config._attn_implementation`` at every forward). A config built in code defaults to eager
    attention, which would silently attend over the tokens of one call only; a module holding
    another config that says so raises :class:`DraftMismatch`."""
    config._attn_implementation = ATTN_IMPLEMENTATION
    for name, module in head.named_modules():
        cfg = getattr(module, "config", None)
        impl = getattr(cfg, "_attn_implementation", ATTN_IMPLEMENTATION)
        require(
            cfg is None or impl == ATTN_IMPLEMENTATION,
            f"{who}: module {name or type(head).__name__!r} uses attention {impl!r}, not the paged "
            f"{ATTN_IMPLEMENTATION!r} attention (build it from the draft's config)",
        )


def require(condition: bool, message: str) -> None:
    if not condition:
        raise DraftMismatch(message)


class DraftAdapter(abc.ABC):
    """What every draft adapter (the feature heads and the standalone draft) shares: the
    signatures of ``DraftModel.forward`` and of loading, once, over each kind's
    :meth:`_forward` and :meth:`_load`."""

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        target: HFTarget,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        **options,
    ):
        """The draft in checkpoint ``directory`` for ``target``; ``dtype`` and ``device``
        default to the target's. ``options`` go to the adapter (EAGLE-3's ``fused``)."""
        return cls._load(directory, target, dtype, device, **options)

    @classmethod
    @abc.abstractmethod
    def _load(cls, directory, target, dtype, device, **options):
        """The kind's loading; the arguments are :meth:`from_pretrained`'s."""

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, target vocabulary
        hidden: torch.Tensor | None,  # [T, Hf] when from_target else [T, Hd]; standalone: ignored
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        *,
        from_target: bool,
        step: int = 0,
        logits_index: torch.Tensor | None = None,  # [R] int64
    ) -> DraftOutput:
        return self._forward(input_ids, hidden, positions, attn, from_target, step, logits_index)

    __call__ = forward

    @abc.abstractmethod
    def _forward(self, input_ids, hidden, positions, attn, from_target, step, logits_index) -> DraftOutput:
        """The kind's forward; the arguments are :meth:`forward`'s."""

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


class FeatureDraft(DraftAdapter):
    """Shared adapter state: target modules, draft config, head, rotary embedding, KV pool."""

    uses_features = True
    kv_lead = 0  # draft row p carries token p+1 with the target feature of p

    def __init__(
        self, target: HFTarget, config: LlamaConfig, head: torch.nn.Module, num_pool_layers: int
    ) -> None:
        self.target = target
        self.config = config
        self.head = head.eval()
        use_paged_attention(config, head, type(self).__name__)
        param = next(head.parameters())
        self.dtype = param.dtype
        self.device = param.device
        self.hidden_size: int = config.hidden_size
        # RoPE tables stay float32 whatever the head's dtype.
        self.rotary = LlamaRotaryEmbedding(config=config).to(self.device)
        self.kv_spec = KVSpec(
            num_layers=num_pool_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim_of(config),
            dtype=self.dtype,
        )
        self.pool: KVPool | None = None

    def attach_kv(self, pool: KVPool) -> None:
        self.pool = check_pool_fits(pool, self.kv_spec, "the draft")

    def _attached_pool(self) -> KVPool:
        if self.pool is None:
            raise RuntimeError(f"{type(self).__name__}.attach_kv(pool) must be called first")
        return self.pool

    def _context(self, attn: AttentionMetadata, positions: torch.Tensor | None = None):
        return forward_context(attn, self._attached_pool(), positions=positions)

    def _rope(
        self, like: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [1, T, D]
        return self.rotary(like, positions[None])

    @property
    def embedding(self) -> torch.nn.Module:
        """The head's own ``embed_tokens`` where its checkpoint carries one that differs from
        the target's (the reference loaders let the checkpoint's win), else the target's."""
        own = getattr(self.head, "embed_tokens", None)
        return own if own is not None else self.target.embed_tokens

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T, H]
        return embed(self.embedding, input_ids)

    def drop_copied_embedding(self) -> None:
        """Free the head's ``embed_tokens`` where it is a copy of the target's (what most
        trainers save): the same numbers, without a second vocabulary-sized table."""
        own = getattr(self.head, "embed_tokens", None)
        if own is None:
            return
        theirs = self.target.embed_tokens.weight
        if own.weight.shape == theirs.shape and torch.equal(own.weight.to(theirs.dtype), theirs):
            del self.head.embed_tokens

    @staticmethod
    def _rows(x: torch.Tensor, logits_index: torch.Tensor | None) -> torch.Tensor:
        return x if logits_index is None else take_rows(x, logits_index)

    # -- loading: one template, the kinds fill in their head and checks -------------------------

    @classmethod
    def _load(cls, directory, target, dtype, device, **options):
        """Load a head from a checkpoint directory in its public layout: ``config.json`` plus
        ``model.safetensors`` (or ``pytorch_model.bin``); every key checked against the head."""
        where = str(directory)
        raw = flat_config(read_config(directory), where)
        config = draft_config(directory, raw)
        cls.check_config(where, config, raw, target)
        checkpoint = Checkpoint(directory, allow_bin=True)
        cls.check_layout(where, config, raw, checkpoint, target)
        with building(device or target.device, init=False):
            head = cls.build_head(config, raw, checkpoint)
        load_into_module(head, checkpoint, allowed_extra=cls.ignored_keys(config, raw, checkpoint))
        head.to(resolve_dtype(dtype) if dtype is not None else target.dtype)
        draft = cls(target, config, head, **options)
        draft.drop_copied_embedding()
        draft.check_loaded(where)
        return draft

    @classmethod
    def check_config(cls, where: str, config: LlamaConfig, raw: dict, target: HFTarget) -> None:
        """Raise :class:`DraftMismatch` where the head cannot serve ``target`` (before reading
        weights). By default: same hidden size and vocabulary, features of the target's width."""
        check_fits_target(where, config, target, feature_size=config.hidden_size)

    @classmethod
    def check_layout(
        cls, where: str, config: LlamaConfig, raw: dict, checkpoint: Checkpoint, target: HFTarget
    ) -> None:
        """Raise :class:`DraftMismatch` where the checkpoint's tensor names and the config
        disagree on the head's layout (names read, no weight yet). Nothing by default."""
        return None

    @classmethod
    @abc.abstractmethod
    def build_head(cls, config: LlamaConfig, raw: dict, checkpoint: Checkpoint) -> torch.nn.Module:
        """The kind's head module with the checkpoint's layout (weights not loaded yet)."""

    @classmethod
    def ignored_keys(
        cls, config: LlamaConfig, raw: dict, checkpoint: Checkpoint
    ) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensors the head accepts and does not use: some trainers save the
        target's embedding beside the head (the target's own is used)."""
        return {"embed_tokens.weight": (config.vocab_size, config.hidden_size)}

    def check_loaded(self, where: str) -> None:
        """Checks that need the loaded weights (none by default)."""
        return None


def run_decoder_layer(
    layer: torch.nn.Module,
    x: torch.Tensor,  # [T, H]
    position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin [1, T, D]
    positions: torch.Tensor,  # [T]
) -> torch.Tensor:  # [T, H]
    """One transformers decoder layer over flattened tokens (inside a forward context)."""
    out = layer(
        x[None],
        attention_mask=None,
        position_ids=positions[None],
        position_embeddings=position_embeddings,
    )
    out = out[0] if isinstance(out, tuple) else out
    return out[0]


def check_fits_target(
    where: str, config: LlamaConfig, target: HFTarget, *, feature_size: int
) -> None:
    """Raise :class:`DraftMismatch` unless hidden size, vocabulary and feature width fit."""
    require(
        config.hidden_size == target.hidden_size,
        f"{where}: draft hidden_size {config.hidden_size} != target hidden_size "
        f"{target.hidden_size} (the draft uses the target's embedding)",
    )
    require(
        config.vocab_size == target.vocab_size,
        f"{where}: draft vocab_size {config.vocab_size} != target vocab_size {target.vocab_size}",
    )
    require(
        target.feature_size == feature_size,
        f"{where}: the head consumes features of width {feature_size}, but the target "
        f"provides {target.feature_size} (feature_mode={target.feature_mode!r})",
    )
