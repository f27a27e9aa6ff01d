"""Machine behaviour: modes, errors, traces."""

from __future__ import annotations

import json

import pytest
import torch

from phasegraph.statemachine import (
    IllegalTransition,
    Machine,
    PhaseGraphError,
    SchemaViolation,
    Trace,
    UnknownPhase,
    ValidationMode,
    get_validation_mode,
    validation_mode,
)
from phasegraph.testing import synthetic as syn


@pytest.fixture
def graph():
    return syn.synthetic_eagle_graph()


def test_first_phase_needs_an_input_state(graph):
    m = Machine(graph)
    assert m.phase is None and m.allowed() == ("prefill-extend",)
    with pytest.raises(PhaseGraphError, match="pass the input of 'prefill-extend' as state="):
        m.advance("prefill-extend", None)
    with pytest.raises(IllegalTransition, match="Can't run 'draft' before the first phase; allowed: 'prefill-extend'"):
        m.advance("draft", None, state=syn.draft_state(1))


def test_unknown_phase(graph):
    m = Machine(graph)
    with pytest.raises(UnknownPhase, match="'teleport'"):
        m.advance("teleport")


def test_state_argument_only_for_the_first_phase(graph):
    m = Machine(graph)
    ctx = syn.SyntheticContext()
    m.advance("prefill-extend", ctx, state=syn.prefill_input([2]))
    with pytest.raises(PhaseGraphError, match="state= is only for the first phase"):
        m.advance("draft-extend", ctx, state=syn.draft_extend_input([2]))


def test_bad_entry_input_is_rejected_and_machine_unchanged(graph):
    m = Machine(graph, validate="boundary")
    bad = syn.prefill_input([2, 3]).replace(positions=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(SchemaViolation) as err:
        m.advance("prefill-extend", None, state=bad)
    assert err.value.phase == "prefill-extend" and err.value.side == "input"
    assert "PrefillInput.positions (input of phase 'prefill-extend')" in str(err.value)
    assert m.phase is None and m.state is None


def test_bad_output_is_rejected_and_machine_unchanged(graph):
    import attrs

    from phasegraph.phases.eagle import EDGES
    from phasegraph.statemachine import PhaseGraph

    def wrong_device_extend(state, ctx):
        good = syn.draft_state(state.seq_lens.shape[0])
        return good.replace(topk_p=good.topk_p.to("meta"))

    phases = [attrs.evolve(p, fn=wrong_device_extend) if p.name == "draft-extend" else p for p in graph]
    m = Machine(PhaseGraph("g", phases, EDGES, entry="prefill-extend"), validate="boundary")
    m.advance("prefill-extend", None, state=syn.prefill_input([2]))
    before = m.state
    with pytest.raises(SchemaViolation) as err:
        m.advance("draft-extend", None)
    assert err.value.side == "output" and err.value.field == "topk_p"
    assert "device meta" in str(err.value)
    assert m.phase == "prefill-extend" and m.state is before


def test_validation_modes_global_and_per_machine(graph):
    assert get_validation_mode() is ValidationMode.STRICT  # set by the plugin's default
    with validation_mode("off"):
        m = Machine(graph)
        assert m.validation is ValidationMode.OFF
        m2 = Machine(graph, validate="boundary")
        assert m2.validation is ValidationMode.BOUNDARY
    assert m.validation is ValidationMode.STRICT  # follows the global default
    with pytest.raises(ValueError, match="choose one of strict, boundary, off"):
        Machine(graph, validate="sometimes")


def test_off_mode_skips_schema_checks_but_not_legality(graph):
    m = Machine(graph, validate="off")
    bad = syn.prefill_input([2]).replace(positions=torch.zeros(2, dtype=torch.int32))
    m.advance("prefill-extend", None, state=bad)  # not checked
    with pytest.raises(IllegalTransition):
        m.advance("verify")


def test_trace_records_and_exports_chrome_json(graph, tmp_path):
    trace = Trace()
    m = Machine(graph, trace=trace, name="batch0")
    ctx = syn.SyntheticContext()
    m.advance("prefill-extend", ctx, state=syn.prefill_input([2, 3, 4]))
    m.advance("draft-extend", ctx)
    for _ in range(3):
        for p in ("draft", "verify", "finalize-tree-path", "draft-extend"):
            m.advance(p, ctx)
    assert trace.phases()[:3] == ["prefill-extend", "draft-extend", "draft"]
    assert all(t.batch_size == 3 for t in trace)
    stats = trace.edge_stats()
    assert stats[("draft", "verify")].count == 3
    assert stats[(None, "prefill-extend")].count == 1
    assert trace.always_followed_by("verify", "finalize-tree-path")
    path = trace.save_chrome(tmp_path / "t.json")
    data = json.loads(path.read_text())
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(trace) == 14
    assert events[0]["name"] == "prefill-extend" and events[0]["args"]["batch_size"] == 3
    assert events[1]["args"]["from"] == "prefill-extend"
    back = Trace.load_chrome(path)
    assert back.edges() == trace.edges()


def test_load_chrome_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{\"nope\": 1}")
    with pytest.raises(PhaseGraphError, match="is not a phasegraph Chrome-trace JSON file"):
        Trace.load_chrome(p)


def test_reset_places_a_validated_state(graph):
    m = Machine(graph, validate="strict")
    m.reset("merge", syn.draft_state(2))
    assert m.allowed() == graph.allowed("merge")
    with pytest.raises(SchemaViolation):
        m.reset("merge", syn.tree_proposal(syn.draft_state(2)))
    m.reset()
    assert m.phase is None
