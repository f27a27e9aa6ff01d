"""EAGLE-2 dynamic draft-tree expansion (Li et al. 2024, arXiv 2406.16858), torch reference.

The draft grows K beams for S steps. Every step proposes K children per beam; a child's score is
the product of the draft probabilities along its path (its "global acceptance confidence" in
EAGLE-2), and the K best children become the next beams. Every proposal is recorded as a
*candidate* in the per-request candidate index space of ``docs/internals.md``:

- step 0: candidates ``[0, K)`` (children of the root, parent ``-1``);
- step i >= 1: candidate ``K + (i-1)*K*K + beam*K + child`` (parent = the beam's candidate id).

``select_tree_nodes`` (build_tree.py) later keeps the N-1 best candidates as the verified tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from phasegraph.kernels._checks import expect, expect_shape


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


def expand_step(
    beam_scores: torch.Tensor,  # [B, K] f32
    beam_cand: torch.Tensor,  # [B, K] i64
    step_topk_p: torch.Tensor,  # [B, K, K] f32, draft top-k of each beam's next token
    step_topk_index: torch.Tensor,  # [B, K, K] i64
    step: int,
    topk: int,
) -> ExpandedCandidates:
    """Score the K*K children of the current beams (step ``step >= 1``) and keep the K best.

    Child ``(beam, child)`` scores ``beam_scores[beam] * step_topk_p[beam, child]``. The new beams
    are the K best children by a stable descending sort (ties go to the lower candidate index).
    """
    if step < 1:
        raise ValueError(f"expand_step handles steps >= 1, got step={step}")
    expect(beam_scores, "beam_scores", 2, torch.float32)
    expect(beam_cand, "beam_cand", 2, torch.int64)
    expect(step_topk_p, "step_topk_p", 3, torch.float32)
    expect(step_topk_index, "step_topk_index", 3, torch.int64)
    batch = beam_scores.shape[0]
    expect_shape(beam_scores, "beam_scores", (batch, topk))
    expect_shape(beam_cand, "beam_cand", (batch, topk))
    expect_shape(step_topk_p, "step_topk_p", (batch, topk, topk))
    expect_shape(step_topk_index, "step_topk_index", (batch, topk, topk))

    width = topk * topk
    cand_scores = (beam_scores[:, :, None] * step_topk_p).reshape(batch, width)  # [B, K*K]
    cand_tokens = step_topk_index.reshape(batch, width)  # [B, K*K]
    cand_parents = beam_cand[:, :, None].expand(batch, topk, topk).reshape(batch, width)

    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :topk]
    first_id = topk + (step - 1) * width
    return ExpandedCandidates(
        cand_tokens=cand_tokens,
        cand_scores=cand_scores,
        cand_parents=cand_parents,
        beam_scores=cand_scores.gather(1, order),
        beam_tokens=cand_tokens.gather(1, order),
        beam_parent=torch.div(order, topk, rounding_mode="floor"),
        beam_cand=order + first_id,
    )


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
