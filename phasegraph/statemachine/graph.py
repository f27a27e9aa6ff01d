"""The declared phase graph: built once, checked once, frozen.

Build-time rules (each a named function; failures raise :class:`InvalidPhaseGraph` listing every
offending phase or field):

- ``known_phases``: every edge, the entry and the terminals name declared phases, names unique;
- ``single_entry``: exactly one entry phase, and no edge leads into it from outside a cycle it
  starts;
- ``reachable``: every phase is reachable from the entry;
- ``no_dead_ends``: every phase has an outgoing edge unless declared terminal (terminals have none);
- ``schema_compatible``: on every edge, the source's output schema satisfies the target's input.

:meth:`PhaseGraph.from_outline` builds a graph from a torch-free :class:`GraphOutline` (its
names, edges and summaries), checking that each phase's name and schemas are the outline's.

Before the rules, the arguments themselves are checked: phases must be :class:`PhaseSpec` (made
with :func:`phase`), edges ``(source, target)`` pairs of phase names, the entry a phase name;
anything else raises :class:`InvalidPhaseGraph` with its findings under ``"declaration"`` (no
rule skips that). ``terminals`` and ``skip_rules`` take one name or a collection of names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs
import networkx as nx

from phasegraph.statemachine.errors import InvalidPhaseGraph, RendererUnavailable
from phasegraph.statemachine.outline import GraphOutline, PhaseOutline
from phasegraph.statemachine.phase import PhaseSpec
from phasegraph.statemachine.render import render, render_bytes
from phasegraph.statemachine.schema import schema_satisfies

Rule = Callable[["PhaseGraph"], list[str]]


def _rule_known_phases(g: PhaseGraph) -> list[str]:
    problems = []
    names = [p.name for p in g._phase_list]
    dupes = sorted({n for n in names if names.count(n) > 1})
    problems += [f"phase {n!r} is declared more than once" for n in dupes]
    known = set(names)
    for a, b in g._edge_list:
        for end in (a, b):
            if end not in known:
                problems.append(f"edge {a!r} -> {b!r} names undeclared phase {end!r}")
    seen: set[tuple[str, str]] = set()
    for edge in g._edge_list:
        if edge in seen:
            problems.append(f"edge {edge[0]!r} -> {edge[1]!r} is declared more than once")
        seen.add(edge)
    if g.entry not in known:
        problems.append(f"entry {g.entry!r} is not a declared phase")
    problems += [f"terminal {t!r} is not a declared phase" for t in g.terminals if t not in known]
    return problems


def _rule_single_entry(g: PhaseGraph) -> list[str]:
    sources = [n for n in g.nx if g.nx.in_degree(n) == 0]
    extra = [n for n in sources if n != g.entry]
    if extra:
        return [f"phase {n!r} has no incoming edge but is not the entry {g.entry!r}" for n in extra]
    return []


def _rule_reachable(g: PhaseGraph) -> list[str]:
    if g.entry not in g.nx:
        return []
    seen = nx.descendants(g.nx, g.entry) | {g.entry}
    return [f"phase {n!r} is unreachable from entry {g.entry!r}" for n in g.nx if n not in seen]


def _rule_no_dead_ends(g: PhaseGraph) -> list[str]:
    problems = []
    for n in g.nx:
        out = g.nx.out_degree(n)
        if n in g.terminals and out:
            problems.append(f"terminal phase {n!r} has outgoing edges")
        elif n not in g.terminals and not out:
            problems.append(f"phase {n!r} is a dead end (no outgoing edge, not declared terminal)")
    return problems


def _rule_schema_compatible(g: PhaseGraph) -> list[str]:
    problems = []
    for a, b in g.nx.edges:
        src, dst = g.phases[a], g.phases[b]
        for why in schema_satisfies(src.output, dst.input):
            problems.append(
                f"edge {a!r} -> {b!r}: output {src.output.__name__} does not satisfy input "
                f"{dst.input.__name__}: {why}"
            )
    return problems


RULES: dict[str, Rule] = {
    "known_phases": _rule_known_phases,
    "single_entry": _rule_single_entry,
    "reachable": _rule_reachable,
    "no_dead_ends": _rule_no_dead_ends,
    "schema_compatible": _rule_schema_compatible,
}


def _names(value: str | Iterable[str]) -> tuple[str, ...]:
    """One name, or a collection of them (a lone string is one name, not its characters)."""
    return (value,) if isinstance(value, str) else tuple(value)


def _declared(
    name: str, phases: Sequence[PhaseSpec], edges: Iterable[tuple[str, str]], entry: str
) -> tuple[tuple[PhaseSpec, ...], tuple[tuple[str, str], ...]]:
    """The phases and edges as tuples, or :class:`InvalidPhaseGraph` (``"declaration"``) naming
    every argument that is not of the declared form."""
    problems = []
    phase_list: tuple = ()
    edge_list: list[tuple[str, str]] = []
    if isinstance(phases, (str, bytes)) or not isinstance(phases, Iterable):
        problems.append(f"phases must be a sequence of PhaseSpec, got {type(phases).__name__}")
    else:
        phase_list = tuple(phases)
        for i, p in enumerate(phase_list):
            if not isinstance(p, PhaseSpec):
                hint = " (decorate it with @phase)" if callable(p) else ""
                problems.append(f"phases[{i}] is a {type(p).__name__}, not a PhaseSpec{hint}")
    if isinstance(edges, (str, bytes)) or not isinstance(edges, Iterable):
        problems.append(f"edges must be a collection of (source, target) pairs, got {type(edges).__name__}")
    else:
        for edge in edges:
            pair = tuple(edge) if isinstance(edge, (tuple, list)) else None
            if pair is None or len(pair) != 2 or not all(isinstance(e, str) for e in pair):
                problems.append(f"edge {edge!r} is not a (source, target) pair of phase names")
            else:
                edge_list.append(pair)
    if not isinstance(entry, str):
        problems.append(f"entry must be a phase name, got {entry!r}")
    if problems:
        raise InvalidPhaseGraph(name, {"declaration": problems})
    return phase_list, tuple(edge_list)


# the edges of the last graph declared under each name: what a coverage report measures against
_DECLARED_EDGES: dict[str, tuple[tuple[str, str], ...]] = {}


def declared_edges(name: str) -> tuple[tuple[str, str], ...] | None:
    """The edges of the last :class:`PhaseGraph` declared as ``name`` in this process (None if none)."""
    return _DECLARED_EDGES.get(name)


class PhaseGraph:
    """An immutable, checked graph of phases (nodes) and legal transitions (edges)."""

    def __init__(
        self,
        name: str,
        phases: Sequence[PhaseSpec],
        edges: Iterable[tuple[str, str]],
        entry: str,
        terminals: Iterable[str] = (),
        *,
        skip_rules: Iterable[str] = (),
    ):
        self.name = name
        self.entry = entry
        self.terminals = frozenset(_names(terminals))
        self._phase_list, self._edge_list = _declared(name, phases, edges, entry)
        self.phases: dict[str, PhaseSpec] = {p.name: p for p in self._phase_list}
        skip_rules = _names(skip_rules)
        unknown_rules = set(skip_rules) - set(RULES)
        if unknown_rules:
            raise InvalidPhaseGraph(name, {"declaration": [
                f"skip_rules names unknown rules {sorted(unknown_rules)}; rules are {sorted(RULES)}"
            ]})
        self.skipped_rules = frozenset(skip_rules)

        g = nx.DiGraph(name=name)
        for p in self._phase_list:
            g.add_node(p.name, phase=p)
        for a, b in self._edge_list:
            if a in self.phases and b in self.phases:
                g.add_edge(a, b)
        self.nx = g
        problems = {}
        for rule_name, rule in RULES.items():
            if rule_name in self.skipped_rules:
                continue
            found = rule(self)
            if found:
                problems[rule_name] = found
        if problems:
            raise InvalidPhaseGraph(name, problems)
        self.nx = nx.freeze(g)
        self._successors: dict[str | None, tuple[str, ...]] = {
            n: tuple(self.nx.successors(n)) for n in self.nx
        }
        self._successors[None] = (entry,)
        self._successor_sets = {k: frozenset(v) for k, v in self._successors.items()}
        _DECLARED_EDGES[name] = self.edges

    @classmethod
    def from_outline(
        cls, outline: GraphOutline, phases: Sequence[PhaseSpec], *, skip_rules: Iterable[str] = ()
    ) -> PhaseGraph:
        """The graph ``outline`` declares (its name, entry, terminals and edges), with ``phases``
        in the outline's order, each given the outline's summary. Every phase the outline names
        must be given once, with the schemas it names, and no other: anything else raises
        :class:`InvalidPhaseGraph` with its findings under ``"outline"``."""
        given = {p.name: p for p in phases if isinstance(p, PhaseSpec)}
        if len(given) != len(phases):  # not PhaseSpecs, or a name twice: the constructor says which
            return cls(outline.name, phases, outline.edges, outline.entry, outline.terminals, skip_rules=skip_rules)
        declared = {o.name: o for o in outline.phases}
        problems = [f"phase {n!r} is in the outline but was not given" for n in declared if n not in given]
        problems += [f"phase {n!r} was given but is not in the outline" for n in given if n not in declared]
        for name in declared.keys() & given.keys():
            o, p = declared[name], given[name]
            for side, drawn, actual in (("input", o.input, p.input), ("output", o.output, p.output)):
                if drawn != actual.__name__:
                    problems.append(f"phase {name!r}: the outline names {side} {drawn}, the phase has {actual.__name__}")
        if problems:
            raise InvalidPhaseGraph(outline.name, {"outline": problems})
        ordered = [attrs.evolve(given[o.name], summary=o.summary) for o in outline.phases]
        return cls(outline.name, ordered, outline.edges, outline.entry, outline.terminals, skip_rules=skip_rules)

    def outline(self) -> GraphOutline:
        """What a drawing shows of this graph; edges in their declared order."""
        phases = tuple(PhaseOutline(p.name, p.input.__name__, p.output.__name__, p.summary) for p in self._phase_list)
        edges = tuple(dict.fromkeys(e for e in self._edge_list if self.nx.has_edge(*e)))
        return GraphOutline(self.name, self.entry, phases, edges, self.terminals)

    # -- queries used on the hot path
    def allowed(self, current: str | None) -> tuple[str, ...]:
        """Phases that may run next after ``current`` (``None`` = before the first phase)."""
        return self._successors.get(current, ())

    def is_allowed(self, current: str | None, requested: str) -> bool:
        s = self._successor_sets.get(current)
        return s is not None and requested in s

    # -- introspection
    @property
    def edges(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.nx.edges)

    def __contains__(self, name: object) -> bool:
        return name in self.phases

    def __iter__(self):
        return iter(self._phase_list)

    def __format__(self, spec: str) -> str:
        if spec in ("", "text", "mermaid", "dot"):
            return render(self, spec or "text")
        return super().__format__(spec)

    def _repr_svg_(self) -> str | None:  # Jupyter
        try:
            return render_bytes(self, "svg").decode()
        except RendererUnavailable:
            return None

    def __repr__(self) -> str:
        return f"PhaseGraph({self.name!r}, phases={len(self.phases)}, edges={len(self.edges)})"
