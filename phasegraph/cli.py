"""The ``phasegraph`` command: ``graph``, ``demo``, ``generate`` and ``bench``.

Every failure a user can cause ends with a one-line ``phasegraph: error: ...`` on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


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


def _cmd_graph(args: argparse.Namespace) -> int:
    from phasegraph.phases import EAGLE_GRAPH
    from phasegraph.statemachine import Trace
    from phasegraph.statemachine.render import BINARY_FORMATS, render_bytes

    for option, path in (("--out", args.out), ("--trace", args.trace)):
        require_name(option, path, "file")
    fmt = graph_format(args.format, args.out)
    if args.out:
        writable_file(args.out, "--out")
    trace = Trace.load_chrome(args.trace) if args.trace else None
    data = render_bytes(EAGLE_GRAPH, fmt, trace)
    if args.out:
        Path(args.out).write_bytes(data)
        print(f"wrote {fmt} of phase graph {EAGLE_GRAPH.name!r} to {args.out}")
    elif fmt in BINARY_FORMATS and fmt == "png" and sys.stdout.isatty():
        raise CliError("--format png writes binary data: pass --out FILE")
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return 0


def _add_graph(sub) -> None:
    from phasegraph.statemachine.render import FORMATS

    p = sub.add_parser("graph", help="draw the EAGLE phase graph (optionally overlaid with a trace)")
    p.add_argument("--format", choices=FORMATS,
                   help="output format (default: the one --out's suffix names, .png .svg .dot .gv .mmd; "
                        "else text)")
    p.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument(
        "--trace", metavar="TRACE.json",
        help="a Chrome-trace JSON written by phasegraph: overlay visit counts and mean time per edge",
    )
    p.set_defaults(func=_cmd_graph)


_SUBCOMMANDS: list[Callable] = [_add_graph]


def register(adder: Callable) -> Callable:
    """Add a subcommand (modules for demo/generate/bench register themselves here)."""
    _SUBCOMMANDS.append(adder)
    return adder


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors as one ``phasegraph: error: ...`` line, exit status 2
    (subcommand parsers are built with this class too)."""

    def error(self, message: str):
        print(f"phasegraph: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="phasegraph",
        description="EAGLE-style speculative decoding as a typed state graph of phases.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _load_subcommand_modules()
    for adder in _SUBCOMMANDS:
        adder(sub)
    return parser


def _load_subcommand_modules() -> None:
    import importlib

    for name in ("phasegraph.demo", "phasegraph.runtime.cli_commands", "phasegraph.bench"):
        importlib.import_module(name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: one line, SystemExit(2) (see _Parser)
    from phasegraph.bench.common import BenchError
    from phasegraph.runtime.errors import PhasegraphRuntimeError
    from phasegraph.statemachine import PhaseGraphError

    try:
        return int(args.func(args) or 0)
    except (CliError, BenchError, PhaseGraphError, PhasegraphRuntimeError, OSError, ValueError) as exc:
        message = str(exc).strip().replace("\n", " ")
        print(f"phasegraph: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phasegraph: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
