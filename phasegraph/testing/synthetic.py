"""Valid synthetic instances of the EAGLE schemas, for tests of the graph itself.

Every function here returns an instance that passes strict validation (shapes, dtypes, dims and
invariants) without running a model. torch is imported when a function is called.
"""

from __future__ import annotations

import torch

from phasegraph.phases.schemas import (
    BatchParams,
    DraftExtendInput,
    DraftState,
    FinalizedPath,
    PrefillInput,
    PrefillResult,
    RowSelection,
    TreeProposal,
    VerifyResult,
)


def batch_params(B: int, *, start_row: int = 1, device: str = "cpu", stop_width: int = 1) -> BatchParams:
    return BatchParams(
        req_pool_idx=torch.arange(start_row, start_row + B, device=device),
        temperature=torch.zeros(B, device=device),
        top_p=torch.ones(B, device=device),
        top_k=torch.zeros(B, dtype=torch.int64, device=device),
        stop_ids=torch.full((B, stop_width), -1, dtype=torch.int64, device=device),
        seed=torch.arange(B, dtype=torch.int64, device=device),
        min_p=torch.zeros(B, device=device),
        repetition_penalty=torch.ones(B, device=device),
        frequency_penalty=torch.zeros(B, device=device),
        presence_penalty=torch.zeros(B, device=device),
    )


def prefill_input(prompt_lens: list[int], *, vocab: int = 32, device: str = "cpu") -> PrefillInput:
    lens = torch.tensor(prompt_lens, device=device)
    B, T = len(prompt_lens), int(sum(prompt_lens))
    token_req = torch.repeat_interleave(torch.arange(B, device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    positions = torch.arange(T, device=device) - starts[token_req]
    return PrefillInput(
        params=batch_params(B, device=device),
        input_ids=torch.randint(0, vocab, (T,), device=device),
        positions=positions,
        token_req=token_req,
        select_index=torch.cumsum(lens, 0) - 1,
        seq_lens=lens,
        prompt_lens=lens,
        remaining=torch.full((B,), 16, device=device),
        forced_tokens=torch.full((B,), -1, dtype=torch.int64, device=device),
    )


def draft_extend_input(
    prompt_lens: list[int], *, hf: int = 8, vocab: int = 32, device: str = "cpu"
) -> PrefillResult:
    p = prefill_input(prompt_lens, vocab=vocab, device=device)
    bonus = torch.randint(0, vocab, (len(prompt_lens),), device=device)
    ids = p.input_ids.roll(-1).index_copy(0, p.select_index, bonus)
    return PrefillResult(
        params=p.params, input_ids=ids, positions=p.positions,
        features=torch.randn(p.input_ids.shape[0], hf, device=device),
        token_req=p.token_req, select_index=p.select_index, seq_lens=p.seq_lens,
        bonus_tokens=bonus, remaining=p.remaining - 1,
        logits_finite=torch.ones(len(prompt_lens), dtype=torch.bool, device=device),
    )


def draft_state(
    B: int, *, K: int = 2, hd: int | None = 8, vocab: int = 32, start_row: int = 1,
    seq_len: int = 5, device: str = "cpu",
) -> DraftState:
    topk_p = torch.rand(B, K, device=device).sort(dim=1, descending=True).values
    return DraftState(
        params=batch_params(B, start_row=start_row, device=device),
        seq_lens=torch.full((B,), seq_len, device=device),
        bonus_tokens=torch.randint(0, vocab, (B,), device=device),
        remaining=torch.full((B,), 16, device=device),
        topk_p=topk_p,
        topk_index=torch.randint(0, vocab, (B, K), device=device),
        hidden=None if hd is None else torch.randn(B, hd, device=device),
    )


def _tree_parents(N: int, K: int) -> list[int]:
    """A small legal tree: the first K nodes hang off the root, node j > K off node j - K."""
    return [-1] + [0 if j <= K else j - K for j in range(1, N)]


def tree_proposal(draft: DraftState, *, N: int = 5, S: int = 3, vocab: int = 32) -> TreeProposal:
    B, K = draft.topk_p.shape
    K = max(K, 1)
    device = draft.seq_lens.device
    par = _tree_parents(N, K)
    depth = [0] * N
    for j in range(1, N):
        depth[j] = depth[par[j]] + 1
    if max(depth) > S:
        raise ValueError(f"a tree of {N} nodes with topk {K} is deeper than S={S}")
    mask = torch.zeros(N, N, dtype=torch.bool)
    for j in range(N):
        a = j
        while a >= 0:
            mask[j, a] = True
            a = par[a]
    first_child = [-1] * N
    next_sibling = [-1] * N
    for j in range(N - 1, 0, -1):
        p = par[j]
        next_sibling[j] = first_child[p]
        first_child[p] = j
    parents = torch.tensor(par, device=device).expand(B, N).clone()
    depth_t = torch.tensor(depth, device=device).expand(B, N).clone()
    tokens = torch.randint(0, vocab, (B, N), device=device)
    tokens[:, 0] = draft.bonus_tokens
    D = max(S - 1, 0)
    return TreeProposal(
        draft=draft,
        num_steps=S,
        draft_tokens=tokens.reshape(-1),
        positions=(draft.seq_lens[:, None] + depth_t).reshape(-1),
        parents=parents,
        depth=depth_t,
        tree_mask=mask.to(device).expand(B, N, N).clone(),
        retrieve_index=torch.arange(B * N, device=device).view(B, N),
        retrieve_next_token=torch.tensor(first_child, device=device).expand(B, N).clone(),
        retrieve_next_sibling=torch.tensor(next_sibling, device=device).expand(B, N).clone(),
        draft_positions=(draft.seq_lens[:, None] + torch.arange(D, device=device))[:, :, None]
        .expand(B, D, K),
        draft_finite=torch.ones(B, dtype=torch.bool, device=device),
    )


def verify_result(proposal: TreeProposal, *, hf: int = 8, vocab: int = 32, accept: int = 1) -> VerifyResult:
    """Accept the root plus the chain of first children, up to ``accept`` drafts per request."""
    B, N = proposal.depth.shape
    S = proposal.num_steps
    device = proposal.depth.device
    first_child = proposal.retrieve_next_token
    W = S + 1
    accept_index = torch.full((B, W), -1, dtype=torch.int64, device=device)
    accept_index[:, 0] = torch.arange(B, device=device) * N
    node = torch.zeros(B, dtype=torch.int64, device=device)
    lens = torch.ones(B, dtype=torch.int64, device=device)
    for i in range(1, min(accept, S) + 1):
        child = first_child.gather(1, node[:, None])[:, 0]
        ok = child >= 0
        node = torch.where(ok, child, node)
        accept_index[:, i] = torch.where(ok, torch.arange(B, device=device) * N + node, -1)
        lens += ok.long()
        # keep -1 only as a suffix
        accept_index[:, i] = torch.where(lens > i, accept_index[:, i], -1)
    predict = torch.randint(0, vocab, (B * N,), device=device)
    last = accept_index.gather(1, (lens - 1)[:, None])[:, 0]
    return VerifyResult(
        proposal=proposal,
        predict=predict,
        features=torch.randn(B * N, hf, device=device),
        accept_index=accept_index,
        accept_lens=lens,
        bonus_tokens=predict[last],
        logits_finite=torch.ones(B, N, dtype=torch.bool, device=device),
    )


def finalized_path(result: VerifyResult) -> FinalizedPath:
    """A FinalizedPath consistent with ``result`` (no KV is touched)."""
    B, W = result.accept_index.shape
    device = result.accept_index.device
    draft = result.proposal.draft
    idx = result.accept_index.clamp(min=0)
    root = (torch.arange(B, device=device) * result.proposal.depth.shape[1])[:, None]
    idx = torch.where(result.accept_index >= 0, idx, root).reshape(-1)
    lens = result.accept_lens
    inside = torch.arange(W, device=device)[None, :] < lens[:, None]
    predict = result.predict[idx]
    return FinalizedPath(
        params=draft.params,
        input_ids=predict,
        positions=(draft.seq_lens[:, None] + torch.arange(W, device=device)).reshape(-1),
        features=result.features[idx],
        token_req=torch.arange(B, device=device).repeat_interleave(W),
        select_index=torch.arange(B, device=device) * W + lens - 1,
        seq_lens=draft.seq_lens + lens,
        bonus_tokens=result.bonus_tokens,
        remaining=draft.remaining - lens,
        verified=result,
        accept_index=result.accept_index,
        accept_lens=lens,
        emitted=torch.where(inside, predict.view(B, W), -1),
        finished=torch.zeros(B, dtype=torch.bool, device=device),
        accepted_predict=predict,
        accepted_features=result.features[idx],
    )


def rows(indices: list[int], device: str = "cpu") -> RowSelection:
    return RowSelection(rows=torch.tensor(indices, dtype=torch.int64, device=device))


__all__ = [
    "DraftExtendInput",
    "batch_params",
    "draft_extend_input",
    "draft_state",
    "finalized_path",
    "prefill_input",
    "rows",
    "tree_proposal",
    "verify_result",
]


# ----------------------------------------------------------------------------- a synthetic graph


class RecordingMemory:
    """A stand-in for the KV memory that only records which request rows were released."""

    page_size = 1

    def __init__(self) -> None:
        self.released: list[int] = []

    def release_rows(self, rows_tensor: torch.Tensor) -> None:
        self.released.extend(int(r) for r in rows_tensor.tolist())

    def target_caches(self) -> list[torch.Tensor]:
        return []

    def draft_caches(self) -> list[torch.Tensor]:
        return []


class SyntheticContext:
    """Context for :func:`synthetic_eagle_graph`: only ``memory`` is used (by filter/retract)."""

    def __init__(self) -> None:
        self.memory = RecordingMemory()


def synthetic_eagle_graph():
    """The EAGLE graph's topology and schemas with model-free phase bodies.

    Merge, filter and retract are the real phases; the others produce valid synthetic outputs
    of the right batch size. Useful to test transition logic and validation without models.
    """
    import attrs

    from phasegraph.phases.eagle import EDGES, PHASES
    from phasegraph.statemachine import PhaseGraph

    def _prefill(state: PrefillInput, ctx) -> PrefillResult:
        B = state.seq_lens.shape[0]
        bonus = torch.zeros(B, dtype=torch.int64)
        return PrefillResult(
            params=state.params, input_ids=state.input_ids.roll(-1).index_copy(0, state.select_index, bonus),
            positions=state.positions, features=torch.zeros(state.input_ids.shape[0], 8),
            token_req=state.token_req, select_index=state.select_index, seq_lens=state.seq_lens,
            bonus_tokens=bonus, remaining=state.remaining - 1,
            logits_finite=torch.ones(B, dtype=torch.bool),
        )

    def _draft_extend(state: DraftExtendInput, ctx) -> DraftState:
        B = state.seq_lens.shape[0]
        return DraftState(
            params=state.params, seq_lens=state.seq_lens, bonus_tokens=state.bonus_tokens,
            remaining=state.remaining.clamp(min=0), topk_p=torch.full((B, 2), 0.5),
            topk_index=torch.zeros(B, 2, dtype=torch.int64), hidden=torch.zeros(B, 8),
        )

    def _draft(state: DraftState, ctx) -> TreeProposal:
        return tree_proposal(state, N=5, S=3)

    def _verify(state: TreeProposal, ctx) -> VerifyResult:
        return verify_result(state, accept=2)

    def _finalize(state: VerifyResult, ctx) -> FinalizedPath:
        return finalized_path(state)

    def _decode(state: DraftState, ctx) -> DraftState:
        return state.replace(seq_lens=state.seq_lens + 1, remaining=(state.remaining - 1).clamp(min=0))

    bodies = {
        "prefill-extend": _prefill, "draft-extend": _draft_extend, "draft": _draft,
        "verify": _verify, "finalize-tree-path": _finalize, "decode": _decode,
    }
    phases = [attrs.evolve(p, fn=bodies[p.name]) if p.name in bodies else p for p in PHASES]
    return PhaseGraph("eagle-synthetic", phases, EDGES, entry="prefill-extend")
