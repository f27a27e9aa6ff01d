"""Draft-tree selection and the tree tensors that verify consumes, torch reference.

The N-1 best draft candidates become the tree (EAGLE-2 reranking, arXiv 2406.16858; token-tree
verification as in SpecInfer, Miao et al. 2024, arXiv 2305.09781). Node 0 of every request is the
root: the bonus token of the previous step, at position ``seq_len``. See ``docs/internals.md``
("Draft candidates and the tree").

``select_tree_nodes`` and ``build_tree`` dispatch to Triton on CUDA tensors (one program per
request each) and to the ``*_reference`` torch versions elsewhere. ``select_tree_nodes`` may take
the step-0 candidates apart from the others (``first_tokens``, ``first_scores``), so that no
concatenation runs before it. It also says, per request, whether every candidate score was
finite: a draft whose logits held NaN or infinity scores its candidates NaN, and the flag lets
the host say so without reading the scores (``commit_path``'s ``draft_finite``).
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch

from phasegraph.kernels import _dispatch
from phasegraph.kernels._checks import expect, expect_shape
from phasegraph.kernels._dispatch import jit, next_pow2, pdl_enter, pdl_options, tl, use_triton
from phasegraph.kernels._lanes import row_lanes
from phasegraph.kernels.argmax import is_finite


@attrs.frozen(eq=False)
class TreeTensors:
    """Everything verify needs about the draft tree (per-node tensors are request-major)."""

    draft_tokens: torch.Tensor  # [B*N] i64, node 0 of each request = bonus token
    positions: torch.Tensor  # [B*N] i64, seq_len + depth
    tree_mask: torch.Tensor  # [B, N, N] bool, tree_mask[b, j, a]: a is j or an ancestor of j
    depth: torch.Tensor  # [B, N] i64, root = 0
    retrieve_index: torch.Tensor  # [B, N] i64, b*N + j
    retrieve_next_token: torch.Tensor  # [B, N] i64, first child in node order, -1
    retrieve_next_sibling: torch.Tensor  # [B, N] i64, next sibling in node order, -1


class SelectedNodes(NamedTuple):
    tokens: torch.Tensor  # [B, N-1] i64: the tokens of nodes 1..N-1
    parents: torch.Tensor  # [B, N] i64: each node's parent node, -1 for the root (node 0)
    scores_finite: torch.Tensor  # [B] bool: False where any candidate's score was NaN or infinite


def _check_candidates(
    cand_tokens: torch.Tensor,  # [B, C] int64
    cand_scores: torch.Tensor,  # [B, C] float32
    cand_parents: torch.Tensor,  # [B, C] int64
    num_nodes: int,
    first_tokens: torch.Tensor | None = None,  # [B, K0] int64
    first_scores: torch.Tensor | None = None,  # [B, K0] float32
) -> tuple[int, int]:
    """Check the candidate lists shared by both implementations; returns ``(B, K0 + C)``."""
    expect(cand_tokens, "cand_tokens", 2, torch.int64)
    expect(cand_scores, "cand_scores", 2, torch.float32)
    expect(cand_parents, "cand_parents", 2, torch.int64)
    batch, num_cand = cand_scores.shape
    expect_shape(cand_tokens, "cand_tokens", (batch, num_cand))
    expect_shape(cand_parents, "cand_parents", (batch, num_cand))
    if (first_tokens is None) != (first_scores is None):
        raise ValueError("first_tokens and first_scores come together")
    if first_scores is not None:
        expect(first_tokens, "first_tokens", 2, torch.int64)
        expect(first_scores, "first_scores", 2, torch.float32)
        expect_shape(first_scores, "first_scores", (batch, first_scores.shape[1]))
        expect_shape(first_tokens, "first_tokens", tuple(first_scores.shape))
        num_cand += first_scores.shape[1]
    if not 1 <= num_nodes <= num_cand + 1:
        raise ValueError(f"num_nodes must be in [1, C+1] = [1, {num_cand + 1}], got {num_nodes}")
    return batch, num_cand


def select_tree_nodes_reference(
    cand_tokens: torch.Tensor,  # [B, C] i64
    cand_scores: torch.Tensor,  # [B, C] f32
    cand_parents: torch.Tensor,  # [B, C] i64, parent candidate id or -1 (root)
    num_nodes: int,
    first_tokens: torch.Tensor | None = None,  # [B, K0] i64
    first_scores: torch.Tensor | None = None,  # [B, K0] f32
) -> SelectedNodes:
    """Keep the N-1 best candidates as tree nodes 1..N-1.

    With ``first_tokens`` and ``first_scores``, those are candidates ``0 .. K0-1`` (parent -1,
    the root's children) and ``cand_*`` hold candidates ``K0 ..``: the same as passing the
    concatenated lists.

    A stable descending sort by score keeps N-1 candidates (ties go to the lower index), then the
    kept ids are sorted ascending, so node j >= 1 is the j-th kept candidate. A candidate's score
    never exceeds its parent's and its id is larger, so the parent is always kept, and at a lower
    node index. Returns :class:`SelectedNodes`: ``tokens`` [B, N-1], ``parents`` [B, N] with
    ``parents[:, 0] = -1`` (a node whose parent candidate is -1 hangs off node 0; should a parent
    be missing anyway, e.g. with NaN scores, the node is attached to the root), and
    ``scores_finite`` [B], whether every candidate score of the request was finite.
    """
    batch, num_cand = _check_candidates(
        cand_tokens, cand_scores, cand_parents, num_nodes, first_tokens, first_scores
    )
    device = cand_scores.device
    if first_scores is not None:
        cand_tokens = torch.cat([first_tokens, cand_tokens], dim=1)
        cand_scores = torch.cat([first_scores, cand_scores], dim=1)
        cand_parents = torch.cat([torch.full_like(first_tokens, -1), cand_parents], dim=1)

    best = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices
    kept = torch.sort(best[:, : num_nodes - 1], dim=1).values  # [B, N-1] candidate ids
    node_tokens = cand_tokens.gather(1, kept)
    parent_cand = cand_parents.gather(1, kept)  # [B, N-1]

    # Lookup candidate id -> node index (0 = not kept, i.e. the root).
    node_of_cand = torch.zeros(batch, num_cand, dtype=torch.int64, device=device)
    node_ids = torch.arange(1, num_nodes, dtype=torch.int64, device=device).expand(batch, -1)
    node_of_cand.scatter_(1, kept, node_ids)
    parent_node = node_of_cand.gather(1, parent_cand.clamp(min=0))
    parent_node = torch.where(parent_cand < 0, 0, parent_node)

    root = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
    scores_finite = torch.isfinite(cand_scores).all(dim=1)  # [B]
    return SelectedNodes(node_tokens, torch.cat([root, parent_node], dim=1), scores_finite)


def _check_nodes(bonus_tokens, node_tokens, node_parents, seq_lens) -> tuple[int, int]:
    """Checks of :func:`build_tree`'s inputs; ``(B, N)``."""
    expect(bonus_tokens, "bonus_tokens", 1, torch.int64)
    expect(node_tokens, "node_tokens", 2, torch.int64)
    expect(node_parents, "node_parents", 2, torch.int64)
    expect(seq_lens, "seq_lens", 1, torch.int64)
    batch, num_nodes = node_parents.shape
    expect_shape(bonus_tokens, "bonus_tokens", (batch,))
    expect_shape(node_tokens, "node_tokens", (batch, num_nodes - 1))
    expect_shape(seq_lens, "seq_lens", (batch,))
    return batch, num_nodes


def build_tree_reference(
    bonus_tokens: torch.Tensor,  # [B] i64, root token of each request
    node_tokens: torch.Tensor,  # [B, N-1] i64
    node_parents: torch.Tensor,  # [B, N] i64, parent node index (< own index), -1 for the root
    seq_lens: torch.Tensor,  # [B] i64, committed tokens (the root sits at position seq_len)
) -> TreeTensors:
    """Build tokens, positions, ancestor mask and retrieve lists of the draft trees.

    Ancestors are found by pointer doubling: after t rounds every node knows its ancestors up to
    distance 2**t and its 2**t-th ancestor, so ceil(log2(N)) rounds of gathers suffice.
    """
    batch, num_nodes = _check_nodes(bonus_tokens, node_tokens, node_parents, seq_lens)
    device = node_parents.device
    nodes = torch.arange(num_nodes, dtype=torch.int64, device=device)

    draft_tokens = torch.cat([bonus_tokens[:, None], node_tokens], dim=1)  # [B, N]

    # mask[b, j, a]: a is an ancestor of j at distance <= 2**t (or j itself).
    has_parent = node_parents >= 0
    jump = node_parents.clamp(min=0)  # 2**t-th ancestor (valid where has_parent)
    mask = (nodes[None, None, :] == nodes[None, :, None]) | (
        (nodes[None, None, :] == jump[:, :, None]) & has_parent[:, :, None]
    )
    reach = 1
    while reach < num_nodes - 1:
        mask = mask | (mask.gather(1, jump[:, :, None].expand_as(mask)) & has_parent[:, :, None])
        has_parent = has_parent & has_parent.gather(1, jump)
        jump = jump.gather(1, jump)
        reach *= 2
    depth = mask.sum(dim=2, dtype=torch.int64) - 1  # [B, N]

    # First child: the smallest node whose parent is p (N = none).
    first_child = torch.full_like(node_parents, num_nodes).scatter_reduce(
        1, node_parents[:, 1:], nodes[1:].expand(batch, -1), reduce="amin"
    )
    next_token = torch.where(first_child < num_nodes, first_child, -1)
    # Next sibling: a stable sort by parent lists every parent's children in node order.
    order = torch.sort(node_parents, dim=1, stable=True).indices  # [B, N]
    grouped = node_parents.gather(1, order)
    follower = torch.cat([order[:, 1:], order[:, :1]], dim=1)
    same_parent = torch.cat(
        [grouped[:, 1:] == grouped[:, :-1], torch.zeros_like(grouped[:, :1], dtype=torch.bool)],
        dim=1,
    ) & (grouped >= 0)
    next_sibling = torch.empty_like(order).scatter(
        1, order, torch.where(same_parent, follower, -1)
    )

    retrieve_index = torch.arange(batch * num_nodes, dtype=torch.int64, device=device)
    return TreeTensors(
        draft_tokens=draft_tokens.reshape(batch * num_nodes),
        positions=(seq_lens[:, None] + depth).reshape(batch * num_nodes),
        tree_mask=mask,
        depth=depth,
        retrieve_index=retrieve_index.view(batch, num_nodes),
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
    )


# --------------------------------------------------------------------------------------------
# Triton


@jit
def _sorts_before(score_a, id_a, score_b, id_b):
    """Whether (score_a, id_a) comes first in torch's stable descending sort: a higher score,
    or an equal score and a lower id. NaN counts as above every number (as in torch.sort)."""
    nan_a = score_a != score_a
    nan_b = score_b != score_b
    higher = (score_a > score_b) | (nan_a & ~nan_b)
    same = (score_a == score_b) | (nan_a & nan_b)
    return higher | (same & (id_a < id_b))


@jit
def _load_candidates(first_ptr, cand_ptr, b, offs, ok, num_first, num_rest, other):
    """Candidates ``offs`` of request b: ids below ``num_first`` from ``first`` [B, K0], the
    rest from ``cand`` [B, C - K0]."""
    is_first = offs < num_first
    a = tl.load(first_ptr + b * num_first + offs, mask=ok & is_first, other=other)
    c = tl.load(cand_ptr + b * num_rest + (offs - num_first), mask=ok & ~is_first, other=other)
    return tl.where(is_first, a, c)


@jit
def _select_tree_nodes_kernel(
    first_tokens_ptr,  # [B, K0] i64, candidates 0 .. K0-1 (parent -1)
    first_scores_ptr,  # [B, K0] f32
    cand_tokens_ptr,  # [B, C - K0] i64, candidates K0 ..
    cand_scores_ptr,  # [B, C - K0] f32
    cand_parents_ptr,  # [B, C - K0] i64
    node_tokens_ptr,  # [B, N-1] i64, out
    node_parents_ptr,  # [B, N] i64, out
    scores_finite_ptr,  # [B] bool, out
    num_first,  # K0 (0: every candidate in cand_*)
    num_cand,  # C
    num_nodes,
    BLOCK_C: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, offs, ok = row_lanes(BLOCK_C, num_cand)
    rest = num_cand - num_first
    score = _load_candidates(first_scores_ptr, cand_scores_ptr, b, offs, ok, num_first, rest, 0.0)
    tl.store(scores_finite_ptr + b, tl.min(is_finite(score).to(tl.int32), axis=0) > 0)
    # rank[c]: how many candidates the stable descending sort puts before c
    rank = tl.zeros([BLOCK_C], tl.int32)
    for start in range(0, BLOCK_C, CHUNK):
        other = start + tl.arange(0, CHUNK)
        other_ok = other < num_cand
        other_score = _load_candidates(first_scores_ptr, cand_scores_ptr, b, other, other_ok,
                                       num_first, rest, 0.0)
        before = _sorts_before(other_score[None, :], other[None, :], score[:, None], offs[:, None])
        rank += tl.sum((before & other_ok[None, :]).to(tl.int32), axis=1)
    kept = ok & (rank < num_nodes - 1)
    node = tl.cumsum(kept.to(tl.int32), axis=0)  # node j >= 1 is the j-th kept id (ascending)
    node_of = tl.where(kept, node, 0)  # candidate -> node, 0 (root) when not kept
    parent = tl.load(cand_parents_ptr + b * rest + (offs - num_first),
                     mask=ok & (offs >= num_first), other=-1)
    parent_node = tl.gather(node_of, tl.minimum(tl.maximum(parent, 0), BLOCK_C - 1).to(tl.int32), 0)
    parent_node = tl.where(parent < 0, 0, parent_node)
    token = _load_candidates(first_tokens_ptr, cand_tokens_ptr, b, offs, ok, num_first, rest, 0)
    tl.store(node_tokens_ptr + b * (num_nodes - 1) + node - 1, token, mask=kept)
    tl.store(node_parents_ptr + b * num_nodes + node, parent_node.to(tl.int64), mask=kept)
    tl.store(node_parents_ptr + b * num_nodes, -1)


def select_tree_nodes_triton(
    cand_tokens: torch.Tensor,  # [B, C] i64
    cand_scores: torch.Tensor,  # [B, C] f32
    cand_parents: torch.Tensor,  # [B, C] i64, parent candidate id or -1 (root)
    num_nodes: int,
    first_tokens: torch.Tensor | None = None,  # [B, K0] i64
    first_scores: torch.Tensor | None = None,  # [B, K0] f32
) -> SelectedNodes:
    """Triton ``select_tree_nodes``: one program per request, no sort.

    The stable descending sort only decides which N-1 candidates are kept, so each candidate's
    rank is counted directly (how many candidates beat it: C x C comparisons in chunks, about
    1e5 for K = 8, S = 6), the kept ones are numbered by a prefix sum (ascending ids = node
    order) and each parent candidate is mapped to its node with a register gather. Same tie rule
    as the reference (equal scores: lower id first; NaN above everything). One launch instead of
    two sorts and five gathers/scatters; the step-0 candidates (``first_*``) are read where
    they lie.
    """
    batch, num_cand = _check_candidates(
        cand_tokens, cand_scores, cand_parents, num_nodes, first_tokens, first_scores
    )
    device = cand_scores.device
    node_tokens = torch.empty((batch, num_nodes - 1), dtype=torch.int64, device=device)
    node_parents = torch.empty((batch, num_nodes), dtype=torch.int64, device=device)
    scores_finite = torch.empty(batch, dtype=torch.bool, device=device)
    if batch > 0:
        block_c = next_pow2(num_cand)
        cand_tokens, cand_scores = cand_tokens.contiguous(), cand_scores.contiguous()
        if first_scores is None:  # unread: every candidate is in cand_*
            first_tokens, first_scores = cand_tokens, cand_scores
            num_first = 0
        else:
            first_tokens, first_scores = first_tokens.contiguous(), first_scores.contiguous()
            num_first = first_scores.shape[1]
        _select_tree_nodes_kernel[(batch,)](
            first_tokens, first_scores, cand_tokens, cand_scores, cand_parents.contiguous(),
            node_tokens, node_parents, scores_finite, num_first, num_cand, num_nodes,
            BLOCK_C=block_c,
            CHUNK=max(1, min(block_c, 8192 // block_c)),
            num_warps=4, **pdl_options(),
        )
    return SelectedNodes(node_tokens, node_parents, scores_finite)


@jit
def _build_tree_kernel(
    bonus_ptr,  # [B] i64
    node_tokens_ptr,  # [B, N-1] i64
    parents_ptr,  # [B, N] i64, parent < own index, -1 for the root
    seq_lens_ptr,  # [B] i64
    draft_tokens_ptr,  # [B*N] i64, out
    positions_ptr,  # [B*N] i64, out
    tree_mask_ptr,  # [B, N, N] u8 (bool), out
    depth_ptr,  # [B, N] i64, out
    retrieve_index_ptr,  # [B, N] i64, out
    next_token_ptr,  # [B, N] i64, out
    next_sibling_ptr,  # [B, N] i64, out
    num_nodes,
    BLOCK_NODES: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (_dispatch.pdl_options)
):
    pdl_enter(PDL)
    b, offs, ok = row_lanes(BLOCK_NODES, num_nodes)
    base = b * num_nodes
    parent = tl.load(parents_ptr + base + offs, mask=ok, other=-1)

    # Ancestor-or-self mask: walk every node up to the root at once (depth <= N-1 steps).
    mask = (offs[:, None] == offs[None, :]) & ok[:, None]
    up = parent
    steps = 0
    while (tl.max(up, axis=0) >= 0) & (steps < num_nodes):
        mask = mask | ((offs[None, :] == up[:, None]) & (up[:, None] >= 0))
        up = tl.where(up >= 0, tl.gather(parent, tl.maximum(up, 0).to(tl.int32), 0), -1)
        steps += 1
    depth = tl.sum(mask.to(tl.int64), axis=1) - 1

    # First child: the smallest j >= 1 whose parent is p. Next sibling: the smallest k > j with
    # the same parent (node order), none for parentless nodes.
    is_child = (parent[None, :] == offs[:, None]) & (offs[None, :] >= 1) & ok[None, :]
    first = tl.min(tl.where(is_child, offs[None, :], BLOCK_NODES), axis=1)
    same = (parent[None, :] == parent[:, None]) & (offs[None, :] > offs[:, None]) & ok[None, :]
    same = same & (parent[:, None] >= 0)
    follower = tl.min(tl.where(same, offs[None, :], BLOCK_NODES), axis=1)

    bonus = tl.load(bonus_ptr + b)
    token = tl.load(node_tokens_ptr + b * (num_nodes - 1) + offs - 1, mask=ok & (offs >= 1),
                    other=0)
    tl.store(draft_tokens_ptr + base + offs, tl.where(offs == 0, bonus, token), mask=ok)
    tl.store(positions_ptr + base + offs, tl.load(seq_lens_ptr + b) + depth, mask=ok)
    tl.store(depth_ptr + base + offs, depth, mask=ok)
    tl.store(retrieve_index_ptr + base + offs, base + offs, mask=ok)
    tl.store(next_token_ptr + base + offs, tl.where(first < num_nodes, first, -1).to(tl.int64),
             mask=ok)
    tl.store(next_sibling_ptr + base + offs,
             tl.where(follower < num_nodes, follower, -1).to(tl.int64), mask=ok)
    tl.store(
        tree_mask_ptr + base * num_nodes + offs[:, None] * num_nodes + offs[None, :],
        mask.to(tl.uint8),
        mask=ok[:, None] & ok[None, :],
    )


def build_tree_triton(
    bonus_tokens: torch.Tensor,  # [B] i64
    node_tokens: torch.Tensor,  # [B, N-1] i64
    node_parents: torch.Tensor,  # [B, N] i64, parent node index (< own index), -1 for the root
    seq_lens: torch.Tensor,  # [B] i64
) -> TreeTensors:
    """Triton ``build_tree``: one program per request builds all seven outputs in registers.

    Ancestors come from walking every node up at once (tree depth iterations, each an N x N
    compare), first children and next siblings from N x N compare-and-min; N <= 128 or so fits
    one program. Output bytes (the N x N mask dominates) are written once; the reference needs
    ~log2(N) rounds of [B, N, N] gathers plus a sort and scatters.
    """
    batch, num_nodes = _check_nodes(bonus_tokens, node_tokens, node_parents, seq_lens)
    device = node_parents.device
    draft_tokens = torch.empty(batch * num_nodes, dtype=torch.int64, device=device)
    positions = torch.empty(batch * num_nodes, dtype=torch.int64, device=device)
    tree_mask = torch.empty((batch, num_nodes, num_nodes), dtype=torch.bool, device=device)
    depth = torch.empty((batch, num_nodes), dtype=torch.int64, device=device)
    retrieve_index = torch.empty((batch, num_nodes), dtype=torch.int64, device=device)
    next_token = torch.empty((batch, num_nodes), dtype=torch.int64, device=device)
    next_sibling = torch.empty((batch, num_nodes), dtype=torch.int64, device=device)
    if batch > 0 and num_nodes > 0:
        block = next_pow2(num_nodes)
        _build_tree_kernel[(batch,)](
            bonus_tokens.contiguous(), node_tokens.contiguous(), node_parents.contiguous(),
            seq_lens.contiguous(), draft_tokens, positions, _dispatch.as_bytes(tree_mask), depth,
            retrieve_index, next_token, next_sibling, num_nodes,
            BLOCK_NODES=block,
            num_warps=1 if block <= 32 else 4, **pdl_options(),
        )
    return TreeTensors(
        draft_tokens=draft_tokens,
        positions=positions,
        tree_mask=tree_mask,
        depth=depth,
        retrieve_index=retrieve_index,
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
    )


def select_tree_nodes(
    cand_tokens: torch.Tensor,  # [B, C] i64
    cand_scores: torch.Tensor,  # [B, C] f32
    cand_parents: torch.Tensor,  # [B, C] i64, parent candidate id or -1 (root)
    num_nodes: int,
    first_tokens: torch.Tensor | None = None,  # [B, K0] i64, candidates 0 .. K0-1 (parent -1)
    first_scores: torch.Tensor | None = None,  # [B, K0] f32
) -> SelectedNodes:
    """Keep the N-1 best candidates as tree nodes 1..N-1, and say where a score was not finite
    (see :func:`select_tree_nodes_reference`); Triton on CUDA tensors."""
    impl = select_tree_nodes_triton if use_triton(cand_scores) else select_tree_nodes_reference
    return impl(cand_tokens, cand_scores, cand_parents, num_nodes, first_tokens, first_scores)


def build_tree(
    bonus_tokens: torch.Tensor,  # [B] i64, root token of each request
    node_tokens: torch.Tensor,  # [B, N-1] i64
    node_parents: torch.Tensor,  # [B, N] i64, parent node index (< own index), -1 for the root
    seq_lens: torch.Tensor,  # [B] i64, committed tokens (the root sits at position seq_len)
) -> TreeTensors:
    """Tokens, positions, ancestor mask and retrieve lists of the draft trees (see
    :func:`build_tree_reference`); Triton on CUDA tensors."""
    if use_triton(node_parents):
        return build_tree_triton(bonus_tokens, node_tokens, node_parents, seq_lens)
    return build_tree_reference(bonus_tokens, node_tokens, node_parents, seq_lens)
