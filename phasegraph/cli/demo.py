"""``phasegraph demo``: speculative decoding on an embedded model, with nothing to download.

The models and their held-out prompts are :mod:`phasegraph.demo`'s: the embedded pair completes
held-out standard-library code; SmolLM2-135M-Instruct (``--model smollm2``) answers HumanEval's
held-out problems through its chat template, one request at a time. The demo prints completions
(each prompt exactly as given, a marker line, then what the model added), the mean acceptance
length τ of chain and tree drafting, tokens/s against the same engine without speculation, and
a summary of the phase flow.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from phasegraph.cli.common import (
    CliError,
    graph_format,
    require_at_least,
    require_name,
    writable_file,
)
from phasegraph.demo import (
    DEFAULT_MODEL,
    DEMO_CHAIN,
    DEMO_KV_TOKENS,
    DEMO_MODELS,
    DEMO_TREE,
    demo_pair_dir,
    demo_prompts,
    smollm2_head_dir,
)

# SmolLM2 runs one request at a time: its prompts are ~150-250 tokens, so a small pool holds one
SMOLLM2_KV_TOKENS = 4096


def _engine(model: dict, spec_kwargs: dict, device: str | None, trace: bool):
    from phasegraph import Engine, SpecConfig

    spec = SpecConfig(**spec_kwargs)
    draft = model["head"] if spec.speculative else None
    return Engine.from_pretrained(
        model["target"], draft, spec=spec, device=device, dtype="float32" if device == "cpu" else None,
        max_batch_size=16, trace=trace, kv_pool_tokens=model["kv_tokens"],
    )


def _run(label: str, spec_kwargs: dict, prompts, params, device, trace=False, model=None, one_at_a_time=False):
    model = model or {"target": demo_pair_dir() / "target", "head": demo_pair_dir() / "eagle3",
                      "kv_tokens": DEMO_KV_TOKENS}
    engine = _engine(model, spec_kwargs, device, trace)
    # warm up: on a GPU, the very run timed below, so that every Triton kernel is compiled and
    # every CUDA graph bucket (the batch shrinks as requests finish) captured before the clock
    # starts (a short warm-up left both in the timed run: speculation then read 0.2-0.3x);
    # on the CPU nothing is compiled or captured, and one short call warms the allocator
    if device == "cuda":
        engine.generate(prompts, params)
    else:
        engine.generate(prompts[:1], params.__class__(max_new_tokens=4))
    if engine.trace is not None:
        engine.trace.clear()
    start = time.perf_counter()
    if one_at_a_time:  # latency: each request alone, as a chat user waits for it
        outs = [engine.generate([p], params)[0] for p in prompts]
    else:
        outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    lens = [n for o in outs for n in o.stats.accept_lengths]
    tau = sum(lens) / len(lens) if lens else None
    return {"label": label, "engine": engine, "outs": outs, "seconds": seconds,
            "tokens": tokens, "tok_s": tokens / seconds, "tau": tau}


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from phasegraph import SamplingParams
    from phasegraph.kernels import check_kernel_settings
    from phasegraph.runtime.engine import resolve_device
    from phasegraph.statemachine import PhaseGraphError

    smol = args.model == "smollm2"
    if args.head is not None and not smol:
        raise CliError("--head is for --model smollm2 (the embedded pair has its own head)")
    if not smol and not (demo_pair_dir() / "target" / "config.json").exists():
        raise PhaseGraphError(
            f"the embedded model pair is missing from {demo_pair_dir()}; reinstall phasegraph "
            "or train one with `python -m phasegraph.train demo-pair --out DIR`"
        )
    head = Path(args.head) if args.head is not None else smollm2_head_dir()
    if smol and not (head / "config.json").is_file():
        raise CliError(
            f"no SmolLM2 head in {head}: train one with `python -m phasegraph.train smollm2 --out DIR` "
            "and pass --head DIR/eagle3" if args.head is None else f"--head {args.head}: no config.json there"
        )
    require_name("--graph", args.graph, "file")
    graph_file, graph_fmt = _graph_output(args.graph) if args.graph else (None, None)
    if args.prompts is None:  # SmolLM2 decodes ~10 tok/s on a 2-core CPU: two answers per run
        args.prompts = 2 if smol else 4
    for option, value, least in (("--prompts", args.prompts, 1), ("--show", args.show, 0), ("--threads", args.threads, 1)):
        require_at_least(option, value, least)
    # a GPU asked for and missing, or a kernel setting it cannot honour: refused before the header
    torch_device = resolve_device(args.device)
    check_kernel_settings(torch_device)
    device = torch_device.type
    if device == "cpu":
        torch.set_num_threads(max(1, args.threads))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    if smol:
        model, requests, prompts = smollm2_model(head, args.prompts)
        shown, what = requests, "held-out HumanEval problems through the chat template, one at a time"
    else:
        model, prompts = None, demo_prompts(args.prompts)
        shown, what = prompts, "held-out stdlib prompts"
    fewer = f" (asked for {args.prompts}; the held-out set has {len(prompts)})" if len(prompts) < args.prompts else ""
    name = "SmolLM2-135M-Instruct + its EAGLE-3 head" if smol else "embedded pair"
    print(f"phasegraph demo: {name} on {device}, {len(prompts)} {what}{fewer}, "
          f"{args.max_new_tokens} new tokens each, greedy")
    runs = {"model": model, "one_at_a_time": smol}
    base = _run("baseline (target alone)", {"method": "none"}, prompts, params, device, **runs)
    chain = _run("EAGLE-3 chain (S=3)", DEMO_CHAIN, prompts, params, device, **runs)
    tree = _run("EAGLE-3 tree (K=4, S=4, N=16)", DEMO_TREE, prompts, params, device, trace=True, **runs)

    for i, out in enumerate(tree["outs"][: args.show]):
        print()
        show_completion(i + 1, shown[i] + ("\n" if smol else ""), out.text, args.color)
    same = all(a.token_ids == b.token_ids for r in (chain, tree) for a, b in zip(base["outs"], r["outs"], strict=True))
    print("\n=== speed ===")
    print(f"{'configuration':<32}{'tokens/s':>10}{'tau':>8}{'speedup':>9}")
    for r in (base, chain, tree):
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        print(f"{r['label']:<32}{r['tok_s']:>10.1f}{tau:>8}{r['tok_s'] / base['tok_s']:>8.2f}x")
    best = max((chain, tree), key=lambda r: r["tok_s"])
    print(f"best speculative configuration: {best['label']}, {best['tok_s'] / base['tok_s']:.2f}x the baseline's tokens/s")
    print(f"greedy outputs identical to the baseline: {'yes' if same else 'NO'}")
    target = (model or {}).get("target", demo_pair_dir() / "target")
    agrees = _transformers_choices(target, base["outs"]) == [o.token_ids for o in base["outs"]]
    same = same and agrees
    print(f"greedy outputs identical to transformers' greedy choices (its own model and attention): "
          f"{'yes' if agrees else 'NO'}")
    if smol:
        print("note: one request at a time, the setting speculation is for: a verify reads the\n"
              "      weights once for all its tokens, where the baseline reads them once per token.")
    elif device == "cpu":
        print("note: on a CPU a forward's cost grows with every token it processes, so verifying a\n"
              "      tree costs several decode steps and speculation cannot pay on a model this small;\n"
              "      on a GPU a step's cost hardly grows with its tokens, and this pair decodes\n"
              "      1.0-1.4x faster with speculation (docs/performance.md).")
    else:
        print("note: this 7.7M-parameter pair's steps are mostly the host's work on a GPU, so these\n"
              "      speedups move from run to run; `phasegraph bench` measures a 96M pair (docs/performance.md).")
    print("\n=== phase flow (tree run) ===")
    trace = tree["engine"].trace
    times = trace.phase_time()
    total = sum(times.values()) or 1.0
    counts: dict[str, int] = {}
    for t in trace:
        counts[t.target] = counts.get(t.target, 0) + 1
    for phase_name, secs in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {phase_name:<20} x{counts[phase_name]:<5} {100 * secs / total:5.1f}% of phase time")
    if graph_file is not None:
        from phasegraph.phases import EAGLE_GRAPH
        from phasegraph.statemachine.render import render_bytes

        graph_file.write_bytes(render_bytes(EAGLE_GRAPH, graph_fmt, trace))
        print(f"\nwrote the phase graph with this run's trace to {graph_file} ({graph_fmt})")
    return 0 if same else 1


def smollm2_model(head: Path, count: int):
    """The SmolLM2 model (converted from its GGUF on the first run) and the held-out requests,
    as text and as chat-template token ids (the demo's, and ``phasegraph bench``'s real model).
    A missing package raises ``MissingPromptSource``, which the CLI prints as its one error line."""
    from phasegraph.demo import smollm2_prompts, smollm2_target
    from phasegraph.runtime.models.gguf import DONE_MARKER, cache_key, cache_root
    from phasegraph.runtime.models.loading import load_tokenizer
    from phasegraph.train.distill import smollm2_gguf
    from phasegraph.train.prompts import chat_ids

    requests = smollm2_prompts(count)
    if not (cache_root() / cache_key(smollm2_gguf()) / DONE_MARKER).is_file():
        print("converting SmolLM2-135M-Instruct's GGUF once (cached for later runs) ...", flush=True)
    target = smollm2_target()
    tok = load_tokenizer(target)
    prompts = [chat_ids(tok, r) for r in requests]
    return {"target": target, "head": head, "kv_tokens": SMOLLM2_KV_TOKENS}, requests, prompts


def _transformers_choices(target: Path, outs) -> list[list[int]]:
    """Per output in ``outs``: the token transformers' greedy decoding picks at each of its
    positions given the tokens before it, from one forward over the prompt and the output (the
    model loaded by transformers alone, with its own attention). Equal to the output where
    transformers' ``generate`` would have produced it, at the cost of one forward each."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # the demo's output stays its own
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    choices = []
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, os.cpu_count() or 1))  # a whole-sequence forward uses every core
    try:
        for out in outs:
            ids = torch.tensor([out.prompt_token_ids + out.token_ids])  # [1, P + N]
            with torch.no_grad():
                logits = model(ids).logits[0]  # [P + N, V]
            first = len(out.prompt_token_ids) - 1  # the row that predicts the first new token
            choices.append(logits[first : first + len(out.token_ids)].argmax(-1).tolist())
    finally:
        torch.set_num_threads(threads)
    return choices


def show_completion(number: int, prompt: str, completion: str, color: bool = False) -> None:
    """The prompt exactly as the model read it, its final newline kept, then a marker line, then
    the completion: the boundary stays visible (the completion alone is coloured with ``color``)."""
    sys.stdout.write(f"--- prompt {number} ---\n{prompt}")
    if prompt.endswith("\n"):
        print(f"--- completion {number} ---")
    else:  # the marker needs a line of its own; say that the completion goes on the same line
        print(f"\n--- completion {number} (continues the prompt's last line) ---")
    print("\033[32m" + completion + "\033[0m" if color else completion)


def _graph_output(path: str) -> tuple[Path, str]:
    """``--graph FILE``: the file and the format its suffix names (any other suffix: text), checked
    before the demo runs: a missing directory or an SVG/PNG without Graphviz is a :class:`CliError`
    then, not after the three runs."""
    from phasegraph.statemachine.render import BINARY_FORMATS, graphviz_available

    fmt = graph_format(None, path)
    file = writable_file(path, "--graph")
    if fmt in BINARY_FORMATS and not graphviz_available():
        raise CliError(f"--graph {path}: a .{fmt} file needs Graphviz's `dot` program, which is not "
                       "installed; name a .dot, .mmd or .txt file instead, which need nothing")
    return file, fmt


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="speculative decoding on a real model (SmolLM2-135M-Instruct) or the embedded toy pair")
    p.add_argument("--model", default=DEFAULT_MODEL, choices=DEMO_MODELS,
                   help=f"pair: the embedded 7.7M pair; smollm2: SmolLM2-135M-Instruct with its head "
                   f"(needs the packages scripts/install.sh installs) (default {DEFAULT_MODEL})")
    p.add_argument("--head", metavar="DIR", help="--model smollm2: an EAGLE-3 head directory in place of the embedded one")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--prompts", type=int, default=None,
                   help="held-out prompts (default 4 with the pair, 2 with smollm2)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--show", type=int, default=2, help="completions to print (default 2)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the models are small)")
    p.add_argument("--graph", metavar="FILE", help="also write the phase graph overlaid with the run's trace; the suffix names the format "
                        "(.svg/.png need Graphviz; .dot/.gv, .mmd, anything else text)")
    p.add_argument("--color", action="store_true", help="colour the completions")
    p.set_defaults(func=run_demo)
