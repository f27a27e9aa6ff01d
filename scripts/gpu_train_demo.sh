#!/usr/bin/env bash
# On the GPU machine (device tool): train the demo pair, package it, and measure its acceptance
# through the public Engine on held-out stdlib prompts. Results land in $OUT.
#   bash scripts/gpu_train_demo.sh [SEED] [BUDGET_S]
set -euo pipefail
seed="${1:-0}"
budget="${2:-900}"
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python -m phasegraph.train demo-pair --out /tmp/pair --seed "$seed" --time-budget-s "$budget" --no-progress 2>&1 | tee "$out/train.log"
cp /tmp/pair/train_report.json "$out/train_report.json"
tar -C /tmp/pair -czf "$out/target.tgz" target
tar -C /tmp/pair -czf "$out/eagle3.tgz" eagle3
python scripts/measure_acceptance.py /tmp/pair --device cuda 2>&1 | tee "$out/acceptance.txt"
