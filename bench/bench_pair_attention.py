"""The bench pair's float32 paged attention, by tile: time and bitwise agreement per variant.

    python bench/bench_pair_attention.py [--out DIR]

Shapes of one batch-1 iteration of the `bench-pair` target (12 query heads, 4 kv heads, head
dim 64, float32, page size 1, a page-table row of 1050 positions as the engine sizes it for a
1024-token context): verify (the 16 tree nodes on one row, tree mask), draft (4 branch rows, one
token each), extend (4 consecutive tokens of one row). Committed lengths 220-470, as in the
bench's 256-token continuations of ~217-token prompts.

Every variant is timed in a captured CUDA graph (``do_bench_cudagraph``, median) and compared
bit for bit with the default tiles: float32 attention must give the same bits whatever tiles the
dispatcher picks, or a verify would disagree with the decode step it replaces (greedy outputs
equal to the baseline's). A variant that changes a bit is reported and may not be used.
Result on an H100 (bench/RESULTS.md §5, 2026-11-24): the default tiles are the fastest that keep
the bits (~13 µs per call); every faster variant changes them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_kernels import rotating  # noqa: E402  (bench/ is this script's directory)
from triton.testing import do_bench_cudagraph  # noqa: E402

from phasegraph.kernels import attention as attn  # noqa: E402
from tests.gpu.kernel_cases import ancestor_mask, random_parents  # noqa: E402

DEVICE = torch.device("cuda")
HEADS, KV_HEADS, HEAD_DIM, POSITIONS = 12, 4, 64, 1050


def pair_case(gen: torch.Generator, layout: str, kv_len: int):
    """``(q, k_cache, v_cache, meta)`` of one layer's attention at batch 1."""
    rows = 4 if layout == "draft" else 1
    table = torch.zeros(1 + rows, POSITIONS, dtype=torch.int64)
    slots = torch.randperm(POSITIONS * 2, generator=gen)[:POSITIONS] + 1  # slot 0: the sink
    table[1:] = slots  # every branch row shares the request's slots (page size 1)
    extra = None
    if layout == "verify":
        tokens = 16
        query_row = torch.ones(tokens, dtype=torch.int64)
        lens = torch.full((tokens,), kv_len)
        extra = ancestor_mask(random_parents(gen, 1, tokens))[0]
    elif layout == "draft":
        tokens = 4
        query_row = torch.arange(1, 5)
        lens = kv_len + 1 + torch.randint(0, 3, (tokens,), generator=gen)
    else:  # extend
        tokens = 4
        query_row = torch.ones(tokens, dtype=torch.int64)
        lens = kv_len + 1 + torch.arange(tokens)
    k_cache = torch.randn(POSITIONS * 2 + 1, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    meta = attn.AttentionMetadata(
        write_slots=torch.zeros(tokens, dtype=torch.int64, device=DEVICE),
        page_table=table.to(DEVICE), query_row=query_row.to(DEVICE), kv_len=lens.to(DEVICE),
        extra_mask=extra.to(DEVICE) if extra is not None else None, page_size=1,
        one_query_per_row=layout == "draft",
    )
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta


VARIANTS = {
    "default": {},
    "block_m32": dict(block_m=32),
    "block_m64": dict(block_m=64),
    "warps2": dict(num_warps=2),
    "warps8": dict(num_warps=8),
    "block_n32": dict(block_n=32),
    "stages2": dict(num_stages=2),
    "block_m64_warps8": dict(block_m=64, num_warps=8),
    "one_split": dict(num_splits=1),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    scale = HEAD_DIM ** -0.5
    rows = []
    for layout in ("verify", "draft", "extend"):
        gen = torch.Generator().manual_seed(0)
        sets = [pair_case(gen, layout, kv_len) for kv_len in (220, 300, 390, 470)]
        ref = [attn.paged_attention_reference(*s, scale) for s in sets]
        base = None
        for name in args.variants.split(","):
            kw = VARIANTS[name]
            try:
                outs = [attn.paged_attention_triton(*s, scale, **kw) for s in sets]
            except Exception as exc:  # a tile that does not compile: report and go on
                print(f"{layout:<7} {name:<18} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            base = outs if base is None else base
            same = all(torch.equal(o, b) for o, b in zip(outs, base, strict=True))
            err = max(float((o - r).abs().max()) for o, r in zip(outs, ref, strict=True))
            call = rotating([partial(attn.paged_attention_triton, *s, scale, **kw) for s in sets])
            call()
            us = 1e3 * do_bench_cudagraph(call, rep=50, return_mode="median")
            rows.append(dict(layout=layout, variant=name, us=us, bitwise_equal_default=same, max_err_ref=err))
            print(f"{layout:<7} {name:<18} {us:7.2f} µs  same bits as default: {same}  "
                  f"max |Δ| vs reference {err:.1e}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_pair_attention.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
