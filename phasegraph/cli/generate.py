"""``phasegraph generate``: completions from the command line.

::

    phasegraph generate --target DIR [--draft DIR [--method M]] --prompt "def fib(n):"
        [--prompt TEXT ... | --prompt-file FILE ... | --prompt - (stdin) | --prompt-ids IDS ...]
        [--max-new-tokens N] [--topk K --num-steps S --num-draft-tokens N] [--page-size P]
        [--temperature T --top-p P --top-k K --min-p P --seed S] [--stop STR ...] [--threads N] [--trace FILE]
        [--repetition-penalty R --frequency-penalty F --presence-penalty F]
        [--json-schema FILE | --regex RE | --grammar FILE] [--jsonl [--logprobs K]]

Prints the completion on stdout (several prompts: each completion under a ``--- completion i of
n ---`` line, in the prompts' order; with ``--jsonl`` one JSON object a line, logprobs included); a progress bar (for long generations) and the statistics
(mean acceptance length, tokens, time) on stderr. Without ``--method``, a ``--draft`` directory
selects the kind of draft it holds. ``--trace FILE`` saves the run's phase trace as Chrome-trace
JSON, which ``phasegraph graph --trace FILE`` overlays on the drawn graph.

Ctrl-C stops the run between two engine steps: what was generated so far is printed, the
summary says ``interrupted after N tokens`` and the exit status is 130 (a second Ctrl-C quits at
once). Every error the runtime raises on purpose ends as one ``phasegraph: error: ...`` line and
exit status 2 (:func:`phasegraph.cli.main`), naming the command's flags, not the library's
parameters.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
import time
import warnings

from phasegraph.cli.common import (
    CliError,
    add_command,
    load_engine,
    model_spec,
    read_text_file,
    require_name,
    writable_file,
)

PROGRESS_MIN_TOKENS = 32  # show a progress bar from this many new tokens on
INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C (128 + SIGINT), as the shell's

# The library's messages name its parameters; this command's user knows only its flags.
FLAG_OF_PARAMETER = {
    "method": "--method", "num_steps": "--num-steps", "topk": "--topk", "num_draft_tokens": "--num-draft-tokens",
    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
    "seed": "--seed", "stop": "--stop", "page_size": "--page-size", "kv_pool_tokens": "--kv-pool-tokens",
    "max_context": "--max-context",
    "num_threads": "--threads", "dtype": "--dtype", "draft_dtype": "--draft-dtype", "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty", "frequency_penalty": "--frequency-penalty",
    "presence_penalty": "--presence-penalty", "logprobs": "--logprobs", "json_schema": "--json-schema",
}
# renamed anywhere: names no prose uses ("SpecConfig.topk", "max_new_tokens", "topk=4")
_PARAMETER = re.compile(
    r"\bSpecConfig\.(\w+)|(?<![\w-])(" + "|".join(n for n in FLAG_OF_PARAMETER if "_" in n or n == "topk") + r")\b"
)
# renamed only where a message starts with them ("temperature must be >= 0"): they are words too
_LEADING_WORD = re.compile(r"^(method|temperature|seed|stop|dtype|logprobs)(?= must\b)")


def flag_names(message: str) -> str:
    """``message`` with the library's parameter names turned into this command's flags."""
    message = message.removeprefix("SpecConfig: ")
    message = re.sub(r" (?:\(or None: [^)]*\)|or None)(?=;)", "", message)  # a flag cannot be None
    message = _PARAMETER.sub(lambda m: FLAG_OF_PARAMETER.get(m[1] or m[2], m[0]), message)
    return _LEADING_WORD.sub(lambda m: FLAG_OF_PARAMETER[m[1]], message)


def add_parser(sub) -> None:
    p = add_command(sub, "generate", "generate completions with a target model (and a draft for speculative "
                    "decoding)", "Generate a completion of each prompt; speculative when a draft is given. "
                    "Ctrl-C stops the run and prints what was generated so far (exit status 130).",
                    model_options=True)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", metavar="TEXT",
                        help="prompt text, '-' to read it from stdin (needs the target's tokenizer); "
                             "repeat it for a batch")
    prompt.add_argument("--prompt-file", action="append", metavar="FILE",
                        help="read the prompt from FILE (UTF-8, taken exactly); repeat it for a batch")
    prompt.add_argument("--prompt-ids", action="append", metavar="IDS",
                        help="prompt token ids, e.g. '1,2,3'; repeat it for a batch")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="new tokens per prompt at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default: %(default)s, greedy)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the smallest set of tokens holding this probability (default: %(default)s, all)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample from the K likeliest tokens (default: %(default)s, off)")
    p.add_argument("--seed", type=int, metavar="S",
                   help="sampling seed, the same tokens in any batch (default: one per request, from the engine's seed)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the text holds STR (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token (default: stop)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="keep the tokens at least P times as likely as the likeliest (default: %(default)s, off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide the logits of tokens already in the prompt or output by R (default: %(default)s, off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F per time a token was generated, in [-2, 2] (default: %(default)s)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F once a token was generated, in [-2, 2] (default: %(default)s)")
    constrained = p.add_mutually_exclusive_group()
    constrained.add_argument("--json-schema", metavar="FILE",
                             help="the output is JSON that this JSON-schema file allows (needs the grammar extra; "
                                  "default: unconstrained)")
    constrained.add_argument("--regex", metavar="RE", help="the output matches this regular expression (default: none)")
    constrained.add_argument("--grammar", metavar="FILE",
                             help="the output follows this EBNF grammar file, root rule 'root' (default: none)")
    p.add_argument("--jsonl", action="store_true",
                   help="print each completion as one JSON line (text, token ids, finish reason, acceptance "
                        "lengths, logprobs) instead of its text (default: the text)")
    p.add_argument("--logprobs", type=int, metavar="K",
                   help="with --jsonl: each token's logprob and the K likeliest tokens' (K in [0, 20]; default: none)")
    p.add_argument("--trace", metavar="FILE", help="save the phase trace (Chrome-trace JSON) to FILE (default: none)")
    p.add_argument("--no-progress", action="store_true", help="never show a progress bar (default: shown "
                   f"from --max-new-tokens {PROGRESS_MIN_TOKENS} on)")
    p.set_defaults(func=run_generate)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise CliError(f"--prompt-ids must be integers separated by commas or spaces; got {text!r}") from None
    if not ids:
        raise CliError("--prompt-ids is empty")
    return ids


def _prompt_file(path: str) -> str:
    return read_text_file(path, "--prompt-file")


def _structured(args: argparse.Namespace) -> dict:
    """The SamplingParams of --json-schema, --regex or --grammar (at most one: argparse sees to that)."""
    if args.json_schema is not None:
        return {"json_schema": read_text_file(args.json_schema, "--json-schema")}
    if args.grammar is not None:
        return {"grammar": read_text_file(args.grammar, "--grammar")}
    return {"regex": args.regex} if args.regex is not None else {}


def _stdin_prompt() -> str:
    text = sys.stdin.read()
    if not text:
        raise CliError("--prompt - read an empty prompt from stdin")
    return text


def _prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """Every prompt, in the order given (one option kind per run: argparse sees to that)."""
    if args.prompt_ids:
        return [_token_ids(ids) for ids in args.prompt_ids]
    if args.prompt_file:
        return [_prompt_file(path) for path in args.prompt_file]
    if args.prompt.count("-") > 1:
        raise CliError("--prompt - reads stdin, which holds one prompt: give it once")
    return [_stdin_prompt() if text == "-" else text for text in args.prompt]


class _CtrlC:
    """Ctrl-C while the engine generates: the first one asks it to stop between two steps (so the
    output holds every token generated, and no step is cut in half); a second one raises
    KeyboardInterrupt at once. Only the main thread may set a signal handler; elsewhere Ctrl-C
    keeps Python's behaviour."""

    def __init__(self) -> None:
        self.pressed = False
        self._installed = False
        self._previous = None

    def __enter__(self) -> _CtrlC:
        # a process started with SIGINT ignored (a shell's background job) keeps ignoring it
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def _on_sigint(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)

    def asked(self) -> bool:
        return self.pressed


def _write_outputs(engine, outs, jsonl: bool = False) -> None:
    if jsonl:
        for out in outs:
            sys.stdout.write(json.dumps(_record(out), ensure_ascii=False) + "\n")
        sys.stdout.flush()
        return
    for i, out in enumerate(outs, 1):
        if len(outs) > 1:
            sys.stdout.write(f"--- completion {i} of {len(outs)} ---\n")
        text = out.text if engine.tokenizer is not None else " ".join(map(str, out.token_ids))
        sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _record(out) -> dict:
    """One completion as --jsonl prints it."""
    record = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
              "accept_lengths": out.stats.accept_lengths}
    if out.logprobs is not None:
        record["logprobs"] = out.logprobs
    if out.top_logprobs is not None:
        record["top_logprobs"] = [[list(pair) for pair in alts] for alts in out.top_logprobs]
    return record


def _summary(engine, out, method: str, max_new_tokens: int, stopped: bool) -> tuple[str, str]:
    """(what one request's statistics say, how it ended)."""
    tau = out.stats.mean_accept_length
    accept = (
        f"mean acceptance length: {tau:.2f} over {len(out.stats.accept_lengths)} verify steps"
        if tau is not None else f"mean acceptance length: n/a (method {method})"
    )
    if out.stats.nonfinite_drafts:
        accept += (f" (in {out.stats.nonfinite_drafts} of them the draft's logits were not finite, "
                   "so verify rejected its drafts: check the draft's weights and dtype)")
    if stopped and out.finish_reason == "abort":
        return accept, f"interrupted after {len(out.token_ids)} tokens"
    ending = f"finish reason: {out.finish_reason}"
    if out.finish_reason == "length" and len(out.token_ids) < max_new_tokens:
        ending += (f" (the model's context of {engine.max_context} tokens holds the "
                   f"{len(out.prompt_token_ids)}-token prompt and {len(out.token_ids)} new ones, "
                   f"not the {max_new_tokens} asked for)")
    return accept, ending


def _print_summary(engine, outs, method: str, args: argparse.Namespace, seconds: float, stopped: bool) -> None:
    total = sum(len(o.token_ids) for o in outs)
    rate = total / seconds if seconds > 0 else float("inf")
    timing = f"{total} tokens in {seconds:.2f} s ({rate:.1f} tok/s)"
    if len(outs) == 1:
        accept, ending = _summary(engine, outs[0], method, args.max_new_tokens, stopped)
        print(f"[{method}] {accept}; {timing}, {ending}", file=sys.stderr)
        return
    for i, out in enumerate(outs, 1):
        accept, ending = _summary(engine, out, method, args.max_new_tokens, stopped)
        print(f"completion {i}: {accept}; {len(out.token_ids)} tokens, {ending}", file=sys.stderr)
    ending = f", interrupted after {total} tokens" if stopped else ""
    print(f"[{method}] {len(outs)} prompts: {timing}{ending}", file=sys.stderr)


def run_generate(args: argparse.Namespace) -> int:
    from phasegraph.runtime.errors import InvalidConfig, InvalidRequest

    try:
        return _generate(args)
    except (InvalidConfig, InvalidRequest) as exc:
        raise CliError(flag_names(str(exc))) from None


def _generate(args: argparse.Namespace) -> int:
    from phasegraph.runtime.config import MAX_LOGPROBS, SamplingParams
    from phasegraph.runtime.errors import NonFiniteDraftWarning, RequestFailed

    require_name("--trace", args.trace, "file")
    spec = model_spec(args)
    method = spec.method
    if args.logprobs is not None and not args.jsonl:
        raise CliError("--logprobs needs --jsonl: the plain text output has no place for them")
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        raise CliError(f"--logprobs must be in [0, {MAX_LOGPROBS}] (the likeliest tokens per position); "
                       f"got {args.logprobs}")
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, logprobs=False if args.logprobs is None else args.logprobs,
        **_structured(args),
    )
    prompts = _prompts(args)
    if args.trace:  # fail before the run, not after it
        writable_file(args.trace, "--trace")
    engine = load_engine(args, spec, trace=bool(args.trace))
    if engine.tokenizer is None:
        if any(isinstance(p, str) for p in prompts):
            raise CliError(f"--target {args.target} has no tokenizer, so --prompt TEXT cannot be encoded: "
                           "pass the prompt's token ids with --prompt-ids (e.g. --prompt-ids 1,2,3)")
        if args.stop:
            raise CliError(f"--stop needs the target's tokenizer to match text, and --target {args.target} has none")
    # under torchrun every rank runs this command: rank 0 speaks, and Ctrl-C (which may reach
    # the ranks at different steps) is left to torchrun, since the ranks must stop together
    spmd = engine.tp is not None and engine.tp.mode == "spmd"
    quiet = spmd and engine.tp.rank != 0
    progress = not args.no_progress and args.max_new_tokens >= PROGRESS_MIN_TOKENS and not quiet
    start = time.perf_counter()
    try:
        with engine, warnings.catch_warnings(), _CtrlC() as ctrl_c:  # the summary line says it, in one line
            warnings.simplefilter("ignore", NonFiniteDraftWarning)
            outs = engine.generate(prompts, params, progress=progress, should_stop=None if spmd else ctrl_c.asked)
    except RequestFailed as exc:  # show what came before the failure, then the error
        if not quiet:
            _write_outputs(engine, exc.outputs, args.jsonl)
        raise CliError(str(exc)) from None
    seconds = time.perf_counter() - start
    if quiet:
        return 0
    _write_outputs(engine, outs, args.jsonl)
    _print_summary(engine, outs, method, args, seconds, ctrl_c.pressed)
    if args.trace:
        path = engine.save_trace(args.trace)
        print(f"wrote the phase trace to {path} (draw it: phasegraph graph --trace {path})", file=sys.stderr)
    return INTERRUPTED if ctrl_c.pressed else 0
