"""Row-wise gather and concatenation of batch schemas (used by merge, filter and retract)."""

from __future__ import annotations

import torch

from phasegraph.phases.schemas import BatchParams, DraftState
from phasegraph.statemachine import PhaseGraphError


def select_params(p: BatchParams, rows: torch.Tensor) -> BatchParams:
    return BatchParams(
        req_pool_idx=p.req_pool_idx[rows], temperature=p.temperature[rows], top_p=p.top_p[rows],
        top_k=p.top_k[rows], stop_ids=p.stop_ids[rows], seed=p.seed[rows],
    )


def select_state(s: DraftState, rows: torch.Tensor) -> DraftState:
    """The rows ``rows`` [R] of ``s``, in that order."""
    return DraftState(
        params=select_params(s.params, rows),
        seq_lens=s.seq_lens[rows],
        bonus_tokens=s.bonus_tokens[rows],
        remaining=s.remaining[rows],
        topk_p=s.topk_p[rows],
        topk_index=s.topk_index[rows],
        hidden=None if s.hidden is None else s.hidden[rows],
        bonus_logprobs=None if s.bonus_logprobs is None else s.bonus_logprobs[rows],
        emitted=None if s.emitted is None else s.emitted[rows],
    )


def _pad_columns(x: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    pad = x.new_full((x.shape[0], width - x.shape[1]), fill)
    return torch.cat([x, pad], dim=1)


def concat_params(a: BatchParams, b: BatchParams) -> BatchParams:
    z = max(a.stop_ids.shape[1], b.stop_ids.shape[1])
    return BatchParams(
        req_pool_idx=torch.cat([a.req_pool_idx, b.req_pool_idx]),
        temperature=torch.cat([a.temperature, b.temperature]),
        top_p=torch.cat([a.top_p, b.top_p]),
        top_k=torch.cat([a.top_k, b.top_k]),
        stop_ids=torch.cat([_pad_columns(a.stop_ids, z, -1), _pad_columns(b.stop_ids, z, -1)]),
        seed=torch.cat([a.seed, b.seed]),
    )


def concat_states(a: DraftState, b: DraftState) -> DraftState:
    """``a``'s rows then ``b``'s. Both must come from the same draft kind and tree shape."""
    if a.topk_p.shape[1] != b.topk_p.shape[1]:
        raise PhaseGraphError(
            f"cannot merge DraftStates with topk {a.topk_p.shape[1]} and {b.topk_p.shape[1]}"
        )
    empty = [s for s in (a, b) if s.seq_lens.shape[0] == 0]
    if (a.hidden is None) != (b.hidden is None) and not empty:
        raise PhaseGraphError("cannot merge a DraftState with draft hidden states and one without")
    hidden = None
    if a.hidden is not None and b.hidden is not None:
        hidden = torch.cat([a.hidden, b.hidden])
    elif a.hidden is not None or b.hidden is not None:
        hidden = a.hidden if a.hidden is not None else b.hidden  # the other side is empty
    logprobs = None
    if a.bonus_logprobs is not None and b.bonus_logprobs is not None:
        logprobs = torch.cat([a.bonus_logprobs, b.bonus_logprobs])
    emitted = None
    if a.emitted is not None and b.emitted is not None:
        emitted = torch.cat([a.emitted, b.emitted])
    return DraftState(
        params=concat_params(a.params, b.params),
        seq_lens=torch.cat([a.seq_lens, b.seq_lens]),
        bonus_tokens=torch.cat([a.bonus_tokens, b.bonus_tokens]),
        remaining=torch.cat([a.remaining, b.remaining]),
        topk_p=torch.cat([a.topk_p, b.topk_p]),
        topk_index=torch.cat([a.topk_index, b.topk_index]),
        hidden=hidden,
        bonus_logprobs=logprobs,
        emitted=emitted,
    )
