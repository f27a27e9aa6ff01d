#!/usr/bin/env bash
# On the GPU machine: train the demo pair twice with the same seed (side by side on one GPU) to
# check that the recipe reproduces its held-out figures, package the first run, and measure its
# acceptance through the public Engine. Results land in $OUT.
set -euo pipefail
seed="${1:-0}"
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
python -m phasegraph.train demo-pair --out /tmp/pairA --seed "$seed" --time-budget-s 900 --no-progress > "$out/trainA.log" 2>&1 &
a=$!
python -m phasegraph.train demo-pair --out /tmp/pairB --seed "$seed" --time-budget-s 900 --no-progress > "$out/trainB.log" 2>&1 &
b=$!
wait $a; wait $b
tail -22 "$out/trainA.log"
cp /tmp/pairA/train_report.json "$out/train_report_A.json"
cp /tmp/pairB/train_report.json "$out/train_report_B.json"
python scripts/compare_train_reports.py "$out/train_report_A.json" "$out/train_report_B.json" | tee "$out/reproduce.txt"
tar -C /tmp/pairA -czf "$out/target.tgz" target
tar -C /tmp/pairA -czf "$out/eagle3.tgz" eagle3
python scripts/measure_acceptance.py /tmp/pairA --device cuda 2>&1 | tail -4 | tee "$out/acceptance.txt"
