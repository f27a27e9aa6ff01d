"""Small tensor helpers shared by several phases (no phase logic here)."""

from __future__ import annotations

import torch

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.cache_slots import extend_slots
from phasegraph.kernels.logprobs import TokenLogprobs, token_logprobs
from phasegraph.kernels.penalties import (
    apply_penalties,
    apply_token_bitmask,
    token_bitmask_allowed,
)
from phasegraph.kernels.softmax_top1 import softmax_top1
from phasegraph.kernels.softmax_topk import softmax_topk
from phasegraph.phases.context import SpecContext
from phasegraph.phases.protocols import DraftModel, KVMemory, TargetOutput
from phasegraph.phases.schemas import BatchParams


def target_forward(
    ctx: SpecContext,
    input_ids: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [T] int64
    attn: AttentionMetadata,
    logits_index: torch.Tensor | None = None,  # [R] int64
) -> TargetOutput:
    """The target's forward, asked for its routed experts where a request wants them (the
    keyword goes only to an MoE target, which the engine checks before a request runs)."""
    if ctx.return_routed_experts:
        return ctx.target.forward(input_ids, positions, attn, logits_index, routed_experts=True)
    return ctx.target.forward(input_ids, positions, attn, logits_index)


def causal_extend_metadata(
    memory: KVMemory,
    req_rows: torch.Tensor,
    token_req: torch.Tensor | None,
    positions: torch.Tensor,
    one_query_per_row: bool = False,
) -> AttentionMetadata:
    """Tokens at ``positions`` [T] of requests ``token_req`` [T] (page-table rows ``req_rows``
    [B]; ``token_req`` None: token t is request t), each attending causally up to itself.
    ``one_query_per_row``: the caller guarantees that the tokens' rows have no repeats (decode).
    One kernel writes the rows, slots and kv_len."""
    ext = extend_slots(memory.page_table, req_rows, token_req, positions, memory.page_size)
    return AttentionMetadata(
        write_slots=ext.slots,  # [T]
        page_table=memory.page_table,
        query_row=ext.rows,  # [T]
        kv_len=ext.kv_len,  # [T] positions + 1
        extra_mask=None,
        page_size=memory.page_size,
        one_query_per_row=one_query_per_row,
    )


def topk_of_logits(
    logits: torch.Tensor, k: int, id_offsets: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of softmax(logits) [R, V]: probabilities [R, k] float32 and ids [R, k]
    (``id_offsets`` [V]: id i comes back as ``i + id_offsets[i]``).

    Always the full softmax's values, also for k == 1 (SGLang #26358: a path-specific shortcut
    collapsed accuracy on one backend). The kernels keep softmax + ``max`` / ``topk`` as their
    references; on CUDA :func:`softmax_top1` (k == 1) streams a row once with an online
    normaliser and :func:`softmax_topk` (k > 1) takes each chunk's top k and merges them, in
    place of a softmax kernel and CUDA's radix top-k (~25-30 us per call over a 32k vocabulary).
    """
    if k == 1:
        return softmax_top1(logits, id_offsets)
    return softmax_topk(logits, k, id_offsets)


def draft_topk(
    model: DraftModel,
    logits: torch.Tensor,  # [R, Vd]
    k: int,
    token_bitmask: torch.Tensor | None = None,  # [R, ceil(V/32)] int32: grammar masks
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_of_logits` of a draft's logits [R, Vd], ids in the target vocabulary: mapped
    in the top-k kernel where the model has ``target_id_offsets`` (an EAGLE-3 head's ``d2t``),
    else by its ``to_target_ids``.

    With grammar masks, only the tokens a row's grammar allows are proposed (XGrammar, Dong et
    al. 2024, arXiv 2411.15100): the draft's softmax is taken over them, and a candidate the
    grammar leaves no room for (probability 0) repeats the row's best one, so no forbidden token
    reaches verify. A row that allows no token of the draft's vocabulary stays unmasked: verify
    rejects its drafts."""
    offsets = getattr(model, "target_id_offsets", None)  # [Vd] int64 or None
    if token_bitmask is not None:
        logits = _grammar_masked_draft_logits(model, logits, token_bitmask, offsets)
    probs, ids = topk_of_logits(logits, k, offsets)
    ids = ids if offsets is not None else model.to_target_ids(ids)
    if token_bitmask is not None:
        ids = torch.where(probs > 0, ids, ids[:, :1])  # [R, k]
    return probs, ids


def extend_draft(
    ctx: SpecContext,
    input_ids: torch.Tensor,  # [T] the token after each row's position
    features: torch.Tensor,  # [T, Hf] target features at each row
    positions: torch.Tensor,  # [T] draft positions (logical KV slots)
    attn: AttentionMetadata,
    select_index: torch.Tensor,  # [B] each request's last row
    token_bitmask: torch.Tensor | None = None,  # [B, ceil(V/32)] grammar masks after the rows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Write the draft's KV over committed rows and propose each request's depth-1 candidates:
    (top-k probabilities [B, K], ids [B, K], the draft hidden row [B, Hd] or None), what a
    :class:`DraftState` carries into the next draft."""
    draft = ctx.draft
    out = draft.forward(input_ids, features if draft.uses_features else None, positions, attn,
                        from_target=True, step=0, logits_index=select_index)
    topk_p, topk_ids = draft_topk(draft, out.logits, ctx.draft_topk or ctx.tree.topk, token_bitmask)
    hidden = None
    if draft.uses_features:  # the rows the model already gathered for its logits
        hidden = out.hidden_rows if out.hidden_rows is not None else out.hidden[select_index]
    return topk_p, topk_ids, hidden


def _grammar_masked_draft_logits(model: DraftModel, logits: torch.Tensor, token_bitmask: torch.Tensor,
                                 offsets: torch.Tensor | None) -> torch.Tensor:
    draft_ids = torch.arange(logits.shape[1], device=logits.device)  # [Vd]
    target_ids = draft_ids + offsets if offsets is not None else model.to_target_ids(draft_ids)  # [Vd]
    allowed = token_bitmask_allowed(token_bitmask, token_bitmask.shape[1] * 32)[:, target_ids]  # [R, Vd]
    allowed |= ~allowed.any(dim=1, keepdim=True)  # nothing allowed: leave the row as it is
    return logits.masked_fill(~allowed, float("-inf"))


def processed_logits(
    ctx: SpecContext,
    params: BatchParams,
    logits: torch.Tensor,  # [B*N, V] the target's logits
    output_counts: torch.Tensor | None,  # [B, V] int32
    prompt_mask: torch.Tensor | None,  # [B, V] bool
    node_tokens: torch.Tensor | None = None,  # [B*N] (verify: the tree's nodes)
    tree_mask: torch.Tensor | None = None,  # [B, N, N]
    token_bitmask: torch.Tensor | None = None,  # [B*N, ceil(V/32)] int32: grammar masks
) -> torch.Tensor:
    """``logits`` with the batch's logit bias and penalties (:func:`apply_penalties`, the one
    place they are applied, by prefill, decode and verify) where a request of the batch uses
    them, then the grammar masks where given (:func:`apply_token_bitmask`), else ``logits``
    themselves: no pass when none applies (``ctx.penalties``, no bitmask)."""
    if token_bitmask is not None:
        logits = processed_logits(ctx, params, logits, output_counts, prompt_mask, node_tokens, tree_mask)
        return apply_token_bitmask(logits, token_bitmask)
    if not ctx.penalties:
        return logits
    if output_counts is None or prompt_mask is None:
        raise ValueError(
            "a request of the batch uses penalties (ctx.penalties) but the state carries no "
            "output_counts / prompt_mask: it was prefilled without them"
        )
    return apply_penalties(
        logits, output_counts, prompt_mask, params.repetition_penalty, params.frequency_penalty,
        params.presence_penalty, params.logit_bias, node_tokens, tree_mask,
    )


def logprobs_if_asked(ctx: SpecContext, logits: torch.Tensor, tokens: torch.Tensor) -> TokenLogprobs:
    """The target's logprobs of ``tokens`` and its top ``ctx.top_logprobs`` per row, from its
    raw ``logits`` (:mod:`phasegraph.kernels.logprobs`); all None unless a request asks."""
    if not ctx.return_logprobs:
        return TokenLogprobs(None, None, None)
    return token_logprobs(logits, tokens, ctx.top_logprobs)


def min_p_if_used(ctx: SpecContext, params: BatchParams) -> torch.Tensor | None:
    """The batch's min_p where a request uses it, else None (no pass)."""
    return params.min_p if ctx.min_p else None
