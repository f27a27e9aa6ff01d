"""A standalone draft: a separate small causal LM with the target's vocabulary.

It consumes no target features (``uses_features = False``; ``hidden`` is ignored and the
returned hidden is an empty ``[T, 0]`` tensor, ``hidden_size = 0``) and has its own KV pool
(``kv_spec`` from its own layers/heads). KV convention: a standalone draft has a KV lead of 1 (``docs/internals.md``): its KV row ``p``
holds token ``p`` at its own position, like the target's, and the bonus token at ``seq_len``
gets a row too, so the draft sees the whole context, the first token included.
"""

from __future__ import annotations

from phasegraph.phases.protocols import DraftOutput
from phasegraph.runtime.errors import DraftMismatch
from phasegraph.runtime.kv_pool import KVPool
from phasegraph.runtime.models.draft_base import DraftAdapter
from phasegraph.runtime.models.fused_decoder import shard_target
from phasegraph.runtime.models.loading import read_config
from phasegraph.runtime.models.target import HFTarget, load_causal_lm


class StandaloneDraft(DraftAdapter):
    """:class:`DraftModel` over any supported HF causal LM (wrapped as an :class:`HFTarget`)."""

    uses_features = False
    hidden_size = 0
    kv_lead = 1

    def __init__(self, model: HFTarget, target: HFTarget | None = None) -> None:
        if model.feature_mode != "none":
            raise ValueError("the standalone draft's model must use feature_mode='none'")
        if target is not None and model.vocab_size != target.vocab_size:
            raise DraftMismatch(
                f"standalone draft vocab_size {model.vocab_size} != target vocab_size "
                f"{target.vocab_size}"
            )
        self.model = model
        self.vocab_size: int = model.vocab_size
        self.kv_spec = model.kv_spec
        self.dtype = model.dtype
        self.device = model.device
        self.tp = None  # a TensorParallelGroup once split() kept this rank's slice of the layers

    def split(self, group) -> None:
        """Keep ``group.rank``'s slice of the layers, split as the target is
        (``draft_tensor_parallel_size``; the model was loaded whole, on the CPU)."""
        shard_target(self.model, group, "standalone draft")
        self.kv_spec = self.model.kv_spec
        self.device = group.device
        self.tp = group

    @classmethod
    def _load(cls, directory, target, dtype, device) -> StandaloneDraft:
        vocab = read_config(directory).get("vocab_size")
        if vocab != target.vocab_size:  # before reading any weights
            raise DraftMismatch(
                f"{directory}: standalone draft vocab_size {vocab} != target vocab_size "
                f"{target.vocab_size} (a standalone draft must share the target's vocabulary)"
            )
        model = load_causal_lm(
            directory, dtype or target.dtype, device or target.device, allow_bin=True
        )
        return cls(HFTarget(model, feature_mode="none"), target)

    def attach_kv(self, pool: KVPool) -> None:
        self.model.attach_kv(pool)

    @property
    def pool(self) -> KVPool | None:
        return self.model.pool

    def _forward(self, input_ids, hidden, positions, attn, from_target, step, logits_index) -> DraftOutput:
        # input_ids: the token at each row's position; hidden: ignored
        out = self.model.forward(input_ids, positions, attn, logits_index)
        return DraftOutput(logits=out.logits, hidden=out.features)  # features: [T, 0]
