"""Drawing a phase graph: terminal text, Mermaid, DOT, and SVG/PNG through Graphviz.

Every renderer reads one intermediate description (:func:`describe`), optionally overlaid with
a trace's per-edge statistics (visit counts and mean time of the phase the edge leads to).
Text and Mermaid need nothing; DOT is plain text; SVG and PNG need Graphviz's ``dot`` program.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Protocol

import attrs
import networkx as nx

from phasegraph.statemachine.errors import PhaseGraphError, RendererUnavailable
from phasegraph.statemachine.outline import GraphOutline
from phasegraph.statemachine.trace import EdgeStats, Trace

TEXT_FORMATS = ("text", "mermaid", "dot")
BINARY_FORMATS = ("svg", "png")
FORMATS = TEXT_FORMATS + BINARY_FORMATS


class Drawable(Protocol):
    """What a renderer draws: anything with an outline (a
    :class:`~phasegraph.statemachine.PhaseGraph`, or a :class:`GraphOutline` itself, which a
    command can draw without importing the phases' modules)."""

    def outline(self) -> GraphOutline: ...


@attrs.frozen
class NodeView:
    name: str
    input: str
    output: str
    summary: str
    entry: bool
    terminal: bool
    visits: int | None = None
    mean_s: float | None = None
    notes: tuple[tuple[str, int], ...] = ()  # the trace's notes of its runs, in order (run lengths)
    collective_s: float | None = None  # mean seconds a run spent in collectives (None: not measured)


@attrs.frozen
class EdgeView:
    source: str
    target: str
    stats: EdgeStats | None = None


@attrs.frozen
class GraphView:
    name: str
    entry: str
    nodes: tuple[NodeView, ...]
    edges: tuple[EdgeView, ...]
    traced: bool


def describe(graph: Drawable, trace: Trace | None = None) -> GraphView:
    """The intermediate representation every renderer consumes."""
    outline = graph.outline()
    names = {p.name for p in outline.phases}
    stats = trace.edge_stats() if trace is not None else {}
    unknown = sorted({n for edge in stats for n in edge if n is not None and n not in names})
    if unknown:
        raise PhaseGraphError(
            f"the trace names phases {unknown} that graph {outline.name!r} does not declare"
        )
    declared = set(outline.edges) | {(None, outline.entry)}
    undeclared = sorted(f"{a or '(start)'} -> {b}" for a, b in stats if (a, b) not in declared)
    if undeclared:
        raise PhaseGraphError(
            f"the trace took transitions {undeclared} that graph {outline.name!r} does not declare"
        )
    visits: dict[str, list[EdgeStats]] = {}
    for (_, target), s in stats.items():
        visits.setdefault(target, []).append(s)
    nodes = []
    for p in outline.phases:
        vs = visits.get(p.name)
        count = sum(s.count for s in vs) if vs else (0 if trace is not None else None)
        mean = (sum(s.total_s for s in vs) / count) if vs else None
        nodes.append(
            NodeView(
                p.name, p.input, p.output, p.summary,
                p.name == outline.entry, p.name in outline.terminals, count, mean,
                tuple(trace.notes(p.name)) if trace is not None else (),
                trace.collective_mean(p.name) if trace is not None else None,
            )
        )
    edges = [EdgeView(a, b, stats.get((a, b))) for a, b in outline.edges]
    if trace is not None:
        entry_stats = stats.get((None, outline.entry))
        if entry_stats is not None:
            edges.insert(0, EdgeView("(start)", outline.entry, entry_stats))
    return GraphView(outline.name, outline.entry, tuple(nodes), tuple(edges), trace is not None)


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1e-1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-4:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _edge_label(e: EdgeView) -> str:
    if e.stats is None:
        return ""
    return f"×{e.stats.count} · {_fmt_time(e.stats.mean_s)}"


def to_text(view: GraphView) -> str:
    lines = [f"phase graph {view.name!r} (entry: {view.entry})", ""]
    g = nx.DiGraph()
    g.add_nodes_from(n.name for n in view.nodes)
    g.add_edges_from((e.source, e.target) for e in view.edges if e.source != "(start)")
    lines += list(nx.generate_network_text(g, sources=[view.entry]))
    lines += ["", "phases:"]
    width = max(len(n.name) for n in view.nodes)
    for n in view.nodes:
        tag = " [entry]" if n.entry else (" [terminal]" if n.terminal else "")
        visit = ""
        if view.traced:
            visit = f"  visits={n.visits} mean={_fmt_time(n.mean_s)}{_collective(n, '  collectives=')}"
        lines.append(f"  {n.name:<{width}}  {n.input} -> {n.output}{tag}{visit}")
        if n.summary:
            lines.append(f"  {'':<{width}}  {n.summary}")
    noted = [n for n in view.nodes if n.notes]
    if noted:
        lines += ["", "notes (in order; ×count of consecutive runs):"]
        for n in noted:
            totals: dict[str, int] = {}
            for note, count in n.notes:
                totals[note] = totals.get(note, 0) + count
            lines.append(f"  {n.name}: " + ", ".join(f"{k} ×{v}" for k, v in totals.items()))
            lines.append(f"  {'':<{len(n.name)}}  " + _timeline(n.notes))
    lines += ["", "edges:"]
    for e in view.edges:
        label = _edge_label(e)
        lines.append(f"  {e.source} -> {e.target}" + (f"  ({label})" if label else ""))
    return "\n".join(lines) + "\n"


def _collective(n: NodeView, prefix: str) -> str:
    """The mean time a run spent in collectives, where the trace measured it."""
    return "" if n.collective_s is None else prefix + _fmt_time(n.collective_s)


def _timeline(runs: tuple[tuple[str, int], ...], most: int = 12) -> str:
    """The runs as ``a ×3 → b ×10 → ...``, the first ``most`` and the count of the rest."""
    parts = [f"{note} ×{count}" for note, count in runs[:most]]
    if len(runs) > most:
        parts.append(f"... {len(runs) - most} more")
    return " → ".join(parts)


def _mermaid_id(name: str) -> str:
    return "p_" + "".join(c if c.isalnum() else "_" for c in name)


def to_mermaid(view: GraphView) -> str:
    lines = ["flowchart TD"]
    if view.traced and any(e.source == "(start)" for e in view.edges):
        lines.append('    start(("start"))')
    for n in view.nodes:
        detail = f"{n.input} → {n.output}"
        if view.traced:
            detail += f"<br/>visits {n.visits} · mean {_fmt_time(n.mean_s)}{_collective(n, '<br/>collectives ')}"
        shape = ('(["', '"])') if n.entry else ('["', '"]')
        lines.append(f"    {_mermaid_id(n.name)}{shape[0]}{n.name}<br/><small>{detail}</small>{shape[1]}")
    for e in view.edges:
        src = "start" if e.source == "(start)" else _mermaid_id(e.source)
        label = _edge_label(e)
        arrow = f' -->|"{label}"| ' if label else " --> "
        lines.append(f"    {src}{arrow}{_mermaid_id(e.target)}")
    return "\n".join(lines) + "\n"


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(view: GraphView) -> str:
    lines = [
        f"digraph {_dot_quote(view.name)} {{",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fillcolor="#eef3fb", fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=10];',
    ]
    for n in view.nodes:
        label = f"{n.name}\\n{n.input} → {n.output}"
        if view.traced:
            label += f"\\nvisits {n.visits} · mean {_fmt_time(n.mean_s)}" + _collective(n, "\\ncollectives ")
        extra = ', peripheries=2, fillcolor="#dff0d8"' if n.entry else ""
        label_attr = '"' + label.replace('"', '\\"') + '"'
        tooltip = _dot_quote(n.summary)
        lines.append(f"  {_dot_quote(n.name)} [label={label_attr}, tooltip={tooltip}{extra}];")
    for e in view.edges:
        if e.source == "(start)":
            lines.append('  "(start)" [shape=point];')
        label = _edge_label(e)
        attr = f" [label={_dot_quote(label)}]" if label else ""
        lines.append(f"  {_dot_quote(e.source)} -> {_dot_quote(e.target)}{attr};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(graph: Drawable, fmt: str = "text", trace: Trace | None = None) -> str:
    """Render to a text format: ``text``, ``mermaid`` or ``dot``."""
    view = describe(graph, trace)
    if fmt == "text":
        return to_text(view)
    if fmt == "mermaid":
        return to_mermaid(view)
    if fmt == "dot":
        return to_dot(view)
    if fmt in BINARY_FORMATS:
        raise PhaseGraphError(f"{fmt!r} is a binary format: use render_bytes")
    raise PhaseGraphError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def to_pydot(graph: Drawable, trace: Trace | None = None):
    """The graph as a ``pydot.Dot`` (the ``[diagrams]`` extra), for users who lay it out or
    style it further themselves."""
    try:
        import pydot
    except ImportError:
        raise RendererUnavailable(
            "to_pydot needs pydot: pip install 'phasegraph[diagrams]' (or pip install pydot)"
        ) from None
    (dot,) = pydot.graph_from_dot_data(render(graph, "dot", trace))
    return dot


def graphviz_available() -> bool:
    return shutil.which("dot") is not None


def render_bytes(graph: Drawable, fmt: str, trace: Trace | None = None) -> bytes:
    """Render to any format as bytes; ``svg`` and ``png`` run Graphviz's ``dot``."""
    if fmt in TEXT_FORMATS:
        return render(graph, fmt, trace).encode()
    if fmt not in BINARY_FORMATS:
        raise PhaseGraphError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    dot = shutil.which("dot")
    if dot is None:
        raise RendererUnavailable(
            f"--format {fmt} needs Graphviz's `dot` program, which is not installed. Install "
            "Graphviz (Debian/Ubuntu: `apt install graphviz`; macOS: `brew install graphviz`; "
            "conda: `conda install graphviz`), or use --format text, mermaid or dot, which need "
            "nothing."
        )
    source = render(graph, "dot", trace)
    proc = subprocess.run([dot, f"-T{fmt}"], input=source.encode(), capture_output=True, check=False)
    if proc.returncode != 0:
        raise PhaseGraphError(f"Graphviz failed: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout
