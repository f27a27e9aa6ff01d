"""GPU check of the bench's kernel warm-up when another process holds the GPU's memory.

Run 26 (bench/RESULTS.md §5): while the pair trained, the trainer's allocator cache held 76.8 of
79.2 GiB, and the warm-up process died of an out-of-memory error on its fourth configuration.
Since 1546c7b a configuration that runs out waits until 8 GiB are free and runs again. This
script reproduces the situation without a training: a second process ("hog") takes all but
``--leave-gib`` of the free memory for ``--hold-s`` seconds and then exits; meanwhile the
warm-up (``python -m phasegraph.bench.warm``, the bench-pair preset, part 1's batches 1, 8
and 32) runs. It passes
when a configuration ran out of memory, ran again after the hog let go, and the warm-up exited
with status 0.

    python bench/check_warm_memory.py --out DIR [--leave-gib 1.0] [--hold-s 40]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_HOG = """
import sys, time, torch
leave = float(sys.argv[1]) * 2**30
free, _ = torch.cuda.mem_get_info()
held = torch.empty(int(free - leave), dtype=torch.uint8, device="cuda")
print(f"hog: holding {held.numel() / 2**30:.1f} GiB", flush=True)
time.sleep(float(sys.argv[2]))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--leave-gib", type=float, default=1.0, help="memory the hog leaves free")
    ap.add_argument("--hold-s", type=float, default=40.0, help="how long the hog holds it")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from phasegraph.bench import warm
    from phasegraph.bench.pair import kv_pool_tokens

    if not torch.cuda.is_available():
        print("check_warm_memory: needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [1, 8, 32]  # part 1's, as run 26's warm-up had them
    spec = {"preset": "bench-pair", "overrides": [], "seed": 0, "batches": batches, "prompt_tokens": 256,
            "engine": {"device": "cuda", "dtype": "float32", "draft_dtype": "bfloat16",
                       "max_batch_size": max(batches),
                       "kv_pool_tokens": kv_pool_tokens(max(batches), 256, 256),
                       "cuda_graphs": True, "trace": True, "validate": None,
                       "prefill_graphs": True}}
    hog = subprocess.Popen([sys.executable, "-c", _HOG, str(args.leave_gib), str(args.hold_s)])
    time.sleep(8.0)  # the hog's CUDA context and allocation come first
    t0 = time.perf_counter()
    log_path = args.out / "warm.log"
    proc = warm.start(spec, log_path)
    code = proc.wait(timeout=600)
    hog.wait(timeout=120)
    lines = log_path.read_text().splitlines()
    ran_out = [ln for ln in lines if "out of device memory" in ln]
    retried = [ln for ln in lines if ln.endswith("(second try)")]
    result = {"returncode": code, "wall_s": round(time.perf_counter() - t0, 1), "ran_out": ran_out,
              "second_tries": retried, "hog_returncode": hog.returncode, "spec": spec}
    (args.out / "check_warm_memory.json").write_text(json.dumps(result, indent=2))
    print("\n".join(ln for ln in lines if ln.startswith("warm-up")))
    ok = code == 0 and ran_out and len(retried) == len(ran_out)
    print(f"check_warm_memory: {'PASS' if ok else 'FAIL'} (exit {code}, {len(ran_out)} ran out, "
          f"{len(retried)} ran again)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
