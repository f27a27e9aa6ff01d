"""Random inputs for the Triton kernel tests, the sm_90 compile check and the benchmark.

Every builder takes a ``torch.Generator`` (CPU) and a device, draws fresh random inputs on the
CPU and moves them to the device, so the same seed gives the same inputs everywhere.
"""

from __future__ import annotations

import math

import torch

from phasegraph.kernels.attention import AttentionMetadata

# ------------------------------------------------------------------------------- attention

ATTENTION_LAYOUTS = ("decode", "draft", "verify", "extend")


def random_parents(gen: torch.Generator, batch: int, num_nodes: int) -> torch.Tensor:
    """[B, N] i64: a random tree per request (parent of node j >= 1 is some node < j)."""
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for j in range(1, num_nodes):
        parents[:, j] = torch.randint(0, j, (batch,), generator=gen)
    return parents


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: mask[b, j, a] = a is j or an ancestor of j (parents as above)."""
    batch, num_nodes = parents.shape
    mask = torch.eye(num_nodes, dtype=torch.bool).repeat(batch, 1, 1)
    for j in range(1, num_nodes):
        par = parents[:, j]
        mask[torch.arange(batch), j] |= mask[torch.arange(batch), par]
    return mask


def attention_case(
    gen: torch.Generator,
    device: torch.device | str,
    *,
    layout: str,
    batch: int,
    topk: int,
    page_size: int,
    kv_heads: int = 8,
    group: int = 4,
    head_dim: int = 128,
    max_kv: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    pad_tokens: int = 3,
    sink_poison: float = float("nan"),
    pool_on_device: bool = False,
    num_nodes: int | None = None,
):
    """``(q, k_cache, v_cache, meta)`` for one attention call of a speculative iteration.

    Layouts (K = ``topk``, tree of N = ``num_nodes`` nodes, default 1 + 2K, W = 4):

    - ``decode``: T = B, one token per request row;
    - ``draft``: T = B*K, every token on its own (branch) row, kv_len = seq_len + 1..4 (the K
      branch rows of a request share its pages, as branches share the prefix);
    - ``verify``: T = B*N, the N nodes of a request share its row, kv_len = seq_len and the
      extra mask is the tree's ancestor mask;
    - ``extend``: T = B*W consecutive tokens of each request, causal.

    ``pad_tokens`` padding tokens (row 0, kv_len 0, no tree bits) are appended, as a CUDA-graph
    bucket would. Every real row owns all its pages (so nothing real maps to the sink page 0);
    the sink slots hold ``sink_poison`` (NaN) to show any read of them. ``pool_on_device`` draws
    the KV pool with the device's default generator (fast, for the benchmark).
    """
    num_nodes = 1 + 2 * topk if num_nodes is None else num_nodes
    if layout == "decode":
        per_req, rows_per_req = 1, 1
    elif layout == "draft":
        per_req, rows_per_req = topk, topk
    elif layout == "verify":
        per_req, rows_per_req = num_nodes, 1
    elif layout == "extend":
        per_req, rows_per_req = 4, 1
    else:
        raise ValueError(layout)
    tree = num_nodes if layout == "verify" else 0
    capacity = max_kv + num_nodes + 8
    max_pages = math.ceil(capacity / page_size)
    num_rows = 1 + batch * rows_per_req
    num_pages = 1 + batch * max_pages
    pages = torch.randperm(num_pages - 1, generator=gen) + 1
    page_table = torch.zeros(num_rows, max_pages, dtype=torch.int64)
    page_table[1:] = (
        pages.view(batch, 1, max_pages)
        .expand(batch, rows_per_req, max_pages)
        .reshape(num_rows - 1, max_pages)
    )
    num_slots = num_pages * page_size

    seq_lens = torch.randint(1, max_kv + 1, (batch,), generator=gen)
    req = torch.arange(batch).repeat_interleave(per_req)  # [T_real]
    j = torch.arange(per_req).repeat(batch)  # index within the request
    extra = None
    if layout == "decode":
        query_row = 1 + req
        kv_len = seq_lens[req] + 1
    elif layout == "draft":
        query_row = 1 + req * topk + j
        kv_len = seq_lens[req] + 1 + torch.randint(0, 4, (batch * per_req,), generator=gen)
    elif layout == "verify":
        query_row = 1 + req
        kv_len = seq_lens[req]
        extra = ancestor_mask(random_parents(gen, batch, num_nodes)).view(-1, num_nodes)
    else:  # extend
        query_row = 1 + req
        kv_len = seq_lens[req] + j + 1
    kv_len = kv_len.clamp(max=capacity - tree)

    query_row = torch.cat([query_row, torch.zeros(pad_tokens, dtype=torch.int64)])
    kv_len = torch.cat([kv_len, torch.zeros(pad_tokens, dtype=torch.int64)])
    if extra is not None:
        extra = torch.cat([extra, torch.zeros(pad_tokens, tree, dtype=torch.bool)])
    num_tokens = query_row.shape[0]

    if pool_on_device:
        k_cache = torch.randn(num_slots, kv_heads, head_dim, device=device, dtype=dtype)
        v_cache = torch.randn(num_slots, kv_heads, head_dim, device=device, dtype=dtype)
    else:
        k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
        v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache[:page_size] = sink_poison
    v_cache[:page_size] = sink_poison
    q = torch.randn(num_tokens, kv_heads * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        write_slots=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        page_table=page_table.to(device),
        query_row=query_row.to(device),
        kv_len=kv_len.to(device),
        extra_mask=extra.to(device) if extra is not None else None,
        page_size=page_size,
    )
    return q.to(device), k_cache.to(device), v_cache.to(device), meta


def own_slots(meta: AttentionMetadata) -> torch.Tensor:
    """[T] i64: the slot of each token's own position (kv_len - 1) in its row, -1 for padding:
    the write slots of a decode or draft step."""
    pos = (meta.kv_len - 1).clamp(min=0)
    pages = meta.page_table[meta.query_row, pos // meta.page_size]
    return torch.where(meta.kv_len > 0, pages * meta.page_size + pos % meta.page_size, -1)


def clean_sink(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """A copy of ``cache`` with the sink page zeroed (what the torch reference may read)."""
    cache = cache.clone()
    cache[:page_size] = 0
    return cache


# ------------------------------------------------------------------------------ draft trees


def draft_case(gen: torch.Generator, *, batch: int, topk: int, num_steps: int, vocab: int):
    """CPU tensors of one draft loop: ``(first, steps, cand, node_tokens, node_parents)``.

    Draft top-k tables come from a random Markov "draft" over ``vocab`` tokens; scores are
    products of probabilities as in EAGLE-2. Run through the torch references.
    """
    from phasegraph.kernels.build_tree import select_tree_nodes_reference
    from phasegraph.kernels.draft_expand import (
        concat_candidates,
        expand_step_reference,
        first_step_candidates,
    )

    draft = torch.rand(vocab, vocab, generator=gen).pow(4).softmax(-1)
    top_p, top_i = draft.topk(topk, dim=-1)
    roots = torch.randint(0, vocab, (batch,), generator=gen)
    first = first_step_candidates(top_p[roots], top_i[roots])
    steps = []
    beams = first
    for step in range(1, num_steps):
        beams = expand_step_reference(
            beams.beam_scores, beams.beam_cand, top_p[beams.beam_tokens],
            top_i[beams.beam_tokens], step, topk,
        )
        steps.append(beams)
    cand = concat_candidates(first, steps)
    num_nodes = tree_nodes(topk, num_steps)
    node_tokens, node_parents, _ = select_tree_nodes_reference(*cand, num_nodes)
    return roots, first, steps, cand, node_tokens, node_parents


def tree_nodes(topk: int, num_steps: int) -> int:
    """N used by the tests: 1 + 2K + S, capped at C + 1."""
    num_cand = topk + max(num_steps - 1, 0) * topk * topk
    return min(num_cand + 1, 1 + 2 * topk + num_steps)


def verify_case(
    gen: torch.Generator,
    device,
    *,
    batch: int,
    topk: int,
    num_steps: int,
    vocab: int,
    duplicate_siblings: bool = True,
):
    """Tree lists, greedy targets and sampling probabilities for verification.

    Returns a dict with ``draft_tokens [B*N]``, ``next_token``/``next_sibling [B, N]``,
    ``target_predict [B*N]`` (agrees with some child often, so paths get long), ``probs
    [B*N, V]`` (mixed temperatures, top-k and top-p, greedy one-hot rows, mass pushed onto the
    children), ``coins``/``bonus_coins [B, S+1]`` and ``num_steps``. With
    ``duplicate_siblings`` some siblings repeat a token (the sampler must not count it twice).
    """
    from phasegraph.kernels.build_tree import build_tree_reference
    from phasegraph.kernels.tree_sampling import target_probs

    # the draft's Markov table is vocab x vocab: keep the draft tokens in a small range
    roots, _, _, _, node_tokens, node_parents = draft_case(
        gen, batch=batch, topk=topk, num_steps=num_steps, vocab=min(vocab, 500)
    )
    num_nodes = node_parents.shape[1]
    if duplicate_siblings and num_nodes > 2:
        # make node j repeat the token of an earlier sibling, for some j
        for j in range(2, num_nodes):
            same = (node_parents[:, :j] == node_parents[:, j : j + 1]).to(torch.int64)
            same[:, 0] = 0
            first_sib = same.argmax(dim=1)
            flip = (torch.rand(batch, generator=gen) < 0.15) & (same.sum(1) > 0)
            node_tokens[:, j - 1] = torch.where(
                flip, node_tokens.gather(1, (first_sib - 1).clamp(min=0)[:, None])[:, 0],
                node_tokens[:, j - 1],
            )
    seq_lens = torch.randint(0, 100, (batch,), generator=gen)
    tree = build_tree_reference(roots, node_tokens, node_parents, seq_lens)
    tokens = tree.draft_tokens.view(batch, num_nodes)

    # A random child token of every node (or a random token for leaves).
    children = node_parents[:, None, :] == torch.arange(num_nodes)[None, :, None]  # [B, p, j]
    pick = (torch.rand(batch, num_nodes, num_nodes, generator=gen) * children).argmax(-1)
    child_token = tokens.gather(1, pick)
    has_child = children.any(-1)
    random_token = torch.randint(0, vocab, (batch, num_nodes), generator=gen)
    agree = (torch.rand(batch, num_nodes, generator=gen) < 0.85) & has_child
    target_predict = torch.where(agree, child_token, random_token).view(-1)

    logits = torch.randn(batch * num_nodes, vocab, generator=gen) * 2
    logits[torch.arange(batch * num_nodes), child_token.view(-1)] += 8 * agree.view(-1)
    temperature = torch.rand(batch, generator=gen) + 0.3
    temperature[::5] = 0.0
    top_k = torch.randint(0, vocab // 2, (batch,), generator=gen)
    top_p = torch.rand(batch, generator=gen) * 0.5 + 0.6
    top_p[1::3] = 1.0
    # drawn on the CPU (reproducible), processed where the test runs (fast on a GPU)
    probs = target_probs(
        logits.to(device), temperature.to(device), top_k.to(device), top_p.to(device), num_nodes
    ).cpu()
    coins = torch.rand(batch, num_steps + 1, generator=gen)
    bonus_coins = torch.rand(batch, num_steps + 1, generator=gen)
    return {
        k: (v.to(device) if isinstance(v, torch.Tensor) else v)
        for k, v in dict(
            draft_tokens=tree.draft_tokens,
            next_token=tree.retrieve_next_token,
            next_sibling=tree.retrieve_next_sibling,
            target_predict=target_predict,
            probs=probs,
            coins=coins,
            bonus_coins=bonus_coins,
            num_steps=num_steps,
        ).items()
    }


# ------------------------------------------------------------------------ sm_90 compile cases


def compile_cases():
    """``(name, thunk)`` pairs; each thunk calls Triton wrappers on CPU tensors (compile only)."""
    from phasegraph.kernels import attention

    cases = []

    def attn(layout, batch, topk, page_size, dtype, group=4, head_dim=128, **kw):
        def run():
            gen = torch.Generator().manual_seed(0)
            q, k, v, meta = attention_case(
                gen,
                "cpu",
                layout=layout,
                batch=batch,
                topk=topk,
                page_size=page_size,
                group=group,
                head_dim=head_dim,
                max_kv=64,
                dtype=dtype,
            )
            attention.paged_attention_triton(q, k, v, meta, head_dim**-0.5, **kw)

        name = f"attention/{layout}/B{batch}/K{topk}/P{page_size}/{str(dtype)[6:]}/G{group}"
        name += "".join(f"/{k}{v}" for k, v in kw.items())
        cases.append((name, run))

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        attn("decode", 1, 1, 16, dtype)
        attn("verify", 7, 4, 16, dtype)
    attn("verify", 7, 8, 1, torch.bfloat16)
    attn("draft", 64, 8, 1, torch.bfloat16)
    attn("extend", 7, 4, 16, torch.bfloat16, num_splits=1)
    attn("decode", 7, 1, 16, torch.bfloat16, group=1, head_dim=64)
    attn("decode", 7, 1, 16, torch.bfloat16, group=8)
    attn("verify", 7, 4, 16, torch.bfloat16, block_n=32, num_warps=4)
    attn("verify", 7, 4, 16, torch.bfloat16, block_m=128, num_warps=8)
    attn("verify", 7, 4, 16, torch.bfloat16, num_stages=3)
    attn("verify", 7, 4, 16, torch.bfloat16, num_splits=4)
    attn("verify", 2, 40, 16, torch.bfloat16)

    def write_kv(dtype):
        def run():
            cache = torch.zeros(64, 8, 128, dtype=dtype)
            kv = torch.randn(8, 32, 128).to(dtype).transpose(0, 1)
            attention.write_kv_triton(cache, cache.clone(), torch.arange(32), kv, kv)

        cases.append((f"write_kv/{str(dtype)[6:]}", run))

    write_kv(torch.bfloat16)
    write_kv(torch.float32)

    import importlib

    bonus = importlib.import_module("phasegraph.kernels.bonus")
    tree = importlib.import_module("phasegraph.kernels.build_tree")
    expand = importlib.import_module("phasegraph.kernels.draft_expand")
    sampling = importlib.import_module("phasegraph.kernels.tree_sampling")
    greedy = importlib.import_module("phasegraph.kernels.verify_greedy")
    simulated = importlib.import_module("phasegraph.kernels.simulated_accept")

    def verify(batch, topk, num_steps, vocab):
        def run():
            gen = torch.Generator().manual_seed(0)
            d = verify_case(gen, "cpu", batch=batch, topk=topk, num_steps=num_steps, vocab=64)
            lists = (d["draft_tokens"], d["next_token"], d["next_sibling"])
            probs = torch.rand(d["probs"].shape[0], vocab).softmax(-1)
            greedy.verify_tree_greedy_triton(*lists, d["target_predict"], num_steps)
            simulated.verify_tree_simulated_triton(d["draft_tokens"], d["next_token"], d["target_predict"],
                                                   num_steps, num_steps - 1)
            out = sampling.verify_tree_sampling_triton(
                *lists, probs, d["coins"], d["bonus_coins"], num_steps
            )
            bonus.gather_accepted_tokens_triton(out.predict, out.accept_index)
            bonus.fill_bonus_tokens_triton(out.predict, out.accept_index, out.accept_lens)

        cases.append((f"verify/B{batch}/K{topk}/S{num_steps}/V{vocab}", run))

    verify(7, 4, 4, 128256)
    verify(64, 8, 6, 32000)

    def draft(batch, topk, num_steps):
        def run():
            gen = torch.Generator().manual_seed(0)
            roots, first, steps, cand, _, _ = draft_case(
                gen, batch=batch, topk=topk, num_steps=num_steps, vocab=300
            )
            p = torch.rand(batch, topk, topk)
            i = torch.randint(0, 300, (batch, topk, topk))
            expand.expand_step_triton(first.beam_scores, first.beam_cand, p, i, 1, topk)
            table = expand.StepCandidates.empty(batch, topk, num_steps, torch.device("cpu"))
            expand.expand_step_triton(first.beam_scores, None, p, i, 1, topk, table)  # as draft runs it
            num_nodes = tree_nodes(topk, num_steps)
            tokens, parents, _ = tree.select_tree_nodes_triton(*cand, num_nodes)
            tree.select_tree_nodes_triton(*[c[:, topk:] for c in cand], num_nodes,
                                          first_tokens=cand[0][:, :topk], first_scores=cand[1][:, :topk])
            tree.build_tree_triton(roots, tokens, parents, torch.zeros(batch, dtype=torch.int64))

        cases.append((f"draft/B{batch}/K{topk}/S{num_steps}", run))

    draft(7, 1, 4)
    draft(7, 4, 4)
    draft(64, 8, 6)

    compact = importlib.import_module("phasegraph.kernels.compact")
    slots = importlib.import_module("phasegraph.kernels.cache_slots")
    positions = importlib.import_module("phasegraph.kernels.extend_positions")
    random = importlib.import_module("phasegraph.kernels.random")

    def misc(batch, topk, page_size, num_steps=6):
        def run():
            num_nodes, width = tree_nodes(topk, num_steps), num_steps + 1
            region = slots.draft_region_pages(page_size, num_steps)
            table = torch.randint(1, 100, (batch + 1, 64))
            rows = torch.arange(1, batch + 1)
            seq_lens = torch.randint(0, 500, (batch,))
            region_pages = torch.randint(1, 100, (batch, topk, region))
            pos = seq_lens[:, None] + torch.arange(num_nodes)
            node_slots = slots.row_slots_triton(table, rows, pos, page_size)
            slots.span_slots_triton(table, rows, seq_lens, num_nodes, page_size)
            layout = slots.assign_draft_cache_locs_triton(
                table, rows, seq_lens, region_pages, page_size, num_steps
            )
            parent = torch.randint(0, topk, (batch, topk))
            slots.reorder_branches_triton(region_pages, parent, page_size)
            # as the draft phase runs them: the pool's region table, hidden rows of the 8B head
            region_table = torch.randint(1, 100, (batch + 1, topk, region))
            hidden = torch.randn(batch, 4096, dtype=torch.bfloat16)
            slots.assign_draft_cache_locs_triton(table, rows, seq_lens, region_table, page_size,
                                                 num_steps, region_table=True, hidden=hidden)
            slots.reorder_branches_triton(region_pages, parent, page_size,
                                          hidden=hidden.repeat_interleave(topk, dim=0))
            slots.span_slots_and_rows_triton(table, rows, seq_lens, num_nodes, page_size)
            token_req = torch.arange(batch).repeat_interleave(width)
            slots.extend_slots_triton(table, rows, token_req, pos[:, :width].reshape(-1), page_size)
            slots.extend_slots_triton(table, rows, None, seq_lens, page_size)
            accept_index = torch.full((batch, width), -1)
            accept_index[:, 0] = torch.arange(batch) * num_nodes
            lens = torch.ones(batch, dtype=torch.int64)
            src, dst = compact.accepted_kv_moves_triton(
                accept_index, lens, node_slots.view(-1), node_slots[:, :width].reshape(-1)
            )
            compact.compact_to_front_triton(torch.randn(batch * num_nodes, 4096), accept_index)
            compact.compact_to_front_triton(torch.zeros(batch * num_nodes, dtype=torch.bool),
                                            accept_index)
            caches = [torch.zeros(2000, 8, 128, dtype=torch.bfloat16) for _ in range(64)]
            compact.move_kv_triton(caches, src, dst)
            compact.move_kv_triton(caches[:2], layout.tail_src, layout.tail_dst)
            positions.extend_positions_triton(seq_lens, width)
            positions.extend_rows_triton(seq_lens, width)
            positions.ragged_extend_positions_triton(seq_lens, lens, batch + 5)
            random.counter_uniform_triton(seq_lens, pos)
            random.counter_uniform_triton(seq_lens, seq_lens)

        cases.append((f"slots+moves/B{batch}/K{topk}/P{page_size}", run))

    misc(7, 4, 16)
    misc(64, 8, 1)

    top1 = importlib.import_module("phasegraph.kernels.softmax_top1")
    for dtype, vocab in ((torch.bfloat16, 32000), (torch.float32, 128256)):
        cases.append((f"softmax_top1/{str(dtype)[6:]}/V{vocab}",
                      lambda dtype=dtype, vocab=vocab: top1.softmax_top1_triton(torch.randn(4, vocab).to(dtype))))
        cases.append((f"softmax_top1/{str(dtype)[6:]}/V{vocab}/d2t",
                      lambda dtype=dtype, vocab=vocab: top1.softmax_top1_triton(
                          torch.randn(4, vocab).to(dtype), torch.zeros(vocab, dtype=torch.int64))))
    commit = importlib.import_module("phasegraph.kernels.commit_path")
    from tests.kernels.commit_path_cases import commit_path_case

    for batch, width, stops in ((1, 4, 1), (64, 9, 0)):
        cases.append((f"commit_path/B{batch}/W{width}/Z{stops}",
                      lambda b=batch, w=width, z=stops: commit.commit_path_triton(
                          *commit_path_case(torch.Generator().manual_seed(0), b, w, w + 3, z, 0))))
    topk = importlib.import_module("phasegraph.kernels.softmax_topk")
    for dtype, vocab, k in ((torch.bfloat16, 32000, 4), (torch.float32, 128256, 8)):
        cases.append((f"softmax_topk/{str(dtype)[6:]}/V{vocab}/k{k}",
                      lambda dtype=dtype, vocab=vocab, k=k: topk.softmax_topk_triton(torch.randn(16, vocab).to(dtype), k)))
        cases.append((f"softmax_topk/{str(dtype)[6:]}/V{vocab}/k{k}/d2t",
                      lambda dtype=dtype, vocab=vocab, k=k: topk.softmax_topk_triton(
                          torch.randn(16, vocab).to(dtype), k, torch.zeros(vocab, dtype=torch.int64))))
    logprobs = importlib.import_module("phasegraph.kernels.logprobs")
    for dtype, vocab, k in ((torch.bfloat16, 32000, 20), (torch.float32, 128256, 5)):
        cases.append((f"token_logprobs/{str(dtype)[6:]}/V{vocab}/k{k}",
                      lambda dtype=dtype, vocab=vocab, k=k: logprobs.token_logprobs_triton(
                          torch.randn(4, vocab).to(dtype), torch.zeros(4, dtype=torch.int64), k)))
    rotary = importlib.import_module("phasegraph.kernels.rotary")
    norms = importlib.import_module("phasegraph.kernels.rms_norm")

    def rope(dtype, tables: bool):
        def run():
            tokens, hq, hkv, d = 7, 32, 8, 128
            q, k, v = (torch.randn(tokens, h, d).to(dtype) for h in (hq, hkv, hkv))
            cache = torch.zeros(64, hkv, d, dtype=dtype)
            rows = torch.arange(tokens) if tables else None
            cos = torch.randn(1024 if tables else tokens, d).to(dtype)
            rotary.rotary_write_kv_triton(q, k, v, cos, cos, cache, cache, torch.arange(tokens), rows)

        cases.append((f"rotary_write_kv/{str(dtype)[6:]}/{'tables' if tables else 'rows'}", run))

    linear = importlib.import_module("phasegraph.kernels.linear")
    float32_tiles = {
        "tf32x3": linear.SkinnyConfig(32, 64, 4, 3, True, precision="tf32x3"),
        "tf32x3-split4": linear.SkinnyConfig(32, 64, 4, 3, True, precision="tf32x3", split_k=4),
        "sums16-split4": linear.SkinnyConfig(8, 64, 4, 3, False, split_k=4),
    }
    for name, cfg in float32_tiles.items():
        cases.append((f"linear/float32/M16/{name}",
                      lambda cfg=cfg: linear.linear_triton(torch.randn(16, 2560), torch.randn(768, 2560),
                                                           config=cfg)))
    for block_k in (128, 256):  # split-K slices of one K tile each, static weights loaded early
        cfg = linear.SkinnyConfig(32, block_k, 4, 1, True, precision="tf32x3", split_k=1024)
        cases.append((f"linear/float32/M16/tf32x3-slices{block_k}-early",
                      lambda cfg=cfg: linear.linear_triton(torch.randn(16, 2560), torch.randn(768, 2560),
                                                           config=cfg, static_weight=True)))
    # the batch-1 decode step's float32 products: the table's one-tile multiply-sum at one row
    cases.append(("linear/float32/M1/table",
                  lambda: linear.linear_triton(torch.randn(1, 768), torch.randn(1280, 768))))
    cases.append(("linear/float32/M1/table-early",  # static weights: loaded before the wait
                  lambda: linear.linear_triton(torch.randn(1, 768), torch.randn(1280, 768),
                                               static_weight=True)))
    cases.append(("linear/float32/M1/table-norm",
                  lambda: linear.add_rms_norm_linear_triton(
                      torch.randn(1, 768), torch.randn(1, 768), torch.randn(768), 1e-6,
                      torch.randn(5120, 768))))
    rope_attention = importlib.import_module("phasegraph.kernels.rope_attention")
    argmax = importlib.import_module("phasegraph.kernels.argmax")

    def rope_attn(dtype, batch: int, tables: bool):
        def run():
            gen = torch.Generator().manual_seed(0)
            _, k, v, meta = attention_case(gen, "cpu", layout="decode", batch=batch, topk=1,
                                           page_size=16, max_kv=64, dtype=dtype)
            meta = attention.AttentionMetadata(
                write_slots=torch.arange(meta.kv_len.shape[0]), page_table=meta.page_table,
                query_row=meta.query_row, kv_len=meta.kv_len, extra_mask=None, page_size=16,
                one_query_per_row=True)
            tokens = meta.kv_len.shape[0]
            qkv = torch.randn(tokens, (32 + 16) * 128).to(dtype)
            cos = torch.randn(1024 if tables else tokens, 128).to(dtype)
            rope_attention.rope_paged_attention_triton(
                qkv, 32, 8, 128, cos, cos, k, v, meta, 0.1, meta.kv_len if tables else None)

        cases.append((f"rope_attention/{str(dtype)[6:]}/B{batch}/{'tables' if tables else 'rows'}", run))

    for dtype in (torch.bfloat16, torch.float32):
        rope(dtype, False)
        rope(dtype, True)
        rope_attn(dtype, 1, True)
        rope_attn(dtype, 64, False)
        for vocab in (128256, 8192):
            cases.append((f"argmax/{str(dtype)[6:]}/V{vocab}",
                          lambda dtype=dtype, vocab=vocab: argmax.argmax_triton(torch.randn(3, vocab).to(dtype))))
        cases.append((f"add_rms_norm/{str(dtype)[6:]}",
                      lambda dtype=dtype: norms.add_rms_norm_triton(
                          torch.randn(4, 4096).to(dtype), torch.randn(4, 4096).to(dtype),
                          torch.ones(4096).to(dtype), 1e-5)))
        cases.append((f"rms_norm_concat/{str(dtype)[6:]}",
                      lambda dtype=dtype: norms.rms_norm_concat_triton(
                          torch.randn(4, 4096).to(dtype), torch.ones(4096).to(dtype), 1e-5,
                          torch.randn(4, 4096).to(dtype), torch.ones(4096).to(dtype), 1e-5)))
        cases.append((f"rms_norm_concat/table-rows/{str(dtype)[6:]}",
                      lambda dtype=dtype: norms.rms_norm_concat_triton(
                          torch.randn(64, 4096), torch.ones(4096).to(dtype), 1e-5,
                          torch.randn(4, 4096).to(dtype), torch.ones(4096).to(dtype), 1e-5,
                          torch.tensor([3, 0, 63, 3]))))
    return cases
