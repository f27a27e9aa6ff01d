"""``phasegraph bench --tp N``: benchmarks/bench_tp.py under ``torchrun --nproc-per-node N`` at
TP=N, then at TP=1 on one GPU, then the goals side by side (``goals.txt``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from phasegraph.bench.common import REPO_ROOT, BenchError

# NVLink multicast must stay off on shared hosts (docs/parallel.md); torchrun's ranks inherit it
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def commands(tp: int, out: Path, extra: list[str]) -> list[list[str]]:
    """The runs, in order: TP=N (70B, then 8B: the goals that need most GPUs first), TP=1 (the
    8B shape), the report."""
    script = REPO_ROOT / "benchmarks" / "bench_tp.py"
    if not script.exists():
        raise BenchError(f"{script} is missing: run `phasegraph bench --tp` from a phasegraph checkout")
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    return [
        [torchrun, "--nproc-per-node", str(tp), str(script), "--tp", str(tp), "--out", str(out), *extra],
        [sys.executable, str(script), "--tp", "1", "--out", str(out), *extra],
        [sys.executable, str(script), "--report", str(out)],
    ]


def run_tp_bench(tp: int, out: Path, extra: list[str], log) -> int:
    """Run :func:`commands` one after the other; the first failing one's exit status."""
    env = {**os.environ, **NO_MULTICAST}
    out.mkdir(parents=True, exist_ok=True)
    for cmd in commands(tp, out, extra):
        log("$ " + " ".join(cmd))
        rc = subprocess.run(cmd, env=env, check=False).returncode
        if rc != 0:
            return rc
    return 0
