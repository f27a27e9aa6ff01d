"""An n-gram (prompt-lookup) drafter, built the way a user of phasegraph builds one.

Prompt lookup (LLMA, Yang et al., arXiv 2304.04487; Saxena's "prompt lookup decoding"): where
the text being generated repeats the context (code being edited, a summary quoting its
source), the tokens that followed the latest earlier occurrence of the last n tokens are good
drafts, and finding them costs no model at all. Verification is the target's, as for every
drafter, so the output stays exactly the target's.

Everything here goes through the public framework: the draft phase is a pure ``@phase`` from
:class:`DraftState` to :class:`TreeProposal`; the graph is the EAGLE outline's with that phase
in place of the model drafter's (:meth:`PhaseGraph.from_outline` checks names and schemas);
the method is registered by name (``SpecConfig(method="ngram")``). The token history lives in
the draft's KV pool: :class:`NgramDraft` declares one float per KV slot, and its forward, which
draft-extend calls over every committed token, writes each token id into its slot (KV lead 1:
the slot of position p holds token p). docs/custom-drafter.md walks through it.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Int32, Int64

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.build_tree import build_tree
from phasegraph.kernels.penalties import token_bitmask_allows
from phasegraph.phases.context import SpecContext
from phasegraph.phases.eagle import FUNCTIONS
from phasegraph.phases.outline import EAGLE_OUTLINE
from phasegraph.phases.protocols import DraftOutput
from phasegraph.phases.schemas import DraftState, TreeProposal
from phasegraph.runtime.errors import InvalidConfig
from phasegraph.runtime.kv_pool import KVSpec
from phasegraph.runtime.methods import DraftMethod, register_method
from phasegraph.statemachine import PhaseGraph, phase

Tensor = torch.Tensor
# token ids travel as float32 through the KV pool: exact below 2**24
MAX_VOCAB = 1 << 24


class NgramDraft:
    """The draft object of ``method="ngram"``: no weights, a KV pool of one float per slot that
    holds the token at that position, and the n-gram sizes the draft phase tries (longest
    first)."""

    uses_features = False  # the target hands it no hidden states
    hidden_size = 0
    kv_lead = 1  # slot of position p holds token p; the bonus token gets its slot too

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        ok = all(isinstance(n, int) and not isinstance(n, bool) for n in (max_ngram, min_ngram))
        if not ok or not 1 <= min_ngram <= max_ngram <= 16:
            raise InvalidConfig(f"NgramDraft: need 1 <= min_ngram <= max_ngram <= 16; got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.kv_spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
        self.pool = None

    @classmethod
    def for_engine(cls, target, spec) -> NgramDraft:
        """The draft the engine builds for ``SpecConfig(method="ngram")``: chains only."""
        if spec.topk != 1:
            raise InvalidConfig(f"method 'ngram' drafts one continuation per request: topk must be 1; got {spec.topk}")
        if target.vocab_size > MAX_VOCAB:
            raise InvalidConfig(f"method 'ngram' keeps token ids as float32: the vocabulary must be at most "
                                f"{MAX_VOCAB}; the target's has {target.vocab_size}")
        return cls()

    def attach_kv(self, pool) -> None:
        self.pool = pool

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids

    def forward(self, input_ids: Tensor, hidden: Tensor | None, positions: Tensor, attn: AttentionMetadata, *,
                from_target: bool, step: int, logits_index: Tensor | None = None) -> DraftOutput:
        """Draft-extend's call: write each row's token into its slot. One logit per row (the
        top-1 draft-extend takes is never used: the draft phase reads the history)."""
        store = self.pool.k[0].view(-1)  # [slots]
        store[attn.write_slots] = input_ids.to(store.dtype)
        rows = input_ids.shape[0] if logits_index is None else logits_index.shape[0]
        return DraftOutput(logits=torch.zeros(rows, 1, device=input_ids.device),
                           hidden=input_ids.new_zeros(input_ids.shape[0], 0, dtype=torch.float32))


def read_history(page_table: Int64[Tensor, "R P"], rows: Int64[Tensor, "B"], store: Tensor,
                 page_size: int) -> Int64[Tensor, "B L"]:
    """Every request's token at every position its page-table row can hold (L = pages x page
    size; positions past its length hold whatever the slot holds)."""
    pages = page_table.index_select(0, rows)  # [B, P]
    p = torch.arange(pages.shape[1] * page_size, device=pages.device)  # [L]
    slots = pages[:, p // page_size] * page_size + p % page_size  # [B, L]
    return store.view(-1)[slots].to(torch.int64)


def ngram_propose(history: Int64[Tensor, "B L"], lengths: Int64[Tensor, "B"], count: int, max_ngram: int,
                  min_ngram: int) -> tuple[Int64[Tensor, "B C"], Bool[Tensor, "B"]]:
    """Per row, the ``count`` tokens that followed the latest earlier occurrence of its last n
    tokens (the largest n in [min_ngram, max_ngram] that occurs with a token after it), and
    whether one occurred. Positions past the history repeat its last token. Fixed shapes and no
    host synchronisation, so a CUDA graph captures it."""
    B, L = history.shape
    device = history.device
    start = torch.full((B,), -1, dtype=torch.int64, device=device)  # where the continuation begins
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= L:
            continue
        tail = (lengths[:, None] - n + torch.arange(n, device=device)).clamp(min=0)  # [B, n]
        suffix = history.gather(1, tail)  # [B, n]: the last n tokens
        hit = (history.unfold(1, n, 1) == suffix[:, None, :]).all(dim=2)  # [B, L-n+1]
        j = torch.arange(L - n + 1, device=device)
        hit &= j[None, :] + n < lengths[:, None]  # a token follows it, and it is not the suffix itself
        latest = torch.where(hit, j[None, :], -1).amax(dim=1)  # [B]
        start = torch.where((start < 0) & (latest >= 0), latest + n, start)
    found = start >= 0
    at = start.clamp(min=0)[:, None] + torch.arange(count, device=device)  # [B, count]
    at = torch.minimum(at, (lengths[:, None] - 1).clamp(min=0))
    return history.gather(1, at), found


def _cut_at_forbidden(
    bitmask: Int32[Tensor, "BN Vw"],
    tokens: Int64[Tensor, "BN"],
    parents: Int64[Tensor, "B N"],
    next_token: Int64[Tensor, "B N"],
) -> Int64[Tensor, "B N"]:
    """``next_token`` with the link to every node cut whose token the grammar forbids after its
    parent's path, or which lies below such a node: n-gram drafts have no logits to mask, so the
    chain ends before its first forbidden token and verify never tries it (XGrammar masks: Dong
    et al. 2024, arXiv 2411.15100)."""
    B, N = parents.shape
    base = (torch.arange(B, device=parents.device) * N)[:, None]  # [B, 1]
    legal = token_bitmask_allows(bitmask, (base + parents.clamp(min=0)).reshape(-1), tokens).view(B, N)
    legal[:, 0] = True  # the root is the emitted bonus token
    ok = legal.long().cumprod(dim=1).bool()  # [B, N] a chain: node j's ancestors are 0..j-1
    keep = ok.gather(1, next_token.clamp(min=0))
    return torch.where((next_token >= 0) & keep, next_token, -1)


@phase("draft")
def ngram_draft(state: DraftState, ctx: SpecContext) -> TreeProposal:
    """A chain of the N-1 tokens that followed the latest earlier occurrence of each request's
    last n tokens in its own context (prompt and output), verified like any draft tree."""
    tree, memory, draft = ctx.tree, ctx.memory, ctx.draft
    S, N = tree.num_steps, tree.num_draft_tokens
    B = state.seq_lens.shape[0]
    device = state.seq_lens.device
    lead = ctx.kv_lead  # 1: position p's slot holds token p, the bonus token at seq_len
    lengths = state.seq_lens + lead  # [B] tokens known: the committed ones and the bonus
    history = read_history(memory.page_table, state.params.req_pool_idx, memory.draft_caches()[0], memory.page_size)
    # the bonus token from the state itself (its slot is not written after an iteration without drafts)
    history = history.scatter(1, (lengths - 1)[:, None], state.bonus_tokens[:, None])  # [B, L]
    proposals, _ = ngram_propose(history, lengths, N - 1, draft.max_ngram, draft.min_ngram)  # [B, N-1]
    parents = (torch.arange(N, device=device) - 1).repeat(B, 1)  # [B, N] a chain: node j's parent is j - 1
    built = build_tree(state.bonus_tokens, proposals, parents, state.seq_lens)
    next_token, bitmask = built.retrieve_next_token, None  # [B, N]
    if ctx.grammar is not None:  # the grammar's mask after every node (a host round trip)
        bitmask = ctx.grammar.tree_bitmask(built.draft_tokens, parents)  # [B*N, Vw]
        next_token = _cut_at_forbidden(bitmask, built.draft_tokens, parents, next_token)
    steps = torch.arange(S - 1, device=device)
    return TreeProposal.of_tree(
        state, S, lead, built, parents, retrieve_next_token=next_token,
        # no draft forwards ran; the positions they would have run at, as the schema records them
        draft_positions=(lengths[:, None] + steps[None, :])[:, :, None],  # [B, S-1, 1]
        draft_finite=torch.ones(B, dtype=torch.bool, device=device),
        token_bitmask=bitmask,  # [B*N, Vw] or None
    )


NGRAM_GRAPH = PhaseGraph.from_outline(EAGLE_OUTLINE, [ngram_draft if f.name == "draft" else f for f in FUNCTIONS])
NGRAM = DraftMethod("ngram", NGRAM_GRAPH, make_draft=NgramDraft.for_engine, feature_mode="none", max_topk=1)
register_method(NGRAM)
