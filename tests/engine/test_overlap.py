"""Overlap scheduling: the device runs one iteration ahead of the host, and nothing changes.

With ``overlap=True`` every :meth:`Engine.step` issues the next iteration before it reads the
previous one's tokens (the default on a GPU, so the GPU never waits for the host's
bookkeeping). The price is that a finished request runs one iteration too many and that pages
are reserved for the worst case. These tests hold the overlapped engine to the serial one:
the same tokens and logprobs for greedy and seeded sampled requests finishing by budget, stop
token and context length; requests arriving and aborted while an iteration is in flight;
retraction under a pool too small for the workload; and the device state one iteration ahead
of the host after a step, equal to it after a drain. Schemas are checked in strict mode
throughout (a finished row's extra iteration must keep ``remaining >= 0``).
"""

from __future__ import annotations

import pytest

from phasegraph.runtime.config import SamplingParams
from tests.engine.support import (
    STRONG_TOKENS,
    arch_bundle,
    assert_all_free,
    engine_for,
    make_prompts,
)

CASES = {
    # name: (method, spec kwargs, page size, extra engine kwargs)
    "baseline-P4": ("none", {}, 4, {}),
    "eagle3-tree-P1": ("eagle3", dict(topk=2, num_steps=3, num_draft_tokens=6), 1, {}),
    "eagle3-chain-P16-graphs": ("eagle3", dict(topk=1, num_steps=3), 16, dict(cuda_graphs="emulate")),
    "standalone-tree-P4": ("standalone", dict(topk=2, num_steps=2, num_draft_tokens=4), 4, {}),
}


def _workload(n: int = 10):
    """Mixed budgets, greedy and seeded sampling, stop tokens, logprobs on some."""
    prompts = make_prompts(n, seed=5)
    params = []
    for i in range(n):
        stop = dict(stop_token_ids=list(STRONG_TOKENS)) if i % 3 == 0 else {}
        if i % 2:
            params.append(SamplingParams(max_new_tokens=5 + 4 * i, temperature=0.9, top_p=0.95, seed=70 + i,
                                         ignore_eos=True, logprobs=i % 4 == 1, **stop))
        else:
            params.append(SamplingParams(max_new_tokens=5 + 4 * i, ignore_eos=True, logprobs=i % 4 == 0, **stop))
    return prompts, params


def _assert_same(got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i}: overlapped {g.token_ids} != serial {w.token_ids}"
        assert g.finish_reason == w.finish_reason, f"request {i}"
        if w.logprobs is None:
            assert g.logprobs is None
        else:
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5), f"request {i}"


def _run_stepwise(engine, prompts, params):
    """generate() by hand, recording after each step whether an iteration was left in flight."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, p, sp)
    tokens = {rid: [] for rid in ids}
    finish = {}
    in_flight_after = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finish_reason is not None:
                finish[delta.request_id] = delta.finish_reason
        in_flight_after.append(engine.scheduler.in_flight is not None)
    return [tokens[r] for r in ids], [finish[r] for r in ids], in_flight_after


@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_engine_equals_serial(engine_root, case):
    method, spec, page_size, extra = CASES[case]
    bundle = arch_bundle(engine_root, "llama")
    prompts, params = _workload()
    serial = engine_for(bundle, method, page_size=page_size, max_batch_size=6, overlap=False, **spec, **extra)
    want = serial.generate(prompts, params)
    assert serial.scheduler.in_flight is None

    overlapped = engine_for(bundle, method, page_size=page_size, max_batch_size=6, overlap=True,
                            validate="strict", **spec, **extra)
    got = overlapped.generate(prompts, params)
    _assert_same(got, want)
    assert {w.finish_reason for w in want} == {"stop", "length"}, "the workload must finish both ways"
    assert_all_free(overlapped)  # check() drains the iteration left in flight

    # streamed through step(): the same tokens, and an iteration is in flight after most steps
    fresh = engine_for(bundle, method, page_size=page_size, max_batch_size=6, overlap=True,
                       validate="strict", **spec, **extra)
    tokens, finish, in_flight = _run_stepwise(fresh, prompts, params)
    assert tokens == [w.token_ids for w in want]
    assert finish == [w.finish_reason for w in want]
    assert sum(in_flight) >= len(in_flight) - 2, in_flight
    assert_all_free(fresh)


@pytest.mark.parametrize("case", ["baseline-P4", "eagle3-tree-P1"])
def test_no_iteration_is_wasted_at_the_end_of_a_batch(engine_root, case):
    """Requests that finish by budget: the overlapped engine runs exactly as many decode steps
    or speculative iterations as the serial one (it collects before issuing once every running
    request may reach its budget in the iteration in flight)."""
    method, spec, page_size, extra = CASES[case]
    bundle = arch_bundle(engine_root, "llama")
    prompts = make_prompts(3, seed=9)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 17, 17)]
    counts = []
    for overlap in (False, True):
        engine = engine_for(bundle, method, page_size=page_size, max_batch_size=4, overlap=overlap,
                            **spec, **extra)
        outs = engine.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == [9, 17, 17]
        phase = "decode" if method == "none" else "verify"
        counts.append(sum(1 for t in engine.trace.transitions if t.target == phase))
    assert counts[1] == counts[0], counts


def test_device_runs_one_iteration_ahead_until_drained(engine_root):
    bundle = arch_bundle(engine_root, "llama")
    engine = engine_for(bundle, "eagle3", topk=2, num_steps=3, num_draft_tokens=6, overlap=True, validate="strict")
    for i, p in enumerate(make_prompts(3, seed=2)):
        engine.add_request(f"a{i}", p, SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()  # prefill + the first iteration issued
    engine.step()  # the second issued, the first collected
    sched = engine.scheduler
    assert sched.in_flight is not None
    device = sched.machine.state.seq_lens.tolist()
    host = [r.seq_len for r in sched.running]
    assert all(d > h for d, h in zip(device, host, strict=True)), (device, host)
    sched.drain()
    assert sched.in_flight is None
    assert sched.machine.state.seq_lens.tolist() == [r.seq_len for r in sched.running]
    engine.check()


def test_arrivals_and_aborts_while_an_iteration_is_in_flight(engine_root):
    bundle = arch_bundle(engine_root, "llama")
    prompts, params = _workload(8)
    want = engine_for(bundle, "eagle3", topk=2, num_steps=3, num_draft_tokens=6, overlap=False).generate(prompts, params)

    engine = engine_for(bundle, "eagle3", topk=2, num_steps=3, num_draft_tokens=6, overlap=True,
                        validate="strict", max_batch_size=4)
    tokens = {i: [] for i in range(len(prompts))}
    finish = {}
    pending = list(range(len(prompts)))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:  # a new request every other step, mid-generation
            i = pending.pop(0)
            engine.add_request(f"q{i}", prompts[i], params[i])
        if steps == 5:
            assert engine.scheduler.in_flight is not None
            assert engine.abort("q1")
        for d in engine.step():
            i = int(d.request_id[1:])
            tokens[i] += list(d.new_token_ids)
            if d.finish_reason is not None:
                finish[i] = d.finish_reason
        steps += 1
    assert finish[1] == "abort"
    assert tokens[1] == want[1].token_ids[: len(tokens[1])]
    for i, w in enumerate(want):
        if i != 1:
            assert tokens[i] == w.token_ids, f"request {i}"
            assert finish[i] == w.finish_reason
    assert_all_free(engine)


def test_retraction_with_an_iteration_in_flight(engine_root):
    bundle = arch_bundle(engine_root, "llama")
    prompts = make_prompts(16, seed=11)
    params = [SamplingParams(max_new_tokens=12 + (7 * i) % 21, ignore_eos=True, temperature=0.8 if i % 2 else 0.0,
                             seed=300 + i) for i in range(16)]
    spec = dict(topk=4, num_steps=3, num_draft_tokens=8)
    want = engine_for(bundle, "eagle3", max_batch_size=16, overlap=False, **spec).generate(prompts, params)
    tight = engine_for(bundle, "eagle3", max_batch_size=16, kv_pool_tokens=200, overlap=True, validate="strict", **spec)
    got = tight.generate(prompts, params)
    assert tight.num_retractions >= 3, f"only {tight.num_retractions} retractions: the pool is not tight"
    _assert_same(got, want)
    assert_all_free(tight)


def test_context_limit_leaves_room_for_the_extra_iteration(engine_root):
    """A request whose budget is cut by the context length still has KV slots for the
    iteration it runs after finishing (the device does not know it finished)."""
    bundle = arch_bundle(engine_root, "llama")
    prompt = make_prompts([30], seed=4)[0]
    params = SamplingParams(max_new_tokens=500, ignore_eos=True)
    want = engine_for(bundle, "eagle3", topk=2, num_steps=3, max_context=40, overlap=False).generate([prompt], params)
    engine = engine_for(bundle, "eagle3", topk=2, num_steps=3, max_context=40, overlap=True, validate="strict")
    got = engine.generate([prompt], params)
    assert len(want[0].token_ids) == 10 and want[0].finish_reason == "length"
    _assert_same(got, want)
    assert_all_free(engine)
