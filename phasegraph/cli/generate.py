"""``phasegraph generate``: one completion from the command line.

::

    phasegraph generate --target DIR [--draft DIR --method eagle3] --prompt "def fib(n):"
        [--max-new-tokens N] [--topk K --num-steps S --num-draft-tokens N] [--page-size P]
        [--temperature T --top-p P --top-k K --seed S] [--stop STR ...] [--trace FILE]

Prints the completion on stdout; a progress bar (for long generations) and the statistics
(mean acceptance length, tokens, time) on stderr. ``--trace FILE`` saves the run's phase trace
as Chrome-trace JSON, which ``phasegraph graph --trace FILE`` overlays on the drawn graph.
Every error the runtime raises on purpose ends as one ``phasegraph: error: ...`` line and exit
status 2 (:func:`phasegraph.cli.main`).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from phasegraph.cli.common import (
    CliError,
    add_model_options,
    load_engine,
    model_spec,
    require_name,
    writable_file,
)

PROGRESS_MIN_TOKENS = 32  # show a progress bar from this many new tokens on


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a completion with a target model (and a draft for speculative decoding)",
        description="Generate one completion; speculative when a draft is given.",
    )
    add_model_options(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the target's tokenizer)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, e.g. '1,2,3'")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--top-k", type=int, default=0, metavar="K")
    p.add_argument("--seed", type=int, metavar="S")
    p.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    p.add_argument("--trace", metavar="FILE", help="save the phase trace (Chrome-trace JSON) to FILE")
    p.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    p.set_defaults(func=run_generate)


def _prompt(args: argparse.Namespace):
    if args.prompt is not None:
        return args.prompt
    try:
        ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
    except ValueError:
        raise CliError(f"--prompt-ids must be integers separated by commas or spaces; got {args.prompt_ids!r}") from None
    if not ids:
        raise CliError("--prompt-ids is empty")
    return ids


def _write_output(engine, out) -> None:
    if engine.tokenizer is not None:
        sys.stdout.write(out.text + "\n")
    else:
        sys.stdout.write(" ".join(map(str, out.token_ids)) + "\n")
    sys.stdout.flush()


def run_generate(args: argparse.Namespace) -> int:
    from phasegraph.runtime.config import SamplingParams
    from phasegraph.runtime.errors import NonFiniteDraftWarning, RequestFailed

    require_name("--trace", args.trace, "file")
    spec = model_spec(args)
    method = spec.method
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
    )
    prompt = _prompt(args)
    if args.trace:  # fail before the run, not after it
        writable_file(args.trace, "--trace")
    engine = load_engine(args, spec, trace=bool(args.trace))
    if isinstance(prompt, str) and engine.tokenizer is None:
        raise CliError(f"--target {args.target} has no tokenizer, so --prompt TEXT cannot be encoded: "
                       "pass the prompt's token ids with --prompt-ids (e.g. --prompt-ids 1,2,3)")
    progress = not args.no_progress and args.max_new_tokens >= PROGRESS_MIN_TOKENS
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():  # the summary line below says it, in one line
            warnings.simplefilter("ignore", NonFiniteDraftWarning)
            out = engine.generate([prompt], params, progress=progress)[0]
    except RequestFailed as exc:  # show what came before the failure, then the error
        _write_output(engine, exc.outputs[0])
        raise CliError(str(exc)) from None
    seconds = time.perf_counter() - start
    _write_output(engine, out)
    tau = out.stats.mean_accept_length
    accept = (
        f"mean acceptance length: {tau:.2f} over {len(out.stats.accept_lengths)} verify steps"
        if tau is not None else f"mean acceptance length: n/a (method {method})"
    )
    if out.stats.nonfinite_drafts:
        accept += (f" (in {out.stats.nonfinite_drafts} of them the draft's logits were not finite, "
                   "so verify rejected its drafts: check the draft's weights and dtype)")
    rate = len(out.token_ids) / seconds if seconds > 0 else float("inf")
    capped = ""
    if out.finish_reason == "length" and len(out.token_ids) < args.max_new_tokens:
        capped = (f" (the model's context of {engine.max_context} tokens holds the "
                  f"{len(out.prompt_token_ids)}-token prompt and {len(out.token_ids)} new ones, "
                  f"not the {args.max_new_tokens} asked for)")
    print(
        f"[{method}] {accept}; {len(out.token_ids)} tokens in {seconds:.2f} s ({rate:.1f} tok/s), "
        f"finish reason: {out.finish_reason}{capped}",
        file=sys.stderr,
    )
    if args.trace:
        path = engine.save_trace(args.trace)
        print(f"wrote the phase trace to {path} (draw it: phasegraph graph --trace {path})", file=sys.stderr)
    return 0
