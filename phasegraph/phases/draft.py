"""draft: grow each request's dynamic draft tree and build it for verification."""

from __future__ import annotations

import torch

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.build_tree import build_tree, select_tree_nodes
from phasegraph.kernels.cache_slots import assign_draft_cache_locs, branch_reorder_moves
from phasegraph.kernels.compact import move_kv
from phasegraph.kernels.draft_expand import concat_candidates, expand_step, first_step_candidates
from phasegraph.phases._common import topk_of_logits
from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import DraftState, TreeProposal
from phasegraph.statemachine import phase


@phase("draft", input=DraftState, output=TreeProposal)
def draft(state: DraftState, ctx: SpecContext) -> TreeProposal:
    """EAGLE-2 dynamic tree drafting (arXiv 2406.16858): S-1 draft forwards over K beams.

    Step 0's candidates are the top-k from draft-extend. Draft forward i (i = 0..S-2) runs the K
    beams of every request at position ``seq_len + lead + i`` (seed 001; ``lead`` is the draft's
    KV lead, 1 for standalone drafts), each beam attending the
    prefix plus its own ancestors in its page-aligned branch region; the K best of the K² new
    candidates by cumulative probability become the next beams. Finally the N-1 best candidates
    become the tree verified behind the bonus token.
    """
    tree, memory, model = ctx.tree, ctx.memory, ctx.draft
    K, S, N = tree.topk, tree.num_steps, tree.num_draft_tokens
    B = state.seq_lens.shape[0]
    device = state.seq_lens.device
    rows = state.params.req_pool_idx  # [B]
    seq_lens = state.seq_lens  # [B]

    lead = int(getattr(model, "kv_lead", 0))
    # [B] the draft's committed KV length; step i runs at base + i (no add kernel for EAGLE's 0)
    base = seq_lens + lead if lead else seq_lens
    beams = first_step_candidates(state.topk_p, state.topk_index)
    steps = []  # ExpandedCandidates of draft steps 1 .. S-1
    beam_scores, beam_cand, beam_tokens = beams.beam_scores, beams.beam_cand, beams.beam_tokens
    hidden = state.hidden.repeat_interleave(K, dim=0) if state.hidden is not None else None  # [B*K, Hd]

    regions = memory.draft_regions[rows]  # [B] each request's branch region
    layout = assign_draft_cache_locs(memory.page_table, rows, base, regions, memory.page_size, S)
    draft_caches = memory.draft_caches()
    move_kv(draft_caches, layout.tail_src, layout.tail_dst)  # prefix tail into every branch region
    branch_rows = torch.arange(B * K, device=device)
    for i in range(S - 1):
        positions = layout.step_positions[i]  # [B*K]: every beam of request b at base[b] + i
        attn = AttentionMetadata(
            write_slots=layout.step_slots[i],
            page_table=layout.branch_page_table,
            query_row=branch_rows,
            kv_len=layout.step_kv_len[i],
            extra_mask=None,
            page_size=memory.page_size,
            one_query_per_row=True,  # every beam on its own branch row
        )
        out = model.forward(
            beam_tokens.reshape(-1), hidden, positions, attn, from_target=False, step=i
        )
        step_p, step_ids = topk_of_logits(out.logits, K)  # [B*K, K]
        step_ids = model.to_target_ids(step_ids)
        grown = expand_step(
            beam_scores, beam_cand, step_p.view(B, K, K), step_ids.view(B, K, K), step=i + 1, topk=K
        )
        steps.append(grown)
        beam_scores, beam_cand, beam_tokens = grown.beam_scores, grown.beam_cand, grown.beam_tokens
        if i < S - 2:  # the next forward needs each new beam's ancestors and hidden state
            src, dst = branch_reorder_moves(regions, grown.beam_parent, memory.page_size)
            move_kv(draft_caches, src, dst)
            if out.hidden is not None and hidden is not None:
                hd = out.hidden.shape[1]  # new beam k of request b continues beam beam_parent[b, k]
                parent = grown.beam_parent[:, :, None].expand(B, K, hd)  # [B, K, Hd]
                hidden = out.hidden.view(B, K, hd).gather(1, parent).view(B * K, hd)

    node_tokens, node_parents = select_tree_nodes(*concat_candidates(beams, steps), N)
    built = build_tree(state.bonus_tokens, node_tokens, node_parents, seq_lens)
    return TreeProposal(
        draft=state,
        num_steps=S,
        draft_lead=lead,
        draft_tokens=built.draft_tokens,
        positions=built.positions,
        parents=node_parents,
        depth=built.depth,
        tree_mask=built.tree_mask,
        retrieve_index=built.retrieve_index,
        retrieve_next_token=built.retrieve_next_token,
        retrieve_next_sibling=built.retrieve_next_sibling,
        draft_positions=layout.draft_positions,  # [B, S-1] step i at base + i
    )
