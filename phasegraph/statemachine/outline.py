"""A phase graph's outline: what a drawing shows of it, as plain data.

Names, the names of each phase's schemas, a one-line summary per phase, the entry, terminals and
edges, with no functions or schema classes: a graph whose phases' modules are costly to import
(the EAGLE phases import torch) can be declared as an outline in a module that imports nothing,
drawn from it, and built into the checked :class:`~phasegraph.statemachine.PhaseGraph` from the
same outline (:meth:`PhaseGraph.from_outline`), so the drawing and the graph cannot drift apart.

This module imports attrs only.
"""

from __future__ import annotations

import re

import attrs


@attrs.frozen
class PhaseOutline:
    """One phase as drawn: its name, its input and output schemas' class names, one line on
    what it does."""

    name: str
    input: str
    output: str
    summary: str = ""


@attrs.frozen
class GraphOutline:
    """A phase graph as drawn (the renderers draw nothing else: a PhaseGraph is drawn through
    its :meth:`~phasegraph.statemachine.PhaseGraph.outline`). Not checked: the graph built
    from it is."""

    name: str
    entry: str
    phases: tuple[PhaseOutline, ...] = attrs.field(converter=tuple)
    edges: tuple[tuple[str, str], ...] = attrs.field(converter=lambda es: tuple(tuple(e) for e in es))
    terminals: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)

    def outline(self) -> GraphOutline:
        """Itself: what a renderer asks any graph for."""
        return self


# a sentence ends at . ! or ? followed by whitespace ("arXiv 2406.16858" and "x.y" go on)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring, whole and on one line (its first line alone may stop
    mid-sentence)."""
    paragraph = doc.strip().split("\n\n", 1)[0]
    joined = " ".join(paragraph.split())
    return _SENTENCE_END.split(joined, maxsplit=1)[0]
