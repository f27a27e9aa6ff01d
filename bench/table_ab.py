"""A/B of the skinny-product table on whole engine steps at batch 1: the steady-state decode step
and EAGLE-3 iterations (SIMULATED acceptance) with linear.py's table as shipped, then with the
rules a ``bench_linear.py`` run tuned for the row counts it swept, placed before the shipped
rules of as many rows or more. bf16 (``CONFIGS``, ``H200_CONFIGS`` on an H200): the 8B shape, decode and chain; float32
(``FP32_CONFIGS``): the bench pair's target, decode, chain and tree, with the GPU kernels:

    python bench/bench_linear.py --ms 4 --no-pdl --out DIR
    python bench/table_ab.py --linear DIR/bench_linear.json --out DIR
    python bench/bench_linear.py --dtype float32 --shape-set pair --ms 4,16 --no-pdl --out DIR
    python bench/table_ab.py --linear DIR/bench_linear.json --out DIR
    python bench/table_ab.py --fp32-previous --out DIR   # shipped vs PREVIOUS_FP32_CONFIGS
    python bench/table_ab.py --fp32-one-tile-slices --out DIR  # shipped vs one_tile_slices(...)

Prints and writes ``table_ab.json``: step times per table (bench_scale's probe, overlap on). With
``--linear`` the shipped table runs again last, since a table run later in the process can time
slower for that reason alone (the 8B decode step on an H200: ~1 %).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_pair_host  # noqa: E402

from phasegraph.kernels import linear as lin  # noqa: E402
from phasegraph.kernels._dispatch import EARLY_WEIGHTS_ENV_VAR  # noqa: E402

C = lin.SkinnyConfig
# linear.FP32_CONFIGS of 19f556f (float32: IEEE multiply-sums at 1 and 5..16 rows, cuBLAS at
# 2..4 rows): the table the tf32x3 rules of 2026-11-23 replaced, kept to A/B against.
PREVIOUS_FP32_CONFIGS = (
    lin._Rule(1, lin._ANY, lin._K_WHOLE, C(2, 4096, 4, 1, dot=False), True, True),
    lin._Rule(4, lin._ANY, lin._ANY, C(2, 4096, 4, 1, dot=False), False, False),
    lin._Rule(16, lin._ANY, lin._K_WHOLE, C(8, 64, 4, 3, dot=False), True, False),
)


def one_tile_slices(shipped: tuple, block_k: int) -> tuple:
    """``shipped`` with its 5..16-row rules for the bench pair's shapes (the tree verify's and
    draft-extend's products) turned into three-pass TF32 tiles of ``block_k`` with one K tile per
    slice (split_k above any tile count; the launch clamps it), the form that loads its static
    weights before the PDL wait."""
    sliced = lin._FP32_TF32X3._replace(block_k=block_k, num_stages=1, split_k=1 << 10)
    pair = {(r.n_range, r.k_range) for r in lin._FP32_PAIR_RULES}
    return tuple(r._replace(config=sliced)
                 if r.m_max == 16 and (r.n_range, r.k_range) in pair else r for r in shipped)


def merged_table(shipped: tuple, tuned_rows: list[dict], swept: list[int]) -> tuple:
    """The shipped rules for fewer rows than the smallest swept M, the tuned rules of the swept
    row counts (per shape in increasing M), then the other shipped rules (first match wins)."""
    tuned = tuple(lin._Rule(r["m_max"], tuple(r["n_range"]), tuple(r["k_range"]),
                            lin.SkinnyConfig(**r["config"]) if isinstance(r["config"], dict)
                            else lin.SkinnyConfig(*r["config"]), r["plain"], r["fused"])
                  for r in tuned_rows if r["m_max"] in swept and r["n_range"] != list(lin._ANY))
    fewer = tuple(r for r in shipped if r.m_max < min(swept))
    more = tuple(r for r in shipped if r.m_max >= min(swept))
    return fewer + tuned + more


def main() -> int:
    ap = argparse.ArgumentParser()
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--linear", help="bench_linear.json of a sweep: shipped vs tuned")
    what.add_argument("--fp32-previous", action="store_true",
                      help="float32: PREVIOUS_FP32_CONFIGS vs the shipped FP32_CONFIGS")
    what.add_argument("--fp32-one-tile-slices", action="store_true",
                      help="float32: the shipped FP32_CONFIGS vs one_tile_slices() of K 128 and "
                           "256 (early weights on and off), the shipped table again last")
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    early = {}  # table name -> PHASEGRAPH_EARLY_WEIGHTS while it runs (else as set)
    if args.fp32_previous:
        fp32, table_name = True, "FP32_CONFIGS"
        shipped = lin.FP32_CONFIGS
        tables = {"previous": PREVIOUS_FP32_CONFIGS, "shipped": shipped}
        run = {"dtype": "float32"}
    elif args.fp32_one_tile_slices:
        fp32, table_name = True, "FP32_CONFIGS"
        shipped = lin.FP32_CONFIGS
        tables = {"shipped": shipped,
                  "slices K128": one_tile_slices(shipped, 128),
                  "slices K128 early off": one_tile_slices(shipped, 128),
                  "slices K256": one_tile_slices(shipped, 256),
                  "shipped again": shipped}
        early = {"slices K128 early off": "off"}
        run = {"dtype": "float32"}
    else:
        run = json.loads(Path(args.linear).read_text())
        swept = sorted({e["m"] for e in run["sweep"]})
        fp32 = run.get("dtype") == "float32"
        table_name = lin.gpu_table_name(torch.float32 if fp32 else torch.bfloat16)
        shipped = getattr(lin, table_name)
        tuned_name = "tuned M=" + ",".join(map(str, swept))
        tables = {"shipped": shipped, tuned_name: merged_table(shipped, run["tuned_table"], swept),
                  "shipped again": shipped}  # last too: what moves with the order, not the table
    if fp32:
        probe = ["--shape", "bench-pair", "--dtype", "float32", "--configs", "baseline", "chain",
                 "tree", "--kernels", "--checks", "default"]  # kernels: on the traced run
    else:
        probe = ["--shape", "8b", "--dtype", "bfloat16", "--configs", "baseline", "chain",
                 "--checks", "off"]
    result = {"gpu": torch.cuda.get_device_name(), "dtype": run.get("dtype"), "tables": {}}
    with profile_pair_host.restored_env(EARLY_WEIGHTS_ENV_VAR) as early_setting:
        try:
            for name, table in tables.items():
                setattr(lin, table_name, table)
                profile_pair_host.set_env(EARLY_WEIGHTS_ENV_VAR, early.get(name, early_setting))
                out = Path(args.out) / name.replace(" ", "_").replace("=", "").replace(",", "-")
                print(f"===== table: {name} =====", flush=True)
                for rule in table:
                    print(f"  {rule}", flush=True)
                profile_pair_host.main(probe + ["--batches", "1", "--no-profile", "--out", str(out)])
                result["tables"][name] = json.loads((out / "pair_host.json").read_text())["rows"]
        finally:
            setattr(lin, table_name, shipped)
    Path(args.out, "table_ab.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
