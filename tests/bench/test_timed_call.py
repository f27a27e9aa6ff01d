"""phasegraph.bench.common.timed_call: the wall time of one call, with the heap frozen."""

import gc

import pytest

from phasegraph.bench.common import timed_call


def test_returns_the_result_and_counts_collections_inside_the_call():
    def work():
        gc.collect()  # one full collection inside the timed call
        return "done"

    wall, out, pauses = timed_call("cpu", work)
    assert out == "done"
    assert pauses["frozen"] is True and pauses["pauses"] >= 1
    assert 0 < pauses["seconds"] <= wall
    assert gc.get_freeze_count() == 0, "the heap must be unfrozen after the call"


def test_freezing_shrinks_what_a_full_collection_scans():
    garbage_free_heap = [[i] for i in range(200_000)]  # long-lived objects, like imports and models
    _, _, frozen = timed_call("cpu", gc.collect)
    _, _, thawed = timed_call("cpu", gc.collect, freeze_gc=False)
    assert frozen["pauses"] == thawed["pauses"] == 1
    assert frozen["seconds"] < thawed["seconds"]
    del garbage_free_heap


def test_cleans_up_when_the_call_raises():
    callbacks = list(gc.callbacks)

    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        timed_call("cpu", boom)
    assert gc.callbacks == callbacks
    assert gc.get_freeze_count() == 0


def test_warm_then_time_times_calls_whose_prefill_graph_is_already_captured():
    """A prefill graph is captured the second time its bucket is used, so both parts run each
    call twice before timing it (one warm-up left the capture inside the timed call)."""
    from types import SimpleNamespace

    from phasegraph.bench.common import warm_then_time
    from phasegraph.runtime.config import SamplingParams, SpecConfig
    from phasegraph.runtime.engine import Engine
    from tests.phases.lossless_support import prompts, tiny_target

    engine = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=2, kv_pool_tokens=4096,
                    cuda_graphs="emulate", prefill_graphs=True, trace=True)
    run = SimpleNamespace(device="cpu", args=SimpleNamespace(gc="freeze"))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    warm, wall, outs, pauses, captured = warm_then_time(run, engine, [prompts(2)], params)
    assert captured == 0 and len(outs) == 2 and wall > 0
    assert [o.token_ids for o in warm] == [o.token_ids for o in outs]
    stats = engine.graph_runner.stats()["prefill-extend"]
    assert stats["graphs"] == 1 and stats["replays"] == 2  # captured in the 2nd call, replayed in the timed one


def test_repeated_timing_keeps_the_median_run_and_its_trace(monkeypatch):
    """warm_then_time with repeats: the row's wall time and its trace (iterations, prefill time,
    phase shares) both come from the repetition of median wall time, not a mix of them."""
    from types import SimpleNamespace

    from phasegraph.bench import common
    from phasegraph.statemachine.trace import Trace, Transition

    walls = iter([0.3, 0.1, 0.2])  # the median is the third run

    class FakeEngine:
        graph_runner = None
        trace = Trace()
        runs = 0

        def generate(self, batch, params):
            return [f"out-{batch}"]

    engine = FakeEngine()

    def fake_timed_calls(run, calls, generate):
        engine.runs += 1
        for _ in range(engine.runs):  # run k leaves k transitions in the trace
            engine.trace.record(Transition("m", None, "decode", 0, 1, 1, "S"))
        return next(walls), [generate(c) for c in calls], {"pauses": 0, "seconds": 0.0, "frozen": True}

    monkeypatch.setattr(common, "timed_calls", fake_timed_calls)
    warm, wall, outs, _, captured = common.warm_then_time(SimpleNamespace(), engine, [["a"], ["b"]], None, repeats=3)
    assert wall == 0.2 and len(engine.trace) == 3  # the third run's wall time and transitions
    assert warm == ["out-['a']", "out-['b']"] and outs == [["out-['a']"], ["out-['b']"]] and captured == 0
