#!/usr/bin/env bash
# A/B of one environment setting on whole CUDA graphs, on one GPU: bench/graph_anatomy.py (the
# bench pair's decode step and iterations, random weights, batch 1) with VAR=A, then VAR=B,
# alternating for ROUNDS rounds so that drift of the machine falls on both sides.
#   OUT=DIR bash bench/env_ab.sh VAR A B [ROUNDS=2] [CONFIGS="baseline chain tree"]
# e.g. OUT=DIR bash bench/env_ab.sh PHASEGRAPH_PDL off auto
# Results under $OUT/env-ab/<value>-<round>/ and a summary in $OUT/env-ab/summary.txt.
set -u
var=$1 a=$2 b=$3 rounds=${4:-2} configs=${5:-baseline chain tree}
out=${OUT:-out}/env-ab
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for round in $(seq 1 "$rounds"); do
  for value in "$a" "$b"; do
    env "$var=$value" timeout 250 python bench/graph_anatomy.py --out "$out/$value-$round" \
        --configs $configs 2>&1 | grep -v Warning > "$out/$value-$round.log"
    echo "== $var=$value round $round" >> "$out/summary.txt"
    grep -E "nodes, replay" "$out/$value-$round/graph_anatomy.txt" >> "$out/summary.txt"
  done
done
cat "$out/summary.txt"
