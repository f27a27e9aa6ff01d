"""Tensor parallelism on GPUs: Llama-3-8B and -70B shapes, random bf16 weights, simulated acceptance.

    python benchmarks/bench_tp.py --tp 1 --out DIR                          # 8B at TP=1
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --tp 2 --out DIR     # 8B and 70B at TP=2
    python benchmarks/bench_tp.py --report DIR                              # the goals, side by side

Each rank builds only its own slice of the target directly on its GPU (no checkpoint: the 70B
shape is ~70 GB a GPU at TP=2), with the EAGLE-3 head replicated. Under torchrun every rank runs
the same engine calls (SPMD); rank 0 times them and writes ``tp{N}.json`` under ``--out``.

Measured (SIMULATED acceptance where a τ is given: verify accepts τ-1 drafts whatever they are,
as SGLang's and vLLM's benchmark modes do; outputs are not the target's):
- the per-GPU bandwidth bound of a decode step: the weight bytes one rank streams (its layer
  slices and the replicated lm_head) over the device-to-device copy bandwidth;
- the graphed decode step's GPU time at each batch, and its share of that bound;
- the all-reduces of one step alone (2 per layer on ``[B, hidden]``, captured in a CUDA graph);
- at TP=N, the decode step again with bf16 sums (``tp_reduce_dtype="model"``; the default sums
  in float32) and with ``tp_all_reduce="symm_mem"``;
- tokens/s of the baseline and of speculation at simulated τ, speedup and η = speedup / τ
  (fixed shapes; at the 8B shape also adaptive speculation up to the tree, asked for at every
  TP size: its cost table is measured at start-up, rank 0's timings on every rank).

Goals: 70B TP=2 batch-1 decode step ≥ 80 % of the per-GPU bound; 70B chain S=3 at
τ=4, batch 1: η ≥ 0.75; 8B TP=2 decode step ≤ 0.62× the TP=1 step.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch

HERE = Path(__file__).resolve().parent
SHAPES = {
    # name: LlamaConfig fields
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256),
}
# fixed shapes (adaptive speculation, on by default on one GPU, would pick its own at TP=1 only)
CHAIN = {"method": "eagle3", "num_steps": 3, "topk": 1, "adaptive": False}
TREE = {"method": "eagle3", "num_steps": 4, "topk": 4, "num_draft_tokens": 16, "adaptive": False}
ADAPTIVE = dict(TREE, adaptive=True)  # off, chains of 1 and 3, the tree: from costs measured at start-up


def _bench_scale():
    spec = importlib.util.spec_from_file_location("phasegraph_bench_scale", HERE / "bench_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def random_target(shape: str, group, layers: int | None = None, device: str = "cuda"):
    """An HFTarget of ``shape`` whose decoder layers are this rank's random slices, built on the
    GPU without the whole model: one full layer is built (for the modules around the layers),
    sharded as a template, and every layer gets fresh normal(0, 0.02) tensors of its shapes."""
    from transformers import LlamaConfig

    from phasegraph.bench.common import fill_random_weights
    from phasegraph.runtime.models.fused_decoder import shard_layer
    from phasegraph.runtime.models.target import HFTarget, build_causal_lm, eagle3_feature_layers

    fields = dict(SHAPES[shape])
    num_layers = layers or fields["num_hidden_layers"]
    config = LlamaConfig(**{**fields, "num_hidden_layers": 1}, rope_theta=500000.0, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = build_causal_lm(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device,
                            init=False)
    fill_random_weights(model)
    target = HFTarget(model, feature_mode="eagle3")
    template = target.fused_layers[0]
    if group is not None:
        template = shard_layer(template, group.rank, group.world_size, group.device)
    model.model.layers = torch.nn.ModuleList()
    model.__dict__.pop("_phasegraph_fused_layers", None)

    def fresh(t):
        if t is None:
            return None
        return torch.ones_like(t) if t.ndim == 1 else torch.empty_like(t).normal_(0.0, 0.02)

    with torch.no_grad():
        target.fused_layers = [
            attrs.evolve(template, **{name: fresh(getattr(template, name)) for name in (
                "input_norm", "post_norm", "qkv_weight", "o_weight", "gate_up_weight", "down_weight")})
            for _ in range(num_layers)
        ]
    del template
    model.config.num_hidden_layers = num_layers
    target.num_layers = num_layers
    target.feature_layers = eagle3_feature_layers(num_layers)
    target.kv_spec = attrs.evolve(target.kv_spec, num_layers=num_layers,
                                  num_kv_heads=target.fused_layers[0].num_kv_heads)
    target.tp = group
    return target


def rank_weight_bytes(target) -> int:
    """Bytes one rank's decode step streams: its layer slices, the final norm and the lm_head."""
    n = 0
    for layer in target.fused_layers:
        for t in (layer.input_norm, layer.post_norm, layer.qkv_weight, layer.o_weight, layer.gate_up_weight,
                  layer.down_weight):
            n += t.numel() * t.element_size()
    for t in (target.final_norm.weight, target.lm_head.weight):
        n += t.numel() * t.element_size()
    return n


def all_reduce_step_time(group, layers: int, batch: int, hidden: int, repeats: int = 10) -> float | None:
    """GPU time of one step's all-reduces alone: 2 per layer on ``[batch, hidden]`` in the dtype the
    engine sums in (``group.reduce_dtype``, else bf16), captured in one CUDA graph as the engine's
    graphs capture them (through symmetric memory where the group has its buffers)."""
    if group is None:
        return None
    x = torch.zeros(batch, hidden, dtype=group.reduce_dtype or torch.bfloat16, device=group.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(4):
            group.all_reduce_(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    group.start_forward()
    with torch.cuda.graph(graph):
        for _ in range(2 * layers):
            group.all_reduce_(x)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    del graph
    return statistics.median(times)


def timed_generate(engine, prompts, new_tokens: int) -> dict:
    """Warm the batch's graphs up with a short run, then time one whole generate call."""
    from phasegraph import SamplingParams

    engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    lens = [x for o in outs for x in o.stats.accept_lengths]
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "tau_measured": sum(lens) / len(lens) if lens else None,
            "iterations": len(lens) // max(1, len(prompts)) or None}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def measure_shape(shape: str, group, bs, args, log, out: dict, save) -> None:
    """Fill ``out`` with ``shape``'s rows, calling ``save()`` after every group of rows (a run cut
    short keeps what it measured)."""
    from phasegraph import Engine, SpecConfig

    tp = 1 if group is None else group.world_size
    batches = args.batches_70b if shape == "70B" else args.batches_8b
    taus = args.taus_70b if shape == "70B" else [4]
    configs = {"chain S=3": CHAIN}
    if shape == "8B":
        configs |= {"tree K=4 S=4 N=16": TREE, "adaptive up to the tree": ADAPTIVE}
    target = random_target(shape, group, args.layers)
    head = bs.build_eagle3_head(target)
    bw = bs.copy_bandwidth()
    wbytes = rank_weight_bytes(target)
    out.update({"shape": shape, "tp": tp, "layers": target.num_layers, "weight_bytes_per_gpu": wbytes,
                "copy_bandwidth_Bps": bw, "bound_s": wbytes / bw, "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens, "baseline": [], "spec": []})
    log(f"{shape} TP={tp}: {wbytes / 1e9:.1f} GB a GPU, bound {1e3 * wbytes / bw:.2f} ms at {bw / 1e12:.2f} TB/s")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.vocab_size, (max(batches), args.prompt_tokens), generator=g).tolist()
    engine_kw = dict(max_batch_size=max(batches), kv_pool_tokens=max(batches) * (args.prompt_tokens + args.new_tokens
                                                                                 + 128),
                     max_context=1024, validate="off", trace=False, tensor_parallel_size=tp,
                     graph_buckets=batches)  # the batches timed: the adaptive warm-up captures no other
    base = Engine(_baseline_view(target), spec=SpecConfig(method="none"), **engine_kw)
    base_tps = {}
    for b in batches:
        step = bs.decode_step_time(base, b, context=args.prompt_tokens)
        row = {"batch": b, "decode_step_s": step, "share_of_bound": out["bound_s"] / step,
               "all_reduce_s": all_reduce_step_time(group, target.num_layers, b, target.hidden_size)}
        row.update(timed_generate(base, prompts[:b], args.new_tokens))
        base_tps[b] = row["tokens_per_s"]
        out["baseline"].append(row)
        save()
        ar = "" if row["all_reduce_s"] is None else f", all-reduces {1e3 * row['all_reduce_s']:.2f} ms"
        log(f"  baseline batch {b:>3}: step {1e3 * step:.2f} ms ({100 * row['share_of_bound']:.0f} % of the bound"
            f"{ar}), {row['tokens_per_s']:.1f} tok/s")
    del base
    _free()
    if group is not None:  # the decode step with bf16 sums, as peers reduce
        out["baseline_model_reduce"] = _variant_rows("tp_reduce_dtype=model", dict(tp_reduce_dtype="model"), group,
                                                     target, batches, bs, args, engine_kw, out["bound_s"], log)
        save()
    if group is not None and args.symm_mem:
        out["baseline_symm_mem"] = _variant_rows("symm_mem", dict(tp_all_reduce="symm_mem"), group, target, batches,
                                                 bs, args, engine_kw, out["bound_s"], log)
        save()
    for name, spec_kw in configs.items():
        for tau in taus:
            try:
                engine = Engine(target, head, spec=SpecConfig(**spec_kw), simulate_accept_length=tau, **engine_kw)
            except Exception as exc:  # noqa: BLE001 - recorded (adaptive under TP is new); the other rows stand
                out["spec"].append({"config": name, "tau_simulated": tau, "error": f"{type(exc).__name__}: {exc}"})
                log(f"  {name}: {type(exc).__name__}: {exc}")
                continue
            if engine.scheduler.adaptive is not None:  # every shape's graphs now: a shape first
                engine.warm_up(sampled=False)  # chosen mid-run would capture inside the timed run
            for b in batches:
                row = {"config": name, "tau_simulated": tau, "batch": b}
                row.update(timed_generate(engine, prompts[:b], args.new_tokens))
                row["speedup"] = row["tokens_per_s"] / base_tps[b]
                row["eta"] = row["speedup"] / row["tau_measured"]
                row["iteration_s"] = row["seconds"] / max(1, row["iterations"] or 1)
                out["spec"].append(row)
                save()
                log(f"  {name} SIMULATED τ={tau} batch {b:>3}: {row['tokens_per_s']:.1f} tok/s, speedup "
                    f"{row['speedup']:.2f}, η {row['eta']:.2f}, {1e3 * row['iteration_s']:.2f} ms an iteration "
                    "(wall, prefill included)")
            del engine
            _free()
    del head, target
    _free()


def _variant_rows(name, options, group, target, batches, bs, args, engine_kw, bound, log) -> list[dict]:
    """The decode step and the all-reduces alone with the engine ``options`` (another reduction);
    the error where it does not run here (e.g. torch's symmetric memory; the main rows stand)."""
    from phasegraph import Engine, SpecConfig

    rows = []
    try:
        engine = Engine(_baseline_view(target), spec=SpecConfig(method="none"), **options, **engine_kw)
        for b in batches:
            step = bs.decode_step_time(engine, b, context=args.prompt_tokens)
            row = {"batch": b, "decode_step_s": step, "share_of_bound": bound / step,
                   "all_reduce_s": all_reduce_step_time(group, target.num_layers, b, target.hidden_size)}
            rows.append(row)
            log(f"  baseline {name} batch {b:>3}: step {1e3 * step:.2f} ms ({100 * row['share_of_bound']:.0f} % of "
                f"the bound, all-reduces {1e3 * row['all_reduce_s']:.2f} ms)")
        del engine
    except Exception as exc:  # noqa: BLE001 - recorded; the NCCL rows stand
        rows.append({"error": f"{type(exc).__name__}: {exc}"})
        log(f"  baseline {name}: {type(exc).__name__}: {exc}")
    group.symm.clear()  # the rows after this use NCCL
    _free()
    return rows


def _baseline_view(target):
    """The same weights without EAGLE-3 features (the baseline computes none)."""
    import copy

    view = copy.copy(target)
    view.feature_mode, view.feature_layers, view.feature_size = "none", (), 0
    return view


def goals(results: dict) -> list[str]:
    """The issue's goals from whatever runs are in ``results`` (keyed ``"{shape} TP={n}"``)."""
    lines = []

    def base(key, batch):
        return next((r for r in results.get(key, {}).get("baseline", []) if r["batch"] == batch), None)

    def variant(key, rows, batch):
        return next((r for r in results.get(key, {}).get(rows, []) if r.get("batch") == batch), None)

    r = base("70B TP=2", 1)
    if r:
        share = r["share_of_bound"]
        lines.append(f"70B TP=2 batch-1 decode step {1e3 * r['decode_step_s']:.2f} ms = {100 * share:.1f} % of the "
                     f"per-GPU bound (goal >= 80 %): {'MET' if share >= 0.8 else 'NOT MET'}; all-reduces alone "
                     f"{1e3 * (r['all_reduce_s'] or 0):.2f} ms")
    chain = next((r for r in results.get("70B TP=2", {}).get("spec", [])
                  if r["config"] == "chain S=3" and r["tau_simulated"] == 4 and r.get("batch") == 1), None)
    if chain:
        lines.append(f"70B TP=2 chain S=3 SIMULATED τ=4 batch 1: η {chain['eta']:.2f} (goal >= 0.75): "
                     f"{'MET' if chain['eta'] >= 0.75 else 'NOT MET'}")
    one, two = base("8B TP=1", 1), base("8B TP=2", 1)
    if one and two:
        ratio = two["decode_step_s"] / one["decode_step_s"]
        lines.append(f"8B decode step at batch 1: TP=2 {1e3 * two['decode_step_s']:.2f} ms / TP=1 "
                     f"{1e3 * one['decode_step_s']:.2f} ms = {ratio:.3f} (goal <= 0.62): "
                     f"{'MET' if ratio <= 0.62 else 'NOT MET'}")
    for rows, what in (("baseline_model_reduce", "bf16 sums (tp_reduce_dtype=model)"),
                       ("baseline_symm_mem", "symm_mem all-reduces")):  # the same steps, another reduction
        for key in ("70B TP=2", "8B TP=2"):
            r = variant(key, rows, 1)
            if r:
                extra = ""
                if key == "8B TP=2" and one:
                    extra = f", {r['decode_step_s'] / one['decode_step_s']:.3f}x the TP=1 step"
                lines.append(f"{key} batch-1 decode step with {what}: {1e3 * r['decode_step_s']:.2f} ms = "
                             f"{100 * r['share_of_bound']:.1f} % of the bound{extra}; all-reduces alone "
                             f"{1e3 * r['all_reduce_s']:.2f} ms")
    return lines


def report(directory: Path) -> int:
    results = {}
    for path in sorted(directory.glob("tp*.json")):
        for part in json.loads(path.read_text())["parts"]:
            results[f"{part['shape']} TP={part['tp']}"] = part
    for line in goals(results):
        print(line)
    (directory / "goals.txt").write_text("\n".join(goals(results)) + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="1: the 8B shape on one GPU; N: under torchrun, N ranks")
    p.add_argument("--out", type=Path, default=Path("bench-tp"))
    p.add_argument("--shapes", nargs="+", default=None, help="default: 8B at TP=1; 8B and 70B at TP=2")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quick look)")
    p.add_argument("--batches-8b", type=int, nargs="+", default=[1, 64])
    p.add_argument("--batches-70b", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--taus-70b", type=int, nargs="+", default=[4, 3, 2])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256, help="tokens a request generates (part 2's 256)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="a rank waits this long in a collective")
    p.add_argument("--no-symm-mem", dest="symm_mem", action="store_false",
                   help="skip the decode rows with tp_all_reduce='symm_mem'")
    p.add_argument("--report", type=Path, metavar="DIR", help="print the goals from DIR's tp*.json and stop")
    args = p.parse_args(argv)
    if args.report:
        return report(args.report)
    from phasegraph.runtime.tensor_parallel import current_group

    group = None
    if args.tp > 1:
        group = current_group(args.tp, torch.device("cuda"), args.timeout_s)
        if group is None:
            print(f"--tp {args.tp} runs under torchrun --nproc-per-node {args.tp}", file=sys.stderr)
            return 2
    rank = 0 if group is None else group.rank
    shapes = args.shapes or (["8B"] if args.tp == 1 else ["70B", "8B"])  # the 70B goals first

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    bs = _bench_scale()
    parts: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        if rank == 0:
            (args.out / f"tp{args.tp}.json").write_text(json.dumps(
                {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tp": args.tp,
                 "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",)},
                 "parts": [p for p in parts if "shape" in p]}, indent=1))

    for shape in shapes:
        parts.append({})
        measure_shape(shape, group, bs, args, log, parts[-1], save)
    if group is not None:
        group.close()
    if rank == 0:
        report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
