"""What the phases need from models and memory, as small protocols the runtime implements.

Phases never import :mod:`phasegraph.runtime`; they receive objects that satisfy these protocols
through their context. Shapes follow ``docs/internals.md``.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import torch

from phasegraph.kernels.attention import AttentionMetadata


@attrs.frozen(eq=False)
class TargetOutput:
    logits: torch.Tensor  # [R, V] float32, rows chosen by ``logits_index``
    features: torch.Tensor  # [T, Hf] what the draft consumes (empty [T, 0] for standalone)
    # [T, M, k] int64: the experts each of the M MoE layers chose for every token (layer order),
    # where the forward was asked for them (``routed_experts=True``); else None
    routed_experts: torch.Tensor | None = None


@attrs.frozen(eq=False)
class DraftOutput:
    logits: torch.Tensor  # [R, Vd] float32 or the draft's dtype (read in float32 by the top-k),
    # rows chosen by ``logits_index``
    hidden: torch.Tensor  # [T, Hd] fed to the next draft step
    # [R, Hd] the rows of ``hidden`` at ``logits_index``, where the model gathered them anyway
    # (draft-extend then needs no gather of its own); None: not gathered
    hidden_rows: torch.Tensor | None = None


class TargetModel(Protocol):
    vocab_size: int
    feature_size: int  # Hf

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        logits_index: torch.Tensor | None = None,  # [R] int64, None = every row
        *,
        routed_experts: bool = False,  # only passed (True) to an MoE target, when asked
    ) -> TargetOutput: ...


class DraftModel(Protocol):
    hidden_size: int  # Hd
    uses_features: bool  # False for a standalone draft model (hidden is None)
    # How far the draft's committed KV runs ahead of the target's: 0 for EAGLE kinds (draft row
    # p carries token p+1 with the target feature of p), 1 for standalone drafts (row p carries
    # token p at its own position, so the bonus token at seq_len has a KV row too).
    kv_lead: int

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64 (target vocabulary)
        hidden: torch.Tensor | None,  # [T, Hf] when from_target else [T, Hd]
        positions: torch.Tensor,  # [T] int64
        attn: AttentionMetadata,
        *,
        from_target: bool,
        step: int,
        logits_index: torch.Tensor | None = None,
    ) -> DraftOutput: ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...
    # Optional: ``target_id_offsets`` [Vd] int64 or None, with to_target_ids(d) = d + offsets[d];
    # where a model has it, the top-k kernel applies it (phases._common.draft_topk).


class KVMemory(Protocol):
    """The paged KV memory as phases see it (see docs/internals.md, "KV pool and pages")."""

    page_size: int
    page_table: torch.Tensor  # [max_reqs, max_pages] int64
    draft_regions: torch.Tensor  # [max_reqs, K, R] int64 page ids of each request's branch regions

    def target_caches(self) -> list[torch.Tensor]:
        """Every per-layer key and value tensor of the target pool ([slots, Hkv, D] each)."""
        ...

    def draft_caches(self) -> list[torch.Tensor]:
        """Every per-layer key and value tensor of the draft pool."""
        ...

    def release_rows(self, rows: torch.Tensor) -> None:
        """Free every page and the page-table row of each request row in ``rows`` (host op)."""
        ...


class GrammarMasks(Protocol):
    """The grammar state of a batch's structured-output requests, held on the host (one matcher
    per request, XGrammar: Dong et al. 2024, arXiv 2411.15100). Masks are packed [R, Vw] int32
    (``Vw = ceil(V/32)``, bit set = allowed); a row of a request without a grammar allows every
    token. Each call reads the given tokens from the device (a host round trip) and leaves every
    matcher as it found it: only the runtime advances them, over a phase's emitted tokens.
    Every argument is a device tensor or a row count, so that a captured graph can be cut at a
    call and the call run between its pieces (:class:`~phasegraph.runtime.cuda_graphs.SegmentedGraph`)."""

    def next_token_bitmask(self, rows: int | None = None) -> torch.Tensor:
        """[rows, Vw]: row b allows the tokens that may follow request b's emitted tokens (rows
        past the batch's requests, a padded graph's, allow every token). Reads no device tensor."""
        ...

    def beam_bitmask(self, beam_tokens: torch.Tensor, beam_parent: torch.Tensor | None = None) -> torch.Tensor:
        """[B*K, Vw]: row b*K + k allows the tokens that may follow request b's emitted tokens
        plus draft beam k's path, whose last token is ``beam_tokens[b, k]`` ([B, K]). The first
        call of an iteration (``beam_parent`` None) starts every beam at its token; each later
        one extends the previous call's beam ``beam_parent[b, k]`` ([B, K]) by it."""
        ...

    def next_token_bitmask_after(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[B, Vw]: :meth:`next_token_bitmask` after ``new_tokens`` [B, W] (-1 padded), the tokens
        a phase emitted that the runtime has not read yet (those after verify; prefill's first)."""
        ...

    def tree_bitmask(self, draft_tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """[B*N, Vw]: row b*N + j allows the tokens that may follow node j of request b's tree,
        i.e. its emitted tokens plus node j's drafted ancestors and itself (``draft_tokens``
        [B*N], node 0 the root already emitted; ``parents`` [B, N]). Nodes under a token the
        grammar refuses allow every token: they are never reached."""
        ...
