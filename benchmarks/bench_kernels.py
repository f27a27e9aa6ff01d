"""Triton kernels against their torch references on the GPU, one row per kernel and shape.

    python benchmarks/bench_kernels.py [--only attention|tree,verify,slots|rope] [--quick] [--out DIR]

``--only attention`` takes ~6 min on an H100 (three extra tile variants per shape; ``--quick``
times the default tiles only), the other parts together ~3 min (``--only draft``: the chain draft
step's top-1 and the rotary table, seconds).

Shapes are those of one speculative iteration of a Llama-3-8B-shaped target (32 query heads,
8 kv heads, head dim 128, bf16, V = 128256) with tree drafting (``--topk`` K, ``--steps`` S,
``--nodes`` N). Two timings per implementation, both medians:

- ``eager``: ``triton.testing.do_bench`` (L2 flushed before every call; includes launch gaps);
- ``graph``: ``triton.testing.do_bench_cudagraph`` (calls unrolled in a captured CUDA graph, as
  the runner replays them), cycling through several input sets so large inputs do not sit in L2.

Attention rows also give the bytes floor: the KV bytes the call must read (each (row, position)
in range once, keys and values) plus q and the output, divided by the copy bandwidth measured at
the start, and the share of it reached (``floor / graph time``). The short table is printed
last; ``--out`` writes every number as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from tests.gpu import kernel_cases as cases  # noqa: E402

attn = importlib.import_module("phasegraph.kernels.attention")
bonus = importlib.import_module("phasegraph.kernels.bonus")
tree = importlib.import_module("phasegraph.kernels.build_tree")
expand = importlib.import_module("phasegraph.kernels.draft_expand")
sampling = importlib.import_module("phasegraph.kernels.tree_sampling")
greedy = importlib.import_module("phasegraph.kernels.verify_greedy")
compact = importlib.import_module("phasegraph.kernels.compact")
slots = importlib.import_module("phasegraph.kernels.cache_slots")
positions = importlib.import_module("phasegraph.kernels.extend_positions")
rand = importlib.import_module("phasegraph.kernels.random")
top1 = importlib.import_module("phasegraph.kernels.softmax_top1")
topk = importlib.import_module("phasegraph.kernels.softmax_topk")
logprobs = importlib.import_module("phasegraph.kernels.logprobs")

DEVICE = torch.device("cuda")
ROWS: list[dict] = []


def rotating(fns):
    """One callable that runs the next of ``fns`` on every call."""
    state = {"i": 0}

    def call():
        fn = fns[state["i"] % len(fns)]
        state["i"] += 1
        return fn()

    return call


def timed(fn) -> tuple[float, float]:
    """(eager median ms, graph median ms) of ``fn`` (a rotating callable or a plain one)."""
    fn()
    torch.cuda.synchronize()
    eager = do_bench(fn, warmup=25, rep=100, return_mode="median")
    try:
        graph = do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception as exc:  # report and go on
        print(f"  graph timing failed: {type(exc).__name__}: {exc}")
        graph = float("nan")
    return eager, graph


def bench(kernel: str, shape: str, reference, triton_fn, floor_ms: float | None = None, **extra):
    """Time both implementations (each a list of per-input-set thunks) and record a row."""
    row = dict(kernel=kernel, shape=shape, **extra)
    for name, fns in (("ref", reference), ("triton", triton_fn)):
        if fns is None:
            row[f"{name}_eager"] = row[f"{name}_graph"] = float("nan")
            continue
        row[f"{name}_eager"], row[f"{name}_graph"] = timed(rotating(fns))
    row["floor"] = floor_ms if floor_ms is not None else float("nan")
    ROWS.append(row)
    print(
        f"{kernel:<26} {shape:<40} ref {row['ref_eager']:8.4f} / {row['ref_graph']:8.4f} ms  "
        f"triton {row['triton_eager']:8.4f} / {row['triton_graph']:8.4f} ms",
        flush=True,
    )


def copy_bandwidth() -> float:
    """Bytes per ms of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms


def attention_bytes(q, k_cache, meta) -> int:
    """KV bytes of every (row, position) some query reads, plus q and the output."""
    kv_len = meta.kv_len.cpu()
    ends = kv_len.clone()
    if meta.extra_mask is not None:
        e = meta.extra_mask.shape[1]
        last = (meta.extra_mask.cpu() * torch.arange(1, e + 1)).amax(dim=1)
        ends = kv_len + last
    rows = meta.query_row.cpu()
    per_row = {}
    for r, end in zip(rows.tolist(), ends.tolist(), strict=True):
        per_row[r] = max(per_row.get(r, 0), end)
    positions_read = sum(per_row.values())
    kv = positions_read * k_cache.shape[1] * k_cache.shape[2] * k_cache.element_size() * 2
    return kv + 2 * q.numel() * q.element_size()


def bench_attention(args, bandwidth):
    layouts = args.layouts.split(",")
    for layout in layouts:
        for batch in args.batches:
            for page_size in (16, 1):
                sets = []
                total = 0
                seed = 0
                while not sets or (total < 200e6 and len(sets) < 8):
                    gen = torch.Generator().manual_seed(seed)
                    seed += 1
                    q, k, v, meta = cases.attention_case(
                        gen, DEVICE, layout=layout, batch=batch, topk=args.topk,
                        page_size=page_size, max_kv=args.kv, dtype=torch.bfloat16,
                        sink_poison=0.0, pool_on_device=True,
                    )
                    nbytes = attention_bytes(q, k, meta)
                    total += nbytes
                    sets.append((q, k, v, meta, nbytes))
                floor = sum(s[4] for s in sets) / len(sets) / bandwidth
                scale = 128**-0.5
                shape = f"{layout} B{batch} P{page_size} T{sets[0][0].shape[0]} kv<={args.kv}"

                ref_thunks = [
                    partial(attn.paged_attention_reference, *s[:4], scale) for s in sets
                ]

                variants = [("default", {})]
                if not args.quick:
                    variants += [
                        ("block_m16", dict(block_m=16)),
                        ("splits1", dict(num_splits=1)),
                        ("warps8", dict(num_warps=8)),
                    ]
                for i, (name, kw) in enumerate(variants):
                    thunks = [partial(attn.paged_attention_triton, *s[:4], scale, **kw)
                              for s in sets]
                    # the reference is slow at large shapes: time it once per shape
                    ref = ref_thunks if i == 0 and not args.skip_reference_attention else None
                    bench(f"paged_attention[{name}]", shape, ref, thunks, floor_ms=floor,
                          kv_bytes=sets[0][4])
                    ROWS[-1]["floor_share"] = floor / ROWS[-1]["triton_graph"]

    # write_kv of one layer: decode (T = B) and verify (T = B*N) tokens, transposed k/v views
    for batch in args.batches:
        for tokens in (batch, batch * args.nodes):
            k_cache = torch.zeros(1 << 16, 8, 128, dtype=torch.bfloat16, device=DEVICE)
            v_cache = torch.zeros_like(k_cache)
            kv = torch.randn(1, 8, tokens, 128, dtype=torch.bfloat16, device=DEVICE)
            key = kv[0].transpose(0, 1)
            write_slots = torch.randperm(1 << 16, device=DEVICE)[:tokens]
            bench(
                "write_kv", f"T{tokens}",
                [partial(attn.write_kv_reference, k_cache, v_cache, write_slots, key, key)],
                [partial(attn.write_kv_triton, k_cache, v_cache, write_slots, key, key)],
            )


def bench_tree_kernels(args):
    topk, steps = args.topk, args.steps
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        roots, first, expanded, cand, node_tokens, node_parents = cases.draft_case(
            gen, batch=batch, topk=topk, num_steps=steps, vocab=1000
        )
        cand = [c.to(DEVICE) for c in cand]
        num_nodes = min(args.nodes, cand[0].shape[1] + 1)
        step_p = torch.rand(batch, topk, topk, device=DEVICE)
        step_i = torch.randint(0, 1000, (batch, topk, topk), device=DEVICE)
        beams = (first.beam_scores.to(DEVICE), first.beam_cand.to(DEVICE), step_p, step_i, 1, topk)
        shape = f"B{batch} K{topk} S{steps} N{num_nodes}"
        bench("expand_step", shape, [partial(expand.expand_step_reference, *beams)],
              [partial(expand.expand_step_triton, *beams)])
        bench("select_tree_nodes", shape,
              [partial(tree.select_tree_nodes_reference, *cand, num_nodes)],
              [partial(tree.select_tree_nodes_triton, *cand, num_nodes)])
        tok, par, _ = tree.select_tree_nodes_reference(*cand, num_nodes)
        seq = torch.randint(0, 2000, (batch,), device=DEVICE)
        targs = (roots.to(DEVICE), tok, par, seq)
        bench("build_tree", shape, [partial(tree.build_tree_reference, *targs)],
              [partial(tree.build_tree_triton, *targs)])


def bench_verify(args):
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        d = cases.verify_case(
            gen, "cpu", batch=batch, topk=args.topk, num_steps=args.steps, vocab=1000
        )
        num_nodes = d["next_token"].shape[1]
        d = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
        lists = (d["draft_tokens"], d["next_token"], d["next_sibling"])
        shape = f"B{batch} N{num_nodes} S{args.steps}"
        gargs = (*lists, d["target_predict"], args.steps)
        bench("verify_tree_greedy", shape, [partial(greedy.verify_tree_greedy_reference, *gargs)],
              [partial(greedy.verify_tree_greedy_triton, *gargs)])
        vocab = args.vocab
        logits = torch.randn(batch * num_nodes, vocab, device=DEVICE) * 3
        temperature = torch.full((batch,), 0.8, device=DEVICE)
        top_k = torch.full((batch,), 50, device=DEVICE, dtype=torch.int64)
        top_p = torch.full((batch,), 0.9, device=DEVICE)
        pargs = (logits, temperature, top_k, top_p, num_nodes)
        bench("target_probs (torch only)", f"{shape} V{vocab}",
              [partial(sampling.target_probs, *pargs)], None)
        probs = torch.softmax(logits, dim=-1)
        sargs = (*lists, probs, d["coins"], d["bonus_coins"], args.steps)
        bench("verify_tree_sampling", f"{shape} V{vocab}",
              [partial(sampling.verify_tree_sampling_reference, *sargs)],
              [partial(sampling.verify_tree_sampling_triton, *sargs)],
              floor_ms=probs.numel() * 4 / BANDWIDTH)
        out = greedy.verify_tree_greedy_reference(*gargs)
        bargs = (out.predict, out.accept_index)
        bench("gather_accepted_tokens", shape,
              [partial(bonus.gather_accepted_tokens_reference, *bargs)],
              [partial(bonus.gather_accepted_tokens_triton, *bargs)])
        fargs = (out.predict, out.accept_index, out.accept_lens)
        bench("fill_bonus_tokens", shape, [partial(bonus.fill_bonus_tokens_reference, *fargs)],
              [partial(bonus.fill_bonus_tokens_triton, *fargs)])

        # finalize: compaction, KV moves of 32 layers (64 caches), positions
        hidden = torch.randn(batch * num_nodes, 4096, dtype=torch.bfloat16, device=DEVICE)
        bench("compact_to_front", f"{shape} F4096 bf16",
              [partial(compact.compact_to_front_reference, hidden, out.accept_index)],
              [partial(compact.compact_to_front_triton, hidden, out.accept_index)])
        width = args.steps + 1
        num_slots = max(1 << 14, 4 * batch * num_nodes)  # 64 caches of 2 KiB rows: <= 2 GiB
        node_slots = torch.randperm(num_slots, device=DEVICE)[: batch * num_nodes]
        front = node_slots.view(batch, num_nodes)[:, :width].reshape(-1)
        margs = (out.accept_index, out.accept_lens, node_slots, front)
        bench("accepted_kv_moves", shape,
              [partial(compact.accepted_kv_moves_reference, *margs)],
              [partial(compact.accepted_kv_moves_triton, *margs)])
        src, dst = compact.accepted_kv_moves_reference(*margs)
        caches = [
            torch.randn(num_slots, 8, 128, device=DEVICE).to(torch.bfloat16) for _ in range(64)
        ]
        bench("move_kv (64 caches)", f"B{batch} moves {src.numel()}",
              [partial(compact.move_kv_reference, caches, src, dst)],
              [partial(compact.move_kv_triton, caches, src, dst)])
        seq = torch.randint(0, 2000, (batch,), device=DEVICE)
        bench("extend_positions", f"B{batch} W{width}",
              [partial(positions.extend_positions_reference, seq, width)],
              [partial(positions.extend_positions_triton, seq, width)])
        total = batch * width
        rargs = (seq, out.accept_lens, total)
        bench("ragged_extend_positions", f"B{batch} T{total}",
              [partial(positions.ragged_extend_positions_reference, *rargs)],
              [partial(positions.ragged_extend_positions_triton, *rargs)])
        counters = rand.position_counter(seq[:, None] + torch.arange(width, device=DEVICE), 1)
        bench("counter_uniform", f"B{batch} X{width}",
              [partial(rand.counter_uniform_reference, seq, counters)],
              [partial(rand.counter_uniform_triton, seq, counters)])


def bench_slots(args):
    steps, topk = args.steps, args.topk
    for batch in args.batches:
        for page_size in (16, 1):
            region = slots.draft_region_pages(page_size, steps)
            max_pages = 4096 // page_size
            table = torch.randint(1, 10**5, (batch + 1, max_pages), device=DEVICE)
            rows = torch.arange(1, batch + 1, device=DEVICE)
            seq = torch.randint(0, 2000, (batch,), device=DEVICE)
            region_pages = torch.randint(1, 10**5, (batch, topk, region), device=DEVICE)
            pos = seq[:, None] + torch.arange(args.nodes, device=DEVICE)
            shape = f"B{batch} K{topk} S{steps} P{page_size}"
            bench("row_slots", shape,
                  [partial(slots.row_slots_reference, table, rows, pos, page_size)],
                  [partial(slots.row_slots_triton, table, rows, pos, page_size)])
            aargs = (table, rows, seq, region_pages, page_size, steps)
            bench("assign_draft_cache_locs", shape,
                  [partial(slots.assign_draft_cache_locs_reference, *aargs)],
                  [partial(slots.assign_draft_cache_locs_triton, *aargs)])
            parent = torch.randint(0, topk, (batch, topk), device=DEVICE)
            bench("reorder_branches", shape,
                  [partial(slots.reorder_branches_reference, region_pages, parent, page_size)],
                  [partial(slots.reorder_branches_triton, region_pages, parent, page_size)])


BANDWIDTH = float("nan")


def bench_draft_step(args):
    """A chain draft step's top-1 (softmax + max vs one pass) and a tree draft step's top-4
    (softmax + topk vs chunk top-k + merge, over B * 4 rows) over the 32k draft vocabulary, the
    target's logprobs of a chosen token and its top 0 / 20 (logsumexp + gather + topk vs the
    same two passes in logprob mode) over a 32k vocabulary, and
    the rotary cos/sin of one forward (transformers' module vs the table gather; the "triton"
    column is the table)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from phasegraph.kernels.attention import AttentionMetadata
    from phasegraph.runtime.models.rotary_table import RotaryTable

    for batch in args.batches:
        logits = [torch.randn(batch, 32000, device=DEVICE).to(torch.bfloat16) for _ in range(4)]
        bench("softmax_top1", f"B{batch} V32000 bf16", [partial(top1.softmax_top1_reference, x) for x in logits],
              [partial(top1.softmax_top1_triton, x) for x in logits])
    for batch in args.batches:
        for dtype in (torch.bfloat16, torch.float32):
            logits = [torch.randn(4 * batch, 32000, device=DEVICE).to(dtype) for _ in range(4)]
            bench("softmax_topk k=4", f"R{4 * batch} V32000 {str(dtype)[6:]}",
                  [partial(topk.softmax_topk_reference, x, 4) for x in logits],
                  [partial(topk.softmax_topk_triton, x, 4) for x in logits])
    for batch in args.batches:
        for dtype in (torch.bfloat16, torch.float32):
            logits = [torch.randn(batch, 32000, device=DEVICE).to(dtype) for _ in range(4)]
            tokens = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
            for k in (0, 20):
                bench(f"token_logprobs k={k}", f"B{batch} V32000 {str(dtype)[6:]}",
                      [partial(logprobs.token_logprobs_reference, x, tokens, k) for x in logits],
                      [partial(logprobs.token_logprobs_triton, x, tokens, k) for x in logits])
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    table = RotaryTable(LlamaRotaryEmbedding(cfg).to(DEVICE))
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    meta = AttentionMetadata(write_slots=empty, page_table=torch.zeros(2, 256, dtype=torch.int64, device=DEVICE),
                             query_row=empty, kv_len=empty, extra_mask=None, page_size=16)
    like = torch.zeros(1, dtype=torch.bfloat16, device=DEVICE)
    for tokens in (1, 4):
        pos = torch.randint(0, 4000, (tokens,), device=DEVICE)
        table(like, pos, meta)  # builds
        bench("rotary cos/sin", f"T{tokens} llama3 bf16", [partial(table.module, like, pos)],
              [partial(table, like, pos, meta)])


def bench_rope(args):
    """Rotary + KV write + attention of one decode token per row: the two kernels (rotary_write_kv,
    paged_attention; both followed by the combine pass where they split) as "ref", against
    rope_attention's one launch; float32 on the bench pair's attention shape (4 kv heads x 3,
    head dim 64), bf16 on the 8B shape."""
    rope = importlib.import_module("phasegraph.kernels.rope_attention")
    rotary = importlib.import_module("phasegraph.kernels.rotary")
    shapes = [("pair", torch.float32, 4, 3, 64), ("8b", torch.bfloat16, 8, 4, 128)]
    for name, dtype, kv_heads, group, head_dim in shapes:
        for batch in args.batches:
            sets = []
            for seed in range(4):
                gen = torch.Generator().manual_seed(seed)
                _, k, v, meta = cases.attention_case(
                    gen, DEVICE, layout="decode", batch=batch, topk=1, page_size=16,
                    kv_heads=kv_heads, group=group, head_dim=head_dim, max_kv=args.kv,
                    dtype=dtype, sink_poison=0.0, pool_on_device=True,
                )
                slots = cases.own_slots(meta)
                meta = attn.AttentionMetadata(
                    write_slots=slots, page_table=meta.page_table, query_row=meta.query_row,
                    kv_len=meta.kv_len, extra_mask=None, page_size=16, one_query_per_row=True,
                )
                heads = kv_heads * group
                qkv = torch.randn(slots.shape[0], (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
                angles = torch.rand(meta.page_table.shape[1] * 16, head_dim, device=DEVICE) * 100
                sets.append((qkv, heads, kv_heads, head_dim, angles.cos().to(dtype),
                             angles.sin().to(dtype), k, v, meta, head_dim**-0.5, (meta.kv_len - 1).clamp(min=0)))

            def two(qkv, heads, kv_heads, head_dim, cos, sin, k, v, meta, scale, rows):
                q, kk, vv = rope._split_qkv(qkv, heads, kv_heads, head_dim)
                q = rotary.rotary_write_kv_triton(q, kk, vv, cos, sin, k, v, meta.write_slots, rows)
                return attn.paged_attention_triton(q, k, v, meta, scale)

            shape = f"{name} {str(dtype)[6:]} decode B{batch} kv<={args.kv}"
            bench("rope_attention", shape, [partial(two, *s) for s in sets],
                  [partial(rope.rope_paged_attention_triton, *s) for s in sets])


def main() -> int:
    global BANDWIDTH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="attention,tree,verify,slots,draft,rope (default all but rope)")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--layouts", default="decode,draft,verify,extend")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--kv", type=int, default=2048, help="largest committed length")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--quick", action="store_true", help="default attention tiles only")
    parser.add_argument("--skip-reference-attention", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    parts = args.only.split(",") if args.only else ["attention", "tree", "verify", "slots", "draft"]

    props = torch.cuda.get_device_properties(DEVICE)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    BANDWIDTH = copy_bandwidth()
    print(f"copy bandwidth {BANDWIDTH / 1e9:.2f} TB/s (read + write)")
    start = time.time()
    if "attention" in parts:
        bench_attention(args, BANDWIDTH)
    if "tree" in parts:
        bench_tree_kernels(args)
    if "verify" in parts:
        bench_verify(args)
    if "slots" in parts:
        bench_slots(args)
    if "draft" in parts:
        bench_draft_step(args)
    if "rope" in parts:
        bench_rope(args)
    print(f"\n{len(ROWS)} rows in {time.time() - start:.0f} s; times in us, median; "
          "eager = do_bench (L2 flushed), graph = do_bench_cudagraph")
    header = (f"{'kernel':<26} {'shape':<40} {'ref eager':>10} {'ref graph':>10} "
              f"{'tri eager':>10} {'tri graph':>10} {'speedup':>8} {'floor':>8} {'%floor':>7}")
    print(header)
    print("-" * len(header))
    for r in ROWS:
        us = {k: r[k] * 1e3 for k in ("ref_eager", "ref_graph", "triton_eager", "triton_graph")}
        speedup = r["ref_graph"] / r["triton_graph"] if r["triton_graph"] > 0 else float("nan")
        floor = r["floor"] * 1e3
        print(f"{r['kernel']:<26} {r['shape']:<40} {us['ref_eager']:10.1f} {us['ref_graph']:10.1f} "
              f"{us['triton_eager']:10.1f} {us['triton_graph']:10.1f} {speedup:8.2f} "
              f"{floor:8.1f} {100 * r['floor'] / r['triton_graph']:6.0f}%")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "bench_kernels.json")
        with open(path, "w") as f:
            json.dump(dict(device=props.name, bandwidth=BANDWIDTH, rows=ROWS), f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
