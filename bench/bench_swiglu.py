"""The MLP of the bench pair's layers with and without the SwiGLU epilogue, in CUDA graphs.

Times what one tree iteration runs: the 16-row float32 verify MLP of the target (12 layers, each
its own weights, so they stream from memory as in a real pass) and the 4- and 5-row bfloat16 MLP
of the EAGLE-3 head (draft steps and draft-extend). Per chain of layers, GPU time per replay:

- ``separate``: norm -> gate/up product (deferred where split) -> SwiGLU kernel -> down product;
- ``glu <config>``: norm -> gate/up product with the SwiGLU epilogue (that config) -> down.

    python bench/bench_swiglu.py [--out DIR]

The table (phasegraph/kernels/linear.py) takes the epilogue only where it wins here and in the
whole iteration (bench/graph_anatomy.py).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from phasegraph.kernels import linear as lin
from phasegraph.kernels.activation import silu_mul
from phasegraph.kernels.rms_norm import add_rms_norm

C = lin.SkinnyConfig
HIDDEN, INNER, EPS = 768, 2560, 1e-5
CASES = {  # name: (dtype, rows, layers, epilogue configs to try)
    "verify-fp32-16": (torch.float32, 16, 12, [
        C(32, 64, 4, 3, True, precision="tf32x3", split_k=s) for s in (2, 4, 8)
    ] + [C(16, 64, 4, 3, True, precision="tf32x3", split_k=s) for s in (2, 4)]
      + [C(64, 64, 4, 3, True, precision="tf32x3", split_k=4)]),
    "head-bf16-4": (torch.bfloat16, 4, 4, [
        C(64, 128, 4, 4, True, True), C(64, 128, 4, 4, True, True, split_k=2),
        C(32, 128, 4, 4, True, True), C(32, 256, 4, 3, True), C(16, 128, 4, 4, True, split_k=2),
        C(4, 512, 4, 3, False), C(8, 256, 4, 3, False, split_k=2),
    ]),
    "extend-bf16-5": (torch.bfloat16, 5, 1, [
        C(64, 128, 4, 4, True, True), C(32, 128, 4, 4, True, True), C(32, 256, 4, 3, True),
    ]),
}


def gpu_seconds(step, replays: int = 20) -> float:
    """GPU seconds per call of ``step`` replayed from a CUDA graph (median of 7 timings)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[3] / replays


def measure(dtype: torch.dtype, rows: int, layers: int, configs) -> dict:
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).cuda()

    weights = [(1 + rand(HIDDEN, scale=0.1), rand(2 * INNER, HIDDEN, scale=0.03),
                rand(HIDDEN, INNER, scale=0.02)) for _ in range(layers)]
    x, residual = rand(rows, HIDDEN), rand(rows, HIDDEN)

    def chain(gate_up_act):
        h, res = x, residual
        for norm_w, w_gu, w_down in weights:
            normed, res = add_rms_norm(h, res, norm_w, EPS)
            h = lin.linear(gate_up_act(normed, w_gu), w_down, defer=True)
        return add_rms_norm(h, res, weights[0][0], EPS)[0]

    def separate(normed, w_gu, cfg=None):  # the table's config, unless given
        return silu_mul(lin.linear_triton(normed, w_gu, config=cfg, defer=True))

    out = {"separate": {"us": gpu_seconds(lambda: chain(separate)) * 1e6}}
    for cfg in configs:
        def glu(normed, w_gu, cfg=cfg):
            return lin.linear_swiglu_triton(normed, w_gu, config=cfg)
        name = "glu " + "-".join(v if isinstance(v, str) else str(int(v)) for v in cfg)
        try:  # the epilogue keeps the bits of the same config's product + SwiGLU kernel
            same = bool(torch.equal(chain(glu), chain(lambda n, w, cfg=cfg: separate(n, w, cfg))))
            out[name] = {"us": gpu_seconds(lambda glu=glu: chain(glu)) * 1e6, "same_bits": same}
        except Exception as exc:  # noqa: BLE001 - out of resources and the like
            out[name] = {"error": repr(exc)[:200]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name()}
    for name, (dtype, rows, layers, configs) in CASES.items():
        results[name] = measure(dtype, rows, layers, configs)
        base = results[name]["separate"]["us"]
        print(f"{name}: {layers} layer(s), {rows} rows, {str(dtype)[6:]}")
        for variant, row in results[name].items():
            if "us" in row:
                print(f"  {variant:42s} {row['us']:8.1f} us  ({row['us'] - base:+6.1f})"
                      f"{'' if row.get('same_bits', True) else '  BITS DIFFER'}")
            else:
                print(f"  {variant:42s} {row['error']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_swiglu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
