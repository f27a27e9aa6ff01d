#!/usr/bin/env bash
# Nsight Compute on one form of bench/gluon_chain.py's persistent chain (GPU machine only):
# warp stall sampling and shared-memory wavefronts per SASS line, summarised by
# bench/ncu_sass_summary.py. This is how the K-split chain's 16-way conflicting cross-warp sum
# and its 2-way conflicting ldmatrix reads were found (bench/RESULTS.md §5).
#
#   OUT=DIR bash bench/ncu_gluon_chain.sh ["FORM"]     # FORM: one of gluon_chain.FORMS
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to a directory}"
FORM=${1:-mma K-split, own sum, swizzle, two accumulators, gate x11}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$NCU" --kernel-name regex:ksplit --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats -o "$OUT/chain" -f \
    python bench/gluon_chain.py --form "$FORM" --launches 3 > "$OUT/ncu.log" 2>&1
"$NCU" -i "$OUT/chain.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv"
python bench/ncu_sass_summary.py "$OUT/sass.csv" | tee "$OUT/summary.txt"
