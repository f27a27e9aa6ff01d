"""``phasegraph bench --serve``: the real server under Poisson arrivals, speculation on and off.

What it serves (:func:`serve_pair`): ``--pair``, else the real model (SmolLM2-135M-Instruct and its
EAGLE-3 head) where its packages are installed, else the embedded demo pair. For each mode
(EAGLE-3 chain drafting, and the target alone) one engine is built and warmed up,
then served by :func:`phasegraph.serving.create_app` with uvicorn on 127.0.0.1 inside this
process; the engine runs in a process of its own (:class:`~phasegraph.serving.ProcessEngine`,
as ``phasegraph serve`` runs it) on CUDA, or with ``--engine-process``, else on a thread of this
one. It measures:

- the cost of the asyncio and HTTP layers at batch 1: one streaming request through the server
  against the same request stepped on the bare engine (where the server steps it, in turns
  with the served runs), as the period of the steps that emit tokens (the gap between a
  stream's chunks, against the gap between the bare engine's steps), where both ran the same
  iterations, else per token; the clients run in a process of their own, as in a deployment;
- at each arrival rate, requests arriving as a Poisson process (exponential gaps, a fixed seed),
  each a streaming ``/v1/completions`` client that records when it sent the request and when
  each chunk arrived: output tokens/s, time to first token, and inter-token latency. A chunk
  holds every token of one engine step (several under speculation), so its gap is shared
  evenly between its tokens: the per-token ITL a reader of the stream sees on average.

Goals: at the lowest rate, p50 ITL with speculation <= 0.6x without; at every rate,
throughput with speculation >= without; the serving layers add <= 3 % to a batch-1 step.
Writes serve_bench.json, serve_bench.md and serve_latency.png into --out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import math
import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from phasegraph.bench.common import BenchError, has_pair

ITL_GOAL_RATIO = 0.6
HTTP_OVERHEAD_GOAL = 0.03
SPEC = {"method": "eagle3", "num_steps": 3, "topk": 1}
MODEL_NAME = "bench"

FULL = {"rates": "1,4,16,64", "requests": 64, "new_tokens": 128, "prompt_tokens": 128, "max_batch": 32,
        "overhead_repeats": 3}
QUICK = {"rates": "2,8", "requests": 4, "new_tokens": 12, "prompt_tokens": 32, "max_batch": 4,
         "overhead_repeats": 1}


@attrs.frozen
class ServeSettings:
    rates: tuple[float, ...]  # requests per second
    requests: int  # per rate
    new_tokens: int
    prompt_tokens: int
    max_batch: int
    overhead_repeats: int
    seed: int = 0


@attrs.define
class _Stream:
    """What one client saw."""

    sent: float
    chunks: list[tuple[float, int]] = attrs.field(factory=list)  # (arrival, tokens in it)
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


def settings_from(args) -> ServeSettings:
    """The run's settings: --serve-* options over the full or --quick defaults."""
    base = QUICK if args.quick else FULL
    rates_text = args.serve_rates or base["rates"]
    try:
        rates = tuple(float(x) for x in rates_text.replace(" ", "").split(",") if x)
    except ValueError:
        raise BenchError(f"--serve-rates: expected comma-separated request rates, got {rates_text!r}") from None
    if not rates or min(rates) <= 0 or any(math.isinf(r) or math.isnan(r) for r in rates):
        raise BenchError(f"--serve-rates: expected finite rates > 0, got {rates_text!r}")
    requests = base["requests"] if args.serve_requests is None else args.serve_requests
    max_batch = base["max_batch"] if args.serve_max_batch is None else args.serve_max_batch
    for name, value in (("--serve-requests", requests), ("--serve-max-batch", max_batch)):
        if value < 1:
            raise BenchError(f"{name} must be at least 1, got {value}")
    new_tokens = base["new_tokens"] if args.new_tokens is None else args.new_tokens
    prompt_tokens = base["prompt_tokens"] if args.prompt_tokens is None else args.prompt_tokens
    for name, value in (("--new-tokens", new_tokens), ("--prompt-tokens", prompt_tokens)):
        if value < 1:
            raise BenchError(f"{name} must be at least 1, got {value}")
    return ServeSettings(rates=tuple(sorted(rates)), requests=requests, new_tokens=new_tokens,
                         prompt_tokens=prompt_tokens, max_batch=max_batch,
                         overhead_repeats=base["overhead_repeats"], seed=args.seed)


REAL_MODEL_SERVED = "SmolLM2-135M-Instruct with its EAGLE-3 head"


def serve_pair(args, real_model: Callable[[], tuple[Path, Path]] | None = None) -> tuple[Path, Path, str]:
    """``(target dir, head dir, name)`` of what to serve: ``--pair`` (or OUT/pair) where it
    holds a pair; else the real model, ``real_model()`` (unless ``--no-real-model`` or
    ``--quick``; where its packages are missing, the embedded pair, unless ``--real-model``
    asked for it); else the embedded demo pair. ``real_model`` comes from the CLI (the demo's
    model: bench and demo are one layer, neither imports the other)."""
    from importlib import resources

    from phasegraph.runtime.models.gguf import GGUFConversionError
    from phasegraph.train.prompts import MissingPromptSource

    pair = Path(args.pair) if args.pair else Path(args.out) / "pair"
    if has_pair(pair):
        return pair / "target", pair / "eagle3", str(pair)
    if args.pair:
        raise BenchError(f"--pair {args.pair}: no target/ and eagle3/ checkpoints there")
    wanted = getattr(args, "real_model", None)
    if real_model is not None and (wanted or (wanted is None and not args.quick)):
        try:
            target, head = real_model()
            return target, head, REAL_MODEL_SERVED
        except (MissingPromptSource, GGUFConversionError) as exc:  # its packages are not installed
            if wanted:
                raise BenchError(f"--real-model: {exc}") from None
    demo = Path(str(resources.files("phasegraph") / "data" / "demo_pair"))
    return demo / "target", demo / "eagle3", "the embedded demo pair"


def measure_serving(args, log=print, real_model: Callable[[], tuple[Path, Path]] | None = None) -> dict:
    """Both modes at every rate; the result dict that serve_bench.json holds."""
    import torch

    s = settings_from(args)
    target, head, pair_name = serve_pair(args, real_model)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    prompts = _prompts(target, s)
    chosen = getattr(args, "engine_process", None)
    engine_process = device.startswith("cuda") if chosen is None else chosen
    result = {"quick": bool(args.quick), "pair": pair_name, "device": device, "engine_process": engine_process,
              "settings": attrs.asdict(s), "spec": SPEC, "modes": {}}
    for mode in ("speculative", "baseline"):
        where = "an engine process" if engine_process else "the server's process"
        log(f"serve bench: {mode} on {pair_name} ({device}, the engine in {where}), "
            f"rates {', '.join(f'{r:g}' for r in s.rates)} req/s")
        build = functools.partial(_warm_engine, target, head, mode, device, args.pair_dtype, args.validate,
                                  prompts, s)
        result["modes"][mode] = _measure_mode(build, engine_process, prompts, s, log)
    result["goals"] = evaluate_goals(result)
    return result


def _prompts(target: Path, s: ServeSettings) -> list[list[int]]:
    """Held-out standard-library prompts as token ids, each its last ``prompt_tokens`` tokens
    (distinct prompts: the prefix cache then serves none of them)."""
    from phasegraph.runtime.models.loading import load_tokenizer
    from phasegraph.train.corpus import heldout_prompts

    tok = load_tokenizer(target)
    texts = [p.text for p in heldout_prompts(max_lines=40, min_lines=8, max_prompts=max(s.requests, 8))]
    ids = [list(tok(t)["input_ids"])[-s.prompt_tokens :] for t in texts]
    return [ids[i % len(ids)] for i in range(s.requests)]


def _warm_engine(target: Path, head: Path, mode: str, device: str, dtype: str | None, validate: str | None,
                 prompts: list[list[int]], s: ServeSettings):
    """The mode's engine, warmed up (module-level: an engine process calls it)."""
    engine = _engine(target, head, mode, device, dtype, validate, s)
    _warm_up(engine, prompts, s)
    return engine


def _engine(target: Path, head: Path, mode: str, device: str, dtype: str | None, validate: str | None,
            s: ServeSettings):
    from phasegraph import Engine, SpecConfig

    spec = SpecConfig(**SPEC) if mode == "speculative" else SpecConfig(method="none")
    draft = head if mode == "speculative" else None
    kv = 2 * s.max_batch * (s.prompt_tokens + s.new_tokens + 64)
    return Engine.from_pretrained(target, draft, spec=spec, device=device, dtype=dtype,
                                  kv_pool_tokens=kv, max_batch_size=s.max_batch, trace=False, prefix_cache=True,
                                  validate=validate)


def _warm_up(engine, prompts, s: ServeSettings) -> None:
    """Compile, and capture every batch bucket's and speculation shape's CUDA graphs
    (:meth:`~phasegraph.runtime.engine.Engine.warm_up`), so that the timed runs replay what
    they need; without graphs, batch 1, a middle batch and the largest. The prompts here start
    with another token, so no timed prompt is read from what they cached."""
    from phasegraph import SamplingParams

    params = SamplingParams(max_new_tokens=min(s.new_tokens, 16), temperature=0.0, ignore_eos=True)
    engine.warm_up(sampled=False)  # (greedy requests)
    batches = (1, max(1, s.max_batch // 4), s.max_batch)
    for batch in dict.fromkeys(b for b in batches if b <= min(s.max_batch, len(prompts))):
        engine.generate([[7 + i] + p[1:] for i, p in enumerate(prompts[:batch])], params)
    engine.clear_prefix_cache()


def _measure_mode(build, engine_process: bool, prompts, s: ServeSettings, log) -> dict:
    """One mode at batch 1 and at every rate; ``build()`` gives its warmed-up engine, called in
    an engine process of its own with ``engine_process``."""
    from phasegraph.serving import AsyncEngine, ProcessEngine, create_app
    from phasegraph.serving.app import serve_in_thread

    max_queue = max(256, s.requests)
    aengine = ProcessEngine(build, max_queue=max_queue) if engine_process else AsyncEngine(build(), max_queue=max_queue)
    # the clients run in a process of their own: in this one they would take the interpreter
    # from the engine and server threads, and their cost would count as the server's
    clients = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        app = create_app(aengine, model_name=MODEL_NAME, on_full="wait")
        with serve_in_thread(app) as url:
            overhead = _measure_overhead(url, aengine, prompts[0], s, clients)
            rows = []
            for rate in s.rates:
                streams, wall = clients.submit(_client_poisson_run, url, prompts, rate, s).result()
                row = summarize(rate, streams, wall)
                log(f"  {rate:g} req/s: {row['tokens_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_s'] * 1e3:.1f} ms, "
                    f"ITL p50 {row['itl_p50_s'] * 1e3:.2f} ms")
                rows.append(row)
    finally:
        clients.shutdown()
        aengine.close()
    return {"rows": rows, **overhead}


@attrs.frozen
class _Run:
    """One batch-1 request: when each step (or chunk) that emitted tokens ended, and how many."""

    times: tuple[float, ...]
    tokens: tuple[int, ...]  # per iteration: the accept lengths, under speculation
    device_wait_s: float = 0.0  # the host's wait for the device, over the whole request

    def period(self) -> float:
        """Seconds per iteration, prefill and the first chunk's wait left out."""
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)

    def per_token(self) -> float:
        return (self.times[-1] - self.times[0]) / sum(self.tokens[1:])


def _measure_overhead(url: str, aengine, prompt: list[int], s: ServeSettings, clients) -> dict:
    """The asyncio and HTTP layers at batch 1: the same request stepped on the bare engine and
    streamed through the server, in turns. The bare run steps the engine where the server steps
    it (:meth:`AsyncEngine.call`: its engine thread, or the engine process's), between served
    runs, so both see the same engine state (graphs, cost table, acceptance estimates) and
    thread; only the layers differ.

    Per iteration compares like with like only where both ran the same iterations (adaptive
    speculation chooses a shape from acceptance estimates every run updates): otherwise the
    figure is per token, and ``same_iterations`` says so."""
    bare, served = [], []
    before = aengine.stats()
    for _ in range(s.overhead_repeats):
        bare.append(asyncio.run(aengine.call(functools.partial(_bare_run, prompt=prompt, s=s))))
        served.append(_served_run(url, aengine, prompt, s, clients))
    after = aengine.stats()
    same = all(b.tokens == v.tokens for b, v in zip(bare, served, strict=True))
    runs = {"bare": bare, "served": served}

    def medians(of) -> dict[str, float]:
        return {kind: statistics.median(of(r) for r in kind_runs) for kind, kind_runs in runs.items()}

    per_iteration, per_token = medians(_Run.period), medians(_Run.per_token)
    basis = per_iteration if same else per_token
    steps = after.steps - before.steps  # the served runs' (the bare ones step the engine directly)
    return {
        "bare_step_s": per_iteration["bare"], "served_step_s": per_iteration["served"],
        "bare_token_s": per_token["bare"], "served_token_s": per_token["served"],
        "same_iterations": same, "overhead_basis": "iteration" if same else "token",
        "iterations": {"bare": [len(r.tokens) for r in bare], "served": [len(r.tokens) for r in served]},
        # host time of the engine thread's serving work per step (handing deltas over, waking loops)
        "serving_host_s_per_step": (after.serving_seconds - before.serving_seconds) / max(steps, 1),
        # the host's wait for the device per iteration: the slack that hides the layers' work
        "device_wait_s_per_iteration": medians(lambda r: r.device_wait_s / len(r.tokens)),
        "http_overhead": basis["served"] / basis["bare"] - 1.0,
    }


def _bare_run(engine, prompt: list[int], s: ServeSettings) -> _Run:
    """One request stepped on the bare engine as the server's engine thread or process steps it
    (module-level, as every function given to ``call`` here: an engine process unpickles it)."""
    from phasegraph import SamplingParams

    engine.add_request("bare", prompt, SamplingParams(max_new_tokens=s.new_tokens, temperature=0.0, ignore_eos=True))
    times, tokens, waited = [], [], engine.scheduler.device_wait_s
    while engine.has_unfinished():
        n = sum(len(d.new_token_ids) for d in engine.step())
        if n:
            times.append(time.perf_counter())
            tokens.append(n)
    engine.clear_prefix_cache()  # the served run prefills the same prompt again
    return _checked(_Run(tuple(times), tuple(tokens), engine.scheduler.device_wait_s - waited))


def _served_run(url: str, aengine, prompt: list[int], s: ServeSettings, clients) -> _Run:
    """The same through the server: the chunks of one streaming request (a chunk holds the
    tokens of one step), as its client (in the ``clients`` process) receives them."""
    waited = asyncio.run(aengine.call(_device_wait))
    stream = clients.submit(_client_one_request, url, prompt, s).result()
    if stream.error:
        raise BenchError(f"the batch-1 request failed: {stream.error}")
    waited = asyncio.run(aengine.call(functools.partial(_device_wait_since, before=waited)))
    return _checked(_Run(tuple(t for t, _ in stream.chunks), tuple(n for _, n in stream.chunks), waited))


def _device_wait(engine) -> float:
    return engine.scheduler.device_wait_s


def _device_wait_since(engine, before: float) -> float:
    """The host's wait for the device since ``before``; the prefix cache cleared, so that the
    next run prefills again."""
    engine.clear_prefix_cache()
    return engine.scheduler.device_wait_s - before


def _checked(run: _Run) -> _Run:
    if len(run.times) < 2:
        raise BenchError("the batch-1 request emitted fewer than two chunks: raise --new-tokens")
    return run


def _client_one_request(url: str, prompt: list[int], s: ServeSettings) -> _Stream:
    """One streaming request, in the clients' process."""
    import httpx

    async def run() -> _Stream:
        async with httpx.AsyncClient(timeout=None) as client:
            return await _one_request(client, url, prompt, s, time.perf_counter())

    return asyncio.run(run())


def _client_poisson_run(url: str, prompts, rate: float, s: ServeSettings) -> tuple[list[_Stream], float]:
    """:func:`_poisson_run`, in the clients' process."""
    return asyncio.run(_poisson_run(url, prompts, rate, s))


async def _poisson_run(url: str, prompts, rate: float, s: ServeSettings) -> tuple[list[_Stream], float]:
    """Every request at its Poisson arrival time; returns what each client saw and the wall time
    from the first send to the last chunk."""
    import httpx

    rng = random.Random(f"{s.seed}-{rate}")
    offsets, t = [], 0.0
    for _ in range(s.requests):
        offsets.append(t)
        t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=s.requests + 4, max_keepalive_connections=s.requests + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> _Stream:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            return await _one_request(client, url, prompts[i], s, time.perf_counter())

        streams = await asyncio.gather(*(one(i) for i in range(s.requests)))
    ends = [st.chunks[-1][0] for st in streams if st.chunks]
    return list(streams), (max(ends) - start) if ends else 0.0


async def _one_request(client, url: str, prompt: list[int], s: ServeSettings, sent: float) -> _Stream:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": s.new_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    stream = _Stream(sent=sent)
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            stream.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
            return stream
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                stream.error = str(chunk["error"].get("message"))
                break
            n = len(chunk.get("phasegraph", {}).get("token_ids", ()))
            if n:
                stream.chunks.append((time.perf_counter(), n))
    return stream


def _percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between order statistics."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(rate: float, streams: list[_Stream], wall: float) -> dict:
    """One rate's row: throughput, TTFT and per-token ITL percentiles, chunk gaps, failures."""
    ok = [st for st in streams if st.error is None and st.chunks]
    ttft = [st.chunks[0][0] - st.sent for st in ok]
    itl, gaps = [], []
    for st in ok:
        for (t0, _), (t1, n) in zip(st.chunks, st.chunks[1:], strict=False):
            gaps.append(t1 - t0)
            itl += [(t1 - t0) / n] * n
    tokens = sum(st.tokens for st in ok)
    return {
        "rate": rate, "requests": len(streams), "failed": len(streams) - len(ok), "tokens": tokens,
        "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
        "itl_p50_s": _percentile(itl, 50), "itl_p99_s": _percentile(itl, 99),
        "chunk_gap_p50_s": _percentile(gaps, 50), "chunk_gap_p99_s": _percentile(gaps, 99),
    }


def evaluate_goals(result: dict) -> list[dict]:
    """The three serving goals, each with the figures it compares and whether it holds."""
    spec, base = result["modes"].get("speculative"), result["modes"].get("baseline")
    if not spec or not base:
        return []
    low_s, low_b = spec["rows"][0], base["rows"][0]
    itl_ratio = low_s["itl_p50_s"] / low_b["itl_p50_s"]
    # at the lowest rate both modes serve the offered load, so throughput is compared above it
    pairs = list(zip(spec["rows"], base["rows"], strict=True))
    high = [p for p in pairs if p[0]["rate"] > low_s["rate"]] or pairs
    worst = min((rs["tokens_per_s"] / rb["tokens_per_s"], rs["rate"]) for rs, rb in high)
    overhead = max(spec["http_overhead"], base["http_overhead"])
    return [
        {"goal": f"low load ({low_s['rate']:g} req/s): p50 ITL with speculation <= {ITL_GOAL_RATIO}x without",
         "value": itl_ratio, "met": itl_ratio <= ITL_GOAL_RATIO},
        {"goal": "high load: throughput with speculation never below without (worst rate: "
                 f"{worst[1]:g} req/s)", "value": worst[0], "met": worst[0] >= 1.0},
        {"goal": f"asyncio + HTTP add <= {HTTP_OVERHEAD_GOAL:.0%} to a batch-1 step (worse mode)",
         "value": overhead, "met": overhead <= HTTP_OVERHEAD_GOAL},
    ]


# ------------------------------------------------------------------------------------ outputs

def write_serve_outputs(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["plot"] = draw_serve_plot(result, out)
    (out / "serve_bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "serve_bench.md").write_text(render_serve_markdown(result))


def render_serve_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# phasegraph bench --serve{' --quick' if result['quick'] else ''}",
        "",
        f"{result['pair']} on {result['device']}, the engine "
        f"{'in a process of its own' if result.get('engine_process') else 'on a thread of the server'}; EAGLE-3 up to a chain of {SPEC['num_steps']} (adaptive on a GPU) "
        "against the target alone; "
        f"{s['requests']} requests per rate, {s['prompt_tokens']}-token prompts, {s['new_tokens']} new tokens, "
        f"batch up to {s['max_batch']}. ITL: each chunk's gap shared between its tokens.",
        "",
        "| mode | rate (req/s) | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, m in result["modes"].items():
        for r in m["rows"]:
            lines.append(f"| {mode} | {r['rate']:g} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s'] * 1e3:.1f} ms | "
                         f"{r['ttft_p99_s'] * 1e3:.1f} ms | {r['itl_p50_s'] * 1e3:.2f} ms | "
                         f"{r['itl_p99_s'] * 1e3:.2f} ms | {r['failed']} |")
    lines += ["", "| mode | bare engine step | through the server | per token, bare / served | same iterations "
              "| engine thread's serving work per step | host waits for the device per iteration, bare / served "
              "| overhead |", "|---|---|---|---|---|---|---|---|"]
    for mode, m in result["modes"].items():
        wait = m["device_wait_s_per_iteration"]
        lines.append(f"| {mode} | {m['bare_step_s'] * 1e3:.3f} ms | {m['served_step_s'] * 1e3:.3f} ms | "
                     f"{m['bare_token_s'] * 1e3:.3f} / {m['served_token_s'] * 1e3:.3f} ms | "
                     f"{'yes' if m['same_iterations'] else 'NO (overhead per token)'} | "
                     f"{m['serving_host_s_per_step'] * 1e6:.0f} µs | "
                     f"{wait['bare'] * 1e6:.0f} / {wait['served'] * 1e6:.0f} µs | {m['http_overhead']:+.1%} |")
    lines += ["", "| goal | value | met |", "|---|---|---|"]
    for g in result.get("goals", []):
        lines.append(f"| {g['goal']} | {g['value']:.3f} | {'yes' if g['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def draw_serve_plot(result: dict, out: Path) -> str | None:
    """serve_latency.png: p50 ITL and p50 TTFT against throughput, with the goals marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    modes = result["modes"]
    for ax, key, title in ((axes[0], "itl_p50_s", "p50 inter-token latency"), (axes[1], "ttft_p50_s", "p50 TTFT")):
        for mode, m in modes.items():
            xs = [r["tokens_per_s"] for r in m["rows"]]
            ys = [r[key] * 1e3 for r in m["rows"]]
            ax.plot(xs, ys, marker="o", label=mode)
            for r, x, y in zip(m["rows"], xs, ys, strict=True):
                ax.annotate(f"{r['rate']:g}/s", (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        if "baseline" in modes:
            top = max(r["tokens_per_s"] for r in modes["baseline"]["rows"])
            ax.axvline(top, ls=":", color="gray", label="goal: speculative throughput >= this (baseline's best)")
            if key == "itl_p50_s":
                low = modes["baseline"]["rows"][0]["itl_p50_s"] * 1e3 * ITL_GOAL_RATIO
                ax.axhline(low, ls="--", color="red", label=f"goal at low load: <= {ITL_GOAL_RATIO}x baseline ITL")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        ax.set_title(title + (" (QUICK)" if result["quick"] else ""))
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "serve_latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
