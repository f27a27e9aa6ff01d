"""The ``phasegraph`` command: ``graph``, ``demo``, ``generate``, ``serve``, ``bench`` and
``import-gguf``, one module each in this package (``python -m phasegraph.train``'s command is
:mod:`phasegraph.cli.train`).

Every failure a user can cause ends with a one-line ``phasegraph: error: ...`` on stderr and
exit status 2, never a traceback. This package is the only place that prints, parses
arguments or picks exit statuses; the library raises named errors, turned into that line here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from phasegraph.bench.common import BenchError
from phasegraph.cli import bench, demo, generate, graph, import_gguf, serve
from phasegraph.cli.common import CliError, Parser
from phasegraph.runtime.errors import PhasegraphRuntimeError
from phasegraph.statemachine import PhaseGraphError

COMMANDS = (graph, demo, generate, serve, bench, import_gguf)  # in the order `phasegraph --help` lists them


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="phasegraph",
        description="EAGLE-style speculative decoding as a typed state graph of phases.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: one line, SystemExit(2) (see Parser)
    try:
        return int(args.func(args) or 0)
    except (CliError, BenchError, PhaseGraphError, PhasegraphRuntimeError, OSError, ValueError) as exc:
        message = str(exc).strip().replace("\n", " ")
        print(f"phasegraph: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phasegraph: interrupted", file=sys.stderr)
        return 130
