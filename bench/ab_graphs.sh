#!/usr/bin/env bash
# A/B of two source trees on whole CUDA graphs, on one GPU: each tree's decode step and tree
# iteration replayed by bench/graph_anatomy.py (random weights, batch 1), alternating A, B, A, B
# so that drift of the machine falls on both. Trees: folders holding phasegraph/ (without its
# data/, linked from this checkout) and bench/, e.g. made by
#   git archive <commit> phasegraph bench/*.py | tar -x -C DIR --exclude=phasegraph/data
#   bash bench/ab_graphs.sh DIR_A DIR_B [ROUNDS=2] [CONFIGS="baseline tree"]
# Results under $OUT/ab-graphs/{a,b}-<round>/ and a summary in $OUT/ab-graphs/summary.txt.
set -u
a=$1 b=$2 rounds=${3:-2} configs=${4:-baseline tree}
out=${OUT:-out}/ab-graphs
mkdir -p "$out"
data=$PWD/phasegraph/data
for tree in "$a" "$b"; do
  [ -e "$tree/phasegraph/data" ] || ln -s "$data" "$tree/phasegraph/data"
done
for round in $(seq 1 "$rounds"); do
  for side in a b; do
    tree=$a; [ $side = b ] && tree=$b
    (cd "$tree" && PYTHONPATH=$PWD timeout 200 python bench/graph_anatomy.py \
        --out "$out/$side-$round" --configs $configs 2>&1 | grep -v Warning \
        > "$out/$side-$round.log")
    echo "== $side round $round ($tree)" >> "$out/summary.txt"
    grep -E "nodes, replay" "$out/$side-$round/graph_anatomy.txt" >> "$out/summary.txt"
  done
done
cat "$out/summary.txt"
