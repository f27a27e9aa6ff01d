"""The pytest plugin: loads without torch, exposes its option and fixtures.

The scripted drafters refuse a setup they cannot serve with a named error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import InvalidConfig
from phasegraph.testing.drafters import NoisyOracleDraft, OracleDraft
from tests.phases.lossless_support import VOCAB, prompts, reference, tiny_target

pytest_plugins = ["pytester"]


def test_plugin_module_loads_without_importing_torch():
    code = (
        "import sys\n"
        "import phasegraph.testing._pytest_plugin as p\n"
        "import phasegraph, phasegraph.statemachine\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_plugin_is_registered_through_the_entry_point():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert eps.get("phasegraph") == "phasegraph.testing._pytest_plugin"


def test_validate_option_and_trace_fixture(pytester):
    pytester.makepyfile(
        """
        from phasegraph.statemachine import get_validation_mode, Machine
        from phasegraph.testing import synthetic as syn

        def test_mode(request):
            assert get_validation_mode().value == request.config.getoption("--phasegraph-validate")

        def test_trace(phase_trace, phase_graph):
            assert "verify" in phase_graph.phases
            m = Machine(syn.synthetic_eagle_graph())
            m.advance("prefill-extend", None, state=syn.prefill_input([2]))
            m.advance("draft-extend", None)
            m.advance("draft", None)
            m.advance("verify", None)
            m.advance("finalize-tree-path", None)
            phase_trace.assert_followed_by("verify", "finalize-tree-path")
            phase_trace.assert_visited("prefill-extend", "draft")
            assert phase_trace.count("verify") == 1

        def test_trace_assertion_fails_when_flow_is_broken(phase_trace):
            m = Machine(syn.synthetic_eagle_graph())
            m.advance("prefill-extend", None, state=syn.prefill_input([2]))
            m.advance("draft-extend", None)
            m.advance("draft", None)
            m.advance("verify", None)
            try:
                phase_trace.assert_followed_by("verify", "finalize-tree-path")
            except AssertionError as e:
                assert "ended in 'verify'" in str(e)
            else:
                raise AssertionError("expected a failure")
        """
    )
    for mode in ("strict", "off"):
        result = pytester.runpytest_subprocess(f"--phasegraph-validate={mode}", "-q", "-p", "no:cacheprovider")
        result.assert_outcomes(passed=3)
    result = pytester.runpytest_subprocess("--phasegraph-validate=bogus")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*invalid choice: 'bogus'*"])


def test_edge_coverage_lists_the_edges_never_taken(pytester):
    pytester.makepyfile(
        """
        import pytest
        from phasegraph.statemachine import Machine
        from phasegraph.testing import synthetic as syn

        PATHS = {"one": ["draft-extend", "draft", "verify", "finalize-tree-path"],
                 "two": ["draft-extend", "draft", "verify", "finalize-tree-path", "draft-extend"]}

        @pytest.mark.parametrize("path", sorted(PATHS))
        def test_iteration(path):
            m = Machine(syn.synthetic_eagle_graph())
            m.advance("prefill-extend", None, state=syn.prefill_input([2]))
            for phase in PATHS[path]:
                m.advance(phase, None)
        """
    )
    from phasegraph.testing import synthetic as syn

    graph = syn.synthetic_eagle_graph()
    taken = {("prefill-extend", "draft-extend"), ("draft-extend", "draft"), ("draft", "verify"),
             ("verify", "finalize-tree-path"), ("finalize-tree-path", "draft-extend")}
    assert taken <= set(graph.edges)
    never = sorted(set(graph.edges) - taken)
    want = f"{graph.name}: 5/{len(graph.edges)} edges taken; never: {', '.join(f'{a} -> {b}' for a, b in never)}"
    result = pytester.runpytest("--phasegraph-coverage", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert want in result.stdout.lines, result.stdout.str()
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")  # off unless asked for
    assert "edge coverage" not in result.stdout.str()


def test_edge_coverage_sums_what_xdist_workers_send():
    """Each worker sends its counts and the edges it knows; the controller, which may never
    have imported the graphs, sums the counts and reports against those edges."""
    import types

    from phasegraph.statemachine import Machine
    from phasegraph.testing import synthetic as syn
    from phasegraph.testing._pytest_plugin import _EdgeCoverage

    graph = syn.synthetic_eagle_graph()
    sent = []
    for phases in (["draft-extend"], ["draft-extend", "draft"]):  # two workers
        worker = _EdgeCoverage()
        worker.pytest_sessionstart()
        m = Machine(graph)
        m.advance("prefill-extend", None, state=syn.prefill_input([2]))
        for phase in phases:
            m.advance(phase, None)
        out: dict = {}
        worker.pytest_sessionfinish(types.SimpleNamespace(config=types.SimpleNamespace(workeroutput=out)))
        sent.append(out)
    controller = _EdgeCoverage()
    for out in sent:
        controller.pytest_testnodedown(types.SimpleNamespace(workeroutput=out), None)
    name = graph.name
    assert controller.taken == {(name, "prefill-extend", "draft-extend"): 2, (name, "draft-extend", "draft"): 1}
    lines = []
    reporter = types.SimpleNamespace(config=types.SimpleNamespace(), section=lines.append, write_line=lines.append)
    controller.pytest_terminal_summary(reporter)
    assert lines[0] == "phasegraph edge coverage"
    assert lines[1].startswith(f"{name}: 2/{len(graph.edges)} edges taken; never: ")
    assert "draft -> verify" in lines[1] and "prefill-extend -> draft-extend" not in lines[1]


def test_a_bad_phasegraph_validate_variable_does_not_break_pytest(pytester, monkeypatch):
    """With PHASEGRAPH_VALIDATE=bogus every pytest run in the environment failed while loading
    this plugin (a ValueError traceback from importing phasegraph); the option replaces it."""
    monkeypatch.setenv("PHASEGRAPH_VALIDATE", "bogus")
    pytester.makepyfile(
        """
        from phasegraph.statemachine import get_validation_mode

        def test_mode():
            assert get_validation_mode().value == "strict"
        """
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_recorder_docstring_example_runs():
    """Its example was a placeholder (`>>> ...`) that failed as written."""
    import doctest

    from phasegraph.testing import recorder

    results = doctest.testmod(recorder)
    assert results.failed == 0 and results.attempted >= 8


@pytest.mark.parametrize(("make", "message"), [
    (lambda: OracleDraft([1, 2], VOCAB), "OracleDraft: continuations must map each prompt"),  # was AttributeError
    (lambda: OracleDraft({}, 0), "OracleDraft: vocab_size must be an integer >= 2, got 0"),
    (lambda: NoisyOracleDraft({}, VOCAB, accept_rate=2.0),  # was an oracle that never missed
     "NoisyOracleDraft: accept_rate must be a number in \\[0, 1\\], got 2.0"),
    (lambda: NoisyOracleDraft({}, VOCAB, accept_rate=float("nan")), "got nan"),  # was one that never hit
])
def test_bad_drafter_arguments_are_invalid_config(make, message):
    with pytest.raises(InvalidConfig, match=message):
        make()


def _generate(drafter, ps, *, attach=True):
    engine = Engine(tiny_target(), drafter, spec=SpecConfig(method="eagle", num_steps=3, topk=2, num_draft_tokens=6),
                    max_batch_size=len(ps), kv_pool_tokens=8192)
    if attach:
        drafter.engine = engine
    return engine.generate(ps, SamplingParams(max_new_tokens=8, ignore_eos=True))


def test_a_drafter_without_its_engine_or_a_prompt_says_so():
    """Were AttributeError ('NoneType' object has no attribute 'scheduler') and a bare KeyError of
    the prompt's token ids, from inside the drafter's forward."""
    ps, ref = prompts(2), reference(2)
    with pytest.raises(InvalidConfig, match="OracleDraft.engine is not set: assign draft.engine = engine"):
        _generate(OracleDraft(dict(zip(map(tuple, ps), ref, strict=True)), VOCAB), ps, attach=False)
    with pytest.raises(InvalidConfig, match=f"OracleDraft has no continuation for the prompt of request '.*' \\({len(ps[1])} tokens\\)"):
        _generate(OracleDraft({tuple(ps[0]): ref[0]}, VOCAB), ps)
