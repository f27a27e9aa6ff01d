"""Compare the held-out figures of two training reports (the reproducibility check).

    python scripts/compare_train_reports.py A.json B.json [--tolerance 0.02]
"""

from __future__ import annotations

import argparse
import json
import sys


def figures(report: dict) -> dict[str, float]:
    out = {"target held-out loss": report["target"]["heldout_loss"], "head held-out loss": report["head"]["heldout_loss"]}
    for i, a in enumerate(report["head"]["heldout_agreement_by_step"], start=1):
        out[f"head agreement s{i}"] = a
    for name, r in report.get("acceptance", {}).items():
        if isinstance(r, dict) and r.get("tau") is not None:
            out[f"simulated tau {name}"] = r["tau"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tolerance", type=float, default=0.02)
    args = ap.parse_args(argv)
    fa, fb = (figures(json.load(open(p))) for p in (args.a, args.b))
    worst = 0.0
    for k in fa:
        rel = abs(fa[k] - fb[k]) / max(abs(fa[k]), 1e-12)
        worst = max(worst, rel)
        print(f"{k:<32} {fa[k]:10.4f} {fb[k]:10.4f}  rel diff {100 * rel:6.3f}%")
    ok = worst <= args.tolerance
    print(f"worst relative difference {100 * worst:.3f}% -> {'within' if ok else 'OUTSIDE'} {100 * args.tolerance:.0f}%")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
