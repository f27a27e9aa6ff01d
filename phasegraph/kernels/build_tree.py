"""Draft-tree selection and the tree tensors that verify consumes, torch reference.

The N-1 best draft candidates become the tree (EAGLE-2 reranking, arXiv 2406.16858; token-tree
verification as in SpecInfer, Miao et al. 2024, arXiv 2305.09781). Node 0 of every request is the
root: the bonus token of the previous step, at position ``seq_len``. See ``docs/internals.md``
("Draft candidates and the tree").
"""

from __future__ import annotations

import attrs
import torch

from phasegraph.kernels._checks import expect, expect_shape


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


def select_tree_nodes(
    cand_tokens: torch.Tensor,  # [B, C] i64
    cand_scores: torch.Tensor,  # [B, C] f32
    cand_parents: torch.Tensor,  # [B, C] i64, parent candidate id or -1 (root)
    num_nodes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the N-1 best candidates as tree nodes 1..N-1.

    A stable descending sort by score keeps N-1 candidates (ties go to the lower index), then the
    kept ids are sorted ascending, so node j >= 1 is the j-th kept candidate. A candidate's score
    never exceeds its parent's and its id is larger, so the parent is always kept, and at a lower
    node index. Returns ``(node_tokens [B, N-1], node_parents [B, N])`` with
    ``node_parents[:, 0] = -1``; a node whose parent candidate is -1 hangs off node 0. (Should a
    parent be missing anyway, e.g. with NaN scores, the node is attached to the root.)
    """
    expect(cand_tokens, "cand_tokens", 2, torch.int64)
    expect(cand_scores, "cand_scores", 2, torch.float32)
    expect(cand_parents, "cand_parents", 2, torch.int64)
    batch, num_cand = cand_scores.shape
    expect_shape(cand_tokens, "cand_tokens", (batch, num_cand))
    expect_shape(cand_parents, "cand_parents", (batch, num_cand))
    if not 1 <= num_nodes <= num_cand + 1:
        raise ValueError(f"num_nodes must be in [1, C+1] = [1, {num_cand + 1}], got {num_nodes}")
    device = cand_scores.device

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
    return node_tokens, torch.cat([root, parent_node], dim=1)


def build_tree(
    bonus_tokens: torch.Tensor,  # [B] i64, root token of each request
    node_tokens: torch.Tensor,  # [B, N-1] i64
    node_parents: torch.Tensor,  # [B, N] i64, parent node index (< own index), -1 for the root
    seq_lens: torch.Tensor,  # [B] i64, committed tokens (the root sits at position seq_len)
) -> TreeTensors:
    """Build tokens, positions, ancestor mask and retrieve lists of the draft trees.

    Ancestors are found by pointer doubling: after t rounds every node knows its ancestors up to
    distance 2**t and its 2**t-th ancestor, so ceil(log2(N)) rounds of gathers suffice.
    """
    expect(bonus_tokens, "bonus_tokens", 1, torch.int64)
    expect(node_tokens, "node_tokens", 2, torch.int64)
    expect(node_parents, "node_parents", 2, torch.int64)
    expect(seq_lens, "seq_lens", 1, torch.int64)
    batch, num_nodes = node_parents.shape
    expect_shape(bonus_tokens, "bonus_tokens", (batch,))
    expect_shape(node_tokens, "node_tokens", (batch, num_nodes - 1))
    expect_shape(seq_lens, "seq_lens", (batch,))
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
