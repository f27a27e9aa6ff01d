"""Acceptance length τ of a trained pair through the public Engine, on held-out stdlib prompts.

    python benchmarks/measure_acceptance.py PAIR_DIR [--device cpu|cuda] [--prompts 16] [--tokens 128]

PAIR_DIR holds ``target/`` (HF format + tokenizer) and ``eagle3/``. Greedy decoding, float32:
every speculative output must equal the baseline's, and τ is printed for the demo's chain
(S=3) and tree (K=4, S=4, N=16) settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("pair", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-lines", type=int, default=24)
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="keep each prompt's last N tokens")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on (GPU only)")
    args = ap.parse_args(argv)
    import torch

    from phasegraph import Engine, SamplingParams, SpecConfig
    from phasegraph.train.corpus import heldout_prompts

    if args.device == "cpu":
        torch.set_num_threads(2)
    prompts = [p.text for p in heldout_prompts(max_lines=args.max_lines, min_lines=min(8, args.max_lines), max_prompts=args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens)
    configs = {
        "none": SpecConfig(method="none"),
        "chain S=3": SpecConfig(method="eagle3", num_steps=3, topk=1, adaptive=False),
        "tree K=4 S=4 N=16": SpecConfig(method="eagle3", num_steps=4, topk=4, num_draft_tokens=16, adaptive=False),
    }
    results, base = {}, None
    for name, spec in configs.items():
        draft = args.pair / "eagle3" if spec.speculative else None
        eng = Engine.from_pretrained(args.pair / "target", draft, spec=spec, device=args.device,
                                     dtype="float32", max_batch_size=max(16, args.prompts),
                                     cuda_graphs=args.graphs if args.device == "cuda" else None)
        if args.max_prompt_tokens:
            prompts = [eng.tokenizer(p)["input_ids"][-args.max_prompt_tokens:] if isinstance(p, str) else p
                       for p in prompts]
        start = time.perf_counter()
        outs = eng.generate(prompts, params)
        seconds = time.perf_counter() - start
        lens = [n for o in outs for n in o.stats.accept_lengths]
        tokens = [o.token_ids for o in outs]
        if base is None:
            base = tokens
        results[name] = {
            "tau": sum(lens) / len(lens) if lens else None,
            "identical_to_baseline": tokens == base,
            "tokens": sum(len(t) for t in tokens),
            "seconds": seconds,
        }
        r = results[name]
        tau = f"{r['tau']:.3f}" if r["tau"] is not None else "-"
        print(f"{name:<20} tau={tau:<7} tokens={r['tokens']} {r['tokens'] / seconds:8.1f} tok/s "
              f"identical={r['identical_to_baseline']}", flush=True)
    first = prompts[0] if isinstance(prompts[0], str) else eng.tokenizer.decode(prompts[0])
    print("sample completion:\n" + first[-200:] + outs[0].text)
    print(json.dumps(results))
    return 0 if all(r["identical_to_baseline"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
