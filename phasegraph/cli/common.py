"""What every command shares: the user-facing error, the argument parser that reports usage
errors in one line, the checks of file and number options made before any work, and the options
that load a model pair (``generate`` and ``serve``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with usage errors as one ``phasegraph: error: ...`` line, exit status 2
    (subcommand parsers are built with this class too)."""

    def error(self, message: str):
        print(f"phasegraph: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


# ``graph --out FILE``: the format a file name's suffix asks for (any other suffix: text)
FORMAT_OF_SUFFIX = {".png": "png", ".svg": "svg", ".dot": "dot", ".gv": "dot", ".mmd": "mermaid",
                    ".mermaid": "mermaid"}


def graph_format(fmt: str | None, out: str | None) -> str:
    """``--format``, else the one ``--out``'s suffix names, else text; a format that contradicts
    the suffix is a :class:`CliError` (text in a ``.png`` would be no picture)."""
    implied = FORMAT_OF_SUFFIX.get(Path(out).suffix.lower()) if out else None
    if fmt is None:
        return implied or "text"
    if implied is not None and implied != fmt:
        raise CliError(f"--out {out} names a {implied} file but --format is {fmt}: drop --format or "
                       "change the suffix")
    return fmt


def require_at_least(option: str, value: int, least: int) -> None:
    """A :class:`CliError` unless the number given to ``option`` is at least ``least``."""
    if value < least:
        raise CliError(f"{option} must be at least {least}, got {value}")


def require_name(option: str, value: str | None, kind: str) -> None:
    """A :class:`CliError` if ``option`` was given an empty ``kind`` name ("file", "directory"):
    "" would silently mean the current directory, stdout or no file at all."""
    if value is not None and not value.strip():
        raise CliError(f"{option} needs a {kind} name, got an empty one")


def read_text_file(path: str, flag: str) -> str:
    """A UTF-8 file an option names, or a one-line error naming the option."""
    require_name(flag, path, "file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise CliError(f"{flag} {path}: is a directory, not a file") from None
    except UnicodeDecodeError:
        raise CliError(f"{flag} {path}: is not UTF-8 text") from None
    except OSError as exc:
        raise CliError(f"{flag} {path}: cannot be read ({exc.strerror or exc})") from None
    if not text:
        raise CliError(f"{flag} {path} is empty")
    return text


def writable_file(path: str, option: str) -> Path:
    """``path`` as a file a command may write, checked before any work: a :class:`CliError` if it
    names a directory, its directory is missing, or the file cannot be opened for writing (a
    read-only place; the check opens it for appending and removes it again if it was new)."""
    file = Path(path)
    if file.is_dir():
        raise CliError(f"{option} {path}: is a directory, not a writable file path")
    parent = file.resolve().parent
    if not parent.is_dir():
        where = f"{parent} is a file, not a directory" if parent.exists() else f"directory {parent} does not exist"
        raise CliError(f"{option} {path}: {where} (not a writable file path)")
    existed = file.exists()
    try:
        open(file, "ab").close()  # opened only to learn that it can be
    except OSError as exc:
        raise CliError(f"{option} {path}: cannot be written ({exc.strerror or exc})") from None
    if not existed:
        file.unlink(missing_ok=True)
    return file


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options that choose and load a target and its draft (``generate``, ``serve``)."""
    p.add_argument("--target", metavar="DIR", help="target checkpoint directory, Hugging Face format (default: "
                   "the embedded demo pair's target)")
    p.add_argument("--draft", metavar="DIR", help="draft checkpoint directory (default: the embedded pair's "
                   "EAGLE-3 head when --target is not given and --method is not none; else none)")
    p.add_argument(
        "--method", metavar="METHOD",
        help="none | eagle | eagle3 | mtp | standalone | ngram (prompt lookup, no --draft) (default: the kind of "
             "draft --draft holds, else none)",
    )
    p.add_argument("--adaptive", choices=("auto", "on", "off"), default="auto",
                   help="choose each iteration's speculation shape (none, chains, the given one) from costs "
                        "measured at start-up: auto is on on a GPU (default: %(default)s)")
    # the draft's options default to None, so that one given beside --method none is refused
    p.add_argument("--topk", type=int, metavar="K", help="draft tree branching (default: 1, a chain)")
    p.add_argument("--num-steps", type=int, metavar="S", help="draft tree depth (default: 3)")
    p.add_argument("--num-draft-tokens", type=int, metavar="N",
                   help="tree nodes verified, root included (default: S+1 for a chain, else min(K*S, 16)+1)")
    p.add_argument("--page-size", type=int, default=1, metavar="P", help="KV cache tokens per page (default: %(default)s)")
    p.add_argument("--kv-pool-tokens", type=int, metavar="N",
                   help="KV pool size in tokens (default: half the free GPU memory; 32768 on a CPU)")
    p.add_argument("--max-context", type=int, metavar="N",
                   help="tokens per request, prompt and output (default: the target's max_position_embeddings)")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto (default: %(default)s, a GPU when one answers)")
    p.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--draft-dtype", help="the draft's precision (default: --dtype); it moves the "
                   "acceptance length, never the output")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="split the target over N ranks (tensor parallelism): under torchrun --nproc-per-node N "
                        "every rank runs this command, else this process starts the other ranks "
                        "(default: %(default)s)")
    p.add_argument("--draft-tp", type=int, default=1, metavar="N",
                   help="split the draft over the ranks too: 1 (replicated) or --tp's N; standalone and "
                        "EAGLE-3 drafts (default: %(default)s)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch's CPU threads (default: the engine's, 1, the fastest on a busy machine); "
                        "ignored on a GPU")


def add_command(sub, name: str, summary: str, description: str, *, model_options: bool = False):
    """The parser of command ``name``: ``summary`` in ``phasegraph --help``, ``description`` in
    its own help; with ``model_options``, :func:`add_model_options`'s too."""
    p = sub.add_parser(name, help=summary, description=description)
    if model_options:
        add_model_options(p)
    return p


def draft_method(args: argparse.Namespace) -> str:
    """``--method``, else the kind of draft ``--draft`` holds, else none."""
    if args.method or not args.draft:
        return args.method or "none"
    from phasegraph.runtime.models.drafts import draft_kind

    kind = draft_kind(args.draft)
    if kind is None:
        raise CliError(f"cannot tell which kind of draft --draft {args.draft} holds (its config and tensor "
                       "names fit none of eagle, eagle3, mtp, standalone): pass --method")
    return kind


def model_spec(args: argparse.Namespace):
    """The SpecConfig the model options ask for, checked before anything loads: a
    :class:`CliError` for a draft option that the method would ignore or a draft it lacks."""
    from phasegraph.runtime.config import SpecConfig

    for option, path in (("--target", args.target), ("--draft", args.draft)):
        require_name(option, path, "directory")
    if args.target is None:  # the embedded pair, whole unless the target alone is asked for
        from phasegraph.demo import demo_pair_dir

        args.target = str(demo_pair_dir() / "target")
        if args.draft is None and args.method != "none" and _needs_checkpoint(args.method):
            args.draft = str(demo_pair_dir() / "eagle3")
    if args.threads is not None:
        require_at_least("--threads", args.threads, 1)
    method = draft_method(args)
    draft_options = {"--draft": args.draft, "--draft-dtype": args.draft_dtype, "--topk": args.topk,
                     "--num-steps": args.num_steps, "--num-draft-tokens": args.num_draft_tokens}
    if method == "none" and (given := [o for o, v in draft_options.items() if v is not None]):
        # the baseline has no draft: these would be silently ignored
        raise CliError(f"{', '.join(given)} {'was' if len(given) == 1 else 'were'} given with --method none: "
                       f"pass a speculative --method or drop {', '.join(given)}")
    tree = {k: v for k, v in (("topk", args.topk), ("num_steps", args.num_steps),
                              ("num_draft_tokens", args.num_draft_tokens)) if v is not None}
    adaptive = {"auto": None, "on": True, "off": False}[getattr(args, "adaptive", "auto")]
    spec = SpecConfig(method="none") if method == "none" else SpecConfig(method=method, adaptive=adaptive, **tree)
    if spec.speculative and not args.draft and _needs_checkpoint(method):
        raise CliError(f"--method {method} needs --draft DIR")
    return spec


def _needs_checkpoint(method: str | None) -> bool:
    """A draft checkpoint directory is what ``method`` drafts with (not ngram: it builds its own)."""
    from phasegraph.runtime.methods import registered

    found = registered(method) if method else None
    return found is None or found.make_draft is None


def load_engine(args: argparse.Namespace, spec, **options):
    """The Engine the model options describe, with ``spec`` (from :func:`model_spec`) and any
    further EngineConfig ``options``."""
    from phasegraph.runtime.engine import Engine

    if args.threads is not None:
        options["num_threads"] = args.threads
    if args.max_context is not None:
        options["max_context"] = args.max_context
    if args.tp != 1:
        options["tensor_parallel_size"] = args.tp
    if args.draft_tp != 1:
        options["draft_tensor_parallel_size"] = args.draft_tp
    return Engine.from_pretrained(
        args.target, args.draft, spec=spec, device=args.device, dtype=args.dtype,
        draft_dtype=args.draft_dtype, page_size=args.page_size, kv_pool_tokens=args.kv_pool_tokens,
        progress=not getattr(args, "no_progress", True), **options,
    )
