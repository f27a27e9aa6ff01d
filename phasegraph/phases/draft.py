"""draft: grow each request's dynamic draft tree and build it for verification."""

from __future__ import annotations

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.kernels.build_tree import build_tree, select_tree_nodes
from phasegraph.kernels.cache_slots import (
    assign_draft_cache_locs,
    draft_region_pages,
    reorder_branches,
)
from phasegraph.kernels.compact import move_kv
from phasegraph.kernels.draft_expand import StepCandidates, expand_step
from phasegraph.phases._common import draft_topk
from phasegraph.phases.context import SpecContext
from phasegraph.phases.schemas import DraftState, TreeProposal
from phasegraph.statemachine import phase


@phase("draft")
def draft(state: DraftState, ctx: SpecContext) -> TreeProposal:
    """EAGLE-2 dynamic tree drafting (arXiv 2406.16858): S-1 draft forwards over K beams.

    Step 0's candidates are the top-k from draft-extend. Draft forward i (i = 0..S-2) runs the K
    beams of every request at position ``seq_len + lead + i`` (SGLang #25015; ``lead`` is the draft's
    KV lead, 1 for standalone drafts), each beam attending the
    prefix plus its own ancestors in its page-aligned branch region; the K best of the K² new
    candidates by cumulative probability become the next beams. Finally the N-1 best candidates
    become the tree verified behind the bonus token.

    Every step writes its candidates into one table and the step-0 candidates are read from
    the state where they lie; the branch layout kernel also gathers the requests' branch regions
    and repeats their hidden rows over the beams, and the branch reorder moves the hidden rows
    with the KV (no torch op of its own between the kernels).

    A structured-output request's candidates at every step are those its grammar allows after
    the beam's path (XGrammar, Dong et al. 2024, arXiv 2411.15100), and verify gets the grammar's
    mask after every node (``token_bitmask``).

    A state that carries more candidates than K (an engine whose iterations change shape keeps
    the largest K) drafts from its first K, the most likely; the branch regions likewise.
    """
    tree, memory, model = ctx.tree, ctx.memory, ctx.draft
    K, S, N = tree.topk, tree.num_steps, tree.num_draft_tokens
    B = state.seq_lens.shape[0]
    device = state.seq_lens.device
    rows = state.params.req_pool_idx  # [B]
    seq_lens = state.seq_lens  # [B]

    lead = ctx.kv_lead
    # [B] the draft's committed KV length; step i runs at base + i (no add kernel for EAGLE's 0)
    base = seq_lens + lead if lead else seq_lens
    first_p, first_ids = state.topk_p, state.topk_index  # [B, K] each (K or more columns)
    if first_p.shape[1] != K:  # sorted most likely first: the first K are this shape's top-K
        first_p, first_ids = first_p[:, :K].contiguous(), first_ids[:, :K].contiguous()
    # step-0 beams: the state's top-k, candidates 0..K-1 (beam_cand None: ids 0..K-1)
    beam_scores, beam_cand, beam_tokens = first_p, None, first_ids  # [B, K] each
    table = StepCandidates.empty(B, K, S, device)  # [B, (S-1)*K*K], candidates K..C-1

    regions = memory.draft_regions  # [max_reqs, K, R]
    want = draft_region_pages(memory.page_size, S)
    if regions.shape[1] != K or regions.shape[2] != want:  # sized for the largest shape
        regions = regions[:, :K, :want].contiguous()
    # each request's branch regions, and its hidden row for every beam ([B*K, Hd] or None)
    layout = assign_draft_cache_locs(memory.page_table, rows, base, regions,
                                     memory.page_size, S, region_table=True, hidden=state.hidden)
    hidden = layout.beam_hidden
    draft_caches = memory.draft_caches()
    move_kv(draft_caches, layout.tail_src, layout.tail_dst)  # prefix tail into every branch region
    beam_parent = None  # [B, K]: the beam each new beam continues (None: the first step's own)
    for i in range(S - 1):
        positions = layout.step_positions[i]  # [B*K]: every beam of request b at base[b] + i
        attn = AttentionMetadata(
            write_slots=layout.step_slots[i],
            page_table=layout.branch_page_table,
            query_row=layout.branch_rows,
            kv_len=layout.step_kv_len[i],
            extra_mask=None,
            page_size=memory.page_size,
            one_query_per_row=True,  # every beam on its own branch row
        )
        out = model.forward(
            beam_tokens.reshape(-1), hidden, positions, attn, from_target=False, step=i
        )
        # structured output: the grammar after every beam's drafted path (the host keeps the
        # paths; a round trip per step, since the tokens are chosen on the device)
        bitmask = None if ctx.grammar is None else ctx.grammar.beam_bitmask(beam_tokens, beam_parent)  # [B*K, Vw]
        step_p, step_ids = draft_topk(model, out.logits, K, bitmask)  # [B*K, K], target vocabulary
        grown = expand_step(
            beam_scores, beam_cand, step_p.view(B, K, K), step_ids.view(B, K, K), step=i + 1,
            topk=K, table=table,
        )
        beam_scores, beam_cand, beam_tokens = grown.beam_scores, grown.beam_cand, grown.beam_tokens
        beam_parent = grown.beam_parent
        if i < S - 2:  # the next forward needs each new beam's ancestors and hidden state
            # new beam k of request b continues beam beam_parent[b, k]: its region and hidden row
            carry = out.hidden if hidden is not None else None  # [B*K, Hd] or None
            moved = reorder_branches(layout.region_pages, grown.beam_parent, memory.page_size,
                                     hidden=carry)
            move_kv(draft_caches, moved.src, moved.dst)
            if carry is not None:
                hidden = moved.hidden

    nodes = select_tree_nodes(
        table.tokens, table.scores, table.parents, N,
        first_tokens=first_ids, first_scores=first_p,
    )
    built = build_tree(state.bonus_tokens, nodes.tokens, nodes.parents, seq_lens)
    # the grammar's mask after every node's path, built on the host from the matchers (reads the
    # tree: one round trip, only where a request has structured output)
    bitmask = None if ctx.grammar is None else ctx.grammar.tree_bitmask(built.draft_tokens, nodes.parents)
    return TreeProposal.of_tree(
        state, S, lead, built, nodes.parents,
        draft_positions=layout.draft_positions,  # [B, S-1, K] a view of the positions given
        draft_finite=nodes.scores_finite,  # [B]: False where the draft's logits were not finite
        token_bitmask=bitmask,  # [B*N, Vw] or None
    )
