"""A graph's outline: the torch-free declaration the renderers draw and the EAGLE graph is
built from, so that the drawing and the checked graph cannot drift apart."""

from __future__ import annotations

import attrs
import pytest

from phasegraph.phases import EAGLE_GRAPH
from phasegraph.phases.eagle import FUNCTIONS, PHASES
from phasegraph.phases.outline import EAGLE_OUTLINE
from phasegraph.statemachine import GraphOutline, InvalidPhaseGraph, PhaseGraph, PhaseOutline
from phasegraph.statemachine.outline import first_sentence
from phasegraph.statemachine.render import render


def test_the_eagle_graph_is_its_outline():
    assert EAGLE_GRAPH.outline() == EAGLE_OUTLINE
    assert render(EAGLE_GRAPH, "text") == render(EAGLE_OUTLINE, "text")
    assert [p.name for p in PHASES] == [p.name for p in EAGLE_OUTLINE.phases]
    assert [p.summary for p in PHASES] == [p.summary for p in EAGLE_OUTLINE.phases]


def _outline(**changes) -> GraphOutline:
    return attrs.evolve(EAGLE_OUTLINE, **changes)


def test_from_outline_refuses_phases_the_outline_does_not_declare():
    verify = next(p for p in EAGLE_OUTLINE.phases if p.name == "verify")
    wrong = attrs.evolve(verify, output="FinalizedPath")
    drawn = _outline(phases=[wrong if p is verify else p for p in EAGLE_OUTLINE.phases])
    with pytest.raises(InvalidPhaseGraph, match="phase 'verify': the outline names output FinalizedPath, "
                                                "the phase has VerifyResult"):
        PhaseGraph.from_outline(drawn, FUNCTIONS)
    with pytest.raises(InvalidPhaseGraph, match="phase 'retract' is in the outline but was not given"):
        PhaseGraph.from_outline(EAGLE_OUTLINE, [f for f in FUNCTIONS if f.name != "retract"])
    fewer = _outline(phases=[p for p in EAGLE_OUTLINE.phases if p.name != "retract"],
                     edges=[e for e in EAGLE_OUTLINE.edges if "retract" not in e])
    with pytest.raises(InvalidPhaseGraph, match="phase 'retract' was given but is not in the outline"):
        PhaseGraph.from_outline(fewer, FUNCTIONS)


def test_from_outline_checks_the_graph_rules_too():
    cut = _outline(edges=[e for e in EAGLE_OUTLINE.edges if e != ("verify", "finalize-tree-path")])
    with pytest.raises(InvalidPhaseGraph, match="no_dead_ends"):
        PhaseGraph.from_outline(cut, FUNCTIONS)


def test_an_outline_is_drawn_as_given():
    outline = GraphOutline("toy", "a", [PhaseOutline("a", "In", "Out", "Does a."), PhaseOutline("b", "Out", "Out")],
                           [("a", "b"), ("b", "b")])
    text = render(outline, "text")
    assert "  a  In -> Out [entry]\n     Does a.\n" in text and "  b -> b\n" in text


@pytest.mark.parametrize(("doc", "first"), [
    ("Free every page and the page-table\nrow of each request; the scheduler requeues them.\n\nMore.",
     "Free every page and the page-table row of each request; the scheduler requeues them."),
    ("EAGLE-2 drafting (arXiv 2406.16858): S-1 forwards. Then more.", "EAGLE-2 drafting (arXiv 2406.16858): S-1 forwards."),
    ("No full stop", "No full stop"),
    ("", ""),
])
def test_a_phase_summary_defaults_to_its_docstring_first_sentence_whole(doc, first):
    assert first_sentence(doc) == first
