"""Hypothesis stateful test of the engine, and a determinism property of seeded sampling.

Each example draws an engine configuration (target alone, EAGLE-3 chain or tree; page size 1 or
4; with or without the prefix cache; a KV pool small enough that retraction happens) and then a random sequence of step-level
calls: add a request (random prompt, budget, greedy or seeded sampling, some stop token ids),
step, abort, force a retraction. After every call ``engine.check()`` verifies the invariants
(KV accounting, one queue per request, device state == host bookkeeping, ``seq_len == prompt +
committed tokens``); the engine also checks them inside every step (``check_every_step``). At
the end the engine is drained: every request finished, every KV page and page-table row free,
the streamed deltas add up to each output, stops and budgets respected, and two of the
requests reproduce their output when run alone.
"""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.models.eagle3 import Eagle3Draft
from phasegraph.runtime.models.target import HFTarget
from tests.engine.support import STRONG_TOKENS, VOCAB, arch_bundle, assert_all_free

SPECS = {  # drawn per example (listed most complex first: what Hypothesis shrinks towards last)
    "eagle3-tree": SpecConfig(method="eagle3", topk=2, num_steps=3, num_draft_tokens=5),
    "eagle3-chain": SpecConfig(method="eagle3", topk=1, num_steps=3),
    "none": SpecConfig(method="none"),
}
CONFIGS = [(spec, page) for spec in SPECS for page in (4, 1)]
POOL_TOKENS = 60  # every request fits alone; four at a time often do not
MAX_STEPS_TO_DRAIN = 400
MAX_REQUESTS = 9  # per example (bounds the run time)


@functools.cache
def _models(root: str):
    from pathlib import Path

    bundle = arch_bundle(Path(root), "llama")
    target = HFTarget.from_pretrained(bundle.target, feature_mode="eagle3")
    draft = Eagle3Draft.from_pretrained(bundle.drafts["eagle3"], target)
    return target, draft


def _engine(root: str, spec: str, page_size: int, **kw) -> Engine:
    target, draft = _models(root)
    return Engine(target, draft if SPECS[spec].speculative else None, spec=SPECS[spec],
                  page_size=page_size, max_batch_size=4, **kw)


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)


@st.composite
def sampling_params(draw):
    kw = dict(max_new_tokens=draw(st.integers(1, 16)), ignore_eos=True)
    if draw(st.booleans()):
        kw.update(temperature=draw(st.sampled_from([0.5, 1.0, 1.5])), seed=draw(st.integers(0, 2**31 - 1)),
                  top_p=draw(st.sampled_from([1.0, 0.9])), top_k=draw(st.sampled_from([0, 8])))
    if draw(st.integers(0, 3)) == 0:
        # tokens the target favours (support.STRONG_TOKENS), so that stops do happen
        kw["stop_token_ids"] = draw(st.lists(st.sampled_from(STRONG_TOKENS), min_size=1, max_size=3))
    return SamplingParams(**kw)


def make_engine_machine(root: str):
    class EngineMachine(RuleBasedStateMachine):
        @initialize(choice=st.integers(0, 6 * 4096 - 1))
        def start(self, choice):
            # (a wide integer spreads the examples evenly over the configurations, where
            # sampled_from would favour its first entries)
            self.spec, self.page_size = CONFIGS[choice % len(CONFIGS)]
            cache = bool(choice // len(CONFIGS) % 2)  # with the prefix cache in every other example
            self.engine = _engine(root, self.spec, self.page_size, kv_pool_tokens=POOL_TOKENS, check_every_step=True,
                                  prefix_cache=cache)
            self.requests = {}  # id -> (prompt, params)
            self.tokens = {}  # id -> streamed tokens
            self.finish = {}  # id -> finish reason streamed
            self.aborted = set()
            self.n = 0

        def _active(self):
            return sorted(rid for rid in self.requests if rid not in self.finish)

        @precondition(lambda self: len(self.requests) < MAX_REQUESTS)
        @rule(prompt=prompts, params=sampling_params())
        def add(self, prompt, params):
            rid = f"r{self.n}"
            self.n += 1
            self.engine.add_request(rid, prompt, params)
            self.requests[rid] = (prompt, params)
            self.tokens[rid] = []

        @precondition(lambda self: len(self.requests) < MAX_REQUESTS - 2)
        @rule(batch=st.lists(st.tuples(prompts, sampling_params()), min_size=2, max_size=3))
        def add_several(self, batch):
            for prompt, params in batch:
                self.add(prompt, params)

        @rule()
        def step(self):
            for d in self.engine.step():
                assert d.request_id not in self.finish, f"{d.request_id} reported after finishing"
                self.tokens[d.request_id] += d.new_token_ids
                if d.finish_reason is not None:
                    self.finish[d.request_id] = d.finish_reason

        @precondition(lambda self: self._active())
        @rule(data=st.data())
        def abort(self, data):
            rid = data.draw(st.sampled_from(self._active()), label="abort")
            finished = self.engine._requests[rid].finish_reason is not None  # done, not yet reported
            assert self.engine.abort(rid) is not finished
            if not finished:
                self.aborted.add(rid)

        @rule()
        def abort_unknown(self):
            assert self.engine.abort("no-such-request") is False

        @precondition(lambda self: self.engine.scheduler.running)
        @rule(data=st.data())
        def retract(self, data):
            running = [r.request_id for r in self.engine.scheduler.running]
            rid = data.draw(st.sampled_from(running), label="retract")
            assert self.engine.retract(rid) is True
            assert self.engine.retract(rid) is False  # waiting now

        @invariant()
        def invariants_hold(self):
            if hasattr(self, "engine"):
                self.engine.check()

        def teardown(self):
            if not hasattr(self, "engine"):
                return
            for _ in range(MAX_STEPS_TO_DRAIN):
                if not self.engine.has_unfinished():
                    break
                self.step()
            self.step()  # reports aborts made after the last step
            assert_all_free(self.engine)
            assert set(self.finish) == set(self.requests), "a request never finished"
            done = []
            for rid, (_prompt, params) in self.requests.items():
                toks, reason = self.tokens[rid], self.finish[rid]
                assert len(toks) <= params.max_new_tokens
                if rid in self.aborted:
                    assert reason == "abort"
                    continue
                assert reason in ("length", "stop"), reason
                stops = set(params.stop_token_ids)
                assert not stops.intersection(toks[:-1]), "tokens after a stop token"
                if reason == "length":
                    assert len(toks) == params.max_new_tokens
                else:
                    assert toks[-1] in stops
                done.append(rid)
            for rid in done[:2]:  # batch, abort and retraction invariance of the output
                prompt, params = self.requests[rid]
                alone = _engine(root, self.spec, self.page_size).generate([prompt], params)[0]
                assert alone.token_ids == self.tokens[rid], f"{rid} differs from its run alone"

    return EngineMachine


def test_engine_state_machine(engine_root):
    machine = make_engine_machine(str(engine_root))
    machine.TestCase.settings = settings(
        max_examples=25, stateful_step_count=20, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    machine.TestCase("runTest").runTest()


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.sampled_from(["none", "eagle3-tree"]),
    prompt=prompts,
    params=st.builds(SamplingParams, max_new_tokens=st.integers(8, 16), temperature=st.sampled_from([0.7, 1.2]),
                     top_p=st.sampled_from([1.0, 0.8]), seed=st.integers(0, 2**31 - 1), ignore_eos=st.just(True)),
    others=st.lists(st.tuples(prompts, sampling_params()), min_size=1, max_size=4),
    position=st.integers(0, 4),
)
def test_seeded_sampling_is_batch_invariant(engine_root, spec, prompt, params, others, position):
    """A seeded sampled request draws the same tokens alone or among other requests
    (counter-based coins: a function of the seed and the position only)."""
    alone = _engine(str(engine_root), spec, 4).generate([prompt], params)[0]
    batch = [p for p, _ in others]
    plist = [sp for _, sp in others]
    position = min(position, len(batch))
    batch.insert(position, prompt)
    plist.insert(position, params)
    among = _engine(str(engine_root), spec, 4).generate(batch, plist)[position]
    assert among.token_ids == alone.token_ids
