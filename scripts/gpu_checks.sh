#!/usr/bin/env bash
# The GPU suite and the maintained benchmarks (benchmarks/README.md) in one device call, from the
# repository root; each part's output is printed and kept under $OUT (default ./out).
#   bash scripts/gpu_checks.sh [all|tests|tests-kernels|tests-rest|scale|kernels|linear|steps|demo-pair|serve
#                               |tp-tests|tp-bench ...]
#   all (the default): tests, then scale. The other parts take minutes each, so they run when named.
#   tests = tests-kernels + tests-rest, each under 8 minutes: name one a call where calls are limited.
#   tp-tests and tp-bench need two GPUs (nvidia-h200-x2), NVLink multicast off.
# Exits non-zero when any part failed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
parts=("${@:-all}")
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the device has no network: wheels carried in .whl/ (pip download --python-version of the device)
# give the structured-output tests their grammar engine, else they skip by name
if [[ -d .whl ]] && ! python -c "import xgrammar, jsonschema" 2>/dev/null; then
  python -m pip install -q --no-index --find-links .whl xgrammar jsonschema || echo "xgrammar: not installed from .whl" >&2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
failed=()

# run NAME SECONDS COMMAND...: COMMAND's output into $OUT/NAME.txt, its failure remembered
run() {
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*"
  timeout "$seconds" "$@" 2>&1 | grep -v Warning | tee "$OUT/$name.txt"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || failed+=("$name")
}

wants() {
  local p
  for p in "${parts[@]}"; do
    [[ $p == "$1" || ($p == all && ($1 == tests-* || $1 == scale)) || ($p == tests && $1 == tests-*) ]] && return 0
  done
  return 1
}

# tests/serving holds no GPU test, and the GPU machine lacks the serve extra it imports
kernel_tests=(tests/kernels tests/gpu/test_triton*.py)
if wants tests-kernels; then
  run gpu-tests-kernels 480 python -m pytest -q -m gpu -n 8 -p no:cacheprovider "${kernel_tests[@]}"
fi
if wants tests-rest; then
  run gpu-tests-rest 480 python -m pytest -q -m gpu -n 8 -p no:cacheprovider --ignore=tests/serving \
    --ignore=tests/kernels $(printf -- '--ignore=%s ' tests/gpu/test_triton*.py) \
    --ignore=tests/gpu/test_tensor_parallel_gpu.py  # two GPUs: tp-tests
fi
if wants scale; then  # the 8B shape: decode step against the bandwidth bound, iterations by phase
  run scale 400 python benchmarks/bench_scale.py --batches 1 8 64 --scopes iteration --scheduler --out "$OUT/scale"
fi
if wants kernels; then
  run kernels 300 python benchmarks/bench_kernels.py --quick --out "$OUT/kernels"
fi
if wants linear; then  # the 8B products at 1 and 4 rows (bf16), the bench pair's at 4 and 16 (float32)
  run linear-8b 300 python benchmarks/bench_linear.py --ms 1,4 --out "$OUT/linear-8b"
  run linear-pair 300 python benchmarks/bench_linear.py --dtype float32 --shape-set pair --ms 4,16 --no-pdl \
    --out "$OUT/linear-pair"
fi
if wants steps; then  # GPU time by kernel: the 8B step and iteration, then the 8B chain by phase
  run profile-step 300 python benchmarks/profile_step.py --out "$OUT/profile-step"
  run phase-kernels-8b 300 python benchmarks/profile_pair_host.py --shape 8b --dtype bfloat16 --configs chain \
    --batches 1 --phase-kernels --out "$OUT/phase-kernels-8b"
fi
if wants demo-pair; then  # the embedded pair's τ through the Engine (its README's figures)
  run demo-pair 300 python benchmarks/measure_acceptance.py phasegraph/data/demo_pair --device cuda
fi

if wants tp-tests; then  # the two-GPU suite: about a minute a test, so its selections side by side
  # (each symm_mem engine in a process of its own: a second one in a process is refused)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  tp=tests/gpu/test_tensor_parallel_gpu.py
  selections=("test_tp2_fp32 and (none-P16 or eagle3-tree or eagle3-chain)"
              "(test_tp2_fp32 and standalone) or bf16" "warm_up"
              "symmetric and none" "symmetric and eagle3-tree"
              "draft_tp2 and nccl" "draft_tp2 and symm_mem")
  pids=()
  for i in "${!selections[@]}"; do
    (failed=(); run "tp-tests-$i" 560 python -m pytest -q -m gpu -p no:cacheprovider --timeout 300 "$tp" \
      -k "${selections[$i]}"; ((${#failed[@]} == 0))) &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed+=("tp-tests-$i"); done
fi
if wants tp-bench; then  # 8B at TP=1 and 2, 70B at TP=2: the three goals in $OUT/tp/goals.txt
  run tp-bench 580 python -m phasegraph.cli bench --tp 2 --out "$OUT/tp"
fi

if wants serve; then  # the server under Poisson arrivals, speculation on and off (needs the serve extra);
  # SERVE_PAIR=DIR serves a trained pair (target/, eagle3/), else the embedded pair
  run serve-bench 580 python -m phasegraph.cli bench --serve --out "$OUT/serve" ${SERVE_PAIR:+--pair "$SERVE_PAIR"}
fi

if ((${#failed[@]})); then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
