#!/usr/bin/env bash
# The bench pair (random weights, SIMULATED acceptance) at batch 8: step and iteration times with
# the shipped settings, then GPU kernels per step and per phase (PDL off, so spans add up).
#   OUT=DIR bash bench/profile_batch8.sh     (GPU only; about 4 minutes)
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
timeout 200 python bench/profile_pair_host.py --out /tmp/s --batches 1 8 --configs baseline chain tree --no-profile --checks off --draft-dtype bfloat16 2>&1 | grep -v Warn > $OUT/steps.txt
PHASEGRAPH_PDL=off timeout 200 python bench/profile_pair_host.py --out /tmp/k --batches 8 --configs baseline tree --kernels --kernel-batch 8 --no-profile --checks off --draft-dtype bfloat16 2>&1 | grep -v Warn > $OUT/kernels-b8.txt
PHASEGRAPH_PDL=off timeout 150 python bench/profile_pair_host.py --out /tmp/p --batches 8 --configs tree --phase-kernels --kernel-batch 8 --no-profile --draft-dtype bfloat16 2>&1 | grep -v Warn > $OUT/phase-kernels-b8.txt
tail -3 $OUT/*.txt
