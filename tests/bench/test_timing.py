"""What the bench's timings rest on: ``timed_call`` (one call's wall time, the heap frozen),
profiler sessions that leave CUPTI detached (TEARDOWN_CUPTI=1, so rows timed after another row's
GPU-busy probe pay no profiler cost), and ``profile_pair_host.py --sites`` (a step's device
launches by phasegraph source line, one call into phasegraph/kernels counting once).

The weight bytes a decode step and a speculative iteration stream (`phasegraph bench`'s bound
on η at the memory-bandwidth limit), against parameter counts worked out from the configs.

The kernel warm-up process of `phasegraph bench` (phasegraph/bench/warm.py): how part 1 waits
for it. Its pair and engines are tested beside the quick run (test_bench_quick.py)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from phasegraph import Engine, SpecConfig
from phasegraph.bench import warm
from phasegraph.bench.common import (
    CUPTI_TEARDOWN_VAR,
    detach_cupti_after_profiling,
    forward_weight_bytes,
    iteration_weight_bytes,
    load_bench_scale,
    load_bench_script,
    timed_call,
)
from phasegraph.testing.checkpoints import (
    TINY,
    write_eagle1_draft,
    write_eagle3_draft,
    write_hf_target,
    write_standalone_draft,
)


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


F32 = 4  # bytes per float32 weight


def llama_layer(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, norms: int = 2,
                attn_in: int | None = None) -> int:
    """Parameters of one Llama decoder layer (q/k/v take ``attn_in`` inputs)."""
    attn_in = attn_in or hidden
    return ((heads + 2 * kv_heads) * head_dim * attn_in + hidden * heads * head_dim
            + 3 * hidden * inter + norms * hidden)


H, INTER, V, L = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"], TINY["num_hidden_layers"]
D = H // TINY["num_attention_heads"]
TARGET_STEP = L * llama_layer(H, INTER, 4, 2, D) + H + V * H  # layers, final norm, lm_head (no embedding)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    target = write_hf_target(root / "target")
    return {
        "target": target,
        "tied": write_hf_target(root / "tied", tie_word_embeddings=True),
        "eagle3": write_eagle3_draft(root / "eagle3", target),
        "eagle3_small_vocab": write_eagle3_draft(root / "eagle3_small", target, draft_vocab_size=32),
        "eagle1": write_eagle1_draft(root / "eagle1", target),
        "standalone": write_standalone_draft(root / "standalone", target),
    }


def engine(dirs, draft: str | None, **spec) -> Engine:
    return Engine.from_pretrained(dirs["target"], dirs[draft] if draft else None, spec=SpecConfig(**spec),
                                  device="cpu", dtype="float32", cuda_graphs=False)


def test_a_tied_table_counts_once_as_the_lm_head(dirs):
    from transformers import AutoModelForCausalLM

    untied = AutoModelForCausalLM.from_pretrained(str(dirs["target"]))
    tied = AutoModelForCausalLM.from_pretrained(str(dirs["tied"]))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert forward_weight_bytes(untied) == forward_weight_bytes(tied) == F32 * TARGET_STEP


def test_baseline_streams_the_target_once(dirs):
    wb = iteration_weight_bytes(engine(dirs, None, method="none"))
    assert wb == {"step": F32 * TARGET_STEP, "draft_pass": 0, "draft_passes": 0, "draft_once": 0,
                  "iteration": F32 * TARGET_STEP, "eta_bound": 1.0}


@pytest.mark.parametrize(("draft", "draft_vocab"), [("eagle3", V), ("eagle3_small_vocab", 32)])
@pytest.mark.parametrize("spec", [dict(num_steps=3, topk=1, num_draft_tokens=4),
                                  dict(num_steps=4, topk=4, num_draft_tokens=16)])
def test_eagle3_reads_its_head_per_step_and_fc_once(dirs, draft, draft_vocab, spec):
    wb = iteration_weight_bytes(engine(dirs, draft, method="eagle3", **spec))
    # the test checkpoints' heads: 2H intermediate, 4 heads of D, 2 KV heads, q/k/v over [emb | hidden]
    midlayer = llama_layer(H, 2 * H, 4, 2, D, norms=3, attn_in=2 * H)
    per_pass = midlayer + H + draft_vocab * H  # + final norm + the head's own lm_head
    fc = 3 * H * H
    steps = spec["num_steps"]
    assert wb["draft_pass"] == F32 * per_pass and wb["draft_once"] == F32 * fc
    assert wb["draft_passes"] == steps
    assert wb["iteration"] == F32 * (TARGET_STEP + steps * per_pass + fc)
    assert wb["eta_bound"] == pytest.approx(TARGET_STEP / (TARGET_STEP + steps * per_pass + fc))


def test_standalone_reads_the_whole_draft_per_step(dirs):
    wb = iteration_weight_bytes(engine(dirs, "standalone", method="standalone", num_steps=3, topk=1,
                                       num_draft_tokens=4))
    h, layers = 32, 2  # write_standalone_draft's model: 2 heads of 16, 1 KV head, untied lm_head
    per_pass = layers * llama_layer(h, 64, 2, 1, 16) + h + V * h
    assert wb["draft_pass"] == F32 * per_pass and wb["draft_once"] == 0
    assert wb["iteration"] == F32 * (TARGET_STEP + 3 * per_pass)


def test_methods_the_bound_does_not_cover_give_none(dirs):
    assert iteration_weight_bytes(engine(dirs, "eagle1", method="eagle", num_steps=3, topk=1,
                                         num_draft_tokens=4)) is None


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_finished_warm_up_is_recorded_with_its_exit_status():
    started = time.perf_counter()
    record = warm.finish(_child("raise SystemExit(3)"), started, timeout_s=60)
    assert record["returncode"] == 3
    assert 0 <= record["waited_s"] <= record["wall_s"] < 60


def test_a_warm_up_past_its_time_is_killed_not_waited_for():
    """Part 1 waits at most WARM_WAIT_S for the warm-up after training; past that it kills the
    process (a kernel left uncompiled only costs part 1 its compile time)."""
    started = time.perf_counter()
    proc = _child("import time; time.sleep(60)")
    record = warm.finish(proc, started, timeout_s=0.5)
    assert proc.poll() is not None and record["returncode"] != 0
    assert record["waited_s"] < 10


def test_accept_lengths_cover_every_width_of_an_accepted_path():
    assert warm.accept_lengths({"method": "none"}) == [None]
    assert warm.accept_lengths({"method": "eagle3", "num_steps": 3, "topk": 1}) == [None, 2, 3, 4]
    assert warm.accept_lengths({"method": "eagle3", "num_steps": 4, "topk": 4, "num_draft_tokens": 16}) == [
        None, 2, 3, 4, 5]


def test_wait_for_memory_polls_until_enough_is_free_or_the_time_is_up():
    readings = iter([1 << 30, 3 << 30, 9 << 30])
    slept = []
    assert warm.wait_for_memory(8 << 30, timeout_s=60, free_bytes=lambda: next(readings),
                                sleep=slept.append, poll_s=2.0)
    assert slept == [2.0, 2.0]  # two polls short of 8 GiB, the third enough
    assert warm.wait_for_memory(8 << 30, timeout_s=0.0, free_bytes=lambda: 1 << 30,
                                sleep=slept.append) is False
    assert warm.wait_for_memory(8 << 30, timeout_s=0.0, free_bytes=lambda: None)  # no CUDA


def _fake_pair(tmp_path):
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "target" / "config.json").write_text('{"vocab_size": 32}')
    return {"target": tmp_path / "target", "eagle3": tmp_path / "eagle3", "draft": tmp_path / "draft"}


def test_a_configuration_out_of_memory_is_tried_again_when_memory_frees_up(monkeypatch, tmp_path):
    """Run 26: the training beside the warm-up held 76.8 of 79.2 GiB and the standalone
    configuration's engine ran out of memory, which ended the warm-up. Now that configuration
    waits for the memory (part 1 releases the training's cache when it ends) and runs again."""
    import torch

    tries = []

    def fake_config(spec, dirs, spec_kw, draft_key, params, vocab, g):
        tries.append(spec_kw["method"])
        if spec_kw["method"] == "standalone" and tries.count("standalone") == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
        return 2

    monkeypatch.setattr(warm, "_warm_config", fake_config)
    readings = iter([1 << 30, 12 << 30])
    lines = []
    calls = warm.run_configs({"seed": 0}, _fake_pair(tmp_path), log=lambda m, **k: lines.append(m),
                             free_bytes=lambda: next(readings), sleep=lambda s: None)
    assert tries == ["none", "eagle3", "eagle3", "standalone", "standalone"]
    assert calls == 4 * 2
    assert "standalone draft chain S=3: out of device memory" in lines[3]
    assert lines[4].endswith("(second try)")


def test_a_configuration_that_runs_out_twice_is_skipped_with_a_message(monkeypatch, tmp_path):
    import torch

    def fake_config(spec, dirs, spec_kw, draft_key, params, vocab, g):
        if spec_kw["method"] == "eagle3" and spec_kw["topk"] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return 1

    monkeypatch.setattr(warm, "_warm_config", fake_config)
    lines = []
    calls = warm.run_configs({"seed": 0}, _fake_pair(tmp_path), log=lambda m, **k: lines.append(m),
                             free_bytes=lambda: 80 << 30, sleep=lambda s: None)
    assert calls == 3  # baseline, chain, standalone
    assert lines[-1] == ("warm-up: EAGLE-3 tree K=4 S=4 N=16: skipped, out of device memory again "
                         "(part 1 compiles its kernels itself)")
    monkeypatch.setattr(warm, "RETRY_WAIT_S", 0.0)
    lines.clear()
    warm.run_configs({"seed": 0}, _fake_pair(tmp_path), log=lambda m, **k: lines.append(m),
                     free_bytes=lambda: 1 << 30, sleep=lambda s: None)
    assert lines[-1].startswith("warm-up: EAGLE-3 tree K=4 S=4 N=16: skipped, 8 GiB of device memory "
                                "were not free within 0 s")


def test_any_other_error_of_a_configuration_still_ends_the_warm_up(monkeypatch, tmp_path):
    import pytest

    def fake_config(spec, dirs, spec_kw, draft_key, params, vocab, g):
        raise RuntimeError("Triton compile failed")

    monkeypatch.setattr(warm, "_warm_config", fake_config)
    with pytest.raises(RuntimeError, match="Triton compile failed"):
        warm.run_configs({"seed": 0}, _fake_pair(tmp_path), log=lambda m, **k: None,
                         free_bytes=lambda: 80 << 30, sleep=lambda s: None)
