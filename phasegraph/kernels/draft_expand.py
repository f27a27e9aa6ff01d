"""EAGLE-2 dynamic draft-tree expansion (Li et al. 2024, arXiv 2406.16858), torch reference.

The draft grows K beams for S steps. Every step proposes K children per beam; a child's score is
the product of the draft probabilities along its path (its "global acceptance confidence" in
EAGLE-2), and the K best children become the next beams. Every proposal is recorded as a
*candidate* in the per-request candidate index space of ``docs/internals.md``:

- step 0: candidates ``[0, K)`` (children of the root, parent ``-1``);
- step i >= 1: candidate ``K + (i-1)*K*K + beam*K + child`` (parent = the beam's candidate id).

``select_tree_nodes`` (build_tree.py) later keeps the N-1 best candidates as the verified tree.

``expand_step`` dispatches to a Triton kernel on CUDA tensors. The draft phase passes it a
:class:`StepCandidates` table that every step writes its K*K candidates into, and hands the
step-0 candidates (the draft state's top-k) to ``select_tree_nodes`` as they are: no
concatenation and no constant tensors. ``first_step_candidates`` and ``concat_candidates`` build
the same candidate lists in torch (an arange, a constant and one ``torch.cat`` per output).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from phasegraph.kernels._checks import expect, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes
from phasegraph.kernels.build_tree import _sorts_before


@attrs.frozen(eq=False)
class DraftCandidates:
    """Step 0: the K root children are both the first candidates and the first beams."""

    beam_scores: torch.Tensor  # [B, K] f32, cumulative score of each beam
    beam_tokens: torch.Tensor  # [B, K] i64, token of each beam (the next draft input)
    beam_cand: torch.Tensor  # [B, K] i64, candidate id of each beam (= arange(K))
    cand_tokens: torch.Tensor  # [B, K] i64
    cand_scores: torch.Tensor  # [B, K] f32
    cand_parents: torch.Tensor  # [B, K] i64, all -1 (the root)


@attrs.frozen(eq=False)
class ExpandedCandidates:
    """Step i >= 1: the K*K new candidates (beam-major) and the K beams chosen among them."""

    cand_tokens: torch.Tensor  # [B, K*K] i64
    cand_scores: torch.Tensor  # [B, K*K] f32
    cand_parents: torch.Tensor  # [B, K*K] i64, candidate id of the parent beam
    beam_scores: torch.Tensor  # [B, K] f32, best-first
    beam_tokens: torch.Tensor  # [B, K] i64
    beam_parent: torch.Tensor  # [B, K] i64 in [0, K): old beam each new beam descends from
    beam_cand: torch.Tensor  # [B, K] i64, candidate id of each new beam


@attrs.frozen(eq=False)
class StepCandidates:
    """The candidates of draft steps 1 .. S-1 in candidate-id order: column ``c - K`` holds
    candidate ``c``, so step i writes columns ``[(i-1)*K*K, i*K*K)``."""

    tokens: torch.Tensor  # [B, (S-1)*K*K] i64
    scores: torch.Tensor  # [B, (S-1)*K*K] f32
    parents: torch.Tensor  # [B, (S-1)*K*K] i64

    @classmethod
    def empty(cls, batch: int, topk: int, num_steps: int, device: torch.device) -> StepCandidates:
        """Unwritten tables (no launch); every expand_step of steps 1 .. S-1 fills its columns."""
        width = max(num_steps - 1, 0) * topk * topk
        return cls(
            tokens=torch.empty((batch, width), dtype=torch.int64, device=device),
            scores=torch.empty((batch, width), dtype=torch.float32, device=device),
            parents=torch.empty((batch, width), dtype=torch.int64, device=device),
        )

    def columns(self, step: int, topk: int) -> slice:
        return slice((step - 1) * topk * topk, step * topk * topk)


def _check_expand(beam_scores, beam_cand, step_topk_p, step_topk_index, step, topk, table) -> int:
    """Check ``expand_step``'s inputs; returns B."""
    if step < 1:
        raise ValueError(f"expand_step handles steps >= 1, got step={step}")
    expect(beam_scores, "beam_scores", 2, torch.float32)
    expect(step_topk_p, "step_topk_p", 3, torch.float32)
    expect(step_topk_index, "step_topk_index", 3, torch.int64)
    batch = beam_scores.shape[0]
    expect_shape(beam_scores, "beam_scores", (batch, topk))
    if beam_cand is not None:
        expect(beam_cand, "beam_cand", 2, torch.int64)
        expect_shape(beam_cand, "beam_cand", (batch, topk))
    elif step != 1:
        raise ValueError(f"beam_cand may be None (the step-0 beams) only at step 1, got step={step}")
    expect_shape(step_topk_p, "step_topk_p", (batch, topk, topk))
    expect_shape(step_topk_index, "step_topk_index", (batch, topk, topk))
    if table is not None:
        cols = table.columns(step, topk)
        for name in ("tokens", "scores", "parents"):
            t = getattr(table, name)
            if t.dim() != 2 or t.shape[0] != batch or t.shape[1] < cols.stop or t.stride(1) != 1:
                raise ValueError(f"table.{name}: expected [{batch}, >= {cols.stop}] with unit "
                                 f"column stride, got {tuple(t.shape)}")
    return batch


def first_step_candidates(
    topk_p: torch.Tensor,  # [B, K] f32, draft top-k probabilities after the bonus token
    topk_index: torch.Tensor,  # [B, K] i64, their token ids
) -> DraftCandidates:
    """Turn the draft's top-k after the bonus token into step-0 candidates and beams."""
    expect(topk_p, "topk_p", 2, torch.float32)
    expect(topk_index, "topk_index", 2, torch.int64)
    expect_shape(topk_index, "topk_index", tuple(topk_p.shape))
    batch, topk = topk_p.shape
    cand = torch.arange(topk, dtype=torch.int64, device=topk_p.device).expand(batch, topk)
    return DraftCandidates(
        beam_scores=topk_p,
        beam_tokens=topk_index,
        beam_cand=cand,
        cand_tokens=topk_index,
        cand_scores=topk_p,
        cand_parents=torch.full_like(topk_index, -1),
    )


def expand_step_reference(
    beam_scores: torch.Tensor,  # [B, K] f32
    beam_cand: torch.Tensor | None,  # [B, K] i64; None at step 1: the step-0 beams, ids 0..K-1
    step_topk_p: torch.Tensor,  # [B, K, K] f32, draft top-k of each beam's next token
    step_topk_index: torch.Tensor,  # [B, K, K] i64
    step: int,
    topk: int,
    table: StepCandidates | None = None,
) -> ExpandedCandidates:
    """Score the K*K children of the current beams (step ``step >= 1``) and keep the K best.

    Child ``(beam, child)`` scores ``beam_scores[beam] * step_topk_p[beam, child]``. The new beams
    are the K best children by a stable descending sort (ties go to the lower candidate index).
    With ``table``, the K*K candidates are written into its columns of this step and the
    ``cand_*`` fields are views of them.
    """
    batch = _check_expand(beam_scores, beam_cand, step_topk_p, step_topk_index, step, topk, table)
    if beam_cand is None:
        beam_cand = torch.arange(topk, dtype=torch.int64, device=beam_scores.device).expand(batch, topk)

    width = topk * topk
    cand_scores = (beam_scores[:, :, None] * step_topk_p).reshape(batch, width)  # [B, K*K]
    cand_tokens = step_topk_index.reshape(batch, width)  # [B, K*K]
    cand_parents = beam_cand[:, :, None].expand(batch, topk, topk).reshape(batch, width)

    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :topk]
    first_id = topk + (step - 1) * width
    out = ExpandedCandidates(
        cand_tokens=cand_tokens,
        cand_scores=cand_scores,
        cand_parents=cand_parents,
        beam_scores=cand_scores.gather(1, order),
        beam_tokens=cand_tokens.gather(1, order),
        beam_parent=torch.div(order, topk, rounding_mode="floor"),
        beam_cand=order + first_id,
    )
    if table is None:
        return out
    cols = table.columns(step, topk)
    table.tokens[:, cols] = cand_tokens
    table.scores[:, cols] = cand_scores
    table.parents[:, cols] = cand_parents
    return attrs.evolve(out, cand_tokens=table.tokens[:, cols], cand_scores=table.scores[:, cols],
                        cand_parents=table.parents[:, cols])


def concat_candidates(
    first: DraftCandidates, steps: Sequence[ExpandedCandidates]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate the candidates of all steps in candidate-id order.

    Returns ``(cand_tokens [B, C], cand_scores [B, C], cand_parents [B, C])`` with
    ``C = K + len(steps) * K*K``, the inputs of ``select_tree_nodes``.
    """
    parts = [first, *steps]
    return (
        torch.cat([p.cand_tokens for p in parts], dim=1),
        torch.cat([p.cand_scores for p in parts], dim=1),
        torch.cat([p.cand_parents for p in parts], dim=1),
    )


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _expand_step_kernel(
    beam_scores_ptr,  # [B, K] f32
    beam_cand_ptr,  # [B, K] i64 (unread with FIRST)
    step_p_ptr,  # [B, K, K] f32
    step_index_ptr,  # [B, K, K] i64
    cand_tokens_ptr,  # [B, *] i64, out at columns col0 + [0, K*K) (STORE_TOKENS)
    cand_scores_ptr,  # [B, *] f32, out at columns col0 + [0, K*K)
    cand_parents_ptr,  # [B, *] i64, out at columns col0 + [0, K*K)
    new_scores_ptr,  # [B, K] f32, out
    new_tokens_ptr,  # [B, K] i64, out
    new_parent_ptr,  # [B, K] i64, out
    new_cand_ptr,  # [B, K] i64, out
    first_id,
    cand_stride,  # row stride of the three candidate outputs
    col0,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two of K*K
    FIRST: tl.constexpr,  # the beams are the step-0 candidates: beam k has candidate id k
    STORE_TOKENS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    WIDTH: tl.constexpr = TOPK * TOPK
    b, offs, ok = row_lanes(BLOCK, WIDTH)
    beam = offs // TOPK
    score = tl.load(beam_scores_ptr + b * TOPK + beam, mask=ok, other=0.0) * tl.load(
        step_p_ptr + b * WIDTH + offs, mask=ok, other=0.0
    )
    if FIRST:
        parent = beam.to(tl.int64)
    else:
        parent = tl.load(beam_cand_ptr + b * TOPK + beam, mask=ok, other=0)
    token = tl.load(step_index_ptr + b * WIDTH + offs, mask=ok, other=0)
    cand = b * cand_stride + col0 + offs
    tl.store(cand_scores_ptr + cand, score, mask=ok)
    tl.store(cand_parents_ptr + cand, parent, mask=ok)
    if STORE_TOKENS:
        tl.store(cand_tokens_ptr + cand, token, mask=ok)
    # The K best children (stable descending sort): child c goes to beam slot rank[c].
    before = _sorts_before(score[None, :], offs[None, :], score[:, None], offs[:, None])
    rank = tl.sum((before & ok[None, :]).to(tl.int32), axis=1)
    keep = ok & (rank < TOPK)
    out = b * TOPK + rank
    tl.store(new_scores_ptr + out, score, mask=keep)
    tl.store(new_tokens_ptr + out, token, mask=keep)
    tl.store(new_parent_ptr + out, beam.to(tl.int64), mask=keep)
    tl.store(new_cand_ptr + out, offs.to(tl.int64) + first_id, mask=keep)


def expand_step_triton(
    beam_scores: torch.Tensor,  # [B, K] f32
    beam_cand: torch.Tensor | None,  # [B, K] i64; None at step 1 (ids 0..K-1)
    step_topk_p: torch.Tensor,  # [B, K, K] f32
    step_topk_index: torch.Tensor,  # [B, K, K] i64
    step: int,
    topk: int,
    table: StepCandidates | None = None,
) -> ExpandedCandidates:
    """Triton ``expand_step``: one program per request scores its K*K children and places each
    of the K best at its rank (K*K x K*K comparisons, 4096 for K = 8), replacing the
    reference's multiply, expand, sort and four gathers with one launch. Without ``table``,
    ``cand_tokens`` is a view of ``step_topk_index``, as in the reference; with it, the kernel
    writes all three candidate outputs into the table's columns of this step."""
    batch = _check_expand(beam_scores, beam_cand, step_topk_p, step_topk_index, step, topk, table)
    width = topk * topk
    device = beam_scores.device
    if table is None:
        cand_tokens = step_topk_index.reshape(batch, width)
        cand_scores = torch.empty((batch, width), dtype=torch.float32, device=device)
        cand_parents = torch.empty((batch, width), dtype=torch.int64, device=device)
        cand_stride, col0 = width, 0
    else:
        cols = table.columns(step, topk)
        cand_tokens, cand_scores, cand_parents = (
            table.tokens[:, cols], table.scores[:, cols], table.parents[:, cols]
        )
        strides = {table.tokens.stride(0), table.scores.stride(0), table.parents.stride(0)}
        if len(strides) != 1:
            raise ValueError(f"table: the three tables need one row stride, got {sorted(strides)}")
        cand_stride, col0 = strides.pop(), cols.start
    new_scores = torch.empty((batch, topk), dtype=torch.float32, device=device)
    new_tokens = torch.empty((batch, topk), dtype=torch.int64, device=device)
    new_parent = torch.empty((batch, topk), dtype=torch.int64, device=device)
    new_cand = torch.empty((batch, topk), dtype=torch.int64, device=device)
    if batch > 0 and topk > 0:
        step_index = step_topk_index.contiguous()
        _expand_step_kernel[(batch,)](
            beam_scores.contiguous(),
            beam_scores if beam_cand is None else beam_cand.contiguous(),
            step_topk_p.contiguous(), step_index,
            cand_parents if table is None else table.tokens,  # unwritten without a table
            cand_scores if table is None else table.scores,
            cand_parents if table is None else table.parents,
            new_scores, new_tokens, new_parent, new_cand,
            topk + (step - 1) * width, cand_stride, col0,
            TOPK=topk,
            BLOCK=next_pow2(width),
            FIRST=beam_cand is None,
            STORE_TOKENS=table is not None,
            num_warps=1 if width <= 16 else 4, **pdl_options(),
        )
    return ExpandedCandidates(
        cand_tokens=cand_tokens,
        cand_scores=cand_scores,
        cand_parents=cand_parents,
        beam_scores=new_scores,
        beam_tokens=new_tokens,
        beam_parent=new_parent,
        beam_cand=new_cand,
    )


def expand_step(
    beam_scores: torch.Tensor,  # [B, K] f32
    beam_cand: torch.Tensor | None,  # [B, K] i64; None at step 1: the step-0 beams (ids 0..K-1)
    step_topk_p: torch.Tensor,  # [B, K, K] f32, draft top-k of each beam's next token
    step_topk_index: torch.Tensor,  # [B, K, K] i64
    step: int,
    topk: int,
    table: StepCandidates | None = None,
) -> ExpandedCandidates:
    """Score the K*K children of the current beams and keep the K best (see
    :func:`expand_step_reference`); with ``table``, the candidates go into its columns of this
    step. Triton on CUDA tensors."""
    impl = expand_step_triton if use_triton(beam_scores) else expand_step_reference
    return impl(beam_scores, beam_cand, step_topk_p, step_topk_index, step, topk, table)
