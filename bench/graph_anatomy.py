"""What a captured CUDA graph holds, what its launch costs the host, and what it costs the GPU.

    python bench/graph_anatomy.py --out DIR [--configs baseline tree] [--synthetic] [--generate]

Profiled breakdowns (``profile_pair_host.py --generate``) put one ``CUDAGraph.replay`` of the tree
iteration's graph at 0.10-0.17 ms of host time. This script measures without the profiler:

- **the engine's own graphs**: the bench pair's shapes with random weights (the bfloat16 head of
  ``profile_pair_host.build_pair``), SIMULATED acceptance, one request driven to a steady state.
  Every graph the engine captured (per phase, or the whole iteration) is listed by its nodes
  (read through the CUDA driver API; kernels by function name) and dumped as DOT
  (``cuGraphDebugDotPrint``). Its replay is timed on the host (the call alone, median of
  ``--repeats``, with the stream idle, behind a 0.5 ms sleep kernel, or behind the same graph)
  and on the GPU (50 back-to-back replays between two events: first kernel to last, the gaps
  between kernels included);
- ``--synthetic``: graphs of 250 tiny kernels plus ``m`` nodes of one kind (device-to-device
  memcpy, memset, a Triton kernel launched plainly or with programmatic dependent launch, a
  torch elementwise op), to see whether any kind of node makes a launch dear;
- ``--generate``: unprofiled ``generate`` calls at batch 1 as part 1 of the bench times them,
  with the bench's settings (trace, default checks, text) and bare: wall time per iteration and
  the host's wait for the device within it (near zero: the host is the bound).

Writes ``graph_anatomy.json``, ``graph_anatomy.txt`` and the ``.dot`` files under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from phasegraph.kernels._dispatch import jit, pdl_enter, tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_launch  # noqa: E402


@jit
def _bump(x_ptr, PDL: tl.constexpr):
    """One program adds 1 to one float: the smallest Triton node."""
    pdl_enter(PDL)
    tl.store(x_ptr + tl.program_id(0), tl.load(x_ptr + tl.program_id(0)) + 1.0)


_CAPTURED: list[tuple[str, torch.cuda.CUDAGraph]] = []  # (site, graph) in capture order


class _DebugGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph that keeps its ``cudaGraph_t`` (for :func:`node_kinds`) and registers itself."""

    def __new__(cls, keep_graph: bool = False):
        graph = super().__new__(cls, True)  # node_kinds reads the kept cudaGraph_t
        frame = sys._getframe(1)
        spec = getattr(frame.f_locals.get("self"), "spec", None)  # a GraphedPhase names its phase
        where = spec.name if spec is not None else "whole iteration" if "iteration" in frame.f_code.co_filename else "?"
        _CAPTURED.append((f"{where} ({Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name})", graph))
        return graph

    def __init__(self, keep_graph: bool = False):
        super().__init__(True)


def replay_gpu_us(graph: torch.cuda.CUDAGraph, replays: int = 50) -> float:
    """GPU wall time of one replay (first kernel to last, the gaps inside the graph included):
    ``replays`` back-to-back replays between two events, divided."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / replays


def generate_wait(engine, calls: int = 3, prompt_tokens: int = 128, new_tokens: int = 256) -> dict:
    """Unprofiled ``generate`` calls at batch 1 as part 1 of the bench times them: wall time per
    iteration, the host's wait for the device inside it (the scheduler's one sync per
    iteration, ``Event.synchronize``; near zero: the host is the bound), and the host time of a
    few calls inside the loop (the graph replays among them), each per iteration."""
    import profile_pair_host as pph

    from phasegraph.runtime.iteration_graph import IterationGraph
    from phasegraph.runtime.scheduler import Scheduler
    from phasegraph.statemachine.machine import Machine

    timed = {"Event.synchronize (the wait)": (torch.cuda.Event, "synchronize"),
             "CUDAGraph.replay": (torch.cuda.CUDAGraph, "replay"),
             "Scheduler._issue": (Scheduler, "_issue"),
             "Scheduler._collect": (Scheduler, "_collect"),
             "Machine.advance": (Machine, "advance"),
             "IterationGraph._draft (copy in, replay, copy out)": (IterationGraph, "_draft")}
    seconds = dict.fromkeys(timed, 0.0)
    counts = dict.fromkeys(timed, 0)
    one_call = pph.generate_call(engine, 1, prompt_tokens, new_tokens)
    for _ in range(2):
        one_call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        outs = one_call()
    torch.cuda.synchronize()
    bare_wall = time.perf_counter() - start
    with pph.wrapped_methods(timed, pph.method_timer(seconds, counts), lambda ready: ready):
        start = time.perf_counter()
        for _ in range(calls):
            one_call()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    iterations = calls * (len(outs[0].stats.accept_lengths) or len(outs[0].token_ids))
    return {"iteration_ms": 1e3 * bare_wall / iterations, "timed_iteration_ms": 1e3 * wall / iterations,
            "iterations": iterations,
            "host_ms_per_iteration": {k: 1e3 * v / iterations for k, v in seconds.items()},
            "calls_per_iteration": {k: v / iterations for k, v in counts.items()}}


def node_kinds(graph: torch.cuda.CUDAGraph, dot_path: Path | None = None) -> collections.Counter:
    """The nodes of a captured graph (kept: ``keep_graph=True``) by kind, kernels by function
    name, read through the CUDA driver API (``cuda.bindings``); a DOT dump beside, if asked."""
    from cuda.bindings import driver as cu

    def ok(answer):
        err, *rest = answer
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    ok((cu.cuInit(0)[0], None))
    handle = cu.CUgraph(init_value=graph.raw_cuda_graph())
    if dot_path is not None:
        ok((cu.cuGraphDebugDotPrint(handle, str(dot_path).encode(), 1)[0], None))  # verbose
    nodes, count = ok(cu.cuGraphGetNodes(handle, numNodes=0))
    nodes, count = ok(cu.cuGraphGetNodes(handle, numNodes=count))
    kinds: collections.Counter = collections.Counter()
    for node in nodes:
        kind = ok(cu.cuGraphNodeGetType(node))
        if kind == cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            params = ok(cu.cuGraphKernelNodeGetParams(node))
            name = ok(cu.cuFuncGetName(params.func))
            name = name.decode() if isinstance(name, bytes) else str(name)
            kinds[f"kernel {name[:70]}"] += 1
        else:
            kinds[str(kind).rsplit(".", 1)[-1]] += 1
    return kinds


def _engine(config: str, **kw):
    """The bench pair's shapes, random weights, the bfloat16 head; SIMULATED acceptance
    (``profile_pair_host.simulated_configs``)."""
    import profile_pair_host as pph

    from phasegraph.runtime.engine import Engine

    target, head = pph.build_pair(torch.float32, draft_dtype=torch.bfloat16)
    _, target, draft, spec, tau = pph.simulated_configs(target, head)[config]
    return Engine(target, draft, spec=spec, max_batch_size=1, kv_pool_tokens=4096, max_context=1024,
                  simulate_accept_length=tau, **kw)


def engine_graphs(config: str, repeats: int, out: Path) -> list[dict]:
    """Drive the bench pair's engine for ``config`` to a steady state; dump and time its graphs."""
    import profile_pair_host as pph

    engine = _engine(config, cuda_graphs=True, trace=False, validate="off")
    first = len(_CAPTURED)
    with pph.steady_batch(engine, 1, config, 5, 40):
        pph.run_steps(engine, 20)
        rows = []
        for i, (site, graph) in enumerate(_CAPTURED[first:]):
            path = out / f"{config}-{i}-{re.sub(r'[^A-Za-z0-9]+', '-', site).strip('-')}.dot"
            kinds = node_kinds(graph, path)
            rows.append({"config": config, "site": site, "dot": path.name, "nodes": sum(kinds.values()),
                         "kinds": dict(kinds.most_common()), "replay_host_us": graph_launch.replay_costs(graph, repeats),
                         "replay_gpu_us": replay_gpu_us(graph)})
    del engine
    torch.cuda.empty_cache()
    return rows


def after_profiler_rows(config: str, sessions: int = 2) -> list[dict]:
    """:func:`generate_wait` with the bench's settings on one engine, before and after each of
    ``sessions`` ``torch.profiler`` sessions (CUDA activities) over one more call in the same
    process, as part 1 of the bench measures a row's GPU busy time after timing it: whether the
    profiler leaves later launches dearer (Kineto keeps CUPTI attached unless ``TEARDOWN_CUPTI=1``)."""
    import profile_pair_host as pph
    from torch.profiler import ProfilerActivity, profile

    from phasegraph import SamplingParams

    engine = _engine(config, cuda_graphs=True, prefill_graphs=True, trace=True, tokenizer=pph._ModuloTokenizer())
    rows = [{"config": config, "settings": "bench settings, before any profiler", **generate_wait(engine)}]
    prompts = [list(range(1, 129))]
    for session in range(sessions):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            engine.generate(prompts, SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True))
            torch.cuda.synchronize()
        rows.append({"config": config, "settings": f"the same engine after profiler session {session + 1}",
                     **generate_wait(engine)})
    return rows


def generate_rows(config: str) -> list[dict]:
    """:func:`generate_wait` for ``config`` with the bench's settings and with everything off."""
    import profile_pair_host as pph

    rows = []
    for label, kw in {"bench (trace, default checks, text)": dict(trace=True, tokenizer=pph._ModuloTokenizer()),
                      "bare (no trace, checks off, no text)": dict(trace=False, validate="off")}.items():
        engine = _engine(config, cuda_graphs=True, prefill_graphs=True, **kw)
        rows.append({"config": config, "settings": label, **generate_wait(engine)})
        del engine
        torch.cuda.empty_cache()
    return rows


def synthetic(repeats: int, base: int = 250, extras: tuple[int, ...] = (0, 16, 64)) -> list[dict]:
    """Host time of a replay of ``base`` tiny kernels plus ``m`` nodes of one kind."""
    from phasegraph.kernels._dispatch import pdl_options

    x = torch.zeros(4096, device="cuda")
    y = torch.ones(4096, device="cuda")
    kinds = {
        "memcpy d2d (Tensor.copy_ of a contiguous slice)": lambda: x[:1000].copy_(y[:1000]),
        "memset (Tensor.zero_)": lambda: y[2048:].zero_(),
        "triton kernel, plain launch": lambda: _bump[(1,)](x, PDL=False),
        "triton kernel, PDL launch": lambda: _bump[(1,)](x, **pdl_options(early=True)),
        "torch elementwise (add_)": lambda: x.add_(1.0),
    }
    rows = []
    for kind, op in kinds.items():
        for m in extras:
            def build(op=op, m=m):
                for _ in range(base):
                    x.add_(1.0)
                for _ in range(m):
                    op()
            rows.append({"kind": kind, "base_kernels": base, "extra_nodes": m,
                         "replay_host_us": graph_launch.replay_costs(graph_launch.capture(build), repeats)})
            print(f"  {base} kernels + {m:3d} x {kind}: {_costs(rows[-1]['replay_host_us'])}", flush=True)
    return rows


def _costs(by_state: dict[str, float]) -> str:
    return ", ".join(f"{state} {us:.1f} us" for state, us in by_state.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", nargs="*", default=["baseline", "tree"], choices=["baseline", "chain", "tree"])
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--generate", action="store_true", help="also unprofiled generate calls: the host's wait")
    ap.add_argument("--after-profiler", action="store_true",
                    help="also generate calls on one engine before and after a torch.profiler session")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--teardown-cupti", action="store_true", help="run with TEARDOWN_CUPTI=1 (Kineto then "
                    "detaches CUPTI when a profiler session ends)")
    args = ap.parse_args(argv)
    if args.teardown_cupti:
        os.environ["TEARDOWN_CUPTI"] = "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from phasegraph.bench.common import host_launch_seconds

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "TEARDOWN_CUPTI": os.environ.get("TEARDOWN_CUPTI"),
              "host_us_per_tiny_op": 1e6 * host_launch_seconds("cuda"), "graphs": [], "synthetic": [], "generate": []}
    lines = [f"host: {result['host_us_per_tiny_op']:.2f} us to issue one tiny op"]
    print(lines[0], flush=True)
    torch.cuda.CUDAGraph = _DebugGraph  # every capture from here on keeps its graph for the dump
    try:
        for config in args.configs:
            for row in engine_graphs(config, args.repeats, out):
                result["graphs"].append(row)
                lines.append(f"{row['config']:<9} {row['site']:<48} {row['nodes']:4d} nodes, replay on the GPU "
                             f"{row['replay_gpu_us']:.1f} us, host {_costs(row['replay_host_us'])} ({row['dot']})")
                lines += [f"    {n:4d}  {k}" for k, n in row["kinds"].items()]
                print("\n".join(lines[-1 - len(row["kinds"]):]), flush=True)
    finally:
        torch.cuda.CUDAGraph = _DebugGraph.__mro__[1]
    if args.generate or args.after_profiler:
        for config in args.configs:
            rows = (generate_rows(config) if args.generate else []) + \
                (after_profiler_rows(config) if args.after_profiler else [])
            for row in rows:
                result["generate"].append(row)
                lines.append(f"generate {config:<9} {row['settings']:<38} {row['iteration_ms']:.3f} ms per "
                             f"iteration ({row['timed_iteration_ms']:.3f} with the timers):")
                lines += [f"    {ms:.3f} ms  {row['calls_per_iteration'][k]:5.2f}x  {k}"
                          for k, ms in row["host_ms_per_iteration"].items()]
                print("\n".join(lines[-1 - len(row["host_ms_per_iteration"]):]), flush=True)
    if args.synthetic:
        result["synthetic"] = synthetic(args.repeats)
        lines += [f"{r['base_kernels']} kernels + {r['extra_nodes']:3d} x {r['kind']}: {_costs(r['replay_host_us'])}"
                  for r in result["synthetic"]]
    (out / "graph_anatomy.json").write_text(json.dumps(result, indent=2))
    (out / "graph_anatomy.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
