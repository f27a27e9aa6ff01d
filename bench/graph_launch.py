"""Host time of one CUDA-graph launch (``CUDAGraph.replay``) by what the stream is doing then.

    python bench/graph_launch.py [--kernels 90 250] [--out DIR]

A speculative iteration at batch 1 is one replay of a graph of ~250 kernels, issued while the
previous iteration's replay of the *same* graph may still run on the GPU (overlap scheduling).
This times the launch call alone (no synchronisation inside the timed span), median of many, for
graphs of ``--kernels`` small kernels:

- ``idle``: the stream has nothing queued;
- ``busy (other work)``: a ~0.5 ms sleep kernel is queued ahead;
- ``busy (same graph)``: the same graph's previous replay is queued ahead;
- ``busy (twin graph)``: a second capture of the same work is queued ahead (two graph
  executables used in turn).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def capture(build) -> torch.cuda.CUDAGraph:
    """A graph of the work ``build()`` issues: run once on a side stream first (compiles, lazy
    initialisation), captured, then replayed once and synchronised (instantiated and uploaded)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        build()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        build()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def median_us(setup, launch, repeats: int) -> float:
    """Median host time (us) of ``launch()`` alone, after ``setup()`` on a synchronised device."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        setup()
        start = time.perf_counter()
        launch()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def replay_costs(graph: torch.cuda.CUDAGraph, repeats: int = 200,
                 twin: torch.cuda.CUDAGraph | None = None) -> dict[str, float]:
    """Median host time (us) of ``graph.replay()`` with the stream idle, behind a ~0.5 ms sleep
    kernel, behind the same graph's previous replay, and (with ``twin``) behind a twin's."""
    sleep_cycles = int(0.5e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # clock_rate in kHz
    costs = {
        "idle": median_us(lambda: None, graph.replay, repeats),
        "busy (other work)": median_us(lambda: torch.cuda._sleep(sleep_cycles), graph.replay, repeats),
        "busy (same graph)": median_us(graph.replay, graph.replay, repeats),
    }
    if twin is not None:
        costs["busy (twin graph)"] = median_us(graph.replay, twin.replay, repeats)
    return costs


def measure(kernels: int, repeats: int = 200) -> dict[str, float]:
    x = torch.zeros(4096, device="cuda")

    def adds():
        for _ in range(kernels):
            x.add_(1.0)

    return replay_costs(capture(adds), repeats, twin=capture(adds))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, nargs="+", default=[90, 250])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for n in args.kernels:
        row = {"kernels": n, **measure(n)}
        result["rows"].append(row)
        print(f"{n:4d} kernels: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items() if k != "kernels"), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "graph_launch.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
