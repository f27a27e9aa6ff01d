"""Embedding-row gathers of a few tokens: ``F.embedding`` against the other ways torch gathers rows.

    python bench/bench_gather.py [--out DIR]

At batch 1 a step gathers 1-16 rows of an embedding table (the target's tokens, the draft head's
beams). ``F.embedding`` runs torch's ``index_select`` kernel, whose variant for few indices
(``indexSelectSmallIndex``) took 9.1 µs for the 16 rows of a tree verify on an H100
(``profile_pair_host.py --phase-kernels``, bench/RESULTS.md §5), against ~2 µs for other small
kernels. This times, in a captured CUDA graph (median), each form on the bench pair's table
(8192 x 768, float32) and the 8B shape's (128256 x 4096, bfloat16), and checks that every form
gives the same rows (a gather is exact, so any form may replace another).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_kernels import rotating, timed  # noqa: E402  (bench/ is this script's directory)

FORMS = {
    "F.embedding": lambda table, ids: F.embedding(ids, table),
    "index_select": lambda table, ids: torch.index_select(table, 0, ids),
    "table[ids]": lambda table, ids: table[ids],
}
TABLES = {"pair fp32 8192x768": (8192, 768, torch.float32), "8b bf16 128256x4096": (128256, 4096, torch.bfloat16)}
ROWS = (1, 4, 16, 64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write gather.json here")
    args = ap.parse_args()
    results = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (vocab, width, dtype) in TABLES.items():
        table = torch.randn(vocab, width, device="cuda", dtype=torch.float32, generator=g).to(dtype)
        for rows in ROWS:
            id_sets = [torch.randint(0, vocab, (rows,), device="cuda", generator=g) for _ in range(4)]
            reference = [FORMS["F.embedding"](table, ids) for ids in id_sets]
            row = {"table": name, "rows": rows}
            for form, fn in FORMS.items():
                same = all(torch.equal(fn(table, ids), ref) for ids, ref in zip(id_sets, reference, strict=True))
                _, graph_ms = timed(rotating([lambda ids=ids, fn=fn, table=table: fn(table, ids) for ids in id_sets]))
                row[form] = {"graph_us": round(1e3 * graph_ms, 2), "same_rows": same}
            results.append(row)
            print(f"{name:<22} rows {rows:>3}: " + "  ".join(
                f"{form} {row[form]['graph_us']:6.2f} us{'' if row[form]['same_rows'] else ' (DIFFERENT ROWS)'}"
                for form in FORMS), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gather.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
