"""Where the time of a graphed decode step and of a speculative iteration goes (8B shape, GPU).

    python benchmarks/profile_step.py [--layers 32] [--out DIR]

Kernel time per step grouped by kernel name (profiler trace over a few graphed steps), the
step's wall time, and the achieved bandwidth of each weight product of a Llama-3-8B layer at
batch 1 (rotating weight copies, so L2 does not serve them). Prints tables; writes
``profile.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_scale  # noqa: E402

from phasegraph.bench.common import detach_cupti_after_profiling  # noqa: E402


def _short(name: str) -> str:
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:70]


def kernel_table(run, steps: int = 5) -> tuple[list[tuple[str, float, int]], float]:
    """[(kernel, µs per step, launches per step)] sorted by time, and busy µs per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    busy = 0.0
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        dur = e.time_range.end - e.time_range.start
        total[_short(e.name)] += dur
        count[_short(e.name)] += 1
        busy += dur
    rows = sorted(((k, v / steps, count[k] // steps) for k, v in total.items()), key=lambda r: -r[1])
    return rows, busy / steps


def gemv_bandwidth(out_features: int, in_features: int, batch: int = 1) -> float:
    """Bytes/s of ``F.linear`` at ``batch`` rows, bf16, over rotating weight copies."""
    import triton.testing

    copies = max(2, int(4e8 // (out_features * in_features * 2)))
    weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16)
    i = [0]

    def f():
        i[0] = (i[0] + 1) % copies
        torch.nn.functional.linear(x, weights[i[0]])

    ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
    return out_features * in_features * 2 / (ms * 1e-3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default="out")
    ap.add_argument("--iteration-only", action="store_true", help="skip the products and the decode step")
    args = ap.parse_args(argv)
    detach_cupti_after_profiling()  # the profiler's sessions leave no cost on later launches

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"gpu": torch.cuda.get_device_name()}
    bw = bench_scale.copy_bandwidth()
    result["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096), "eagle3 fc": (4096, 12288), "draft lm_head 32k": (32000, 4096)}
    result["gemv"] = {}
    for name, (n, k) in ({} if args.iteration_only else shapes).items():
        for b in (1, 8):
            got = gemv_bandwidth(n, k, b)
            result["gemv"][f"{name} B{b}"] = got
            print(f"  F.linear {name:<18} [{n}x{k}] B={b}: {got / 1e12:5.2f} TB/s = {100 * got / bw:5.1f}% of copy")
    target = bench_scale.build_target(args.layers)
    g = torch.Generator().manual_seed(0)
    if not args.iteration_only:
        _profile_decode(target, g, result)
    _profile_iteration(target, g, result)
    (out / "profile.json").write_text(json.dumps(result, indent=1))
    return 0


def _profile_decode(target, g, result) -> None:
    from phasegraph import SamplingParams, SpecConfig
    from phasegraph.runtime.engine import Engine

    vocab = target.vocab_size
    eng = Engine(target, spec=SpecConfig(method="none"), max_batch_size=8, kv_pool_tokens=8192,
                 max_context=2048, cuda_graphs=True, trace=False)
    eng.add_request("p", torch.randint(0, vocab, (256,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=200, ignore_eos=True))
    eng.step()
    eng.step()
    m = eng.scheduler.machine
    for r in eng.scheduler.running:
        eng.kv.ensure_capacity(r.row, r.seq_len + 64)
    ctx = eng.ctx
    rows, busy = kernel_table(lambda: m.advance("decode", ctx))
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        m.advance("decode", eng.ctx)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    step = statistics.median(times)
    print(f"\ndecode step B1 (graphed): {step:.0f} µs; kernels busy {busy:.0f} µs; gaps {step - busy:.0f} µs")
    for k, us, n in rows[:25]:
        print(f"  {us:8.1f} µs  {n:4d}x  {k}")
    result["decode"] = {"step_us": step, "busy_us": busy, "kernels": rows}
    eng.abort("p")
    eng.step()
    del eng
    torch.cuda.empty_cache()


def _profile_iteration(target, g, result) -> None:
    import cProfile
    import io
    import pstats

    from phasegraph import SamplingParams, SpecConfig
    from phasegraph.runtime.engine import Engine

    vocab = target.vocab_size
    draft = bench_scale.build_eagle3_head(target)
    spec = SpecConfig(method="eagle3", num_steps=3, topk=1, adaptive=False)
    eng = Engine(target, draft, spec=spec, max_batch_size=8, kv_pool_tokens=8192, max_context=2048,
                 cuda_graphs=True, trace=False)
    eng.add_request("q", torch.randint(0, vocab, (256,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=400, ignore_eos=True))
    eng.step()
    eng.step()
    m = eng.scheduler.machine
    for r in eng.scheduler.running:
        eng.kv.ensure_capacity(r.row, r.seq_len + 160)
    rows, busy = kernel_table(lambda: _iteration(m, eng.ctx), steps=5)
    print(f"\nchain S=3 iteration B1: kernels busy {busy:.0f} µs")
    for k, us, n in rows[:30]:
        print(f"  {us:8.1f} µs  {n:4d}x  {k}")
    result["chain_iteration"] = {"busy_us": busy, "kernels": rows}
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        _iteration(m, eng.ctx)
        torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    print("\nhost profile of 20 iterations (sorted by own time):")
    print("\n".join(line for line in text.getvalue().splitlines()[6:50] if line.strip()))


def _iteration(m, ctx):
    for p in bench_scale.SPEC_PHASES:
        m.advance(p, ctx)


if __name__ == "__main__":
    sys.exit(main())
