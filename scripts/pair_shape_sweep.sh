#!/usr/bin/env bash
# GPU work of a decode step and of a tree iteration (K=4 S=4 N=16, SIMULATED τ = 3) at batch 1,
# random float32 weights, for target shapes other than the bench pair's: does a deeper or a wider
# target leave the EAGLE-3 draft a smaller share of the iteration (η = step / iteration)?
#   OUT=dir bash scripts/pair_shape_sweep.sh [name ...]   (default: every shape below but
#   deep-18x768; DRAFT_DTYPE=bfloat16: the EAGLE-3 head in bf16, as the bench runs it)
# Results: $OUT/<name>/pair_host.json (params, step and GPU busy times) and $OUT/<name>.txt.
set -u
OUT=${OUT:-out}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
declare -A SHAPES=(
  # the bench-pair preset: 12 layers, hidden 768 (96M)
  [pair-12x768]=""
  # the same width, twice the depth (181M: outside the range; the depth trend on the
  # shapes the float32 product table is tuned for)
  [deep-24x768]="target.num_layers=24"
  # the deepest target of the pair's width inside the 80-150M: 18 layers (141M)
  [deep-18x768]="target.num_layers=18"
  # SmolLM-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads, MLP 1536) at vocabulary
  # 8192: 111M; its EAGLE-3 head copies the attention and MLP shape
  [smol-30x576]="target.num_layers=30 target.hidden_size=576 target.num_heads=9 target.num_kv_heads=3 target.intermediate_size=1536 head.num_kv_heads=3 head.intermediate_size=1536"
  # wider and as deep as the pair: 12 layers, hidden 1024, 16 heads, 4 KV heads, MLP 2816 (143M)
  [wide-12x1024]="target.hidden_size=1024 target.num_heads=16 target.intermediate_size=2816 head.intermediate_size=2816"
)
names=("$@")
[[ ${#names[@]} -eq 0 ]] && names=(pair-12x768 smol-30x576 wide-12x1024 deep-24x768)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for name in "${names[@]}"; do
  sets=()
  for kv in ${SHAPES[$name]}; do sets+=(--set "$kv"); done
  echo "===== $name: ${SHAPES[$name]:-(preset)}" | tee "$OUT/$name.txt"
  timeout 240 python benchmarks/profile_pair_host.py --out "$OUT/$name" --batches 1 --configs baseline tree \
    ${DRAFT_DTYPE:+--draft-dtype $DRAFT_DTYPE} --no-profile --checks off "${sets[@]}" 2>&1 \
    | grep -v Warning | tee -a "$OUT/$name.txt"
done
