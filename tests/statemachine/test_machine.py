"""Machine behaviour: modes, errors, traces."""

from __future__ import annotations

import json
import re

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
    with pytest.raises(UnknownPhase, match=r"\['draft'\]"):  # an unhashable name: was a TypeError
        m.advance(["draft"])


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


def test_trace_records_the_collective_clock_per_phase(graph, tmp_path):
    """A trace with a collective clock: each transition holds its increase over the phase; it
    survives the Chrome export and shows in the rendered graph. Without a clock: None, not shown."""
    from phasegraph.statemachine.render import render

    readings = iter([0.0, 0.0025, 0.0025, 0.0025])  # before and after each of the two phases
    trace = Trace(collective_clock=lambda: next(readings))
    m = Machine(graph, trace=trace)
    ctx = syn.SyntheticContext()
    m.advance("prefill-extend", ctx, state=syn.prefill_input([2, 3]))
    m.advance("draft-extend", ctx)
    assert [t.collective_s for t in trace] == [0.0025, 0.0]
    back = Trace.load_chrome(trace.save_chrome(tmp_path / "t.json"))
    assert [t.collective_s for t in back] == [0.0025, 0.0]
    assert back.collective_mean("prefill-extend") == 0.0025 and back.collective_mean("verify") is None
    lines = render(graph, "text", back).splitlines()
    assert any(" prefill-extend " in s and "collectives=2.50 ms" in s for s in lines)
    assert any(" draft-extend " in s and "collectives=0.0 µs" in s for s in lines)
    assert "collectives 2.50 ms" in render(graph, "dot", back)
    plain = Trace()
    m = Machine(graph, trace=plain)
    m.advance("prefill-extend", ctx, state=syn.prefill_input([2]))
    assert plain.transitions[0].collective_s is None
    assert "collectives" not in render(graph, "text", plain)


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


def test_a_bad_phasegraph_validate_variable_leaves_the_package_importable():
    """PHASEGRAPH_VALIDATE=bogus made `import phasegraph` (and so every pytest run, through the
    plugin) fail with a traceback; now the mode is refused where it is first needed."""
    import os
    import subprocess
    import sys

    code = (
        "import phasegraph.statemachine as s\n"
        "try:\n"
        "    s.get_validation_mode()\n"
        "except s.InvalidValidationMode as e:\n"
        "    print(e)\n"
        "s.set_validation_mode('off')\n"
        "print(s.get_validation_mode().value)\n"
    )
    env = {**os.environ, "PHASEGRAPH_VALIDATE": "bogus"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "environment variable PHASEGRAPH_VALIDATE='bogus': unknown validation mode 'bogus'; "
        "choose one of strict, boundary, off",
        "off",
    ]
    env["PHASEGRAPH_VALIDATE"] = ""  # set but empty: the default, as if unset
    out = subprocess.run([sys.executable, "-c", "import phasegraph.statemachine as s; print(s.get_validation_mode().value)"],
                         capture_output=True, text=True, env=env, check=False)
    assert out.stdout.strip() == "boundary", out.stderr


def test_a_bad_mode_is_an_invalid_validation_mode(graph):
    from phasegraph.statemachine import InvalidValidationMode

    with pytest.raises(InvalidValidationMode, match="unknown validation mode 3"):
        Machine(graph, validate=3)
    m = Machine(graph)
    with pytest.raises(InvalidValidationMode, match="unknown validation mode 'nah'"):
        m.validation = "nah"
    assert issubclass(InvalidValidationMode, ValueError)  # what Engine and older callers catch


def test_machine_arguments_are_checked_when_it_is_made(graph):
    """A graph or trace of the wrong type, or a device torch does not take, was a raw
    AttributeError / RuntimeError at the first phase (the trace's after the state changed)."""
    with pytest.raises(PhaseGraphError, match="a Machine runs a PhaseGraph, got str"):
        Machine("eagle")
    with pytest.raises(PhaseGraphError, match="trace must be a phasegraph Trace or None, got list"):
        Machine(graph, trace=[])
    with pytest.raises(PhaseGraphError, match="device 'cuda:x' is not a usable torch device"):
        Machine(graph, device="cuda:x")


@pytest.mark.parametrize("mode", ["boundary", "strict"])
def test_nested_schemas_from_outside_are_checked(graph, mode):
    """A BatchParams of the wrong dtype inside an entry state, a reset state or an extra input
    passed every mode (a nested schema's fields were never checked)."""
    bad_params = syn.batch_params(2).replace(seed=torch.zeros(2))
    entry = syn.prefill_input([2, 3]).replace(params=bad_params)
    m = Machine(graph, validate=mode)
    with pytest.raises(SchemaViolation) as err:
        m.advance("prefill-extend", None, state=entry)
    assert str(err.value) == ("BatchParams.seed (input of phase 'prefill-extend'): "
                              "expected dtype int64, got dtype float32")
    assert m.phase is None
    with pytest.raises(SchemaViolation, match="BatchParams.seed \\(output of phase 'merge'\\)"):
        m.reset("merge", syn.draft_state(2).replace(params=bad_params))
    m.reset("merge", syn.draft_state(2))
    other = syn.draft_state(2, start_row=3).replace(params=syn.batch_params(2, start_row=3).replace(seed=torch.zeros(2)))
    with pytest.raises(SchemaViolation, match="BatchParams.seed \\(extra input 'other' of phase 'merge'\\)"):
        m.advance("merge", syn.SyntheticContext(), other=other)


def test_strict_mode_sees_a_nested_input_mutated_in_place(graph):
    """A phase that changed its input's BatchParams in place was not caught."""
    import attrs

    from phasegraph.phases.eagle import EDGES
    from phasegraph.statemachine import PhaseContractViolation, PhaseGraph

    def sloppy_decode(state, ctx):
        state.params.temperature.add_(1.0)
        return state.replace(seq_lens=state.seq_lens + 1)

    phases = [attrs.evolve(p, fn=sloppy_decode) if p.name == "decode" else p for p in graph]
    m = Machine(PhaseGraph("g", phases, EDGES, entry="prefill-extend"), validate="strict")
    m.reset("merge", syn.draft_state(2))
    with pytest.raises(PhaseContractViolation, match="mutated its input DraftState in place \\(fields \\['params.temperature'\\]\\)"):
        m.advance("decode")


def _chrome(tmp_path, event):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": [event]}).replace('"INF"', "Infinity"))
    return p


OUT_OF_RANGE = " is out of range (a trace's times, start and end, are within ±1.8e+305 µs)"


@pytest.mark.parametrize(("change", "why"), [
    ({"ts": "INF"}, "event 0: 'ts' must be a finite number, got inf"),  # was a raw OverflowError
    ({"ts": True}, "event 0: 'ts' must be a finite number, got True"),
    ({"dur": -5}, "event 0: 'dur' must be >= 0, got -5"),  # was a transition that ended first
    # finite, but its nanoseconds are not: was a raw OverflowError from int(inf)
    ({"ts": 1e306, "dur": 1e306}, f"event 0: 'ts' 1e+306 + 'dur' 1e+306{OUT_OF_RANGE}"),
    ({"ts": 1.5e305, "dur": 1e305}, f"event 0: 'ts' 1.5e+305 + 'dur' 1e+305{OUT_OF_RANGE}"),
    ({"ts": -1e306}, f"event 0: 'ts' -1e+306 + 'dur' 1{OUT_OF_RANGE}"),
    ({"name": 5}, "event 0: 'name' must be a string, got 5"),
    ({"args": {"from": 3}}, "event 0: 'args.from' must be a string or null, got 3"),
    ({"args": {"batch_size": "x"}}, "event 0: 'args.batch_size' must be an integer or null, got 'x'"),
    ({"args": []}, "event 0: 'args' must be an object, got list"),
    ({"args": {"collective_s": "x"}}, "event 0: 'args.collective_s' must be a number or null, got 'x'"),
    ({"args": {"collective_s": -1}}, "event 0: 'args.collective_s' must be a finite number >= 0, got -1"),
])
def test_load_chrome_checks_every_field_it_reads(tmp_path, change, why):
    event = {"ph": "X", "name": "draft", "ts": 0, "dur": 1, "args": {"from": "draft-extend"}, **change}
    with pytest.raises(PhaseGraphError, match=f"is not a phasegraph Chrome-trace JSON file \\({re.escape(why)}\\)"):
        Trace.load_chrome(_chrome(tmp_path, event))


def test_load_chrome_refuses_other_shapes_and_deep_nesting(tmp_path):
    p = tmp_path / "x.json"
    for text, why in [("[1, 2]", "expected an object whose 'traceEvents' is a list"),
                      ('{"traceEvents": {"a": 1}}', "expected an object whose 'traceEvents' is a list"),
                      ('{"traceEvents": ["x"]}', "event 0 is a str, not an object"),
                      ("[" * 100000 + "]" * 100000, "nested too deeply")]:  # was a raw RecursionError
        p.write_text(text)
        with pytest.raises(PhaseGraphError, match=re.escape(why)):
            Trace.load_chrome(p)
