"""Host and GPU timeline of ``generate`` calls on the bench pair's shape: who waits for whom.

    python bench/timeline_pair.py --out DIR [--configs baseline chain tree] [--prompt-tokens 217]

``profile_pair_host.py --generate`` adds up where the host's time goes; it cannot say whether
the GPU waited for the host at a given moment or the other way round. This script profiles one
whole ``generate`` call per configuration (the slowest per iteration of ``--calls`` prompts
timed as part 1 of the bench times them) (random weights with the ``bench-pair`` preset's
shapes, SIMULATED acceptance, trace and default checks on, overlap scheduling as the engine has
it) with the scheduler's and the iteration graph's pieces marked as profiler ranges, and writes:

- ``timeline-<config>.json``: the call's host ranges, runtime calls and device activities
  (kernels, copies), compact, for analysis off the GPU machine (:func:`analyse` reads it);
- ``timeline.txt``: per configuration, the steady-state iteration (median over the call) as the
  host saw it (when each piece started and how long it took) and as the GPU ran it (when the
  iteration's graph started and ended, relative to its launch), and the GPU's idle time split
  by what the host was doing when the GPU ran out of work.

The ranges cost the host a few microseconds each; the unprofiled wall time per iteration is
printed beside the profiled one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_pair_host import _ModuloTokenizer, build_pair, wrapped_methods  # noqa: E402

from phasegraph.bench.common import detach_cupti_after_profiling, sync  # noqa: E402

MARK = "tl::"  # prefix of this script's profiler ranges
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _marked_methods():
    """``label -> (owner, attribute)`` of the methods wrapped in profiler ranges."""
    from phasegraph.runtime import iteration_graph
    from phasegraph.runtime.cuda_graphs import GraphedPhase, InputCopier, OutputCopier
    from phasegraph.runtime.engine import Engine
    from phasegraph.runtime.scheduler import PinnedBuffers, Scheduler
    from phasegraph.statemachine.machine import Machine

    return {
        "step": (Engine, "_step_scheduler"),
        "admit": (Scheduler, "_admit"),
        "filter": (Scheduler, "_filter_finished"),
        "reserve": (Scheduler, "_reserve_pages"),
        "issue": (Scheduler, "_issue"),
        "collect": (Scheduler, "_collect"),
        "drain": (Scheduler, "drain"),
        "advance": (Machine, "advance"),
        "copy_in": (InputCopier, "__call__"),
        "copy_out": (OutputCopier, "__call__"),
        "replay": (torch.cuda.CUDAGraph, "replay"),
        "phase_graph": (GraphedPhase, "__call__"),
        "pinned_copy": (PinnedBuffers, "copy"),
        "iteration_draft": (iteration_graph.IterationGraph, "_draft"),
    }


def marked(methods: dict[str, tuple[type, str]]):
    """Wrap each method in a profiler range ``tl::<label>`` (``advance`` also names the phase),
    and the wait of ``Scheduler._collect`` in ``tl::wait``; restores them on exit."""
    record = torch.autograd.profiler.record_function

    def wrap(label, fn):
        def marked_fn(*args, **kwargs):
            name = MARK + label
            if label == "advance" and len(args) > 1:
                name += ":" + str(args[1])
            with record(name):
                return fn(*args, **kwargs)
        return marked_fn

    class _Wait:
        def __init__(self, event):
            self.event = event

        def synchronize(self):
            with record(MARK + "wait"):
                self.event.synchronize()

    return wrapped_methods(methods, wrap, _Wait)


def compact_trace(path: Path) -> dict:
    """The chrome trace at ``path`` reduced to ``{"host": [[name, ts, dur]], "runtime": [[name,
    ts, dur, correlation]], "device": [[name, ts, dur, correlation]]}`` (µs), each sorted by
    start."""
    raw = json.loads(path.read_text())
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    host, runtime, device = [], [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        corr = (e.get("args") or {}).get("correlation")
        if cat == "user_annotation" and name.startswith(MARK):
            host.append([name[len(MARK):], ts, dur])
        elif cat in ("cuda_runtime", "cuda_driver"):
            runtime.append([name, ts, dur, corr])
        elif cat in DEVICE_CATS:
            device.append([name[:80], ts, dur, corr])
    for xs in (host, runtime, device):
        xs.sort(key=lambda x: x[1])
    return {"host": host, "runtime": runtime, "device": device}


def _innermost(host: list, t: float) -> str:
    """The innermost host range open at time ``t`` (``-`` where none is)."""
    best, best_dur = "-", float("inf")
    for name, ts, dur in host:
        if ts > t:
            break
        if ts + dur >= t and dur < best_dur:
            best, best_dur = name, dur
    return best


def analyse(trace: dict, gap_us: float = 1.0) -> str:
    """The median steady-state iteration of a compact trace and where the GPU idled."""
    host, runtime, device = trace["host"], trace["runtime"], trace["device"]
    steps = [h for h in host if h[0] == "step"]
    lines = []
    if len(steps) < 8:
        return f"only {len(steps)} steps in the trace\n"
    steady = steps[3:-3]  # away from the prefill and the last iterations
    # host: each piece's start offset and duration within its step
    pieces: dict[str, list[tuple[float, float]]] = {}
    for name, ts, dur in host:
        for _, s_ts, s_dur in steady:
            if s_ts <= ts <= s_ts + s_dur:
                pieces.setdefault(name, []).append((ts - s_ts, dur))
                break
    per_step = len(steady)
    walls = [s[2] for s in steady]
    lines.append(f"steady steps: {per_step} (of {len(steps)}), wall per step median {statistics.median(walls):.1f} us, "
                 f"mean {statistics.mean(walls):.1f} us")
    lines.append("host pieces (count per step, median start offset, median duration, total per step, us):")
    order = sorted(pieces.items(), key=lambda kv: statistics.median(o for o, _ in kv[1]))
    for name, xs in order:
        lines.append(f"  {name:<34} {len(xs) / per_step:5.2f}x  at {statistics.median(o for o, _ in xs):7.1f}  "
                     f"{statistics.median(d for _, d in xs):7.1f}  sum {sum(d for _, d in xs) / per_step:7.1f}")
    if not device:
        return "\n".join(lines) + "\n(no device activities: not a GPU run)\n"
    # GPU: the graph launched in each step, its first and last activity
    by_corr: dict = {}
    for _name, ts, dur, corr in device:
        if corr is not None:
            lo, hi = by_corr.get(corr, (ts, ts + dur))
            by_corr[corr] = (min(lo, ts), max(hi, ts + dur))
    launches = [r for r in runtime if "GraphLaunch" in r[0]]
    rows = []
    for _, s_ts, s_dur in steady:
        mine = [r for r in launches if s_ts <= r[1] <= s_ts + s_dur]
        for _name, ts, dur, corr in mine:
            if corr in by_corr:
                g0, g1 = by_corr[corr]
                rows.append((ts - s_ts, dur, g0 - ts, g1 - g0, g1 - s_ts))
    if rows:
        lines.append("graph launches in steady steps (median): launch call at {:.1f} us into the step, takes {:.1f} us; "
                     "GPU starts it {:.1f} us after the call began, runs it {:.1f} us, ends {:.1f} us after the "
                     "step began ({} launches)".format(*(statistics.median(r[i] for r in rows) for i in range(5)), len(rows)))
    # idle stretches of the GPU inside the steady steps, by what the host was doing as it ran dry
    t0, t1 = steady[0][1], steady[-1][1] + steady[-1][2]
    spans = sorted((ts, ts + dur, name, corr) for name, ts, dur, corr in device if t0 <= ts <= t1)
    launch_of = {r[3]: r for r in runtime if r[3] is not None}
    idle_by: dict[str, list[float]] = {}
    idle_after: dict[str, list[float]] = {}
    lag: list[float] = []
    end = spans[0][1] if spans else t0
    for ts, te, name, corr in spans[1:]:
        if ts - end > gap_us:
            idle_by.setdefault(_innermost(host, end), []).append(ts - end)
            idle_after.setdefault(name[:60], []).append(ts - end)
            call = launch_of.get(corr)
            if call is not None:
                lag.append(ts - call[1])
        end = max(end, te)
    total = sum(sum(v) for v in idle_by.values())
    span = t1 - t0
    lines.append(f"GPU idle {total / per_step:.1f} us per step ({100 * total / span:.0f} % of the steady steps)")
    lines.append("  by what the host was doing when the GPU ran out of work (us per step, stretches):")
    for name, xs in sorted(idle_by.items(), key=lambda kv: -sum(kv[1]))[:10]:
        lines.append(f"    {sum(xs) / per_step:7.1f}  {len(xs):5d}  {name}")
    lines.append("  by the device activity after the idle stretch:")
    for name, xs in sorted(idle_after.items(), key=lambda kv: -sum(kv[1]))[:8]:
        lines.append(f"    {sum(xs) / per_step:7.1f}  {len(xs):5d}  {name}")
    if lag:
        lines.append(f"  after an idle stretch the GPU started the next activity a median {statistics.median(lag):.1f} us "
                     f"after the host's call that issued it")
    return "\n".join(lines) + "\n"


def _iterations(engine, outs) -> int:
    """Iterations of one call: speculative iterations, or decode steps."""
    if engine.scheduler.speculative:
        return max(len(o.stats.accept_lengths) for o in outs)
    return max(len(o.token_ids) for o in outs)


def bench_like_calls(engine, calls: list[list], params) -> list[tuple[float, int, int]]:
    """Part 1's batch-1 timing (``warm_then_time``): every call twice, then each timed alone
    between synchronisations with the collector frozen. ``(seconds, iterations, prompt tokens)``
    per timed call."""
    from phasegraph.bench.common import timed_call

    for prompts in calls:
        engine.generate(prompts, params)
        engine.generate(prompts, params)
    rows = []
    for prompts in calls:
        wall, outs, _ = timed_call(engine.device, lambda p=prompts: engine.generate(p, params))
        rows.append((wall, _iterations(engine, outs), len(prompts[0])))
    return rows


def profile_call(engine, prompts, params, out: Path, tag: str) -> dict:
    """The compact trace of one more call of ``prompts`` (warmed up by :func:`bench_like_calls`)
    under the profiler, with this script's ranges."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with marked(_marked_methods()), profile(activities=activities) as prof:
        engine.generate(prompts, params)
        sync(engine.device)
    raw = out / f"trace-{tag}.json"
    prof.export_chrome_trace(str(raw))
    trace = compact_trace(raw)
    raw.unlink()
    return trace


def _random_engines(args, specs):
    """Engines over a random pair with the bench pair's shapes, SIMULATED acceptance, and
    ``--calls`` random prompts of ``--prompt-tokens`` tokens, then 13 fewer each."""
    from phasegraph.runtime.engine import Engine

    target, head = build_pair(torch.float32, args.device, args.set, getattr(torch, args.draft_dtype))
    base_target = type(target)(target.model, feature_mode="none")
    taus = {"baseline": None, "chain": args.tau_chain, "tree": args.tau_tree}

    def make(key):
        tau = taus[key]
        engine = Engine(target if tau else base_target, head if tau else None, spec=specs[key], max_batch_size=1,
                        kv_pool_tokens=2048, max_context=1024, simulate_accept_length=tau,
                        cuda_graphs=args.device == "cuda", prefill_graphs=args.device == "cuda", trace=True,
                        tokenizer=_ModuloTokenizer())
        return engine, tau

    g = torch.Generator().manual_seed(8)
    lengths = [args.prompt_tokens, *(args.prompt_tokens - 13 * k for k in range(1, args.calls))]
    return make, [torch.randint(0, target.vocab_size, (1, n), generator=g).tolist() for n in lengths]


def _pair_engines(pair: Path, args, specs):
    """Engines over a trained pair as part 1 of ``phasegraph bench`` builds them (its pool size,
    checks and graphs), and its first ``--calls`` held-out prompts."""
    from phasegraph import Engine
    from phasegraph.runtime.engine import _load_tokenizer
    from phasegraph.train.corpus import heldout_prompts

    tok = _load_tokenizer(pair / "target")
    texts = [p.text for p in heldout_prompts(max_lines=40, min_lines=8)[: args.calls]]
    prompts = [[tok(t)["input_ids"][-args.prompt_tokens:]] for t in texts]
    kv_tokens = args.prompt_tokens + args.new_tokens + 64 + 1024  # as part 1 sizes its pool

    def make(key):
        spec = specs[key]
        engine = Engine.from_pretrained(
            pair / "target", pair / "eagle3" if spec.speculative else None, spec=spec, device=args.device,
            dtype="float32", draft_dtype=args.draft_dtype, max_batch_size=1, kv_pool_tokens=kv_tokens,
            cuda_graphs=args.device == "cuda", trace=True, prefill_graphs=args.device == "cuda")
        return engine, None

    return make, prompts


def main(argv=None) -> int:
    from phasegraph import SamplingParams, SpecConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--configs", nargs="+", default=["baseline", "chain", "tree"], choices=["baseline", "chain", "tree"])
    ap.add_argument("--prompt-tokens", type=int, default=217,
                    help="random prompt length (the bench's mean); with --pair the held-out prompt's last N tokens")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--calls", type=int, default=3,
                    help="prompts timed one call each, as part 1 of the bench times batch 1 (the slowest is profiled)")
    ap.add_argument("--tau-tree", type=int, default=4, help="SIMULATED accept length of the tree")
    ap.add_argument("--tau-chain", type=int, default=3, help="SIMULATED accept length of the chain")
    ap.add_argument("--draft-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--pair", default=None, metavar="DIR",
                    help="a trained pair (phasegraph bench --pair): load it as part 1 of the bench does, with the "
                         "bench's held-out prompts and real acceptance, instead of random weights")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="preset override, as python -m phasegraph.train --set takes (small shapes for a CPU check)")
    args = ap.parse_args(argv)
    detach_cupti_after_profiling()  # the profiler's sessions leave no cost on later launches
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = {
        "baseline": SpecConfig(method="none"),
        "chain": SpecConfig(method="eagle3", num_steps=3, topk=1),
        "tree": SpecConfig(method="eagle3", num_steps=4, topk=4, num_draft_tokens=16),
    }
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    if args.pair:
        make, prompts = _pair_engines(Path(args.pair), args, specs)
    else:
        make, prompts = _random_engines(args, specs)
    report = [f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
              f"{args.pair or 'random weights'}, {len(prompts[0][0])}-token prompt, {args.new_tokens} new tokens, batch 1"]
    if args.device == "cuda":
        from phasegraph.bench.common import host_launch_seconds

        report.append(f"host: {1e6 * host_launch_seconds('cuda'):.2f} us to issue one tiny op")
    for key in args.configs:
        engine, tau = make(key)
        calls = bench_like_calls(engine, prompts, params)
        per_call = ", ".join(f"{1e3 * w:.1f} ms / {n} it ({1e3 * w / n:.3f} ms/it, {p}-token prompt)" for w, n, p in calls)
        report.append(f"[{key}] bench-like timed calls: {per_call}; all: "
                      f"{1e3 * sum(w for w, _, _ in calls) / sum(n for _, n, _ in calls):.3f} ms per iteration")
        print(report[-1], flush=True)
        slowest = max(range(len(calls)), key=lambda i: calls[i][0] / calls[i][1])
        report.append(f"[{key}] profiled below: call {slowest + 1}, the slowest per iteration")
        wall, iterations, _ = calls[slowest]
        trace = profile_call(engine, prompts[slowest], params, out, key)
        (out / f"timeline-{key}.json").write_text(json.dumps(trace))
        title = f"===== {key} (SIMULATED tau={tau}) =====" if tau else f"===== {key} ====="
        report += [title, f"unprofiled: {1e3 * wall:.2f} ms per call, {iterations} iterations "
                          f"({args.new_tokens / iterations:.2f} tokens each), {1e3 * wall / iterations:.3f} ms per "
                          "iteration", analyse(trace)]
        print("\n".join(report[-3:]), flush=True)
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    (out / "timeline.txt").write_text("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
