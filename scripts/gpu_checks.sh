#!/usr/bin/env bash
# The GPU checks of issue 5 in one device call: Triton kernels vs references, graph capture and
# replay, the GPU lossless matrix, then the 8B-shaped scale bench. Results under $OUT (or ./out).
#   bash scripts/gpu_checks.sh [tests|scale|fp32-table|one-tile-slices|tiled|bf16-head|parity|phase-8b|all]
#   (default all; fp32-table, one-tile-slices, tiled, bf16-head, parity and phase-8b are not in all)
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
  timeout 400 python benchmarks/bench_scale.py --batches 1 8 64 --scopes iteration --scheduler --out "$OUT" \
    2>&1 | grep -v Warning | tee "$OUT/scale.txt"
fi
if [[ $what == fp32-table ]]; then  # the bench pair's float32 products at 4 and 16 rows, then
  # whole steps (decode, chain, tree) with the shipped table against the one this sweep tunes
  timeout 300 python benchmarks/bench_linear.py --dtype float32 --shape-set pair --ms 4,16 --no-pdl \
    --out "$OUT/linear" 2>&1 | grep -v Warning | tee "$OUT/linear.txt"
  timeout 240 python bench/table_ab.py --linear "$OUT/linear/bench_linear.json" --out "$OUT/ab" \
    2>&1 | grep -v Warning | tee "$OUT/table-ab.txt"
fi
if [[ $what == one-tile-slices ]]; then  # the skinny product's split-K tests (slices of one K
  # tile load their weights before the PDL wait), then whole steps of the bench pair with the
  # shipped float32 table against 16-row rules of one tile per slice (K 128 / 256, early on / off)
  timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_linear_gpu.py \
    tests/kernels/test_pdl.py 2>&1 | tail -5 | tee "$OUT/linear-tests.txt"
  timeout 420 python bench/table_ab.py --fp32-one-tile-slices --out "$OUT/ab" 2>&1 \
    | grep -v Warning | tee "$OUT/table-ab.txt"
fi
if [[ $what == tiled ]]; then  # float32 products of 17..512 rows as three-pass TF32 tiles: their
  # tests, the 16-row tiles against the skinny kernel's table, whole steps with the tiles against
  # cuBLAS (bench pair, random weights, SIMULATED acceptance, batch 1, 8 and 32)
  timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_tiled_linear_gpu.py \
    tests/gpu/test_linear_gpu.py 2>&1 | tail -5 | tee "$OUT/tiled-tests.txt"
  timeout 150 python bench/fp32_gemm.py --ms 16 --out "$OUT/m16" 2>&1 | grep -v Warning \
    | grep -v "rel err" | tee "$OUT/fp32-gemm-m16.txt"
  timeout 280 python bench/tiled_linear_ab.py --out "$OUT/ab" 2>&1 | grep -v Warning \
    | tee "$OUT/tiled-ab.txt"
fi
if [[ $what == bf16-head ]]; then  # a bfloat16 EAGLE-3 head beside the float32 target: its
  # engine path on the GPU, the skinny products at the head's shapes in bfloat16 (1, 4 and 5 rows:
  # a draft step's beams and draft-extend's accepted path at batch 1), the split-K down product
  # with its silu prologue at 16 rows (verify), and a tree iteration's kernels with either head
  timeout 200 python -m pytest -q -p no:cacheprovider tests/engine/test_greedy_parity.py \
    -k "bfloat16_draft" tests/gpu/test_linear_gpu.py 2>&1 | tail -8 | tee "$OUT/tests.txt"
  timeout 240 python benchmarks/bench_linear.py --dtype bfloat16 --shape-set pair --ms 1,4,5 --no-pdl \
    --shapes o,gate_up,down,lm_head,head_fc,head_qkv --out "$OUT/linear-bf16" 2>&1 \
    | grep -v Warning | tee "$OUT/linear-bf16.txt"
  timeout 120 python benchmarks/bench_linear.py --dtype float32 --shape-set pair --ms 16 --no-pdl \
    --shapes down --out "$OUT/linear-f32-down" 2>&1 | grep -v Warning | tee "$OUT/linear-f32-down.txt"
  for head in float32 bfloat16; do
    timeout 200 python benchmarks/profile_pair_host.py --out "$OUT/head-$head" --draft-dtype $head \
      --batches 1 --configs baseline tree --kernels --no-profile --checks off 2>&1 \
      | grep -v Warning | tee "$OUT/head-$head.txt"
  done
fi
if [[ $what == parity ]]; then  # the CPU suite's greedy parity against transformers, with the
  # engines on this GPU (float32, as the references are)
  timeout 400 python -m pytest -q -n 8 -p no:cacheprovider tests/engine/test_greedy_parity.py \
    2>&1 | tail -15 | tee "$OUT/parity.txt"
fi
if [[ $what == phase-8b ]]; then  # the 8B shape's decode step and chain iteration, GPU kernels by
  # phase (SIMULATED tau = 4, batch 1)
  timeout 300 python benchmarks/profile_pair_host.py --shape 8b --dtype bfloat16 --configs baseline chain \
    --batches 1 --kernels --no-profile --checks off --out "$OUT/8b" 2>&1 | grep -v Warning | tee "$OUT/8b-kernels.txt"
  timeout 300 python benchmarks/profile_pair_host.py --shape 8b --dtype bfloat16 --configs chain \
    --batches 1 --phase-kernels --out "$OUT/8b-phases" 2>&1 | grep -v Warning | tee "$OUT/8b-phase-kernels.txt"
fi
