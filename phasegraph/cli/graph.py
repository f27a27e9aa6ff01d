"""``phasegraph graph``: the declared EAGLE phase graph as text, Mermaid, DOT, SVG or PNG,
optionally overlaid with a saved trace.

It draws the graph's torch-free outline (:mod:`phasegraph.phases.outline`, from which the
checked graph is built too), so it never imports torch: text is printed at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from phasegraph.cli.common import CliError, graph_format, require_name, writable_file
from phasegraph.statemachine.render import FORMATS


def run_graph(args: argparse.Namespace) -> int:
    from phasegraph.phases.outline import EAGLE_OUTLINE
    from phasegraph.statemachine import Trace
    from phasegraph.statemachine.render import BINARY_FORMATS, render_bytes

    for option, path in (("--out", args.out), ("--trace", args.trace)):
        require_name(option, path, "file")
    fmt = graph_format(args.format, args.out)
    if args.out:
        writable_file(args.out, "--out")
    trace = Trace.load_chrome(args.trace) if args.trace else None
    data = render_bytes(EAGLE_OUTLINE, fmt, trace)
    if args.out:
        Path(args.out).write_bytes(data)
        print(f"wrote {fmt} of phase graph {EAGLE_OUTLINE.name!r} to {args.out}")
    elif fmt in BINARY_FORMATS and fmt == "png" and sys.stdout.isatty():
        raise CliError("--format png writes binary data: pass --out FILE")
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("graph", help="draw the EAGLE phase graph (optionally overlaid with a trace)")
    p.add_argument("--format", choices=FORMATS,
                   help="output format (default: the one --out's suffix names, .png .svg .dot .gv .mmd; "
                        "else text)")
    p.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument(
        "--trace", metavar="TRACE.json",
        help="a Chrome-trace JSON written by phasegraph: overlay visit counts and mean time per edge",
    )
    p.set_defaults(func=run_graph)
