"""finalize-tree-path: commit the accepted path, compacted to the front of every request."""

from __future__ import annotations

import torch

from phasegraph.kernels.cache_slots import span_slots
from phasegraph.kernels.commit_path import commit_path
from phasegraph.kernels.compact import accepted_kv_moves, compact_to_front, move_kv
from phasegraph.kernels.extend_positions import extend_rows
from phasegraph.kernels.penalties import count_tokens
from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import (
    FinalizedPath,
    VerifyResult,
    accepted_name,
    finalized_schema_for,
    node_fields,
)
from phasegraph.statemachine import phase


@phase("finalize-tree-path")
def finalize_tree_path(state: VerifyResult, ctx: SpecContext) -> FinalizedPath:
    """Compact every per-node field of the verify result to the accepted path and move its KV.

    The per-node fields are found from the schema (:func:`node_fields`), so a side output added
    to :class:`VerifyResult` is compacted without code changes (SGLang #26866: routed experts were
    left in raw node order). Accepted node ``accept_index[b, i]`` moves from logical position
    ``seq_len + j`` to ``seq_len + i`` in the target pool. The path is cut after a stop token or
    at the request's budget; the result feeds draft-extend with ``T = B*W`` rows. Where a
    request uses penalties the emitted tokens are counted into the request's output counts.
    """
    memory = ctx.memory
    proposal = state.proposal
    draft_state = proposal.draft
    params = draft_state.params
    B, N = proposal.depth.shape
    W = state.accept_index.shape[1]  # the stride of every per-node -> per-request gather
    seq_lens = draft_state.seq_lens

    lead = proposal.draft_lead
    # the path cut after its first stop token and at the budget, and the state it leaves
    path = commit_path(state.predict, state.accept_index, state.accept_lens, params.stop_ids,
                       draft_state.remaining, seq_lens, lead, node_finite=state.logits_finite.view(-1),
                       draft_finite=proposal.draft_finite)
    lens, accept_index = path.lens, path.accept_index

    compacted = {}
    for name in node_fields(type(state)):
        x = getattr(state, name)
        compacted[accepted_name(name)] = None if x is None else compact_to_front(x, accept_index)

    # the slots of logical positions seq_len + 0 .. max(N, W) - 1: node j sits at seq_len + j and
    # accepted node i moves to seq_len + i (W <= N in every configuration; one lookup for both)
    slots = span_slots(memory.page_table, params.req_pool_idx, seq_lens, max(N, W), memory.page_size)
    node_slots, front_slots = slots[:, :N].reshape(-1), slots[:, :W].reshape(-1)  # [B*N], [B*W]
    src, dst = accepted_kv_moves(accept_index, lens, node_slots, front_slots)
    move_kv(memory.target_caches(), src, dst)

    accepted_predict = compacted[accepted_name("predict")]  # [B*W]
    accepted_features = compacted[accepted_name("features")]  # [B*W, Hf]
    if lead == 0:  # row i carries the token after accepted node i, with that node's feature
        ids, features, width = accepted_predict, accepted_features, W
    else:  # standalone drafts: the root token, then every emitted token, at their own positions
        width = W + 1
        ids = torch.cat([draft_state.bonus_tokens[:, None], accepted_predict.view(B, W)], dim=1).reshape(-1)
        hf = accepted_features.shape[1]
        features = torch.cat(
            [accepted_features.new_zeros(B, 1, hf), accepted_features.view(B, W, hf)], dim=1
        ).reshape(B * width, hf)
    positions, token_req = extend_rows(seq_lens, width)  # [B*width] seq_len + j, and b
    out_cls = finalized_schema_for(type(state))
    return out_cls(
        params=params,
        input_ids=ids,
        positions=positions,
        features=features,
        token_req=token_req,
        select_index=path.select_index,
        lead=lead,
        seq_lens=path.seq_lens,
        bonus_tokens=path.bonus_tokens,
        remaining=path.remaining,  # 0 past the budget (overlap)
        output_counts=count_tokens(draft_state.output_counts, path.emitted) if ctx.penalties else None,
        prompt_mask=draft_state.prompt_mask if ctx.penalties else None,
        verified=state,
        accept_index=accept_index,
        accept_lens=lens,
        emitted=path.emitted,
        finished=path.finished,
        **compacted,
    )
