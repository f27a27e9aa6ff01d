"""Build-time rules of PhaseGraph."""

from __future__ import annotations

import attrs
import pytest
import torch
from jaxtyping import Float32, Int64

from phasegraph.statemachine import (
    RULES,
    IllegalTransition,
    InvalidPhase,
    InvalidPhaseGraph,
    InvalidSchema,
    PhaseGraph,
    Schema,
    phase,
    schema,
    tensor,
)


@schema
class A(Schema):
    x: Int64[torch.Tensor, "B"] = tensor()


@schema
class B(Schema):
    x: Int64[torch.Tensor, "B"] = tensor()
    y: Float32[torch.Tensor, "B H"] = tensor()


@schema
class C(Schema):
    x: Float32[torch.Tensor, "B"] = tensor()


def _mk(name, inp, out):
    return phase(name, input=inp, output=out)(lambda s, c: s)


def test_valid_cycle_builds_and_is_frozen():
    g = PhaseGraph("ok", [_mk("a", A, A), _mk("b", A, A)], [("a", "b"), ("b", "a")], entry="a")
    assert g.allowed(None) == ("a",)
    assert g.allowed("a") == ("b",)
    assert g.is_allowed("b", "a") and not g.is_allowed("a", "a")
    with pytest.raises(Exception, match="[Ff]rozen"):
        g.nx.add_edge("a", "a")


def test_unreachable_phase_fails_to_build():
    phases = [_mk("a", A, A), _mk("b", A, A), _mk("island", A, A)]
    with pytest.raises(InvalidPhaseGraph) as err:
        PhaseGraph("g", phases, [("a", "b"), ("b", "a"), ("island", "island")], entry="a")
    assert "reachable" in err.value.problems
    assert any("'island' is unreachable" in p for p in err.value.problems["reachable"])
    assert "island" in str(err.value)


def test_incompatible_edge_names_phases_and_fields():
    # B needs a field y that A does not give; C's x has another dtype.
    phases = [_mk("a", A, A), _mk("b", B, A), _mk("c", C, A)]
    with pytest.raises(InvalidPhaseGraph) as err:
        PhaseGraph("g", phases, [("a", "b"), ("b", "c"), ("c", "a")], entry="a")
    found = err.value.problems["schema_compatible"]
    assert any("edge 'a' -> 'b'" in p and "'y' is missing in A" in p for p in found)
    assert any("edge 'b' -> 'c'" in p and "dtype int64" in p for p in found)


def test_subclass_output_satisfies_base_input():
    @schema
    class A2(A):
        z: Int64[torch.Tensor, "B"] = tensor()

    g = PhaseGraph("g", [_mk("a", A, A2), _mk("b", A, A)], [("a", "b"), ("b", "a")], entry="a")
    assert g.edges == (("a", "b"), ("b", "a")) and g.allowed("a") == ("b",)
    # the same graph with an output that is not a subclass and lacks a field is refused
    with pytest.raises(InvalidPhaseGraph, match="schema_compatible"):
        PhaseGraph("g", [_mk("a", A, C), _mk("b", A, A)], [("a", "b"), ("b", "a")], entry="a")


def test_dead_end_unless_terminal():
    phases = [_mk("a", A, A), _mk("end", A, A)]
    with pytest.raises(InvalidPhaseGraph, match="'end' is a dead end"):
        PhaseGraph("g", phases, [("a", "end")], entry="a")
    g = PhaseGraph("g", phases, [("a", "end")], entry="a", terminals=["end"])
    assert g.allowed("end") == ()


def test_unknown_names_and_duplicates():
    with pytest.raises(InvalidPhaseGraph) as err:
        PhaseGraph("g", [_mk("a", A, A), _mk("a", A, A)], [("a", "ghost")], entry="nowhere")
    found = err.value.problems["known_phases"]
    assert any("declared more than once" in p for p in found)
    assert any("undeclared phase 'ghost'" in p for p in found)
    assert any("entry 'nowhere'" in p for p in found)


def test_second_source_breaks_single_entry():
    phases = [_mk("a", A, A), _mk("b", A, A)]
    with pytest.raises(InvalidPhaseGraph) as err:
        PhaseGraph("g", phases, [("b", "a"), ("a", "a")], entry="a")
    assert "single_entry" in err.value.problems


def test_rules_can_be_skipped_by_name():
    phases = [_mk("a", A, A), _mk("b", B, A)]
    PhaseGraph("g", phases, [("a", "b"), ("b", "a")], entry="a", skip_rules=["schema_compatible"])
    with pytest.raises(InvalidPhaseGraph, match=r"skip_rules names unknown rules \['nope'\]"):
        PhaseGraph("g", phases, [("a", "b")], entry="a", skip_rules=["nope"])
    assert set(RULES) == {"known_phases", "single_entry", "reachable", "no_dead_ends", "schema_compatible"}


def test_illegal_transition_message():
    err = IllegalTransition("draft-extend", "verify", ["draft", "merge"])
    assert str(err) == "Can't run 'verify' when in 'draft-extend'; allowed: 'draft', 'merge'"


def test_malformed_declarations_are_named_not_raw_errors():
    """Edges that are no pairs of names, phases that are no PhaseSpecs and an entry that is no
    name were a raw ValueError / AttributeError (or, for a string edge, read as its letters)."""
    with pytest.raises(InvalidPhaseGraph) as err:
        PhaseGraph("g", [_mk("a", A, A), "b", lambda s, c: s],
                   [("a", "a", "x"), "ab", ("a", 1)], entry=None)
    found = err.value.problems["declaration"]
    assert found == (
        "phases[1] is a str, not a PhaseSpec",
        "phases[2] is a function, not a PhaseSpec (decorate it with @phase)",
        "edge ('a', 'a', 'x') is not a (source, target) pair of phase names",
        "edge 'ab' is not a (source, target) pair of phase names",
        "edge ('a', 1) is not a (source, target) pair of phase names",
        "entry must be a phase name, got None",
    )
    with pytest.raises(InvalidPhaseGraph, match="edges must be a collection of .source, target. pairs, got str"):
        PhaseGraph("g", [_mk("a", A, A)], "aa", entry="a")


def test_duplicate_edges_are_refused():
    phases = [_mk("a", A, A), _mk("b", A, A)]
    with pytest.raises(InvalidPhaseGraph) as err:
        PhaseGraph("g", phases, [("a", "b"), ("b", "a"), ("a", "b")], entry="a")
    assert err.value.problems == {"known_phases": ("edge 'a' -> 'b' is declared more than once",)}


def test_one_terminal_or_skipped_rule_may_be_given_as_a_string():
    """A lone string was taken letter by letter ("terminal 'e' is not a declared phase")."""
    g = PhaseGraph("g", [_mk("a", A, A), _mk("end", A, A)], [("a", "end")], entry="a", terminals="end")
    assert g.terminals == {"end"}
    g = PhaseGraph("g", [_mk("a", A, A), _mk("b", B, A)], [("a", "b"), ("b", "a")], entry="a",
                   skip_rules="schema_compatible")
    assert g.skipped_rules == {"schema_compatible"}


def test_phase_declaration_errors_are_named():
    """A name that is no string, a function that is not callable or takes no (state, ctx),
    extra inputs that are no mapping, and a schema class never compiled by @schema were accepted
    (failing later as raw TypeError / AttributeError) or a raw AttributeError."""
    with pytest.raises(InvalidPhase, match="phase 3 is declared wrongly:\n  - a phase's name must be a non-empty string"):
        phase(3, input=A, output=A)
    with pytest.raises(InvalidPhase, match="phase '' is declared wrongly"):
        phase("", input=A, output=A)
    with pytest.raises(InvalidPhase, match="its function must be callable, got int"):
        phase("p", input=A, output=A)(3)
    with pytest.raises(InvalidPhase, match="extra_inputs must map argument names to Schema subclasses, got list"):
        phase("p", input=A, output=A, extra_inputs=[A])
    with pytest.raises(InvalidSchema, match="phase 'p': extra input 'o' must be a Schema subclass"):
        phase("p", input=A, output=A, extra_inputs={"o": int})

    class Raw(Schema):
        """Never decorated with @schema."""

    with pytest.raises(InvalidSchema, match="phase 'p': output Raw must be decorated with @schema"):
        phase("p", input=A, output=Raw)

    def one_arg(state):
        return state

    with pytest.raises(InvalidPhase, match=r"its function .*one_arg\(state\) cannot be called as fn\(state, ctx\)"):
        phase("p", input=A, output=A)(one_arg)
    with pytest.raises(InvalidPhase, match=r"cannot be called as fn\(state, ctx, other=\.\.\.\)"):
        phase("p", input=A, output=A, extra_inputs={"other": A})(lambda s, c: s)
    good = _mk("p", A, A)
    with pytest.raises(InvalidPhase, match="cannot be called as fn"):  # a PhaseSpec made otherwise
        attrs.evolve(good, fn=one_arg)


# ----------------------------------------------------------------------------- phase declarations


def test_a_phase_takes_its_schemas_from_its_annotations():
    @phase("p")
    def p(state: A, ctx, *, other: B) -> C:
        return state

    assert (p.input, p.output, dict(p.extra_inputs)) == (A, C, {"other": B})


def test_declared_schemas_must_agree_with_the_annotations():
    with pytest.raises(InvalidPhase, match="output=A disagrees with the function's annotation C"):
        @phase("p", input=A, output=A)
        def p(state: A, ctx) -> C:
            return state

    with pytest.raises(InvalidPhase, match=r"extra_inputs=\{other: A\} disagrees.*\{other: B\}"):
        @phase("q", extra_inputs={"other": A})
        def q(state: A, ctx, *, other: B) -> A:
            return state


def test_a_phase_without_annotations_must_declare_its_schemas():
    with pytest.raises(InvalidPhase, match="no output schema: annotate the function"):
        phase("p", input=A)(lambda s, c: s)
    assert phase("p", input=A, output=C)(lambda s, c: s).output is C
