"""A/B of the skinny-product table on whole engine steps: the 8B shape's steady-state decode step
and EAGLE-3 chain iteration (SIMULATED τ = 4, batch 1) with ``linear.CONFIGS`` as shipped, then
with the rules a ``bench_linear.py`` run tuned for the row counts it swept, placed before the
shipped rules of more rows:

    python bench/bench_linear.py --ms 4 --no-pdl --out DIR
    python bench/table_ab.py --linear DIR/bench_linear.json --out DIR

Prints and writes ``table_ab.json``: step times per table (bench_scale's probe, overlap on).
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


def merged_table(tuned_rows: list[dict], swept_m: int) -> tuple:
    """The shipped rules for fewer rows, the tuned rules for up to ``swept_m`` rows, then the
    shipped rules for more rows (first match wins)."""
    tuned = tuple(lin._Rule(r["m_max"], tuple(r["n_range"]), tuple(r["k_range"]),
                            lin.SkinnyConfig(*r["config"]), r["plain"], r["fused"])
                  for r in tuned_rows if r["m_max"] == swept_m and r["n_range"] != list(lin._ANY))
    fewer = tuple(r for r in lin.CONFIGS if r.m_max < swept_m)
    more = tuple(r for r in lin.CONFIGS if r.m_max >= swept_m)
    return fewer + tuned + more


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--linear", required=True, help="bench_linear.json of a sweep of one M")
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    run = json.loads(Path(args.linear).read_text())
    swept = sorted({e["m"] for e in run["sweep"]})
    if len(swept) != 1:
        raise SystemExit(f"--linear: expected a sweep of one M, got {swept}")
    shipped = lin.CONFIGS
    tables = {"shipped": shipped, f"tuned M<={swept[0]}": merged_table(run["tuned_table"], swept[0])}
    result = {"gpu": torch.cuda.get_device_name(), "tables": {}}
    for name, table in tables.items():
        lin.CONFIGS = table
        out = Path(args.out) / name.replace(" ", "_").replace("<=", "le")
        print(f"===== table: {name} =====", flush=True)
        for rule in table:
            print(f"  {rule}", flush=True)
        profile_pair_host.main(["--shape", "8b", "--dtype", "bfloat16", "--batches", "1", "--configs",
                                "baseline", "chain", "--no-profile", "--checks", "off", "--out", str(out)])
        result["tables"][name] = json.loads((out / "pair_host.json").read_text())["rows"]
    lin.CONFIGS = shipped
    Path(args.out, "table_ab.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
