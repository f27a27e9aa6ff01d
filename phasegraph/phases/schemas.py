"""The schemas that cross the phase boundaries of EAGLE-style speculative decoding.

Each phase's input and output is its own schema type (SGLang #24859: one object mutated across
phases let a stale verify input reach ``merge_batch``). Only :class:`DraftState` is persistent and
mergeable. Symbolic dims (see ``docs/internals.md``):

- ``B`` requests in the batch; ``T`` tokens of a ragged or fixed-width extend;
- ``K`` topk per draft step; ``N`` tree nodes per request, root included; ``W`` accept width
  (= num_steps + 1); ``D`` draft forwards per iteration (= num_steps - 1);
- ``Hd`` draft hidden size; ``Hf`` target feature width handed to the draft; ``Z`` stop ids;
- ``V`` the target's vocabulary; ``L`` top logprobs per generated position, ``Lp`` per prompt
  position (the most any request of the batch asks for);
- ``M`` MoE layers of the target, ``Ke`` experts each token is routed to per MoE layer;
- ``Vw`` = ceil(V/32) int32 words of a packed grammar bitmask (structured output).

Roles: ``REQUEST`` fields have one row per request (``[B, ...]``), ``NODE`` fields one row per
tree node (``[B*N, ...]``, request-major), ``ACCEPTED`` fields one row per accepted-path slot
(``[B*W, ...]``), ``TOKEN`` fields one row per extend token (``[T, ...]``).
"""

from __future__ import annotations

import functools
import types

import numpy as np
import torch
from jaxtyping import Bool, Float, Float32, Int32, Int64

from phasegraph.kernels.argmax import NONFINITE_LOGITS
from phasegraph.kernels.commit_path import DRAFT_NONFINITE, cut_at_nonfinite, mark_nonfinite_draft
from phasegraph.statemachine import (
    InvalidSchema,
    Pad,
    Role,
    Schema,
    invariant,
    schema,
    tensor,
    value,
)

REQUEST = Role("request", "B")
NODE = Role("node", "B*N")
ACCEPTED = Role("accepted", "B*W")
TOKEN = Role("token", "T")

Tensor = torch.Tensor

# BatchParams.draft_cap of a request without a cap of its own (deeper than any tree)
NO_DRAFT_CAP = 1 << 30


def _first_bad_row(ok: Tensor | np.ndarray) -> int | None:
    """Index of the first False in a 1-D bool tensor or host array, or None (reads values:
    strict mode only)."""
    if isinstance(ok, np.ndarray):  # (all of an empty array is True)
        return None if ok.all() else int((~ok).argmax())
    if ok.numel() == 0 or bool(ok.all()):
        return None
    return int((~ok).nonzero()[0, 0])


def _host(*tensors: Tensor) -> list[np.ndarray]:
    """Tensors as host arrays: the structural invariants below index and compare small arrays,
    where numpy's per-operation cost is a fraction of torch's (strict mode reads values anyway)."""
    return [t.detach().cpu().numpy() for t in tensors]


def _ragged_rows_problem(token_req: Tensor, positions: Tensor, select_index: Tensor) -> str | None:
    """Where the token rows of a ragged batch break their layout: each request's rows together,
    in request order, their positions one apart up to its selected row (its last valid one).
    So a request's first position, its cached prefix length, follows from its rows."""
    T, B = len(token_req), len(select_index)
    if T < 2 or B == 0:
        return None
    req, pos, select = _host(token_req, positions, select_index)
    valid = np.arange(T) <= select[req.clip(0, B - 1)]  # rows up to their request's selected one
    pair = valid[1:] & valid[:-1] & (req[1:] == req[:-1])
    first = _first_bad_row((req[1:] >= req[:-1]) & ~(pair & (pos[1:] != pos[:-1] + 1)))
    if first is None:
        return None
    row = first + 1
    return (f"token row {row} (request {int(req[row])}, position {int(pos[row])}) after row "
            f"{row - 1} (request {int(req[row - 1])}, position {int(pos[row - 1])})")


def _within(x: Tensor, lo: float | None, hi: float | None) -> bool:
    """All of ``x`` in [lo, hi] (NaN fails); one reduction."""
    if x.numel() == 0:
        return True
    if hi is None:  # one reduction is cheaper than aminmax
        return x.min().item() >= lo
    if lo is None:
        return x.max().item() <= hi
    low, high = (v.item() for v in torch.aminmax(x))  # NaN compares False below
    return low >= lo and high <= hi


@schema
class BatchParams(Schema):
    """Per-request settings that stay fixed while a request runs (rebuilt by merge/filter)."""

    req_pool_idx: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=Pad.sink(0), doc="row of the request in the KV page table")
    temperature: Float32[Tensor, "B"] = tensor(role=REQUEST, pad=0.0, doc="0 = greedy")
    top_p: Float32[Tensor, "B"] = tensor(role=REQUEST, pad=1.0, doc="1 = off")
    top_k: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=0, doc="0 = off")
    stop_ids: Int64[Tensor, "B Z"] = tensor(role=REQUEST, pad=-1, doc="token ids that end the request, -1 padded")
    seed: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=0, doc="seed of the request's counter-based coins")
    min_p: Float32[Tensor, "B"] = tensor(role=REQUEST, pad=0.0, doc="0 = off")
    repetition_penalty: Float32[Tensor, "B"] = tensor(role=REQUEST, pad=1.0, doc="1 = off")
    frequency_penalty: Float32[Tensor, "B"] = tensor(role=REQUEST, pad=0.0, doc="0 = off")
    presence_penalty: Float32[Tensor, "B"] = tensor(role=REQUEST, pad=0.0, doc="0 = off")
    logit_bias: Float32[Tensor, "B V"] | None = tensor(
        role=REQUEST, pad=0.0, absent_is_pad=True, default=None,
        doc="added to the target's logits; None where no request of the batch has a bias",
    )
    draft_cap: Int64[Tensor, "B"] | None = tensor(
        role=REQUEST, pad=NO_DRAFT_CAP, absent_is_pad=True, default=None,
        doc="the most drafted tokens a request accepts per iteration (0: it does not speculate); "
            "None where no request of the batch has a cap",
    )

    @invariant("req_pool_idx >= 1 (row 0 is the reserved padding row)")
    def _rows_not_reserved(self) -> str | None:
        row = _first_bad_row(self.req_pool_idx >= 1)
        return None if row is None else f"request {row} has req_pool_idx {int(self.req_pool_idx[row])}"

    @invariant("no two requests share a req_pool_idx (decode and draft steps promise one query per row)")
    def _rows_unique(self) -> str | None:
        if self.req_pool_idx.numel() < 2:
            return None
        rows = torch.sort(self.req_pool_idx).values  # [B]
        i = _first_bad_row(rows[1:] != rows[:-1])
        return None if i is None else f"row {int(rows[i])} is held by two requests"

    @invariant("0 <= temperature, 0 < top_p <= 1, top_k >= 0, 0 <= min_p <= 1, finite penalties "
               "with repetition_penalty > 0, draft_cap >= 0")
    def _sampling_ranges(self) -> str | None:
        ok = (self.temperature >= 0) & (self.top_p > 0) & (self.top_p <= 1) & (self.top_k >= 0)
        ok &= (self.min_p >= 0) & (self.min_p <= 1) & (self.repetition_penalty > 0)
        ok &= torch.isfinite(self.repetition_penalty) & torch.isfinite(self.frequency_penalty)
        ok &= torch.isfinite(self.presence_penalty)
        if self.logit_bias is not None:
            ok &= torch.isfinite(self.logit_bias).all(dim=1)
        if self.draft_cap is not None:
            ok &= self.draft_cap >= 0
        row = _first_bad_row(ok)
        return None if row is None else f"request {row} has out-of-range sampling parameters"


# ----------------------------------------------------------------------------- prefill


@schema
class PrefillInput(Schema):
    """New requests' prompts, flattened: the entry of the graph."""

    params: BatchParams = value()
    input_ids: Int64[Tensor, "T"] = tensor(role=TOKEN, pad=0, doc="prompt tokens of every request, concatenated")
    positions: Int64[Tensor, "T"] = tensor(role=TOKEN, pad=0)
    token_req: Int64[Tensor, "T"] = tensor(role=TOKEN, pad=Pad.index(REQUEST), doc="batch row of each token")
    select_index: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=Pad.index(TOKEN), doc="row in T of each request's last prompt token")
    seq_lens: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=1, doc="prompt lengths (committed after prefill)")
    prompt_lens: Int64[Tensor, "B"] = tensor(
        role=REQUEST, pad=1,
        doc="the request's own prompt; the tokens after it are output it emitted before a retraction",
    )
    remaining: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=1, doc="new tokens each request may still emit")
    forced_tokens: Int64[Tensor, "B"] = tensor(
        role=REQUEST, pad=-1, doc="-1: sample the first token; else emit this token (a resumed request's bonus)"
    )
    token_bitmask: Int32[Tensor, "B Vw"] | None = tensor(
        role=REQUEST, pad=-1, absent_is_pad=True, default=None,
        doc="the grammar's allowed first tokens (bit set = allowed, all set without a grammar); "
            "None where no request of the batch has structured output",
    )

    @invariant("1 <= prompt_lens <= seq_lens")
    def _prompt_within(self) -> str | None:
        row = _first_bad_row((self.prompt_lens >= 1) & (self.prompt_lens <= self.seq_lens))
        return None if row is None else (
            f"request {row}: prompt_len {int(self.prompt_lens[row])}, seq_len {int(self.seq_lens[row])}")

    @invariant("a request's prompt rows lie together, their positions one apart")
    def _prompt_rows(self) -> str | None:
        return _ragged_rows_problem(self.token_req, self.positions, self.select_index)

    @invariant("select_index[b] is the last token of request b, at position seq_len - 1")
    def _select_last(self) -> str | None:
        if self.select_index.numel() == 0:
            return None
        ok = (self.token_req[self.select_index] == torch.arange(len(self.select_index), device=self.select_index.device)) & (
            self.positions[self.select_index] == self.seq_lens - 1
        )
        row = _first_bad_row(ok)
        return None if row is None else f"request {row}: select_index does not point at its last token"


# ----------------------------------------------------------------------------- draft extend


@schema
class DraftExtendInput(Schema):
    """What draft-extend reads: one row per token, row p carrying token p+1 and target feature p."""

    params: BatchParams = value()
    input_ids: Int64[Tensor, "T"] = tensor(role=TOKEN, pad=0, doc="the token after each row's position")
    positions: Int64[Tensor, "T"] = tensor(role=TOKEN, pad=0, doc="draft position of each row (= logical KV slot)")
    features: Float[Tensor, "T Hf"] = tensor(role=TOKEN, pad=0, doc="target features at each row")
    token_req: Int64[Tensor, "T"] = tensor(role=TOKEN, pad=Pad.index(REQUEST))
    select_index: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=Pad.index(TOKEN), doc="row of each request's last valid token")
    seq_lens: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=1, doc="committed length after this extend")
    bonus_tokens: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=0, doc="last emitted token, at position seq_len")
    remaining: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=1)
    output_counts: Int32[Tensor, "B V"] | None = tensor(
        role=REQUEST, pad=0, absent_is_pad=True, default=None,
        doc="times each token was emitted, bonus token included (penalties: see DraftState)",
    )
    prompt_mask: Bool[Tensor, "B V"] | None = tensor(
        role=REQUEST, pad=False, absent_is_pad=True, default=None, doc="the token occurs in the prompt",
    )
    lead: int = value(
        default=0,
        doc="draft KV lead: 0 = row p carries token p+1 (EAGLE kinds); 1 = row p carries token p "
        "and the bonus token gets its own row (standalone drafts)",
    )

    @invariant("a request's rows lie together, their positions one apart up to its selected row")
    def _extend_rows(self) -> str | None:
        return _ragged_rows_problem(self.token_req, self.positions, self.select_index)

    @invariant("the selected row of request b sits at position seq_len - 1 + lead and carries its bonus token")
    def _selected_row(self) -> str | None:
        if self.select_index.numel() == 0:
            return None
        b = torch.arange(len(self.select_index), device=self.select_index.device)
        ok = (
            (self.token_req[self.select_index] == b)
            & (self.positions[self.select_index] == self.seq_lens - 1 + self.lead)
            & (self.input_ids[self.select_index] == self.bonus_tokens)
        )
        row = _first_bad_row(ok)
        return None if row is None else f"request {row}: selected row is not (seq_len - 1 + lead, bonus token)"


@schema
class PrefillResult(DraftExtendInput):
    """Prefill's output: the draft-extend input for the prompts plus the first sampled token."""

    first_logprobs: Float32[Tensor, "B"] | None = tensor(role=REQUEST, pad=0.0, default=None)
    first_top_logprobs: Float32[Tensor, "B L"] | None = tensor(
        role=REQUEST, pad=0.0, default=None, doc="the L largest logprobs of the first token's position")
    first_top_ids: Int64[Tensor, "B L"] | None = tensor(role=REQUEST, pad=0, default=None)
    prompt_logprobs: Float32[Tensor, "T"] | None = tensor(
        role=TOKEN, pad=0.0, default=None,
        doc="at the row of position p: logprob of the request's token p + 1 (0 on lead-1 bonus rows)",
    )
    prompt_top_logprobs: Float32[Tensor, "T Lp"] | None = tensor(
        role=TOKEN, pad=0.0, default=None, doc="the Lp largest logprobs at each row's position")
    prompt_top_ids: Int64[Tensor, "T Lp"] | None = tensor(role=TOKEN, pad=0, default=None)
    logits_finite: Bool[Tensor, "B"] = tensor(
        role=REQUEST, pad=True, doc="False where the target's logits for the first token held NaN or +inf (or only -inf)"
    )
    first_routed_experts: Int64[Tensor, "B M Ke"] | None = tensor(
        role=REQUEST, pad=0, default=None,
        doc="the experts each MoE layer chose at the last prompt row (whose logits gave the first token)")


# ----------------------------------------------------------------------------- draft state


@schema
class DraftState(Schema):
    """The only persistent, mergeable state between iterations (one row per running request)."""

    params: BatchParams = value()
    seq_lens: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=1, doc="committed KV length; bonus excluded")
    bonus_tokens: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=0, doc="last emitted token, at position seq_len")
    remaining: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=1, doc="new tokens each request may still emit")
    topk_p: Float32[Tensor, "B K"] = tensor(role=REQUEST, pad=Pad.UNIFORM, doc="draft probabilities of the depth-1 candidates")
    topk_index: Int64[Tensor, "B K"] = tensor(role=REQUEST, pad=0, doc="depth-1 candidate tokens (target vocab)")
    hidden: Float[Tensor, "B Hd"] | None = tensor(role=REQUEST, pad=0.0, default=None, doc="draft hidden fed to step 0")
    output_counts: Int32[Tensor, "B V"] | None = tensor(
        role=REQUEST, pad=0, absent_is_pad=True, default=None,
        doc="times each token was emitted, bonus token included: made by prefill and advanced by "
            "finalize-tree-path and decode while a request of the batch uses penalties, else None "
            "(exact for the requests that use them)",
    )
    prompt_mask: Bool[Tensor, "B V"] | None = tensor(
        role=REQUEST, pad=False, absent_is_pad=True, default=None,
        doc="the token occurs in the prompt (repetition penalty), with output_counts",
    )
    bonus_logprobs: Float32[Tensor, "B"] | None = tensor(
        role=REQUEST, pad=0.0, per_step=True, default=None, doc="set by decode when asked"
    )
    bonus_top_logprobs: Float32[Tensor, "B L"] | None = tensor(
        role=REQUEST, pad=0.0, per_step=True, default=None, doc="set by decode: the L largest logprobs")
    bonus_top_ids: Int64[Tensor, "B L"] | None = tensor(role=REQUEST, pad=0, per_step=True, default=None)
    bonus_routed_experts: Int64[Tensor, "B M Ke"] | None = tensor(
        role=REQUEST, pad=0, per_step=True, default=None,
        doc="set by decode when asked: the experts each MoE layer chose at the row whose logits gave bonus_tokens")
    emitted: Int64[Tensor, "B"] | None = tensor(
        role=REQUEST, pad=0, per_step=True, default=None,
        doc="set by decode: bonus_tokens, or NONFINITE_LOGITS where the target's logits held NaN or +inf",
    )

    @invariant("seq_lens >= 1 and remaining >= 0")
    def _lengths(self) -> str | None:
        if _within(self.seq_lens, 1, None) and _within(self.remaining, 0, None):
            return None
        row = _first_bad_row((self.seq_lens >= 1) & (self.remaining >= 0))
        return f"request {row}: seq_len {int(self.seq_lens[row])}, remaining {int(self.remaining[row])}"

    @invariant("0 <= topk_p <= 1")
    def _probabilities(self) -> str | None:
        if _within(self.topk_p, 0.0, 1.0):
            return None
        ok = ((self.topk_p >= 0) & (self.topk_p <= 1)).all(dim=1)
        row = _first_bad_row(ok)
        return f"request {row}: topk_p {self.topk_p[row].tolist()} (NaN or out of [0, 1])"

    @invariant("emitted (when set) is bonus_tokens or NONFINITE_LOGITS")
    def _emitted(self) -> str | None:
        if self.emitted is None:
            return None
        row = _first_bad_row((self.emitted == self.bonus_tokens) | (self.emitted == NONFINITE_LOGITS))
        return None if row is None else f"request {row}: emitted {int(self.emitted[row])}, bonus token {int(self.bonus_tokens[row])}"


# ----------------------------------------------------------------------------- tree proposal


@schema
class TreeProposal(Schema):
    """The draft tree of every request, built and ready for the target to verify."""

    draft: DraftState = value(doc="the state the tree was drafted from")
    num_steps: int = value(doc="S, the tree depth")
    draft_lead: int = value(default=0, doc="the draft's KV lead (1 for standalone drafts)")
    draft_tokens: Int64[Tensor, "B*N"] = tensor(role=NODE, pad=0, doc="node tokens; node 0 is the bonus token")
    positions: Int64[Tensor, "B*N"] = tensor(role=NODE, pad=0, doc="seq_len + depth")
    parents: Int64[Tensor, "B N"] = tensor(role=REQUEST, pad=-1, doc="tree parent of each node, -1 for the root")
    depth: Int64[Tensor, "B N"] = tensor(role=REQUEST, pad=0)
    tree_mask: Bool[Tensor, "B N N"] = tensor(role=REQUEST, pad=Pad.IDENTITY, doc="ancestor-or-self")
    retrieve_index: Int64[Tensor, "B N"] = tensor(role=REQUEST, pad=Pad.index(NODE), doc="b*N + j")
    retrieve_next_token: Int64[Tensor, "B N"] = tensor(role=REQUEST, pad=-1, doc="first child, -1")
    retrieve_next_sibling: Int64[Tensor, "B N"] = tensor(role=REQUEST, pad=-1, doc="next sibling, -1")
    draft_positions: Int64[Tensor, "B D K"] = tensor(
        role=REQUEST, pad=0, doc="the position every beam of draft forward i ran at: the tensor the forwards were given"
    )
    draft_finite: Bool[Tensor, "B"] = tensor(
        role=REQUEST, pad=True,
        doc="False where a candidate score the tree was chosen from was NaN or infinite: the draft's logits were not",
    )
    token_bitmask: Int32[Tensor, "B*N Vw"] | None = tensor(
        role=NODE, pad=-1, default=None,
        doc="the grammar's allowed tokens after each node's path (bit set = allowed; all set for a "
            "request without a grammar); None where no request of the batch has structured output",
    )

    @classmethod
    def of_tree(cls, draft: DraftState, num_steps: int, draft_lead: int, tree, parents: torch.Tensor, *,
                draft_positions: torch.Tensor, draft_finite: torch.Tensor, token_bitmask: torch.Tensor | None = None,
                retrieve_next_token: torch.Tensor | None = None) -> TreeProposal:
        """The proposal of a tree that :func:`~phasegraph.kernels.build_tree.build_tree` built
        (``tree``), with ``retrieve_next_token`` where the drafter cut first-child links itself."""
        return cls(
            draft=draft, num_steps=num_steps, draft_lead=draft_lead, draft_tokens=tree.draft_tokens,
            positions=tree.positions, parents=parents, depth=tree.depth, tree_mask=tree.tree_mask,
            retrieve_index=tree.retrieve_index,
            retrieve_next_token=tree.retrieve_next_token if retrieve_next_token is None else retrieve_next_token,
            retrieve_next_sibling=tree.retrieve_next_sibling, draft_positions=draft_positions,
            draft_finite=draft_finite, token_bitmask=token_bitmask,
        )

    @invariant("the draft's candidate scores are finite (draft_finite)")
    def _draft_finite(self) -> str | None:
        row = _first_bad_row(self.draft_finite)
        return None if row is None else (
            f"request {row}: a draft candidate's score was NaN or infinite, so the draft's logits "
            "were not finite (its tree is verified and rejected: outputs stay exact, tau falls to 1)"
        )

    @invariant("positions == seq_lens + depth (SGLang #25015)")
    def _positions_follow_depth(self) -> str | None:
        B, N = self.depth.shape
        want = self.draft.seq_lens[:, None] + self.depth
        row = _first_bad_row((self.positions.view(B, N) == want).all(dim=1)) if B else None
        return None if row is None else f"request {row}: positions {self.positions.view(B, N)[row].tolist()} != seq_len {int(self.draft.seq_lens[row])} + depth {self.depth[row].tolist()}"

    @invariant("draft step i runs at seq_len + lead + i (SGLang #25015)")
    def _draft_step_positions(self) -> str | None:
        B, D, K = self.draft_positions.shape
        if D != max(self.num_steps - 1, 0):
            return f"{D} draft forwards recorded for num_steps={self.num_steps} (want {max(self.num_steps - 1, 0)})"
        base = self.draft.seq_lens[:, None, None] + self.draft_lead
        want = base + torch.arange(D, device=self.draft_positions.device)[None, :, None]  # [B, D, 1]
        row = _first_bad_row((self.draft_positions == want).flatten(1).all(dim=1)) if B else None
        return None if row is None else (
            f"request {row}: draft steps ran at {self.draft_positions[row].tolist()} (step by beam), "
            f"want {want[row, :, 0].tolist()}"
        )

    @invariant("node 0 is the root: the bonus token, parent -1, depth 0; parents precede children")
    def _tree_shape(self) -> str | None:
        B, N = self.depth.shape
        if B == 0:
            return None
        tokens, bonus, parents, depth = _host(self.draft_tokens, self.draft.bonus_tokens, self.parents, self.depth)
        ok = (tokens.reshape(B, N)[:, 0] == bonus) & (parents[:, 0] == -1) & (depth[:, 0] == 0)
        ok &= ((parents[:, 1:] >= 0) & (parents[:, 1:] < np.arange(1, N))).all(axis=1)
        ok &= depth.max(axis=1) <= self.num_steps
        row = _first_bad_row(ok)
        return None if row is None else f"request {row}: malformed tree (parents {parents[row].tolist()}, depth {depth[row].tolist()})"

    @invariant("depth[j] == depth[parent[j]] + 1, and tree_mask row j holds j and its ancestors only")
    def _depth_and_mask_follow_parents(self) -> str | None:
        B, N = self.depth.shape
        if B == 0:
            return None
        parents, depth, mask = _host(self.parents, self.depth, self.tree_mask)
        b = np.arange(B)[:, None]
        has_parent = parents >= 0  # [B, N]
        parent = parents.clip(0, N - 1)  # (a malformed index is _tree_shape's to report)
        ok = (~has_parent | (depth == depth[b, parent] + 1)).all(axis=1)
        # by induction over nodes (parents precede children): row j is its parent's row plus j
        want = mask[b, parent] & has_parent[:, :, None]  # [B, N, N]
        want |= np.eye(N, dtype=bool)
        bad_rows = (mask != want).any(axis=2)  # [B, N]
        ok &= ~bad_rows.any(axis=1)
        row = _first_bad_row(ok)
        if row is None:
            return None
        return (f"request {row}: parents {parents[row].tolist()}, depth {depth[row].tolist()}; "
                f"mask rows {np.flatnonzero(bad_rows[row])[:8].tolist()} are not ancestor-or-self")

    @invariant("retrieve_next_token[j] is j's first child or -1 (a cut); retrieve_next_sibling[j] the "
               "next child of j's parent or -1")
    def _retrieve_links_follow_parents(self) -> str | None:
        B, N = self.depth.shape
        if B == 0:
            return None
        parents, nt, sib = _host(self.parents, self.retrieve_next_token, self.retrieve_next_sibling)
        j = np.arange(N)
        children = parents[:, None, :] == j[:, None]  # [B, parent, child]
        first_child = np.where(children.any(axis=2), children.argmax(axis=2), -1)  # [B, N]
        # [B, node, other]: other comes later and hangs off node's parent
        siblings = (parents[:, :, None] == parents[:, None, :]) & (j > j[:, None]) & (parents >= 0)[:, :, None]
        next_sibling = np.where(siblings.any(axis=2), siblings.argmax(axis=2), -1)  # [B, N]
        ok = ((nt == first_child) | (nt == -1)).all(axis=1) & (sib == next_sibling).all(axis=1)
        row = _first_bad_row(ok)
        if row is None:
            return None
        return (f"request {row}: parents {parents[row].tolist()}, next_token {nt[row].tolist()} (first children "
                f"{first_child[row].tolist()}), next_sibling {sib[row].tolist()} (want {next_sibling[row].tolist()})")


# ----------------------------------------------------------------------------- verify result


@schema
class VerifyResult(Schema):
    """The target's verdict on every tree: per-node outputs and the accepted path.

    Every ``NODE`` field here is compacted by finalize-tree-path into the ``accepted_<name>``
    field of the finalized schema, found from this declaration: add a per-node side output here
    (or in a subclass) and it is compacted without code changes (SGLang #26866).
    """

    proposal: TreeProposal = value()
    predict: Int64[Tensor, "B*N"] = tensor(role=NODE, pad=0, doc="token emitted after each node if accepted")
    features: Float[Tensor, "B*N Hf"] = tensor(role=NODE, pad=0.0, doc="target features for draft-extend")
    logprobs: Float32[Tensor, "B*N"] | None = tensor(role=NODE, pad=0.0, default=None, doc="logprob of predict")
    top_logprobs: Float32[Tensor, "B*N L"] | None = tensor(
        role=NODE, pad=0.0, default=None, doc="the L largest logprobs after each node, most likely first")
    top_logprob_ids: Int64[Tensor, "B*N L"] | None = tensor(role=NODE, pad=0, default=None)
    routed_experts: Int64[Tensor, "B*N M Ke"] | None = tensor(
        role=NODE, pad=0, default=None, doc="the experts each MoE layer chose at each node's row (gave its predict)")
    accept_index: Int64[Tensor, "B W"] = tensor(role=REQUEST, pad=Pad.index(NODE), doc="node rows of the accepted path, -1 padded")
    accept_lens: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=1, doc="accepted drafts + 1 (the bonus)")
    bonus_tokens: Int64[Tensor, "B"] = tensor(role=REQUEST, pad=0, doc="the new bonus token")
    logits_finite: Bool[Tensor, "B N"] = tensor(
        role=REQUEST, pad=True, doc="False at node j where the target's logits after it held NaN or +inf (or only -inf)"
    )

    @invariant("accept_index[b,0] is b's root; entries stay in b's node block; -1 only as a suffix")
    def _accept_index_in_block(self) -> str | None:
        B, W = self.accept_index.shape
        if B == 0:
            return None
        N = self.proposal.depth.shape[1]
        b = torch.arange(B, device=self.accept_index.device)[:, None]
        idx = self.accept_index
        valid = idx >= 0
        ok = (idx[:, 0] == b[:, 0] * N)
        ok &= (~valid | ((idx >= b * N) & (idx < (b + 1) * N))).all(dim=1)
        ok &= (valid[:, :-1] | ~valid[:, 1:]).all(dim=1)  # no valid entry after a -1
        row = _first_bad_row(ok)
        return None if row is None else f"request {row}: accept_index {idx[row].tolist()} with N={N}"

    @invariant("the accepted path runs from the root, each node a child of the one before")
    def _accept_path_follows_parents(self) -> str | None:
        B, W = self.accept_index.shape
        if B == 0 or W < 2:
            return None
        N = self.proposal.depth.shape[1]
        index, parents = _host(self.accept_index, self.proposal.parents)
        b = np.arange(B)[:, None]
        local = index - b * N  # [B, W] nodes within each request's tree
        parent = parents[b, local[:, 1:].clip(0, N - 1)]  # [B, W-1]
        ok = ((index[:, 1:] < 0) | (parent == local[:, :-1])).all(axis=1)
        row = _first_bad_row(ok)
        return None if row is None else f"request {row}: accepted nodes {local[row].tolist()} (in its tree), parents {parents[row].tolist()}"

    @invariant("1 <= accept_lens <= num_steps + 1 and accept_lens counts the path")
    def _accept_lens(self) -> str | None:
        B, W = self.accept_index.shape
        S = self.proposal.num_steps
        if W != S + 1:
            return f"accept_index has width {W}, want num_steps + 1 = {S + 1}"
        ok = (self.accept_lens >= 1) & (self.accept_lens <= S + 1)
        ok &= self.accept_lens == (self.accept_index >= 0).sum(dim=1)
        row = _first_bad_row(ok)
        return None if row is None else f"request {row}: accept_lens {int(self.accept_lens[row])}, accept_index {self.accept_index[row].tolist()}"

    @invariant("bonus_tokens[b] == predict[accept_index[b, accept_lens[b] - 1]] (stride W, SGLang #26866)")
    def _bonus(self) -> str | None:
        B, W = self.accept_index.shape
        if B == 0:
            return None
        last = self.accept_index.gather(1, (self.accept_lens - 1).clamp(min=0)[:, None])[:, 0]
        ok = self.predict[last.clamp(min=0)] == self.bonus_tokens
        row = _first_bad_row(ok)
        return None if row is None else f"request {row}: bonus {int(self.bonus_tokens[row])} is not the last accepted prediction"


_ROLES = (REQUEST, NODE, ACCEPTED, TOKEN)


def check_roles(cls: type[Schema]) -> None:
    """Raise :class:`InvalidSchema` where a tensor field of ``cls`` leads with a role's dim
    (``B``, ``B*N``, ``B*W``, ``T``) but declares no role: finalize compacts, the graph runner
    pads and filter keeps a field by its role, so a role-less ``B*N`` side output would stay in
    node order unseen (SGLang #26866: per-node outputs left out of the accepted-path compaction)."""
    problems = []
    for spec in cls.__schema__.tensors:
        lead = next(iter(spec.dim_text.split()), None)
        role = next((r for r in _ROLES if r.leading == lead), None)
        if spec.role is None and role is not None:
            problems.append(
                f"field {spec.name!r} has shape {spec.dim_text!r}, whose first dim {lead!r} is the "
                f"{role.name} role's: declare tensor(role={role.name.upper()}) so that the phases "
                f"move its rows with the batch"
            )
    if problems:
        raise InvalidSchema(cls.__name__, problems)


@functools.cache
def node_fields(verify_cls: type[VerifyResult]) -> tuple[str, ...]:
    """Names of every per-node field ``verify_cls`` declares (what finalize must compact); a
    field shaped per node without the node role is refused (:func:`check_roles`)."""
    check_roles(verify_cls)
    return tuple(t.name for t in verify_cls.__schema__.tensors if t.role == NODE)


# ----------------------------------------------------------------------------- finalized path


@schema
class FinalizedPath(DraftExtendInput):
    """Verify's outcome with the accepted path compacted to the front of every request.

    As a :class:`DraftExtendInput` it feeds draft-extend (``T = B*W`` rows, rows past a request's
    ``accept_len`` are padding); the ``accepted_*`` fields are the compacted per-node fields of
    :class:`VerifyResult`; ``emitted`` are the new tokens of each request.
    """

    verified: VerifyResult = value(doc="the verify result this path was finalized from")
    accept_index: Int64[Tensor, "B W"] = tensor(role=REQUEST, pad=Pad.index(NODE))
    accept_lens: Int64[Tensor, "B"] = tensor(
        role=REQUEST, pad=1, doc="after truncation at a stop or budget, and to W - 1 where the draft was not finite")
    emitted: Int64[Tensor, "B W"] = tensor(
        role=REQUEST, pad=-1,
        doc="new tokens, -1 padded (DRAFT_NONFINITE where the tree's draft was not finite); NONFINITE_LOGITS "
            "at the first whose logits were not finite",
    )
    finished: Bool[Tensor, "B"] = tensor(role=REQUEST, pad=False, doc="hit a stop token or its budget")
    accepted_predict: Int64[Tensor, "B*W"] = tensor(role=ACCEPTED, pad=0)
    accepted_features: Float[Tensor, "B*W Hf"] = tensor(role=ACCEPTED, pad=0.0)
    accepted_logprobs: Float32[Tensor, "B*W"] | None = tensor(role=ACCEPTED, pad=0.0, default=None)
    accepted_top_logprobs: Float32[Tensor, "B*W L"] | None = tensor(role=ACCEPTED, pad=0.0, default=None)
    accepted_top_logprob_ids: Int64[Tensor, "B*W L"] | None = tensor(role=ACCEPTED, pad=0, default=None)
    accepted_routed_experts: Int64[Tensor, "B*W M Ke"] | None = tensor(role=ACCEPTED, pad=0, default=None)

    @invariant("output_counts == the tree's output_counts + the emitted tokens (while penalties are on)")
    def _counts_advance(self) -> str | None:
        before = self.verified.proposal.draft.output_counts
        if self.output_counts is None or before is None:
            return None
        tokens = self.emitted >= 0  # -1 pads and the non-finite marks are no tokens
        where = self.emitted.clamp(0, before.shape[1] - 1)
        added = torch.zeros_like(before).scatter_add(1, where, tokens.to(before.dtype))
        row = _first_bad_row((self.output_counts == before + added).all(dim=1))
        return None if row is None else f"request {row}: output_counts do not add the emitted {self.emitted[row].tolist()}"

    @invariant("seq_lens == seq_lens before verify + accept_lens")
    def _seq_lens_advance(self) -> str | None:
        before = self.verified.proposal.draft.seq_lens
        row = _first_bad_row(self.seq_lens == before + self.accept_lens)
        return None if row is None else f"request {row}: seq_len {int(self.seq_lens[row])} != {int(before[row])} + {int(self.accept_lens[row])}"

    @invariant("emitted tokens are the accepted predictions, -1 past accept_lens, cut at the first "
               "node with non-finite logits; DRAFT_NONFINITE pads where the draft was not finite")
    def _emitted(self) -> str | None:
        B, W = self.emitted.shape
        if B == 0:
            return None
        j = torch.arange(W, device=self.emitted.device)[None, :]
        inside = j < self.accept_lens[:, None]
        want = torch.where(inside, self.accepted_predict.view(B, W), -1)
        want = cut_at_nonfinite(want, self.accept_index, inside, self.verified.logits_finite.reshape(-1))
        want = mark_nonfinite_draft(want, self.verified.proposal.draft_finite)
        row = _first_bad_row((self.emitted == want).all(dim=1))
        return None if row is None else f"request {row}: emitted {self.emitted[row].tolist()} != {want[row].tolist()}"

    @invariant("a request whose draft was not finite ends its emitted row with DRAFT_NONFINITE (W >= 2), "
               "so the host always sees the mark")
    def _draft_mark(self) -> str | None:
        if self.emitted.shape[1] < 2:
            return None
        marked = self.verified.proposal.draft_finite | (self.emitted[:, -1] == DRAFT_NONFINITE)
        row = _first_bad_row(marked)
        return None if row is None else f"request {row}: draft not finite, emitted {self.emitted[row].tolist()}"

    @invariant("every accepted_<field> row i < accept_lens is <field> of node accept_index[b, i], and "
               "draft-extend's rows carry those predictions and features (compacted along the path, "
               "not left in node order: SGLang #26866)")
    def _compacted_along_path(self) -> str | None:
        B, W = self.accept_index.shape
        if B == 0:
            return None
        inside = torch.arange(W, device=self.accept_index.device)[None, :] < self.accept_lens[:, None]  # [B, W]
        nodes = self.accept_index.clamp(min=0).reshape(-1)  # [B*W]
        pairs = [(accepted_name(n), getattr(self, accepted_name(n)), getattr(self.verified, n)[nodes]
                  if getattr(self.verified, n) is not None else None) for n in node_fields(type(self.verified))]
        lead_rows = self.input_ids.shape[0] // B - W  # 1: a row for the root token comes first
        ids, feats = self.input_ids.view(B, W + lead_rows), self.features.view(B, W + lead_rows, -1)
        pairs += [("input_ids", ids[:, lead_rows:].reshape(-1), self.accepted_predict),
                  ("features", feats[:, lead_rows:].reshape(B * W, -1), self.accepted_features)]
        for name, got, want in pairs:
            if (got is None) != (want is None):
                return f"{name} is {'missing' if got is None else 'set'} but its node field is not"
            if got is None:
                continue
            same = (got == want) | (got != got) & (want != want)  # NaN where the node held NaN
            row = _first_bad_row((same.view(B, W, -1).all(dim=2) | ~inside).all(dim=1))
            if row is not None:
                return f"request {row}: {name} is not compacted along accept_index {self.accept_index[row].tolist()}"
        return None


def accepted_name(node_field: str) -> str:
    return f"accepted_{node_field}"


@functools.cache
def finalized_schema_for(verify_cls: type[VerifyResult]) -> type[FinalizedPath]:
    """The FinalizedPath type for ``verify_cls``: one ``accepted_<name>`` field per node field.

    For :class:`VerifyResult` itself this is :class:`FinalizedPath`; a subclass that declares a
    new per-node side output gets a FinalizedPath subclass with the compacted counterpart, so
    finalize-tree-path compacts it without code changes.
    """
    have = {t.name for t in FinalizedPath.__schema__.tensors}
    nodes = set(node_fields(verify_cls))  # refuses a per-node field without the node role
    hints, pads = {}, {}
    import typing

    annotations = typing.get_type_hints(verify_cls, include_extras=True)
    for spec in verify_cls.__schema__.tensors:
        if spec.name not in nodes or accepted_name(spec.name) in have:
            continue
        ann = annotations[spec.name]
        args = typing.get_args(ann)
        arr = next(a for a in args if a is not type(None)) if args else ann
        rest = spec.dim_text.split()[1:]
        new_ann = arr.dtype[arr.array_type, " ".join(["B*W", *rest])]
        hints[accepted_name(spec.name)] = (new_ann | None) if spec.optional else new_ann
        pads[accepted_name(spec.name)] = spec.pad  # an accepted row holds what its node held
    if not hints:
        return FinalizedPath

    def body(ns: dict) -> None:
        ns["__annotations__"] = dict(hints)
        ns["__module__"] = __name__
        for name, ann in hints.items():
            optional = type(None) in typing.get_args(ann)
            kw = {"default": None} if optional else {}
            ns[name] = tensor(role=ACCEPTED, pad=pads[name], **kw)

    cls = types.new_class(f"FinalizedPath_{verify_cls.__name__}", (FinalizedPath,), exec_body=body)
    return schema(cls)


# ----------------------------------------------------------------------------- scheduler inputs


@schema
class RowSelection(Schema):
    """Batch rows chosen by the scheduler (kept by filter, dropped by retract)."""

    rows: Int64[Tensor, "R"] = tensor(doc="batch row indices, ascending")

    @invariant("rows ascending and unique")
    def _ascending(self) -> str | None:
        if self.rows.numel() > 1 and not bool((self.rows[1:] > self.rows[:-1]).all()):
            return f"rows {self.rows.tolist()} are not strictly ascending"
        return None
