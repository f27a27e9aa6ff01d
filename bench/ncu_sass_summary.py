"""Summarise an ``ncu --page source --csv --print-source sass`` export: the kernel's warp stall
samples and shared-memory wavefronts, its stall reasons, and the SASS lines that hold the most
samples and the most shared wavefronts (``bench/ncu_gluon_chain.sh`` makes the export).

    python bench/ncu_sass_summary.py SASS.csv
"""

from __future__ import annotations

import csv
import sys

SAMPLES, WAVEFRONTS, EXCESSIVE = ("Warp Stall Sampling (All Samples)", "L1 Wavefronts Shared",
                                  "L1 Wavefronts Shared Excessive")


def summarise(path: str) -> str:
    rows = list(csv.reader(open(path)))
    header, lines = rows[1], rows[2:]  # rows[0] names the kernel
    column = {name: i for i, name in enumerate(header)}

    def value(row: list[str], name: str) -> float:
        try:
            return float(row[column[name]].replace(",", ""))
        except (KeyError, ValueError):  # a metric ncu left blank or did not collect
            return 0.0

    def total(name: str) -> float:
        return sum(value(row, name) for row in lines)

    stalls = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    out = [f"warp stall samples {total(SAMPLES):.0f}, shared wavefronts {total(WAVEFRONTS):.0f} "
           f"(excessive {total(EXCESSIVE):.0f})",
           "stall reasons: " + ", ".join(
               f"{n[6:]} {t:.0f}" for n, t in sorted(((n, total(n)) for n in stalls),
                                                   key=lambda nt: -nt[1])[:6]),
           "", "by samples: samples, shared wavefronts (excessive), warp executions, top stall, SASS"]
    for row in sorted(lines, key=lambda r: -value(r, SAMPLES))[:20]:
        top = max(stalls, key=lambda n: value(row, n))
        out.append(f"{value(row, SAMPLES):6.0f} {value(row, WAVEFRONTS):8.0f} "
                   f"({value(row, EXCESSIVE):7.0f}) {value(row, 'Instructions Executed'):7.0f} "
                   f"{top[6:]:<10} {row[column['Source']].strip()[:64]}")
    out += ["", "by shared wavefronts:"]
    for row in sorted(lines, key=lambda r: -value(r, WAVEFRONTS))[:8]:
        out.append(f"{value(row, WAVEFRONTS):8.0f} ({value(row, EXCESSIVE):7.0f}) "
                   f"{value(row, 'Instructions Executed'):7.0f} {row[column['Source']].strip()[:64]}")
    return "\n".join(out)


if __name__ == "__main__":
    print(summarise(sys.argv[1]))
