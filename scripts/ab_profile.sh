#!/usr/bin/env bash
# Side-by-side A/B of two commits' GPU work per step (the bench pair, float32, batch 1: decode,
# chain and tree, with kernel tables) in one device call, so that both sides run on one machine.
#   bash scripts/ab_profile.sh prepare <commit>   # here: that commit's code into .ab/ (ignored)
#   bash scripts/ab_profile.sh run                # on the GPU machine, .ab/ carried along:
#                                                 # writes $OUT/profile-{old,new}.txt
#                                                 # (DRAFT_DTYPE=bfloat16: the head in bf16)
#   bash scripts/ab_profile.sh run generate       # the same for whole generate calls (host
#                                                 # and GPU time per iteration, batch 1): this
#                                                 # checkout's probe on both sides' package;
#                                                 # ROUNDS=N alternates the sides N times
#   bash scripts/ab_profile.sh run 8b-spec        # the 8B shape at batch 1: decode step, chain
#                                                 # and tree iterations (bench_scale, random
#                                                 # weights), old/new interleaved twice
#   bash scripts/ab_profile.sh run 8b             # the 8B-shaped decode step at batch 1 (bf16),
#                                                 # old/new interleaved twice (share of the
#                                                 # bandwidth bound), then each side's kernels
set -eu
case ${1:-} in
  prepare)
    rm -rf .ab && mkdir .ab
    git archive "$2" phasegraph bench | tar -x -C .ab
    rm -rf .ab/bench/results .ab/phasegraph/data  # not needed by the probe (random weights)
    mkdir -p "$(git rev-parse --git-dir)/info"
    grep -qx '.ab/' "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null \
      || echo '.ab/' >> "$(git rev-parse --git-dir)/info/exclude"
    echo "prepared .ab/ from $2 ($(du -sh .ab | cut -f1)); carry it: run(carry=[\".ab\"])";;
  run)
    OUT=${OUT:-out}
    if [ "${2:-}" = 8b ]; then
      for round in 1 2; do
        for side in old new; do
          pkg=$PWD; [ "$side" = old ] && pkg=$PWD/.ab
          echo "== $side (round $round)"
          PYTHONPATH=$pkg timeout 150 python benchmarks/bench_scale.py --batches 1 --skip-spec \
            --out "$OUT/8b-$side-$round" 2>&1 | grep -E "GPU|AR decode"
        done
      done
      for side in old new; do
        pkg=$PWD; [ "$side" = old ] && pkg=$PWD/.ab
        PYTHONPATH=$pkg timeout 150 python benchmarks/profile_pair_host.py --shape 8b --dtype bfloat16 \
          --batches 1 --configs baseline --kernels --no-profile --checks default --out "$OUT/8b-kernels-$side" \
          2>&1 | grep -v Warning > "$OUT/8b-kernels-$side.txt"
        echo "== $side kernels"; grep -E "kernels per step" -A6 "$OUT/8b-kernels-$side.txt"
      done
      exit 0
    fi
    if [ "${2:-}" = 8b-spec ]; then
      for round in 1 2; do
        for side in old new; do
          pkg=$PWD; [ "$side" = old ] && pkg=$PWD/.ab
          echo "== $side (round $round)"
          PYTHONPATH=$pkg timeout 200 python benchmarks/bench_scale.py --batches 1 --scopes iteration \
            --out "$OUT/8b-spec-$side-$round" 2>&1 | grep -E "AR decode|iteration " | cut -c1-120
        done
      done
      exit 0
    fi
    if [ "${2:-}" = generate ]; then
      # ROUNDS=N alternates the sides N times (old, new, old, new, ...): the host's speed drifts
      # by ±10 % on a lent machine, so one round each cannot show a host-side change end to end
      rounds=${ROUNDS:-1}
      for round in $(seq 1 "$rounds"); do
        for side in old new; do
          pkg=$PWD; [ "$side" = old ] && pkg=$PWD/.ab
          tag=$side; [ "$rounds" -gt 1 ] && tag=$side-$round
          PYTHONPATH=$pkg timeout 240 python benchmarks/profile_pair_host.py --generate --batches 1 \
            --out "$OUT/generate-$tag" 2>&1 | grep -v Warning > "$OUT/generate-$tag.txt"
          echo "== $tag"; grep -E "=====|ms per call" "$OUT/generate-$tag.txt"
        done
      done
      exit 0
    fi
    for side in old new; do
      dir=$PWD; [ "$side" = old ] && dir=$PWD/.ab
      (cd "$dir" && PYTHONPATH=$dir timeout 120 python benchmarks/profile_pair_host.py --dtype float32 \
        ${DRAFT_DTYPE:+--draft-dtype $DRAFT_DTYPE} \
        --batches 1 --configs baseline chain tree --kernels --no-profile --checks default \
        --out "$OUT/$side" 2>&1 | grep -v Warning > "$OUT/profile-$side.txt")
      echo "== $side"; grep -E "overlap on|kernels per step" "$OUT/profile-$side.txt"
    done;;
  *) echo "usage: bash scripts/ab_profile.sh prepare <commit> | run" >&2; exit 2;;
esac
