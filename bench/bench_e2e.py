"""Script entry point of ``phasegraph bench`` (issue 7), for a checkout without an install.

    python bench/bench_e2e.py --out DIR [--pair DIR] [--train-budget-s 300] [--parts 1,2] [--quick]

Same options and outputs as ``phasegraph bench`` (see ``phasegraph/bench/``): end-to-end
tokens/s, τ, speedup and η of phasegraph against its autoregressive baseline and transformers'
``generate`` on a trained pair, and the 8B shape with simulated acceptance; ``bench.json``,
``bench.md`` and two PNG plots in ``--out``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phasegraph.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
