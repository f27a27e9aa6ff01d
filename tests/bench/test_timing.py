"""What the bench's timings rest on: ``timed_call`` (one call's wall time, the heap frozen),
profiler sessions that leave CUPTI detached (TEARDOWN_CUPTI=1, so rows timed after another row's
GPU-busy probe pay no profiler cost), and ``profile_pair_host.py --sites`` (a step's device
launches by phasegraph source line, one call into phasegraph/kernels counting once)."""

import gc
import os
import re

import pytest
import torch

from phasegraph import SpecConfig
from phasegraph.bench.common import (
    CUPTI_TEARDOWN_VAR,
    detach_cupti_after_profiling,
    load_bench_scale,
    timed_call,
)
from phasegraph.runtime.engine import Engine
from tests.bench.scripts import load_bench_script


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


def test_sets_teardown_when_the_environment_is_silent(monkeypatch):
    monkeypatch.delenv(CUPTI_TEARDOWN_VAR, raising=False)  # monkeypatch restores it afterwards
    detach_cupti_after_profiling()
    assert os.environ[CUPTI_TEARDOWN_VAR] == "1"


def test_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setenv(CUPTI_TEARDOWN_VAR, "0")
    detach_cupti_after_profiling()
    assert os.environ[CUPTI_TEARDOWN_VAR] == "0"


def test_the_gpu_busy_probe_sets_it_before_its_session(monkeypatch):
    """bench_scale.gpu_busy_seconds (part 1's and part 2's probe) opens its profiler session only
    once teardown is set."""
    monkeypatch.delenv(CUPTI_TEARDOWN_VAR, raising=False)
    seen = []

    class FakeProfile:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            seen.append(os.environ.get(CUPTI_TEARDOWN_VAR))
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return []

    monkeypatch.setattr("torch.profiler.profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    calls = []
    busy, activities = load_bench_scale().gpu_busy_seconds(lambda: calls.append(1), 3)
    assert seen == ["1"]
    assert len(calls) == 3
    assert (busy, activities) == (0.0, 0)


def _script():
    return load_bench_script("profile_pair_host")


def test_a_decode_step_is_mapped_to_its_kernel_calls_and_phase_lines():
    script = _script()
    target, _ = script.build_pair(torch.float32, "cpu")
    base = type(target)(target.model, feature_mode="none")
    engine = Engine(base, None, spec=SpecConfig(method="none"), max_batch_size=1, kv_pool_tokens=2048,
                    max_context=1024, cuda_graphs=False, trace=False)
    table = script.launch_sites(engine, 1, steps=2)
    counts = {m.group(2): float(m.group(1)) for m in re.finditer(r"^\s+([\d.]+)x  (.+)$", table, re.MULTILINE)}
    layers = target.model.config.num_hidden_layers
    # one call per layer, although each CPU reference runs several ops (a decode step's rotary,
    # KV write and attention are one kernel module call: rope_attention)
    assert counts["phasegraph/kernels/rope_attention.py:rope_paged_attention (kernel call)"] == layers
    assert not any("rotary.py" in site or "attention.py:paged_attention" in site for site in counts)
    assert counts["phasegraph/kernels/linear.py:silu_mul_linear (kernel call)"] == layers
    assert any(site.startswith("phasegraph/phases/decode.py:") for site in counts)
    total = float(re.search(r"launches per step \(eager; a kernel-module call counts once\): (\d+)", table).group(1))
    assert len(counts) < 150 and total == round(sum(counts.values()))  # every site listed, and summed
