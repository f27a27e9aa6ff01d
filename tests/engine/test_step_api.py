"""The step-level API: requests added, aborted and retracted while others run.

``add_request`` / ``step`` / ``abort`` / ``retract`` / ``has_unfinished`` on a running batch
leave every other request's output unchanged (compared with a run of those requests alone);
aborted requests report finish_reason "abort" once, keep a prefix of what they would have
produced, and give back every KV page at once (accounting checked right after the abort). The
deltas ``step()`` returns add up to each request's final output.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from phasegraph.runtime.config import SamplingParams
from tests.engine.support import arch_bundle, assert_all_free, engine_for, make_prompts

CONFIGS = {
    "baseline": ("none", {}, 16),
    "eagle3-tree": ("eagle3", dict(topk=2, num_steps=3), 4),
    "mtp-chain": ("mtp", dict(topk=1, num_steps=2), 1),
}


def _params():
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=17, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    return greedy, sampled


class Run:
    """Drives an engine step by step, collecting the deltas of every request."""

    def __init__(self, engine):
        self.engine = engine
        self.tokens = defaultdict(list)
        self.finish = {}
        self.steps = 0

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            for d in self.engine.step():
                assert d.request_id not in self.finish, f"{d.request_id} reported after finishing"
                self.tokens[d.request_id] += d.new_token_ids
                if d.finish_reason is not None:
                    self.finish[d.request_id] = d.finish_reason
            self.steps += 1

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self.step()
        self.step()  # a last step reports aborts made after the final step, and is harmless
        assert_all_free(self.engine)


def _solo(bundle, method, spec, page, requests):
    """Each request run on its own engine: the reference outputs."""
    out = {}
    for rid, prompt, params in requests:
        run = Run(engine_for(bundle, method, page_size=page, **spec))
        run.engine.add_request(rid, prompt, params)
        run.drain()
        out[rid] = run.tokens[rid]
    return out


@pytest.mark.parametrize("config", list(CONFIGS))
def test_add_abort_retract_leave_other_outputs_unchanged(engine_root, config):
    method, spec, page = CONFIGS[config]
    bundle = arch_bundle(engine_root, "mistral")
    greedy, sampled = _params()
    p = make_prompts([5, 12, 3, 20, 8, 16, 2], seed=3)
    base = [("a", p[0], greedy), ("b", p[1], sampled), ("c", p[2], greedy), ("d", p[3], sampled)]
    extra = [("x-run-abort", p[4], greedy), ("x-wait-abort", p[5], greedy), ("x-complete", p[6], sampled)]
    solo = _solo(bundle, method, spec, page, base + extra)

    engine = engine_for(bundle, method, page_size=page, check_every_step=True, **spec)
    run = Run(engine)
    assert not engine.has_unfinished()
    engine.add_request("a", p[0], greedy)
    engine.add_request("b", p[1], sampled)
    assert engine.has_unfinished()
    run.step(2)
    engine.add_request("x-run-abort", p[4], greedy)  # joins the running batch
    engine.add_request("c", p[2], greedy)
    run.step(2)
    # abort a running request: its KV goes back at once
    free_before = engine.kv.num_free_pages
    assert engine.abort("x-run-abort") is True
    engine.check()
    assert engine.kv.num_free_pages > free_before
    assert engine.abort("x-run-abort") is False  # already aborted
    assert engine.abort("no-such-request") is False
    # abort a request that never ran
    engine.add_request("x-wait-abort", p[5], greedy)
    assert engine.abort("x-wait-abort") is True
    engine.check()
    run.step()
    engine.add_request("d", p[3], sampled)
    engine.add_request("x-complete", p[6], sampled)
    run.step(3)
    # forced retraction of two running requests: they resume with the same output
    assert engine.retract("a") is True
    assert engine.retract("d") is True
    assert engine.retract("a") is False  # waiting now, not running
    engine.check()
    run.step()
    assert engine.retract("b") is True
    run.drain()
    assert engine.num_retractions >= 3
    assert engine.abort("a") is False  # finished

    for rid, *_ in base + [extra[2]]:
        assert run.finish[rid] == "length", rid
        assert run.tokens[rid] == solo[rid], f"{rid} changed by the other requests"
    assert run.finish["x-run-abort"] == "abort"
    assert run.finish["x-wait-abort"] == "abort"
    aborted = run.tokens["x-run-abort"]
    assert 0 < len(aborted) < len(solo["x-run-abort"])
    assert aborted == solo["x-run-abort"][: len(aborted)]
    assert run.tokens["x-wait-abort"] == []


def test_generate_among_step_level_requests_and_reused_ids(engine_root):
    """A finished request's id may be used again; an active one may not."""
    bundle = arch_bundle(engine_root, "llama")
    engine = engine_for(bundle, "eagle", topk=1, num_steps=2)
    greedy, _ = _params()
    p = make_prompts([4, 9], seed=5)
    engine.add_request("r", p[0], greedy)
    run = Run(engine)
    run.drain()
    first = run.tokens.pop("r")
    assert run.finish.pop("r") == "length"
    engine.add_request("r", p[0], greedy)  # the id is free again
    run.drain()
    assert run.tokens["r"] == first
    outs = engine.generate([p[0], p[1]], greedy)
    assert outs[0].token_ids == first
    assert_all_free(engine)


def test_deltas_carry_logprobs_the_final_output_and_phase_times(engine_root):
    """The deltas' logprobs add up to the output's; the last delta holds the whole output (its
    statistics included); the scheduler's ``on_phase`` hook sees every phase it runs."""
    engine = engine_for(arch_bundle(engine_root, "llama"), "eagle3", topk=2, num_steps=2)
    seen = defaultdict(float)
    engine.scheduler.on_phase = lambda phase, seconds, reqs: seen.__setitem__(phase, seen[phase] + seconds)
    p = make_prompts([7], seed=4)[0]
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, logprobs=True, ignore_eos=True)
    want = engine.generate([p], params)[0]
    seen.clear()
    engine.add_request("r", p, params)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [d.output is None for d in deltas] == [True] * (len(deltas) - 1) + [False]
    last = deltas[-1].output
    assert last.token_ids == want.token_ids and last.logprobs == want.logprobs
    assert last.stats.accept_lengths == want.stats.accept_lengths
    assert [t for d in deltas for t in d.new_token_ids] == want.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == want.logprobs
    assert [n for d in deltas for n in d.accept_lengths] == want.stats.accept_lengths
    assert {"prefill-extend", "draft", "verify", "draft-extend", "filter"} <= set(seen)
    assert seen.keys() == last.stats.phase_time_s.keys()  # one request: its phases are the engine's
    assert all(seen[k] == pytest.approx(last.stats.phase_time_s[k]) for k in seen)
    engine.add_request("q", p, SamplingParams(max_new_tokens=3))
    assert all(d.logprobs is None for d in engine.step())  # none asked for


def test_the_public_names_are_what_the_engine_hands_out(engine_root):
    """``phasegraph.RequestDelta`` / ``RequestOutput`` (lazy top-level names) are the types of
    what ``step()`` and ``generate()`` return, for users' annotations and isinstance checks."""
    import phasegraph

    assert {"Engine", "SpecConfig", "SamplingParams", "RequestOutput", "RequestDelta"} <= set(phasegraph.__all__)
    engine = engine_for(arch_bundle(engine_root, "llama"), "none")
    assert isinstance(engine, phasegraph.Engine)
    engine.add_request("r", make_prompts([4], seed=1)[0], phasegraph.SamplingParams(max_new_tokens=2))
    deltas = engine.step()
    assert deltas and all(isinstance(d, phasegraph.RequestDelta) for d in deltas)
    assert all(isinstance(o, phasegraph.RequestOutput) for o in engine.generate(make_prompts([3], seed=2)))


def test_a_second_thread_inside_a_busy_engine_is_a_named_error(engine_root):
    """While one thread is inside the engine (here in a step, held on an event), another thread's
    add_request, abort, step, generate and retract raise EngineInUse and change nothing; the
    first thread's own nested calls (generate's steps) go through, and it finishes as alone."""
    import threading

    import phasegraph

    engine = engine_for(arch_bundle(engine_root, "llama"), "eagle3")
    greedy, _ = _params()
    p = make_prompts([5, 7], seed=3)
    want = engine_for(arch_bundle(engine_root, "llama"), "eagle3").generate([p[0]], greedy)[0].token_ids
    entered, go_on = threading.Event(), threading.Event()
    step = engine.scheduler.step

    def held_step():
        entered.set()
        go_on.wait(30)
        return step()

    engine.scheduler.step = held_step
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", engine.generate([p[0]], greedy)))
    worker.start()
    try:
        assert entered.wait(30)
        for call in (lambda: engine.add_request("other", p[1], greedy), lambda: engine.abort("other"),
                     engine.step, lambda: engine.generate([p[1]], greedy), lambda: engine.retract("other")):
            with pytest.raises(phasegraph.EngineInUse, match="another thread is inside the engine"):
                call()
    finally:
        go_on.set()
        worker.join(60)
    engine.scheduler.step = step
    assert result["out"][0].token_ids == want
    assert not engine.has_unfinished()
    assert_all_free(engine)


def test_two_engines_sharing_one_target_object(engine_root):
    """Engines built over the same model objects each run over their own KV pools."""
    from phasegraph.runtime.engine import Engine
    from phasegraph.runtime.models.target import HFTarget

    bundle = arch_bundle(engine_root, "qwen3")
    target = HFTarget.from_pretrained(bundle.target)
    greedy, _ = _params()
    p = make_prompts([6, 11], seed=9)
    one = Engine(target, kv_pool_tokens=512)
    two = Engine(target, kv_pool_tokens=512, page_size=4)
    solo = [Engine(target, kv_pool_tokens=512).generate([q], greedy)[0].token_ids for q in p]
    one.add_request("a", p[0], greedy)
    two.add_request("b", p[1], greedy)
    r1, r2 = Run(one), Run(two)
    while one.has_unfinished() or two.has_unfinished():
        r1.step()
        r2.step()
    assert r1.tokens["a"] == solo[0]
    assert r2.tokens["b"] == solo[1]


def test_check_reports_every_broken_invariant(engine_root):
    """engine.check() finds tampered bookkeeping and names it (a named exception, no assert)."""
    import ast
    import inspect

    import phasegraph.runtime.engine as engine_module
    import phasegraph.runtime.scheduler as scheduler_module
    from phasegraph.runtime.errors import SchedulerInvariantError

    for module in (engine_module, scheduler_module):  # checks that survive python -O
        tree = ast.parse(inspect.getsource(module))
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Assert)], module.__name__

    bundle = arch_bundle(engine_root, "llama")
    engine = engine_for(bundle, "eagle3", topk=2, num_steps=2, page_size=4)
    greedy, _ = _params()
    p = make_prompts([5, 9, 3], seed=2)
    engine.add_request("a", p[0], greedy)
    engine.add_request("b", p[1], greedy)
    engine.step()
    engine.step()
    engine.add_request("c", p[2], greedy)
    engine.check()
    a = next(r for r in engine.scheduler.running if r.request_id == "a")
    c = engine.scheduler.waiting[0]

    def broken(*words):
        with pytest.raises(SchedulerInvariantError) as info:
            engine.check()
        for w in words:
            assert w in str(info.value), str(info.value)
        assert info.value.problems

    a.seq_len += 1
    broken("a: device seq_len", "host")
    a.seq_len -= 1
    a.output.append(3)
    broken("a: device seq_len", "prompt 5 + output")
    a.output.pop()
    engine.scheduler.waiting.append(a)
    broken("queued more than once: ['a']")
    engine.scheduler.waiting.pop()
    engine.scheduler.running.remove(a)
    broken("device batch has 2 rows, host runs 1", "page-table rows in use")
    engine.scheduler.running.insert(0, a)
    leaked = engine.kv.admit(4)
    broken(f"page-table rows in use [{', '.join(map(str, sorted([a.row, leaked] + [r.row for r in engine.scheduler.running[1:]])))}]")
    engine.kv.release(leaked)
    c.finish_reason = "stop"
    broken("c: waiting with status waiting")
    c.finish_reason = None
    del engine._requests["b"]
    broken("b: queued in the scheduler but unknown to the engine")
    engine._requests["b"] = next(r for r in engine.scheduler.running if r.request_id == "b")
    engine.kv.allocator._free.append(engine.kv.allocator._free[-1])
    broken("KV: pages in the free list more than once")
    engine.kv.allocator._free.pop()
    engine.check()
    while engine.has_unfinished():
        engine.step()
    assert_all_free(engine)


@pytest.mark.parametrize("config", ["baseline", "eagle3-tree"])
def test_generate_stopped_between_steps_keeps_every_token(engine_root, config):
    """``generate(should_stop=...)``, as Ctrl-C in ``phasegraph generate`` uses it: the requests
    still running (or waiting) end with "abort" holding a prefix of their full output, one that
    already finished keeps its own, and the engine is left clean for the next call."""
    method, spec, page = CONFIGS[config]
    bundle = arch_bundle(engine_root, "mistral")
    p = make_prompts([5, 12, 3], seed=4)
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True), SamplingParams(max_new_tokens=2, ignore_eos=True),
              SamplingParams(max_new_tokens=40, ignore_eos=True)]
    engine = engine_for(bundle, method, page_size=page, max_batch_size=2, **spec)
    full = engine.generate(p, params)
    asked = []

    def after_four_steps() -> bool:
        asked.append(None)
        return len(asked) > 4

    outs = engine.generate(p, params, should_stop=after_four_steps)
    assert [o.finish_reason for o in outs] == ["abort", "length", "abort"]
    assert 0 < len(outs[0].token_ids) < 40 and outs[0].token_ids == full[0].token_ids[: len(outs[0].token_ids)]
    assert outs[1].token_ids == full[1].token_ids
    assert outs[2].token_ids == full[2].token_ids[: len(outs[2].token_ids)]
    assert_all_free(engine)
    assert [o.token_ids for o in engine.generate(p, params)] == [o.token_ids for o in full]
