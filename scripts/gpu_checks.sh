#!/usr/bin/env bash
# The GPU checks of issue 5 in one device call: Triton kernels vs references, graph capture and
# replay, the GPU lossless matrix, then the 8B-shaped scale bench. Results under $OUT (or ./out).
#   bash scripts/gpu_checks.sh [tests|scale|fp32-table|all]   (default all; fp32-table is not in all)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${1:-all}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  timeout 300 python -m pytest -q -m gpu -n 8 -p no:cacheprovider \
    tests/gpu tests/kernels/test_cuda_parity.py tests/runtime/test_gpu_capture.py \
    2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
fi
if [[ $what == scale || $what == all ]]; then
  timeout 400 python bench/bench_scale.py --batches 1 8 64 --scopes iteration --scheduler --out "$OUT" \
    2>&1 | grep -v Warning | tee "$OUT/scale.txt"
fi
if [[ $what == fp32-table ]]; then  # the bench pair's float32 products at 4 and 16 rows, then
  # whole steps (decode, chain, tree) with the shipped table against the one this sweep tunes
  timeout 300 python bench/bench_linear.py --dtype float32 --shape-set pair --ms 4,16 --no-pdl \
    --out "$OUT/linear" 2>&1 | grep -v Warning | tee "$OUT/linear.txt"
  timeout 240 python bench/table_ab.py --linear "$OUT/linear/bench_linear.json" --out "$OUT/ab" \
    2>&1 | grep -v Warning | tee "$OUT/table-ab.txt"
fi
