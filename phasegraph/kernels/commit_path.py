"""The per-request bookkeeping of finalize-tree-path: cut the accepted path and commit it.

After verify, every request ``b`` has an accepted path of ``accept_lens[b]`` tree nodes
(``accept_index[b, :]``, -1 padded) and a token emitted after each (``predict`` of that node).
finalize-tree-path keeps the path up to and including the first stop token and within the
request's token budget (``remaining``), and derives from the cut length ``lens`` the new sequence
length, budget, bonus token and the row draft-extend samples from. The reference computes that
with ~25 small torch ops (each a kernel of a few microseconds on a GPU); the Triton kernel does
it in one program per request.

A node whose target logits were not finite (``node_finite`` False: the target overflowed, see
:func:`phasegraph.kernels.argmax.argmax_finite`) made a meaningless prediction, and so did every
node after it on the path: ``emitted`` keeps the tokens before the first such node, holds
:data:`NONFINITE_LOGITS` in its place and -1 after it, so the host fails that request instead
of emitting garbage. The rest of the state is cut as usual (the host drops the request).

A request whose tree was drafted from non-finite draft logits (``draft_finite`` False: a NaN
candidate score, :func:`phasegraph.kernels.build_tree.select_tree_nodes`) loses nothing but
speed, since verify rejects such drafts; its ``emitted`` row is padded with
:data:`DRAFT_NONFINITE` instead of -1, so the host, which reads that row anyway, can say so
without another copy. So that every such row has padding to carry the mark, its path is cut to
at most ``W - 1`` tokens (``W >= 2``): a broken draft's tokens are accepted only where the target
emits the same token anyway, so this rarely cuts anything, and a cut path stays exact, like a cut
at the budget (the next step starts from its last token).

Both return :class:`CommittedPath`; its fields equal the reference's exactly (integers only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from phasegraph.kernels._checks import expect, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes
from phasegraph.kernels.argmax import NONFINITE_LOGITS
from phasegraph.kernels.bonus import fill_bonus_tokens_reference, gather_accepted_tokens_reference

DRAFT_NONFINITE = -3  # pads ``emitted`` where the draft's scores were not finite (never a token id)


class CommittedPath(NamedTuple):
    lens: torch.Tensor  # [B] i64 in [1, W]: tokens committed
    finished: torch.Tensor  # [B] bool: a stop token or the budget ended the request
    accept_index: torch.Tensor  # [B, W] i64: the accepted nodes, -1 past lens
    emitted: torch.Tensor  # [B, W] i64: their tokens, -1 (or DRAFT_NONFINITE) past lens; NONFINITE_LOGITS
    bonus_tokens: torch.Tensor  # [B] i64: the last committed token
    select_index: torch.Tensor  # [B] i64: b * width + lens - 1 + lead (draft-extend's sampled row)
    seq_lens: torch.Tensor  # [B] i64: seq_lens + lens
    remaining: torch.Tensor  # [B] i64: max(remaining - lens, 0)


def _check(predict, accept_index, accept_lens, stop_ids, remaining, seq_lens, lead, node_finite,
           draft_finite) -> None:
    expect(predict, "predict", 1, torch.int64)
    if node_finite is not None:
        expect(node_finite, "node_finite", 1, torch.bool)
        expect_shape(node_finite, "node_finite", tuple(predict.shape))
    expect(accept_index, "accept_index", 2, torch.int64)
    batch = accept_index.shape[0]
    if draft_finite is not None:
        expect(draft_finite, "draft_finite", 1, torch.bool)
        expect_shape(draft_finite, "draft_finite", (batch,))
    for t, name in ((accept_lens, "accept_lens"), (remaining, "remaining"), (seq_lens, "seq_lens")):
        expect(t, name, 1, torch.int64)
        expect_shape(t, name, (batch,))
    expect(stop_ids, "stop_ids", 2, torch.int64)
    if stop_ids.shape[0] != batch:
        raise ValueError(f"stop_ids: expected {batch} rows, got {stop_ids.shape[0]}")
    if lead not in (0, 1):
        raise ValueError(f"lead: expected 0 or 1, got {lead}")


def cut_at_nonfinite(
    tokens: torch.Tensor,  # [B, W] i64, an accepted path's tokens, -1 outside ``inside``
    accept_index: torch.Tensor,  # [B, W] i64, their nodes
    inside: torch.Tensor,  # [B, W] bool, the committed entries
    node_finite: torch.Tensor,  # [B*N] bool
) -> torch.Tensor:  # [B, W] i64
    """``tokens`` cut at the first committed node whose logits were not finite:
    NONFINITE_LOGITS there, -1 after it (the module docstring)."""
    W = tokens.shape[1]
    j = torch.arange(W, device=tokens.device)
    bad = inside & ~node_finite[accept_index.clamp(min=0)]  # [B, W]
    first_bad = torch.where(bad, j, W).min(dim=1).values[:, None]  # [B, 1], W = none
    return torch.where(j == first_bad, NONFINITE_LOGITS, torch.where(j > first_bad, -1, tokens))


def mark_nonfinite_draft(
    emitted: torch.Tensor,  # [B, W] i64, -1 padded
    draft_finite: torch.Tensor,  # [B] bool
) -> torch.Tensor:  # [B, W] i64
    """``emitted`` with its -1 padding replaced by DRAFT_NONFINITE in the rows whose draft was
    not finite (the module docstring)."""
    return torch.where((emitted == -1) & ~draft_finite[:, None], DRAFT_NONFINITE, emitted)


def commit_path_reference(
    predict: torch.Tensor,  # [B*N] i64, token emitted after each node
    accept_index: torch.Tensor,  # [B, W] i64, accepted nodes, -1 padded
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
    stop_ids: torch.Tensor,  # [B, Z] i64, -1 padded
    remaining: torch.Tensor,  # [B] i64
    seq_lens: torch.Tensor,  # [B] i64
    lead: int,  # 0, or 1 for drafts whose extend starts at the root token
    *,
    node_finite: torch.Tensor | None = None,  # [B*N] bool, None = every node finite
    draft_finite: torch.Tensor | None = None,  # [B] bool, None = every draft finite
) -> CommittedPath:
    """The cut path and the request state it leaves, in torch ops."""
    _check(predict, accept_index, accept_lens, stop_ids, remaining, seq_lens, lead, node_finite,
           draft_finite)
    B, W = accept_index.shape
    device = accept_index.device
    raw = gather_accepted_tokens_reference(predict, accept_index)  # [B, W]
    is_stop = (raw[:, :, None] == stop_ids[:, None, :]).any(dim=-1) & (raw >= 0)  # [B, W]
    j = torch.arange(W, device=device)
    first_stop = torch.where(is_stop, j + 1, W + 1).min(dim=1).values  # [B], W + 1 = none
    lens = torch.minimum(torch.minimum(accept_lens, first_stop), remaining.clamp(min=1))
    if draft_finite is not None:  # room for the DRAFT_NONFINITE mark (the module docstring)
        lens = torch.where(draft_finite, lens, lens.clamp(max=max(W - 1, 1)))
    finished = (first_stop <= lens) | (lens >= remaining)
    inside = j[None, :] < lens[:, None]  # [B, W]
    index = torch.where(inside, accept_index, -1)
    emitted = torch.where(inside, raw, -1)
    if node_finite is not None:
        emitted = cut_at_nonfinite(emitted, accept_index, inside, node_finite)
    if draft_finite is not None:
        emitted = mark_nonfinite_draft(emitted, draft_finite)
    width = W + lead
    return CommittedPath(
        lens=lens,
        finished=finished,
        accept_index=index,
        emitted=emitted,
        bonus_tokens=fill_bonus_tokens_reference(predict, index, lens),
        select_index=torch.arange(B, device=device) * width + lens - 1 + lead,
        seq_lens=seq_lens + lens,
        remaining=(remaining - lens).clamp(min=0),
    )


@jit
def _commit_path_kernel(
    predict_ptr,  # [B*N]
    accept_index_ptr,  # [B, W]
    accept_lens_ptr,  # [B]
    stop_ids_ptr,  # [B, Z]
    remaining_ptr,  # [B]
    seq_lens_ptr,  # [B]
    node_finite_ptr,  # [B*N] bool, read when HAS_FINITE
    draft_finite_ptr,  # [B] bool, read when HAS_DRAFT_FINITE
    lens_ptr,  # [B] out
    finished_ptr,  # [B] bool out
    index_out_ptr,  # [B, W] out
    emitted_ptr,  # [B, W] out
    bonus_ptr,  # [B] out
    select_ptr,  # [B] out
    seq_out_ptr,  # [B] out
    remaining_out_ptr,  # [B] out
    width,  # W
    num_stops,  # Z
    lead,
    BLOCK_W: tl.constexpr,
    BLOCK_Z: tl.constexpr,
    HAS_FINITE: tl.constexpr,
    HAS_DRAFT_FINITE: tl.constexpr,
    NONFINITE: tl.constexpr,
    DRAFT_BAD: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, w, in_w = row_lanes(BLOCK_W, width)
    index = tl.load(accept_index_ptr + b * width + w, mask=in_w, other=-1)
    token = tl.load(predict_ptr + index, mask=in_w & (index >= 0), other=-1)  # -1 where index is
    z = tl.arange(0, BLOCK_Z)
    stops = tl.load(stop_ids_ptr + b * num_stops + z, mask=z < num_stops, other=-1)
    hits = (token[:, None] == stops[None, :]) & (z < num_stops)[None, :]  # [BLOCK_W, BLOCK_Z]
    is_stop = (tl.max(hits.to(tl.int32), axis=1) > 0) & (token >= 0)
    first_stop = tl.min(tl.where(is_stop, w + 1, width + 1), axis=0)
    remaining = tl.load(remaining_ptr + b)
    lens = tl.minimum(tl.minimum(tl.load(accept_lens_ptr + b), first_stop), tl.maximum(remaining, 1))
    if HAS_DRAFT_FINITE:  # room for the DRAFT_BAD mark
        draft_ok = tl.load(draft_finite_ptr + b) != 0
        lens = tl.where(draft_ok, lens, tl.minimum(lens, tl.maximum(width - 1, 1)))
    inside = w < lens
    tl.store(lens_ptr + b, lens)
    tl.store(finished_ptr + b, (first_stop <= lens) | (lens >= remaining))
    tl.store(index_out_ptr + b * width + w, tl.where(inside, index, -1), mask=in_w)
    emitted = tl.where(inside, token, -1)
    if HAS_FINITE:
        finite = tl.load(node_finite_ptr + index, mask=inside & (index >= 0), other=1)
        first_bad = tl.min(tl.where(inside & (finite == 0), w, width), axis=0)
        emitted = tl.where(w == first_bad, NONFINITE, tl.where(w > first_bad, -1, emitted))
    if HAS_DRAFT_FINITE:
        pad = tl.where(draft_ok, -1, DRAFT_BAD)
        emitted = tl.where(emitted == -1, pad, emitted)
    tl.store(emitted_ptr + b * width + w, emitted, mask=in_w)
    tl.store(bonus_ptr + b, tl.sum(tl.where(w == lens - 1, token, 0), axis=0))
    tl.store(select_ptr + b, b * (width + lead) + lens - 1 + lead)
    tl.store(seq_out_ptr + b, tl.load(seq_lens_ptr + b) + lens)
    tl.store(remaining_out_ptr + b, tl.maximum(remaining - lens, 0))


def commit_path_triton(
    predict: torch.Tensor,  # [B*N] i64
    accept_index: torch.Tensor,  # [B, W] i64, -1 padded
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
    stop_ids: torch.Tensor,  # [B, Z] i64, -1 padded
    remaining: torch.Tensor,  # [B] i64
    seq_lens: torch.Tensor,  # [B] i64
    lead: int,
    *,
    node_finite: torch.Tensor | None = None,  # [B*N] bool
    draft_finite: torch.Tensor | None = None,  # [B] bool
) -> CommittedPath:
    """Triton ``commit_path``: one program per request, one launch."""
    _check(predict, accept_index, accept_lens, stop_ids, remaining, seq_lens, lead, node_finite,
           draft_finite)
    B, W = accept_index.shape
    Z = stop_ids.shape[1]
    device = accept_index.device

    def ints(*shape):
        return torch.empty(shape, dtype=torch.int64, device=device)

    out = CommittedPath(
        lens=ints(B), finished=torch.empty(B, dtype=torch.bool, device=device), accept_index=ints(B, W),
        emitted=ints(B, W), bonus_tokens=ints(B), select_index=ints(B), seq_lens=ints(B), remaining=ints(B),
    )
    if B == 0:
        return out
    if W == 0:
        raise ValueError("accept_index: an accepted path has at least one node (W >= 1)")
    _commit_path_kernel[(B,)](
        predict.contiguous(), accept_index.contiguous(), accept_lens.contiguous(), stop_ids.contiguous(),
        remaining.contiguous(), seq_lens.contiguous(),
        predict if node_finite is None else node_finite.contiguous(),  # never read without HAS_FINITE
        predict if draft_finite is None else draft_finite.contiguous(),  # nor this without HAS_DRAFT_FINITE
        *out, W, Z, lead,
        BLOCK_W=max(next_pow2(W), 2), BLOCK_Z=max(next_pow2(Z), 2), HAS_FINITE=node_finite is not None,
        HAS_DRAFT_FINITE=draft_finite is not None, NONFINITE=NONFINITE_LOGITS, DRAFT_BAD=DRAFT_NONFINITE,
        num_warps=1, **pdl_options(),
    )
    return out


def commit_path(
    predict: torch.Tensor,  # [B*N] i64
    accept_index: torch.Tensor,  # [B, W] i64, -1 padded
    accept_lens: torch.Tensor,  # [B] i64 in [1, W]
    stop_ids: torch.Tensor,  # [B, Z] i64, -1 padded
    remaining: torch.Tensor,  # [B] i64
    seq_lens: torch.Tensor,  # [B] i64
    lead: int,
    *,
    node_finite: torch.Tensor | None = None,  # [B*N] bool, None = every node finite
    draft_finite: torch.Tensor | None = None,  # [B] bool, None = every draft finite
) -> CommittedPath:
    """Cut each accepted path after its first stop token and at the budget; the state it leaves;
    mark the first accepted token whose logits were not finite, and the padding of a request
    whose draft was not, cutting its path to leave room for that mark (module docstring)."""
    impl = commit_path_triton if use_triton(accept_index) else commit_path_reference
    return impl(predict, accept_index, accept_lens, stop_ids, remaining, seq_lens, lead,
                node_finite=node_finite, draft_finite=draft_finite)
