"""A/B of programmatic dependent launch (``PHASEGRAPH_PDL``) on whole engine steps at batch 1:
the steady-state decode step and EAGLE-3 iterations (SIMULATED acceptance) with every Triton
kernel launched plainly (``off``), then early (``auto``, on for Hopper GPUs), engines built and
graphs captured anew under each setting:

    python bench/pdl_ab.py --out DIR                 # the bench pair (float32 target, bf16 head)
    python bench/pdl_ab.py --out DIR --shape 8b      # Llama-3-8B shape, bfloat16: decode, chain

Each setting runs ``profile_pair_host.py`` (end-to-end step time with overlap on and off, GPU
busy time = the union of kernel intervals per step, so kernels placed early and waiting count
as busy; ``--kernels``: the kernel table of the traced run; ``--profile``: a cProfile of the
host) into ``DIR/<setting>-<round>/`` and this prints and writes ``pdl_ab.json`` with the rows of both.

``--chains`` first times CUDA graphs of 100 launches of one kernel, each reading the output of
the one before (a 1-row float32 product, a 16-row split-K TF32x3 product, the add + RMSNorm
kernel; the bench pair's 768-wide shapes): GPU time per launch (events around back-to-back
replays) and host time per ``replay()``, under each setting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_launch  # noqa: E402
import profile_pair_host  # noqa: E402

SETTINGS = ("off", "auto")
CHAIN = 100  # launches per graph


def _chain_graph(step, x):
    """A CUDA graph of CHAIN calls of ``step``, each on the output of the one before."""
    def chain():
        y = x
        for _ in range(CHAIN):
            y = step(y)

    return graph_launch.capture(chain)


def chain_times(repeats: int = 50, group: int = 10) -> dict:
    """µs per launch on the GPU and µs per host ``replay()`` of each chain, under each setting."""
    import statistics

    from phasegraph.kernels.linear import linear
    from phasegraph.kernels.rms_norm import add_rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(768, 768, device="cuda", generator=g) / 768**0.5
    nw = torch.ones(768, device="cuda")
    chains = {
        "product, 1 row (fp32, whole-K sums)": (lambda y: linear(y, w), 1),
        "product, 16 rows (fp32, split-K TF32x3)": (lambda y: linear(y, w), 16),
        "add + RMSNorm, 16 rows": (lambda y: add_rms_norm(y, y, nw, 1e-5)[0], 16),
    }
    rows = []
    for name, (step, m) in chains.items():
        x = torch.randn(m, 768, device="cuda", generator=g)
        for setting in SETTINGS:
            os.environ["PHASEGRAPH_PDL"] = setting
            graph = _chain_graph(step, x)
            gpu = []
            for _ in range(repeats // group):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                graph.replay()  # queued first: the timed replays start behind it, not the host
                a.record()
                for _ in range(group):
                    graph.replay()
                b.record()
                torch.cuda.synchronize()
                gpu.append(a.elapsed_time(b) * 1e3 / group / CHAIN)
            row = {"chain": name, "pdl": setting, "gpu_us_per_launch": statistics.median(gpu),
                   "host_us_per_replay": graph_launch.median_us(lambda: None, graph.replay, repeats)}
            rows.append(row)
            print(f"  {name:<42} PDL {setting:<4}: {row['gpu_us_per_launch']:6.2f} us per launch "
                  f"on the GPU, {row['host_us_per_replay']:7.1f} us to issue the graph", flush=True)
            del graph
    return {"launches_per_graph": CHAIN, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--shape", default="bench-pair", choices=["bench-pair", "8b"])
    ap.add_argument("--kernels", action="store_true", help="kernel tables of the traced runs")
    ap.add_argument("--profile", action="store_true", help="a cProfile of the host per setting")
    ap.add_argument("--configs", nargs="+", choices=["baseline", "chain", "tree"])
    ap.add_argument("--chains", action="store_true", help="first, graphs of one kernel's chain")
    ap.add_argument("--no-steps", action="store_true", help="only --chains")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the settings in turn this many times (off, auto, off, auto, ...)")
    args = ap.parse_args()
    if args.shape == "8b":
        probe = ["--shape", "8b", "--dtype", "bfloat16", "--checks", "off",
                 "--configs", *(args.configs or ["baseline", "chain"])]
    else:
        probe = ["--shape", "bench-pair", "--dtype", "float32", "--draft-dtype", "bfloat16",
                 "--checks", "default", "--configs", *(args.configs or ["baseline", "chain", "tree"])]
    if args.kernels:
        probe.append("--kernels")
    if not args.profile:
        probe.append("--no-profile")
    result = {"gpu": torch.cuda.get_device_name(), "shape": args.shape, "settings": {}}
    with profile_pair_host.restored_env("PHASEGRAPH_PDL"):
        if args.chains:
            result["chains"] = chain_times()
        for round_ in range(0 if args.no_steps else args.rounds):
            for setting in SETTINGS:
                os.environ["PHASEGRAPH_PDL"] = setting
                out = Path(args.out) / f"{setting}-{round_}"
                print(f"===== PHASEGRAPH_PDL={setting}, round {round_} =====", flush=True)
                profile_pair_host.main(probe + ["--batches", "1", "--out", str(out)])
                rows = json.loads((out / "pair_host.json").read_text())["rows"]
                result["settings"].setdefault(setting, []).extend(rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "pdl_ab.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
