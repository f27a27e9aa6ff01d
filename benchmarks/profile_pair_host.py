"""Where a step's wall time goes on the bench pair's shape (96M Llama target, EAGLE-3 head),
with random weights and SIMULATED acceptance, so that it needs no training:

    python benchmarks/profile_pair_host.py [--out DIR] [--dtype float32] [--batches 1 8]

For the baseline (``method="none"``), EAGLE-3 chain S=3 (simulated τ = 4) and tree K=4 S=4
N=16 (simulated τ = 3: random weights keep the tree shallow), at each batch size:
- the steady-state wall time of one ``Engine.step()`` with overlap scheduling off and on, and
  the GPU busy time per step (bench_scale's profiler probe);
- the same with ``trace=False`` and ``validate="off"``: what the trace and the phase checks
  cost the host;
- a cProfile of 50 steps (overlap on) sorted by own time and by cumulative time.

On this shape the GPU work of a step is a fraction of a millisecond, so the step is bound by
the host's Python: this script shows which part. Writes ``pair_host.json`` and
``pair_host_profile.txt`` under ``--out``.

``--generate`` times whole ``generate`` calls instead, as part 1 of ``phasegraph bench`` does
(batch 1, three calls of 256 new tokens, trace, default checks and text on; then all off), and
splits each iteration's wall time into the host's wait for the device, the scheduler's pieces,
the phases and text decoding, beside the GPU busy time (``pair_generate.json``,
``pair_generate_profile.txt``).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402

from phasegraph.bench.common import detach_cupti_after_profiling, sync  # noqa: E402


def build_pair(dtype: torch.dtype, device: str = "cuda", overrides: list[str] | None = None,
               draft_dtype: torch.dtype | None = None):
    """Random target and EAGLE-3 head with the ``bench-pair`` preset's shapes (``overrides``:
    ``section.field=value`` replacements, as ``python -m phasegraph.train --set`` takes); the
    head in ``draft_dtype`` (default: ``dtype``)."""
    from transformers import LlamaConfig

    from phasegraph.bench.common import fill_random_weights
    from phasegraph.runtime.models.attention_backend import ATTN_IMPLEMENTATION
    from phasegraph.runtime.models.eagle3 import Eagle3Draft, Eagle3Head
    from phasegraph.runtime.models.target import HFTarget, build_causal_lm
    from phasegraph.train.presets import PRESETS, apply_overrides, head_dims

    preset = apply_overrides(PRESETS["bench-pair"], overrides or [])
    t, h = preset.target, preset.head
    head_heads, head_kv_heads, _ = head_dims(h, t)  # the trained head's attention shape
    cfg = LlamaConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim,
        vocab_size=preset.vocab_size, max_position_embeddings=t.context, rope_theta=t.rope_theta,
        rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=t.tie_embeddings,
    )
    model = build_causal_lm(cfg, dtype=dtype, device=device, init=False)
    hcfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1, "intermediate_size": h.intermediate_size,
                          "num_attention_heads": head_heads, "num_key_value_heads": head_kv_heads})
    hcfg.target_hidden_size = t.hidden_size
    hcfg.draft_vocab_size = preset.vocab_size
    hcfg._attn_implementation = ATTN_IMPLEMENTATION
    with torch.device(device):
        head = Eagle3Head(hcfg, target_hidden_size=t.hidden_size, draft_vocab_size=preset.vocab_size,
                          with_d2t=False, with_t2d=False)
    fill_random_weights(model, head)
    head.to(draft_dtype or dtype)
    target = HFTarget(model, feature_mode="eagle3")
    return target, Eagle3Draft(target, hcfg, head)


def simulated_configs(target, head) -> dict[str, tuple]:
    """The configurations this script times, by key: ``(label, target, draft, spec, SIMULATED
    tau)``; the baseline runs the target without EAGLE-3 features."""
    from phasegraph import SpecConfig

    return {
        "baseline": ("baseline", type(target)(target.model, feature_mode="none"), None,
                     SpecConfig(method="none"), None),
        "chain": ("chain S=3 (SIMULATED tau=4)", target, head, SpecConfig(method="eagle3", num_steps=3, topk=1, adaptive=False), 4),
        "tree": ("tree K=4 S=4 N=16 (SIMULATED tau=3)", target, head,
                 SpecConfig(method="eagle3", num_steps=4, topk=4, num_draft_tokens=16, adaptive=False), 3),
    }


def generate_call(engine, batch: int = 1, prompt_tokens: int = 128, new_tokens: int = 256):
    """One ``generate`` call of the breakdowns' workload: ``batch`` random prompts of
    ``prompt_tokens`` tokens (seed 8), ``new_tokens`` greedy tokens each (ignore_eos)."""
    from phasegraph import SamplingParams

    g = torch.Generator().manual_seed(8)
    prompts = torch.randint(0, engine.target.vocab_size, (batch, prompt_tokens), generator=g).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return lambda: engine.generate(prompts, params)


@contextlib.contextmanager
def steady_batch(engine, batch: int, tag: str, seed: int, steps: int, context: int = 256):
    """``batch`` requests of ``context`` random tokens, prefilled and 4 steps in (warm-up and
    capture of their bucket) with budget for ``steps`` more; aborted and drained after."""
    from phasegraph import SamplingParams

    vocab = engine.target.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(0, vocab, (context,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=8 * (steps + 16), ignore_eos=True))
    for _ in range(4):
        engine.step()
    sync(engine.device)
    yield
    for rid in ids:
        engine.abort(rid)
    engine.step()
    engine.scheduler.drain()


def run_steps(engine, steps: int) -> None:
    for _ in range(steps):
        engine.step()
    sync(engine.device)


PHASE_RANGE = "phase::"  # record_function label of one phase in phase_kernel_table


def device_activities(events):
    """``(event, duration us)`` of the device activities among profiler ``events`` (kernels,
    copies), without the device-side copies of the ``PHASE_RANGE`` annotations."""
    for e in bench_scale.device_events(events):
        if not e.name.startswith(PHASE_RANGE):
            yield e, e.time_range.end - e.time_range.start


def kernels_by_name(prof) -> dict[str, list[float]]:
    """Durations (us) of the device activities of a profiler trace, by (shortened) name."""
    by_name: dict[str, list[float]] = {}
    for e, us in device_activities(prof.events()):
        by_name.setdefault(e.name[:90], []).append(us)
    return by_name


def top_kernel_lines(by_name: dict[str, list[float]], per: int, top: int, width: int) -> list[str]:
    """The ``top`` kernels by total time, per step (or call) of ``per``."""
    return [f"  {sum(v) / per:{width}.1f} us {len(v) / per:6.1f}x  {name}"
            for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]]


def profile_steps(engine, batch: int, steps: int = 50) -> str:
    """cProfile of ``steps`` steady-state ``Engine.step()`` calls (overlap as the engine has it)."""
    with steady_batch(engine, batch, "p", 3, steps):
        prof = cProfile.Profile()
        prof.enable()
        run_steps(engine, steps)
        prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write(f"--- sorted by own time ({steps} steps) ---\n")
    stats.sort_stats("tottime").print_stats(45)
    text.write("--- sorted by cumulative time ---\n")
    stats.sort_stats("cumulative").print_stats(60)
    return text.getvalue()


def kernel_table(engine, batch: int, steps: int = 10, top: int = 40) -> str:
    """GPU kernels of ``steps`` steady-state steps (overlap as the engine has it): time and
    launches per step, by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    with steady_batch(engine, batch, "k", 4, steps):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_steps(engine, steps)
    by_name = kernels_by_name(prof)
    total = sum(sum(v) for v in by_name.values())
    count = sum(len(v) for v in by_name.values())
    lines = [f"kernels per step: {count / steps:.0f}, kernel time per step {total / steps:.1f} us"]
    return "\n".join(lines + top_kernel_lines(by_name, steps, top, 8)) + "\n"


def phase_kernel_table(engine, batch: int, iterations: int = 10, top: int = 14) -> str:
    """GPU kernels of one speculative iteration split by phase: the machine is driven by hand
    (as ``bench_scale.spec_iteration_times`` does), with a synchronisation after every phase, so
    each kernel is credited to the phase whose host range (``record_function``) it started in.
    Give it an engine with ``graph_scope="phase"``: the iteration graph replays all four phases
    at the first one."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    phases = bench_scale.SPEC_PHASES
    m, ctx = engine.scheduler.machine, engine.ctx
    with steady_batch(engine, batch, "f", 9, 4 * iterations):
        engine.scheduler.drain()  # host == device before driving the machine by hand
        for r in engine.scheduler.running:
            engine.kv.ensure_capacity(r.row, r.seq_len + 2 * (iterations + 2) * engine.tokens_per_iteration + 8)
        for _ in range(2):  # warm-up (graph capture of each phase)
            for p in phases:
                m.advance(p, ctx)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iterations):
                for p in phases:
                    with record_function(f"{PHASE_RANGE}{p}"):
                        m.advance(p, ctx)
                        torch.cuda.synchronize()
    events = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end, e.name[len(PHASE_RANGE):]) for e in events
                    if e.device_type == DeviceType.CPU and e.name.startswith(PHASE_RANGE))
    by_phase: dict[str, dict[str, list[float]]] = {p: {} for p in phases}
    unplaced = 0
    for e, us in device_activities(events):
        start = e.time_range.start
        owner = next((name for lo, hi, name in ranges if lo <= start <= hi), None)
        if owner is None:
            unplaced += 1
            continue
        by_phase[owner].setdefault(e.name[:90], []).append(us)
    lines = []
    for p in phases:
        kernels = by_phase[p]
        total = sum(sum(v) for v in kernels.values())
        count = sum(len(v) for v in kernels.values())
        lines.append(f"--- {p}: {count / iterations:.0f} kernels, {total / iterations:.1f} us per iteration")
        lines += top_kernel_lines(kernels, iterations, top, 8)
    if unplaced:
        lines.append(f"({unplaced} device activities outside every phase range)")
    return "\n".join(lines) + "\n"


# dispatcher ops that launch no device work (views, metadata, allocation)
_NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "as_strided", "slice", "select", "expand", "t", "transpose", "permute",
    "unsqueeze", "squeeze", "alias", "detach", "empty", "empty_like", "empty_strided", "split",
    "split_with_sizes", "unbind", "narrow", "lift_fresh", "_reshape_alias", "view_as_real",
    "view_as_complex", "unfold", "diagonal", "set_", "resize_", "is_same_size", "_has_compatible_shallow_copy_type",
})


@functools.cache
def _below_repository(filename: str) -> str | None:
    """``filename`` as a path below the repository where it is phasegraph's own source (not the
    bench's), else None. Decided by the package's directory, not by a path component: a checkout
    named ``phasegraph`` holds its ``.venv``, and torch's frames would count as phasegraph's."""
    import phasegraph

    package = Path(phasegraph.__file__).resolve().parent
    path = Path(filename).resolve()
    if not path.is_relative_to(package) or path.is_relative_to(package / "bench"):
        return None
    return path.relative_to(package.parent).as_posix()


def _phasegraph_frames(frame):
    """(path below the repository, frame) of every phasegraph frame of ``frame``'s caller chain,
    innermost first (the bench's own frames left out)."""
    while frame is not None:
        rel = _below_repository(frame.f_code.co_filename)
        if rel is not None:
            yield rel, frame
        frame = frame.f_back


def _line(rel: str, frame) -> str:
    return f"{rel}:{frame.f_lineno} ({frame.f_code.co_name})"


def _innermost_site(frame) -> str:
    """The innermost phasegraph source line of ``frame``'s caller chain, kernel modules included."""
    return next((_line(rel, f) for rel, f in _phasegraph_frames(frame)), "(outside phasegraph)")


def _site_of(frame) -> tuple[str, object | None]:
    """The innermost phasegraph source line below ``frame``'s caller chain, or, where the op
    runs inside ``phasegraph/kernels``, the outermost kernel-module function (one call there is
    one or two launches on a GPU, however many ops its CPU reference takes) and its frame."""
    inner, kernel, kernel_frame = None, None, None
    for rel, f in _phasegraph_frames(frame):
        if rel.startswith("phasegraph/kernels/"):
            kernel, kernel_frame = f"{rel}:{f.f_code.co_name} (kernel call)", f
        elif inner is None:
            inner = _line(rel, f)
    if kernel is not None:
        return kernel, kernel_frame
    return inner or "(outside phasegraph)", None


def launch_sites(engine, batch: int, steps: int = 5, top: int = 150, expand: bool = False) -> str:
    """Device launches of ``steps`` steady-state steps of an engine *without* CUDA graphs, by the
    phasegraph source line that issued them (runs on any device, the CPU included). Every
    dispatcher op that does device work counts once, except inside ``phasegraph/kernels``, where
    one call of a kernel module counts once (a Triton launch or two on a GPU; its torch
    reference on the CPU). Rotary cos/sin come from the rotary table on every device here, as on
    CUDA. A CUDA-graph replay launches the same kernels, so this is the map of what an
    iteration's small kernels are and where they come from. ``expand``: every torch op counts
    at its own line, inside kernel modules too (the torch work around their Triton launches,
    which the launches themselves, not dispatcher ops, do not show)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    sites: dict[str, int] = {}

    class Count(TorchDispatchMode):
        last_kernel = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = func.overloadpacket.__name__  # in-place forms end in "_": t_, squeeze_, ...
            launches = op not in _NO_LAUNCH and op.rstrip("_") not in _NO_LAUNCH
            if launches and expand:
                key = f"{_innermost_site(sys._getframe(1))} [{op}]"
                sites[key] = sites.get(key, 0) + 1
            elif launches:
                site, kernel_frame = _site_of(sys._getframe(1))
                if kernel_frame is None or kernel_frame is not self.last_kernel:
                    key = site if kernel_frame is not None else f"{site} [{op}]"
                    sites[key] = sites.get(key, 0) + 1
                self.last_kernel = kernel_frame
            return func(*args, **(kwargs or {}))

    from phasegraph.runtime.models.rotary_table import RotaryTable

    devices = RotaryTable.devices
    RotaryTable.devices = ("cuda", "cpu")  # rotary cos/sin from the table, as on CUDA
    try:
        with steady_batch(engine, batch, "l", 5, steps):
            with Count():
                run_steps(engine, steps)
    finally:
        RotaryTable.devices = devices
    total = sum(sites.values())
    how = "every torch op at its own line" if expand else "a kernel-module call counts once"
    lines = [f"launches per step (eager; {how}): {total / steps:.0f}"]
    for site, n in sorted(sites.items(), key=lambda kv: (-kv[1], kv[0]))[:top]:
        lines.append(f"  {n / steps:6.1f}x  {site}")
    return "\n".join(lines) + "\n"


def prefill_table(engine, batch: int, prompt_tokens: int = 128, calls: int = 3, top: int = 25) -> str:
    """Wall time, GPU kernels and host profile of ``generate`` calls that only prefill
    (``max_new_tokens=1``): what a prompt costs before the first decode step."""
    from torch.profiler import ProfilerActivity, profile

    from phasegraph import SamplingParams

    g = torch.Generator().manual_seed(6)
    prompts = torch.randint(0, engine.target.vocab_size, (batch, prompt_tokens), generator=g).tolist()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for _ in range(2):  # the second call captures the prefill graph, where the engine has them
        engine.generate(prompts, params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        engine.generate(prompts, params)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            engine.generate(prompts, params)
        torch.cuda.synchronize()
    by_name = kernels_by_name(prof)
    total = sum(sum(v) for v in by_name.values())
    host_ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
    busy, _ = bench_scale.gpu_busy_seconds(lambda: engine.generate(prompts, params), calls)
    lines = [f"prefill of {batch} x {prompt_tokens} tokens: {1e3 * wall:.2f} ms per call, kernels "
             f"{total / calls / 1e3:.2f} ms, GPU busy {1e3 * busy:.2f} ms"]
    lines += top_kernel_lines(by_name, calls, top, 9)
    prof_host = cProfile.Profile()
    prof_host.enable()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    prof_host.disable()
    text = io.StringIO()
    pstats.Stats(prof_host, stream=text).sort_stats("cumulative").print_stats(35)
    return "\n".join(lines) + "\nhost ops by own CPU time (profiled calls):\n" + host_ops + text.getvalue()


class _TimedEvent:
    """A recorded CUDA event whose ``synchronize`` adds the seconds it blocked to ``waits``."""

    def __init__(self, event, waits: list[float]):
        self.event, self.waits = event, waits

    def synchronize(self) -> None:
        start = time.perf_counter()
        self.event.synchronize()
        self.waits.append(time.perf_counter() - start)


@contextlib.contextmanager
def wrapped_methods(methods: dict[str, tuple[type, str]], wrap, wrap_ready):
    """Replace each ``(cls, name)`` of ``methods`` by ``wrap(label, original)`` and the ready event
    of every issued iteration by ``wrap_ready(event)`` (whose ``synchronize`` is the host's one
    wait per iteration); restores them on exit."""
    from phasegraph.runtime.scheduler import Scheduler

    def issue_wrapped(fn):
        def issue(self, *args, **kwargs):
            flight = fn(self, *args, **kwargs)
            if flight.ready is not None:
                flight.ready = wrap_ready(flight.ready)
            return flight
        return issue

    saved = []
    for label, (cls, name) in methods.items():
        if cls is None or name not in cls.__dict__:  # another version of the package on PYTHONPATH
            continue
        saved.append((cls, name, cls.__dict__[name]))
        setattr(cls, name, wrap(label, cls.__dict__[name]))
    issue = Scheduler.__dict__["_issue"]
    Scheduler._issue = issue_wrapped(issue)
    try:
        yield
    finally:
        Scheduler._issue = issue
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def method_timer(seconds: dict[str, float], counts: dict[str, int] | None = None):
    """A ``wrap`` for :func:`wrapped_methods`: every call of a wrapped method adds its wall time
    to ``seconds[label]`` (and 1 to ``counts[label]``, if given)."""

    def wrap(label, fn):
        def timed(*args, **kwargs):
            if counts is not None:
                counts[label] = counts.get(label, 0) + 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start
        return timed

    return wrap


def timed_methods(methods: dict[str, tuple[type, str]], seconds: dict[str, float], waits: list[float]):
    """Patch each ``(cls, name)`` of ``methods`` to add its wall time to ``seconds[label]``, and
    wrap the ready event of every issued iteration so that the host's one wait per iteration is
    timed apart (``waits``); restores the methods on exit."""
    return wrapped_methods(methods, method_timer(seconds), lambda event: _TimedEvent(event, waits))


class _ModuloTokenizer:
    """The embedded demo tokenizer (4096 tokens) decoding ids modulo its vocabulary, so that a
    random 8192-token model's requests carry text as the bench's do (one full decode per
    iteration, ``Request._update_text``)."""

    def __init__(self):
        from phasegraph.runtime.models.loading import load_tokenizer

        self.inner = load_tokenizer(Path(__file__).resolve().parents[1] / "phasegraph/data/demo_pair/target")
        self.eos_token_id = None

    def decode(self, tokens, skip_special_tokens=True):
        n = len(self.inner)
        return self.inner.decode([t % n for t in tokens], skip_special_tokens=skip_special_tokens)


def generate_breakdown(engine, batch: int = 1, calls: int = 3, prompt_tokens: int = 128,
                       new_tokens: int = 256) -> tuple[str, dict]:
    """Where the wall time of the bench's ``generate`` calls goes (``calls`` calls of ``batch``
    prompts, ``new_tokens`` greedy tokens each, as part 1 of ``phasegraph bench`` times them):
    per iteration, the host's wait for the device (``Scheduler._collect``'s one sync), the
    scheduler's pieces, the phases (``Machine.advance``), text decoding, ``Engine.step``'s
    request loop; and the GPU busy time per iteration (profiler)."""
    from phasegraph.runtime import cuda_graphs, iteration_graph
    from phasegraph.runtime import scheduler as scheduler_module
    from phasegraph.runtime.engine import Engine
    from phasegraph.runtime.requests import Request
    from phasegraph.runtime.scheduler import Scheduler
    from phasegraph.statemachine.machine import Machine

    one_call = generate_call(engine, batch, prompt_tokens, new_tokens)
    for _ in range(2):  # warm-up and graph capture, as the bench's warm_then_time
        one_call()
    sync(engine.device)
    start = time.perf_counter()
    for _ in range(calls):
        outs = one_call()
    sync(engine.device)
    wall = (time.perf_counter() - start) / calls
    tokens = sum(len(o.token_ids) for o in outs)
    iterations = max(len(o.stats.accept_lengths) for o in outs) if engine.scheduler.speculative else tokens // batch
    methods = {
        "Engine.step": (Engine, "step"),
        "Scheduler.step": (Scheduler, "step"),
        "  _admit (prefill)": (Scheduler, "_admit"),
        "  _filter_finished": (Scheduler, "_filter_finished"),
        "  _reserve_pages": (Scheduler, "_reserve_pages"),
        "  _issue": (Scheduler, "_issue"),
        "  _collect": (Scheduler, "_collect"),
        "    Request._update_text (text of the whole output)": (Request, "_update_text"),
        "  Request.take_delta": (Request, "take_delta"),
        "Machine.advance (every phase, host side)": (Machine, "advance"),
        "  iteration graph: copy_into_static": (iteration_graph, "copy_into_static"),
        "  iteration graph: copy_outputs_out": (iteration_graph, "copy_outputs_out"),
        "  phase graphs: copy_into_static": (cuda_graphs, "copy_into_static"),
        "  phase graphs: copy_outputs_out": (cuda_graphs, "copy_outputs_out"),
        "  CUDAGraph.replay": (torch.cuda.CUDAGraph, "replay"),
        "PinnedBuffers.copy (copy of the emitted tokens)": (getattr(scheduler_module, "PinnedBuffers", None), "copy"),
        "_to_pinned_host (the same, before PinnedBuffers)": (scheduler_module, "_to_pinned_host"),
        "  iteration graph: copy_inputs_in": (iteration_graph, "copy_inputs_in"),
        "  phase graphs: copy_inputs_in": (cuda_graphs, "copy_inputs_in"),
    }
    seconds: dict[str, float] = {}
    waits: list[float] = []
    with timed_methods(methods, seconds, waits):
        t0 = time.perf_counter()
        for _ in range(calls):
            one_call()
        sync(engine.device)
        timed_wall = (time.perf_counter() - t0) / calls
    gaps: list = []
    busy, launches = bench_scale.gpu_busy_seconds(one_call, 1, gaps) if engine.device.type == "cuda" else (0.0, 0)
    per_it = 1e3 / iterations
    figures = {"wall_ms_per_call": 1e3 * wall, "iterations_per_call": iterations, "tokens_per_call": tokens,
               "wall_ms_per_iteration": wall * per_it, "timed_wall_ms_per_iteration": timed_wall * per_it,
               "gpu_busy_ms_per_iteration": busy * per_it, "device_activities_per_call": launches,
               "host_wait_ms_per_iteration": sum(waits) / calls * per_it,
               "ms_per_iteration": {k: seconds.get(k, 0.0) / calls * per_it for k in methods}}
    lines = [f"{calls} calls of {batch} x {prompt_tokens}-token prompts, {new_tokens} new tokens: "
             f"{1e3 * wall:.1f} ms per call, {iterations} iterations, {wall * per_it:.3f} ms per iteration "
             f"({timed_wall * per_it:.3f} with the timers below); GPU busy {busy * per_it:.3f} ms per iteration "
             f"({launches} device activities per call)",
             f"  {figures['host_wait_ms_per_iteration']:.3f} ms  host waits for the device (the sync in _collect)"]
    lines += [f"  {v:.3f} ms  {k}" for k, v in figures["ms_per_iteration"].items()]
    lines += gap_table(gaps, per_it)
    prof = cProfile.Profile()
    prof.enable()
    one_call()
    sync(engine.device)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return "\n".join(lines) + "\n--- cProfile of one call, by own time ---\n" + text.getvalue(), figures


def gap_table(gaps: list[tuple[float, str, str]], per_iteration: float, rows: int = 8) -> list[str]:
    """Where one call's GPU idles: idle time per iteration, by the pair of device activities
    around each idle stretch, largest first (``per_iteration`` = 1e3 / iterations)."""
    by_pair: dict[tuple[str, str], list[float]] = {}
    for idle, before, after in gaps:
        by_pair.setdefault((before[:48], after[:48]), []).append(idle)
    total = sum(idle for idle, _, _ in gaps)
    lines = [f"  GPU idle {1e-6 * total * per_iteration:.3f} ms per iteration in {len(gaps)} stretches; "
             f"the largest, by the activities around them (ms per iteration, count per call):"]
    ranked = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:rows]
    lines += [f"    {1e-6 * sum(v) * per_iteration:.3f} ms  {len(v):>5}x  {b} -> {a}" for (b, a), v in ranked]
    return lines


def launch_costs(tokens: int = 128, hidden: int = 4096, calls: int = 200) -> str:
    """Host time per call, without waiting for the GPU, of a few launches the eager prefill
    makes: what one launch costs this machine's host (lent machines differ)."""
    import torch.nn.functional as F

    from phasegraph.bench.common import host_issue_seconds
    from phasegraph.kernels.rms_norm import add_rms_norm

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    m = torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16)
    probes = {
        "torch.add (one ATen kernel)": lambda: torch.add(x, x),
        "torch.empty": lambda: torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16),
        "F.linear [128, 4096] x [4096, 4096] (cuBLAS)": lambda: F.linear(x, m),
        "add_rms_norm (Triton, phasegraph wrapper)": lambda: add_rms_norm(x, x, w, 1e-5),
    }
    lines = []
    for name, fn in probes.items():
        host = host_issue_seconds("cuda", fn, calls)
        lines.append(f"  {1e6 * host:7.1f} us host per call  {name}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--draft-dtype", choices=["float32", "bfloat16"],
                    help="the EAGLE-3 head's dtype (default: --dtype)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shape", default="bench-pair", choices=["bench-pair", "8b"],
                    help="bench-pair (96M target, default) or bench_scale's Llama-3-8B shape (bf16 only)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="with --shape bench-pair: replace a field of the preset (e.g. target.num_layers=24)")
    ap.add_argument("--configs", nargs="+", default=["baseline", "chain", "tree"], choices=["baseline", "chain", "tree"])
    ap.add_argument("--no-profile", action="store_true", help="no cProfile of the host")
    ap.add_argument("--prefill", action="store_true",
                    help="only (with --sites: and): time and profile prefill-only generate calls (128-token prompts) at batch 1, "
                         "and the host cost of single launches")
    ap.add_argument("--prefill-graphs", action="store_true",
                    help="with --prefill: the engines replay prefill from CUDA graphs (as the bench runs them)")
    ap.add_argument("--sites", action="store_true",
                    help="only: device launches per phasegraph source line of an eager (graphs off) step at "
                         "batch 1 (any --device)")
    ap.add_argument("--generate", action="store_true",
                    help="only: where the wall time of the bench's generate calls goes (batch 1, 3 x 256 new "
                         "tokens), with the bench's engine settings (trace, default checks, text) and with none")
    ap.add_argument("--expand", action="store_true",
                    help="with --sites: every torch op at its own source line, inside kernel modules too")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: --sites only")
    ap.add_argument("--kernels", action="store_true",
                    help="also a table of GPU kernels per step at --kernel-batch")
    ap.add_argument("--phase-kernels", action="store_true",
                    help="only: GPU kernels of a speculative iteration at --kernel-batch, split by phase (chain, tree)")
    ap.add_argument("--kernel-batch", type=int, default=1, metavar="B",
                    help="the batch --kernels and --phase-kernels profile (default 1)")
    ap.add_argument("--checks", nargs="+", default=["default", "off"], choices=["default", "off"],
                    help="trace and validation settings to time (default: trace + default checks, and none)")
    args = ap.parse_args(argv)
    detach_cupti_after_profiling()  # the profiler's sessions leave no cost on later launches
    if args.device == "cpu" and not args.sites:
        ap.error("--device cpu runs --sites only (the other tables time the GPU)")
    from phasegraph.runtime.engine import Engine

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    if args.shape == "8b":
        target = bench_scale.build_target(32)
        head = bench_scale.build_eagle3_head(target)
    else:
        target, head = build_pair(dtype, args.device, args.set,
                                  getattr(torch, args.draft_dtype) if args.draft_dtype else None)
    configs = [c for key, c in simulated_configs(target, head).items() if key in args.configs]
    result: dict = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__, "dtype": args.dtype, "draft_dtype": args.draft_dtype or args.dtype, "shape": args.shape,
                    "overrides": args.set, "params": {"target": sum(p.numel() for p in target.model.parameters()),
                                                      "head": sum(p.numel() for p in head.head.parameters())} if args.shape == "bench-pair" else None,
                    "rows": []}
    profiles = io.StringIO()
    max_b = max(*args.batches, args.kernel_batch)  # the engines hold every batch profiled

    def engine(tgt, draft, spec, tau, **kw):
        return Engine(tgt, draft, spec=spec, max_batch_size=max_b, kv_pool_tokens=max_b * 2048,
                      max_context=1024, simulate_accept_length=tau, **kw)

    # the modes that print one table per configuration and nothing else
    only = {"prefill": (prefill_table, "prefill: {}",
                        dict(cuda_graphs=True, trace=True, prefill_graphs=args.prefill_graphs)),
            "phase_kernels": (phase_kernel_table, "GPU kernels by phase: {}, batch " + str(args.kernel_batch),
                              dict(cuda_graphs=True, graph_scope="phase", trace=False)),
            "sites": (functools.partial(launch_sites, expand=args.expand), "launch sites: {}, batch 1",
                      dict(cuda_graphs=False, trace=False))}
    if args.prefill:
        table = launch_costs()
        print(f"===== launch costs =====\n{table}", flush=True)
        profiles.write(f"===== launch costs =====\n{table}")
    if args.generate:
        from phasegraph.bench.common import host_launch_seconds

        result["host_us_per_tiny_op"] = 1e6 * host_launch_seconds("cuda")
        print(f"host: {result['host_us_per_tiny_op']:.2f} us to issue one tiny op", flush=True)
        profiles.write(f"host: {result['host_us_per_tiny_op']:.2f} us to issue one tiny op\n")
        settings = {"bench (trace, default checks, text)": dict(trace=True, tokenizer=_ModuloTokenizer()),
                    "bare (no trace, checks off, no text)": dict(trace=False, validate="off")}
        for name, tgt, draft, spec, tau in configs:
            for label, kw in settings.items():
                eng = engine(tgt, draft, spec, tau, cuda_graphs=True, prefill_graphs=True, **kw)
                table, figures = generate_breakdown(eng)
                result["rows"].append({"config": name, "settings": label, **figures})
                print(f"===== generate: {name}, {label} =====\n{table.split('--- cProfile')[0]}", flush=True)
                profiles.write(f"===== generate: {name}, {label} =====\n{table}")
                del eng
                torch.cuda.empty_cache()
        (out / "pair_generate.json").write_text(json.dumps(result, indent=2))
        (out / "pair_generate_profile.txt").write_text(profiles.getvalue())
        return 0
    modes = [mode for mode in only if getattr(args, mode)]
    for mode in modes:
        table_of, title, kw = only[mode]
        for name, tgt, draft, spec, tau in configs:
            if mode == "phase_kernels" and spec.method == "none":
                continue
            table = table_of(engine(tgt, draft, spec, tau, **kw), args.kernel_batch if mode == "phase_kernels" else 1)
            print(f"===== {title.format(name)} =====\n{table}", flush=True)
            profiles.write(f"===== {title.format(name)} =====\n{table}")
    if modes:
        (out / "pair_host_profile.txt").write_text(profiles.getvalue())
        return 0
    for name, tgt, draft, spec, tau in configs:
        for trace, validate in [{"default": (True, None), "off": (False, "off")}[c] for c in args.checks]:
            t0 = time.perf_counter()
            eng = engine(tgt, draft, spec, tau, cuda_graphs=True, trace=trace, validate=validate)
            for b in args.batches:
                for overlap in (False, True):
                    r = bench_scale.scheduler_step_times(eng, b, overlap)
                    r.update(config=name, trace=trace, validate=validate or "default")
                    result["rows"].append(r)
                    print(f"  {name:<36} trace={trace!s:<5} validate={validate or 'default':<7} batch {b:>2} "
                          f"overlap {'on ' if overlap else 'off'}: {1e3 * r['step_s']:6.3f} ms/step, GPU busy "
                          f"{1e3 * r['gpu_busy_s']:6.3f} ms", flush=True)
            if trace and not args.no_profile:
                profiles.write(f"===== {name}, batch 1, overlap on, trace on, validate default =====\n")
                profiles.write(profile_steps(eng, 1))
            if trace and args.kernels:
                table = kernel_table(eng, args.kernel_batch)
                print(f"  kernels of {name}, batch {args.kernel_batch}:\n{table}", flush=True)
                profiles.write(f"===== GPU kernels: {name}, batch {args.kernel_batch} =====\n{table}")
            print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
            del eng
            torch.cuda.empty_cache()
    (out / "pair_host.json").write_text(json.dumps(result, indent=2))
    (out / "pair_host_profile.txt").write_text(profiles.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
