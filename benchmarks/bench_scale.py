"""Llama-3-8B-shaped target (random bf16 weights) and an EAGLE-3-shaped head on one GPU.

    python benchmarks/bench_scale.py [--batches 1 8 64] [--layers 32] [--out DIR]

Measures, in one run on the same GPU:
- the device-to-device copy bandwidth and, from it, the autoregressive bandwidth bound
  (weight bytes / bandwidth) of one decode step;
- the autoregressive decode step (CUDA graphs on) at each batch size, as a share of that bound;
- the same decode step through transformers' modules (``HFTarget(fused=False)``), to show what
  the fused decoder path buys;
- one speculative iteration (EAGLE-3 chain S=3 and tree K=4 S=4 N=16) with one graph per
  iteration, one graph per phase (and graphs off with ``--graphs-off``): time of each phase
  (CUDA events; with one graph per iteration the draft phase replays the whole iteration and
  the other phases only hand out its outputs), and host time per iteration: the wall time the host
  spends issuing the iteration (measured without waiting for the GPU), and the time the GPU
  waits for the host (iteration wall time minus the union of kernel intervals that the profiler
  records over a few iterations, graph-launched kernels included);
- with ``--simulate TAU`` (clearly labelled: the accepted length is forced, as SGLang's and
  vLLM's benchmark modes do): tokens/s of speculation vs the baseline and the efficiency
  η = speedup / τ.

Writes ``scale.json`` under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from phasegraph.bench.common import (
    detach_cupti_after_profiling,
    fill_random_weights,
    forward_weight_bytes,
)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes moved per second by a large device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def llama8b_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )


def build_target(layers: int, fused: bool | None = None):
    from phasegraph.runtime.models.target import HFTarget, build_causal_lm

    model = build_causal_lm(llama8b_config(layers), dtype=torch.bfloat16, device="cuda", init=False)
    fill_random_weights(model)
    return HFTarget(model, feature_mode="eagle3", fused=fused)


def build_eagle3_head(target, draft_vocab: int = 32000):
    from transformers import LlamaConfig

    from phasegraph.runtime.models.eagle3 import Eagle3Draft, Eagle3Head

    t = target.config  # the head's layer has the target's shape (the 8B's, or the 70B's for bench_tp)
    cfg = LlamaConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=1,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        vocab_size=t.vocab_size, rope_theta=500000.0, max_position_embeddings=4096, rms_norm_eps=1e-5,
    )
    cfg.draft_vocab_size = draft_vocab
    cfg.target_hidden_size = t.hidden_size
    with torch.device("cuda"):
        head = Eagle3Head(cfg, target_hidden_size=t.hidden_size, draft_vocab_size=draft_vocab, with_d2t=True,
                          with_t2d=False)
    fill_random_weights(head)
    if getattr(head, "d2t", None) is not None:
        head.d2t.zero_()
    head.to(torch.bfloat16)
    return Eagle3Draft(target, cfg, head)


def time_engine_tokens(engine, prompts, new_tokens, params_cls) -> tuple[float, int, float | None]:
    engine.generate(prompts[:1], params_cls(max_new_tokens=8, ignore_eos=True))  # warm up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params_cls(max_new_tokens=new_tokens, ignore_eos=True))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    lens = [n for o in outs for n in o.stats.accept_lengths]
    return tokens / dt, tokens, (sum(lens) / len(lens) if lens else None)


def decode_step_time(engine, batch: int, context: int = 256, repeats: int = 20, group: int = 5) -> float:
    """GPU time of one graphed decode step at ``batch`` requests of ``context`` tokens: the
    median over ``repeats // group`` runs of ``group`` steps issued back to back behind one
    more (CUDA events around each run, divided by ``group``). The host issues a step while the GPU
    runs the one before (~6 ms on the 8B shape), so the runs measure the GPU's own time per step,
    gaps between its kernels included, and not how long the host took to reach the first
    launch (events around single steps did: 5.77-6.18 ms for the same code, 2026-11-24)."""
    from phasegraph import SamplingParams

    vocab = engine.target.vocab_size
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", torch.randint(0, vocab, (context,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=2 * repeats + 8, ignore_eos=True))
    engine.step()  # prefill + first decode (captures the bucket's graph)
    engine.step()
    engine.scheduler.drain()  # host == device before driving the machine by hand
    for r in engine.scheduler.running:  # the pages the timed steps below write
        engine.kv.ensure_capacity(r.row, r.seq_len + repeats + repeats // group + 2)
    m = engine.scheduler.machine
    times = []
    for _ in range(max(1, repeats // group)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        m.advance("decode", engine.ctx)  # queued first, so the run starts behind it, not the host
        a.record()
        for _ in range(group):
            m.advance("decode", engine.ctx)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1000 / group)
    for i in range(batch):
        engine.abort(f"d{batch}-{i}")
    engine.step()
    return statistics.median(times)


SPEC_PHASES = ("draft", "verify", "finalize-tree-path", "draft-extend")


def device_events(events):
    """The device activities (kernels, copies) among profiler ``events``."""
    from torch.autograd import DeviceType

    return (e for e in events if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)


def device_spans(prof) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every device activity of a profiler trace, by start."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in device_events(prof.events()))


def idle_gaps(spans: list[tuple[float, float, str]]) -> list[tuple[float, str, str]]:
    """(idle µs, activity before, activity after) for every stretch of the device trace where
    no activity runs: where, between which two launches, the GPU waits."""
    gaps, last_end, last_name = [], None, ""
    for a, b, name in spans:
        if last_end is not None and a > last_end:
            gaps.append((a - last_end, last_name, name))
        if last_end is None or b >= last_end:
            last_end, last_name = b, name
    return gaps


def gpu_busy_seconds(run, iterations: int, gaps: list | None = None) -> tuple[float, int]:
    """GPU busy time per call of ``run`` (union of kernel and copy intervals in a profiler
    trace over ``iterations`` calls; CUDA-graph replays are recorded kernel by kernel), and
    the number of device activities per call. ``gaps``, if given, receives the trace's
    :func:`idle_gaps`."""
    from torch.profiler import ProfilerActivity, profile

    detach_cupti_after_profiling()  # else every launch after this session costs the host more
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            run()
        torch.cuda.synchronize()
    spans = device_spans(prof)
    if not spans:
        return 0.0, 0
    idle = idle_gaps(spans)
    if gaps is not None:
        gaps.extend(idle)
    busy = (max(b for _, b, _ in spans) - spans[0][0]) - sum(g for g, _, _ in idle)
    return busy * 1e-6 / iterations, len(spans) // iterations


def spec_iteration_times(engine, batch: int, context: int = 256, repeats: int = 10) -> dict:
    """Per-phase GPU time (CUDA events, synchronised around each phase) and host time per
    iteration (wall time to issue the four phases without waiting for the GPU, plus the one
    host synchronisation the scheduler makes) of one speculative iteration."""
    from phasegraph import SamplingParams

    vocab = engine.target.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = [f"s{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(0, vocab, (context,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=4 * repeats + 64, ignore_eos=True))
    engine.step()
    engine.step()
    engine.scheduler.drain()  # host == device before driving the machine by hand
    for r in engine.scheduler.running:  # the pages the timed iterations below write
        engine.kv.ensure_capacity(r.row, r.seq_len + 2 * repeats * engine.tokens_per_iteration + 8)
    m = engine.scheduler.machine
    ctx = engine.ctx
    phase_times: dict[str, list[float]] = {p: [] for p in SPEC_PHASES}
    host, total = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        for p in SPEC_PHASES:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            m.advance(p, ctx)
            b.record()
            torch.cuda.synchronize()
            phase_times[p].append(a.elapsed_time(b) / 1000)
        torch.cuda.synchronize()
        start = time.perf_counter()
        path = None
        for p in SPEC_PHASES:
            out = m.advance(p, ctx)
            if p == "finalize-tree-path":
                path = out
        issued = time.perf_counter()
        path.accept_lens.tolist()  # the one host synchronisation of an iteration
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append(issued - start)
        total.append(done - start)
        del out

    def one_iteration():
        path = None
        for p in SPEC_PHASES:
            out = m.advance(p, ctx)
            if p == "finalize-tree-path":
                path = out
        path.accept_lens.tolist()

    busy, activities = gpu_busy_seconds(one_iteration, 5)
    for rid in ids:
        engine.abort(rid)
    engine.step()
    med = {p: statistics.median(v) for p, v in phase_times.items()}
    wall = statistics.median(total)
    return {"batch": batch, "phase_s": med, "iteration_s": wall,
            "host_issue_s": statistics.median(host),
            "host_share": statistics.median(host) / wall,
            "gpu_busy_s": busy, "gpu_waits_s": max(wall - busy, 0.0),
            "gpu_wait_share": max(wall - busy, 0.0) / wall, "device_activities": activities}


def scheduler_step_times(engine, batch: int, overlap: bool, context: int = 256, steps: int = 20) -> dict:
    """Steady-state wall time of one ``Engine.step()`` (one iteration, scheduler included) with
    overlap scheduling on or off, and the share of it the GPU spends waiting for the host
    (wall minus the union of device activity over 5 steps, from a profiler trace)."""
    from phasegraph import SamplingParams

    sched = engine.scheduler
    sched.drain()
    sched.overlap = overlap
    vocab = engine.target.vocab_size
    g = torch.Generator().manual_seed(2)
    ids = [f"o{int(overlap)}-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(0, vocab, (context,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=8 * (2 * steps + 16), ignore_eos=True))
    for _ in range(4):  # prefill, warm-up and capture of this bucket
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    busy, _ = gpu_busy_seconds(engine.step, 5)
    for rid in ids:
        engine.abort(rid)
    engine.step()  # reports the aborts (and collects the iteration in flight)
    sched.drain()
    sched.overlap = engine.overlap
    return {"batch": batch, "overlap": overlap, "step_s": wall, "gpu_busy_s": busy,
            "gpu_waits_s": max(wall - busy, 0.0), "gpu_wait_share": max(wall - busy, 0.0) / wall}


def print_scheduler_rows(name: str, engine, batches, rows: list) -> None:
    for b in batches:
        for overlap in (False, True):
            r = scheduler_step_times(engine, b, overlap)
            r["config"] = name
            rows.append(r)
            print(f"  {name:<18} scheduler step, overlap {'on ' if overlap else 'off'}, batch {b:>3}: "
                  f"{1e3 * r['step_s']:7.2f} ms/step, GPU waits {1e3 * r['gpu_waits_s']:5.2f} ms "
                  f"({100 * r['gpu_wait_share']:4.1f}%)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default="out")
    ap.add_argument("--compare-modules", action="store_true",
                    help="also time the decode step through transformers' modules (fused=False)")
    ap.add_argument("--skip-spec", action="store_true", help="only the autoregressive rows")
    ap.add_argument("--graphs-off", action="store_true", help="also time iterations with graphs off")
    ap.add_argument("--scopes", nargs="+", default=["iteration", "phase"], choices=["iteration", "phase"],
                    help="graph scopes to time (one graph per iteration, or per phase)")
    ap.add_argument("--scheduler", action="store_true",
                    help="also time whole Engine.step() calls with overlap scheduling on and off")
    args = ap.parse_args(argv)
    from phasegraph import SpecConfig
    from phasegraph.runtime.engine import Engine

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    bw = copy_bandwidth()
    target = build_target(args.layers)
    wbytes = forward_weight_bytes(target.model)  # all but the input embedding table
    result.update(copy_bandwidth_Bps=bw, weight_bytes=wbytes, bound_s=wbytes / bw)
    print(f"GPU {result['gpu']}: copy {bw / 1e12:.2f} TB/s; target weights {wbytes / 1e9:.2f} GB; "
          f"bandwidth bound {1e3 * wbytes / bw:.2f} ms/step", flush=True)
    ar = Engine(target, spec=SpecConfig(method="none"), max_batch_size=max(args.batches),
                kv_pool_tokens=max(args.batches) * 1024, max_context=2048, cuda_graphs=True, trace=False)
    rows = []
    for b in args.batches:
        t = decode_step_time(ar, b)
        rows.append({"batch": b, "decode_step_s": t, "share_of_bound": (wbytes / bw) / t})
        print(f"  AR decode, batch {b:>3}: {1e3 * t:7.2f} ms/step = {100 * (wbytes / bw) / t:5.1f}% of the bandwidth bound", flush=True)
    if args.scheduler:
        sched_rows: list = []
        print_scheduler_rows("AR decode", ar, args.batches, sched_rows)
        result["scheduler_steps"] = sched_rows
    del ar
    torch.cuda.empty_cache()
    if args.compare_modules:  # the same weights through transformers' modules
        from phasegraph.runtime.models.target import HFTarget

        modules = HFTarget(target.model, feature_mode="eagle3", fused=False)
        ar = Engine(modules, spec=SpecConfig(method="none"), max_batch_size=max(args.batches),
                    kv_pool_tokens=max(args.batches) * 1024, max_context=2048, cuda_graphs=True, trace=False)
        for row in rows:
            t = decode_step_time(ar, row["batch"])
            row.update(modules_decode_step_s=t, modules_share_of_bound=(wbytes / bw) / t)
            print(f"  AR decode through transformers' modules, batch {row['batch']:>3}: {1e3 * t:7.2f} ms/step "
                  f"= {100 * (wbytes / bw) / t:5.1f}% of the bound", flush=True)
        del ar, modules
        torch.cuda.empty_cache()
    result["autoregressive"] = rows
    (out / "scale.json").write_text(json.dumps(result, indent=2))
    if args.skip_spec:
        return 0
    draft = build_eagle3_head(target)
    spec_rows = []
    for name, spec in (("chain S=3", SpecConfig(method="eagle3", num_steps=3, topk=1, adaptive=False)),
                       ("tree K=4 S=4 N=16", SpecConfig(method="eagle3", num_steps=4, topk=4, num_draft_tokens=16, adaptive=False))):
        modes = [(True, scope) for scope in args.scopes] + ([(False, "phase")] if args.graphs_off else [])
        for graphs, scope in modes:
            eng = Engine(target, draft, spec=spec, max_batch_size=max(args.batches),
                         kv_pool_tokens=max(args.batches) * 1536, max_context=2048, cuda_graphs=graphs, trace=False,
                         graph_scope=scope)
            if args.scheduler and graphs and scope == "iteration":
                print_scheduler_rows(name, eng, args.batches, result.setdefault("scheduler_steps", []))
            for b in args.batches:
                r = spec_iteration_times(eng, b)
                r.update(config=name, graphs=graphs, graph_scope=scope if graphs else None)
                spec_rows.append(r)
                phases = " ".join(f"{p}={1e3 * t:.2f}" for p, t in r["phase_s"].items())
                label = f"graphs={scope}" if graphs else "graphs=off"
                print(f"  {name:<18} {label:<16} batch {b:>3}: iteration "
                      f"{1e3 * r['iteration_s']:7.2f} ms, host issue {1e3 * r['host_issue_s']:6.2f} ms "
                      f"({100 * r['host_share']:4.1f}%), GPU waits {1e3 * r['gpu_waits_s']:5.2f} ms "
                      f"({100 * r['gpu_wait_share']:4.1f}%, {r['device_activities']} activities); "
                      f"phases ms: {phases}", flush=True)
            del eng
            torch.cuda.empty_cache()
    result["speculative_iteration"] = spec_rows
    (out / "scale.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
