"""Adaptive speculation through the engine (injected cost tables, scripted and real drafts).

- Lossless: greedy outputs equal the target's whatever shapes the policy picks (chains, trees,
  no drafts, a batch run as two groups), for every page size, eager and with emulated graphs,
  with every invariant checked after each step.
- The shape follows the batch size as the cost table says (the trace's notes show which shape
  ran when, and ``phasegraph graph --trace`` prints them), and the policy leaves speculation
  where the draft is never right.
- A mixed batch splits: requests that do not speculate are held to decode while the others run
  their chain, and merge back in order.
- Start-up measurement (CPU): a table of every shape, the engine left idle and clean.
- Bad combinations are refused by name.

Per-request speculation control, ``SamplingParams(speculate=False)`` and ``max_draft_tokens``:

- Greedy: a batch that mixes requests without speculation, with a draft cap and without one
  emits exactly the target's greedy tokens; an oracle draft (every draft right) shows that the
  caps act: a request without speculation accepts one token per iteration, a capped one at most
  cap + 1, the others the whole chain.
- Seeded sampling: a request without speculation draws the same tokens alone, among speculating
  requests, under another tree shape and under a draft that is always wrong (no child of its
  root is ever tried, so only the target and its coins choose); a speculating seeded request
  draws the same tokens alone and among non-speculating ones.
- Bad values are refused by name.
"""

from __future__ import annotations

import pytest

from phasegraph.cli.graph import run_graph
from phasegraph.runtime.adaptive import OFF, CostTable, SpecShape
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import LONG_COST_CONTEXT, Engine
from phasegraph.runtime.errors import InvalidConfig, InvalidRequest
from phasegraph.testing.drafters import AdversaryDraft, NoisyOracleDraft, OracleDraft
from tests.engine import support
from tests.engine.support import arch_bundle, assert_all_free, engine_for, make_prompts
from tests.phases.lossless_support import NEW_TOKENS, VOCAB, prompts, reference, tiny_target

CHAIN1, CHAIN3, TREE = SpecShape.chain(1), SpecShape.chain(3), SpecShape(2, 3, 6)
SHAPES = (OFF, CHAIN1, CHAIN3, TREE)
BATCHES = (1, 2, 4, 8)


def costs(per_row: dict, base: float = 1.0, split_s: float = 0.0, shapes=SHAPES) -> CostTable:
    return CostTable(shapes, BATCHES, [[base + per_row[s] * b for b in BATCHES] for s in shapes], split_s)


# alone the tree costs less than the rest, by more than the policy's margin (so with an oracle
# draft, which fills both to the same depth, it wins), and from 2 requests on far more: a chain
# of 3 then
MOVING = CostTable(SHAPES, BATCHES, [(1.0, 1.1, 1.2, 1.4), (1.0, 1.15, 1.3, 1.6), (1.0, 1.2, 1.4, 1.8),
                                     (0.9, 5.0, 10.0, 20.0)])


def _engine(table: CostTable, batch: int, drafter=NoisyOracleDraft, *, seed: int = 3, **kw):
    ps = prompts(batch, seed)
    drafter = drafter(dict(zip(map(tuple, ps), reference(batch, seed), strict=True)), VOCAB)
    engine = Engine(tiny_target(), drafter, spec=SpecConfig(method="eagle", num_steps=3, topk=2, num_draft_tokens=6,
                                                            adaptive=True),
                    max_batch_size=max(batch, 1), kv_pool_tokens=8192, check_every_step=True, spec_costs=table, **kw)
    drafter.engine = engine
    return engine, ps


def _greedy(**kw):
    return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **kw)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_switching_shapes_is_lossless(page_size, cuda_graphs):
    for batch in (1, 5):
        engine, ps = _engine(MOVING, batch, page_size=page_size, cuda_graphs=cuda_graphs)
        outs = engine.generate(ps, _greedy())
        assert [tuple(o.token_ids) for o in outs] == list(reference(batch, 3))
        assert_all_free(engine)
        ran = {note for note, _ in engine.trace.notes("draft")}
        assert ran <= {CHAIN3.name, TREE.name} and (batch == 1 or CHAIN3.name in ran), ran


def test_the_shape_follows_the_batch_and_the_trace_shows_it(tmp_path, capsys):
    engine, ps = _engine(MOVING, 4, OracleDraft)
    budgets = [8, 16, 24, 64]  # the batch shrinks from 4 to 1
    outs = engine.generate(ps, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets])
    assert [tuple(o.token_ids) for o in outs] == [r[:n] for r, n in zip(reference(4, 3), budgets, strict=True)]
    runs = engine.trace.notes("draft")
    assert runs[0][0] == CHAIN3.name and runs[-1][0] == TREE.name, runs
    sizes = [t.batch_size for t in engine.trace if t.target == "draft"]
    for t in engine.trace:
        if t.target == "draft":
            assert t.note == (TREE.name if t.batch_size == 1 else CHAIN3.name), (t.batch_size, t.note)
    assert sizes[0] == 4 and sizes[-1] == 1
    path = engine.save_trace(tmp_path / "trace.json")

    class Args:
        format, out, trace = "text", None, str(path)

    assert run_graph(Args()) == 0
    text = capsys.readouterr().out
    assert f"draft: {CHAIN3.name} ×" in text and f"{CHAIN3.name} ×{runs[0][1]} → {TREE.name}" in text


def test_no_drafts_where_the_draft_is_never_right():
    table = costs({OFF: 0.02, CHAIN1: 0.04, CHAIN3: 0.06, TREE: 0.3})
    engine, ps = _engine(table, 6, AdversaryDraft)
    outs = engine.generate(ps, _greedy())
    assert [tuple(o.token_ids) for o in outs] == list(reference(6, 3))
    runs = [note for note, _ in engine.trace.notes("decode")]
    drafted = sum(n for _, n in engine.trace.notes("draft"))
    assert runs == ["off"] and drafted < 12, (runs, engine.trace.notes("draft"))


# compute-bound costs: per row far above the fixed part, so two groups pay off
SPLITTING = costs({OFF: 0.1, CHAIN1: 0.15, CHAIN3: 0.2, TREE: 0.5}, base=0.01, split_s=0.005,
                  shapes=(OFF, CHAIN3))


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_a_mixed_batch_runs_as_two_groups(cuda_graphs):
    engine, ps = _engine(SPLITTING, 6, OracleDraft, cuda_graphs=cuda_graphs)
    params = [_greedy(speculate=i % 2 == 0) for i in range(6)]
    outs = engine.generate(ps, params)
    assert [tuple(o.token_ids) for o in outs] == list(reference(6, 3))
    for i, o in enumerate(outs):
        lens = o.stats.accept_lengths
        assert (lens[:-1] == [4] * (len(lens) - 1) and lens) if i % 2 == 0 else lens == [], (i, lens)
    assert engine.trace.notes("split")[0][0] == f"{CHAIN3.name} | 3 held: off"
    assert {note for note, _ in engine.trace.notes("decode")} == {"off"}
    assert engine.trace.always_followed_by("verify", "finalize-tree-path")
    assert_all_free(engine)


def test_sampled_requests_stay_within_the_vocabulary_and_budget_under_every_shape():
    engine, ps = _engine(MOVING, 5)
    params = [SamplingParams(max_new_tokens=20, temperature=0.8, seed=40 + i, ignore_eos=True) for i in range(5)]
    outs = engine.generate(ps, params)
    assert all(len(o.token_ids) == 20 and all(0 <= t < VOCAB for t in o.token_ids) for o in outs)
    assert_all_free(engine)


def test_costs_are_measured_at_start_up_and_leave_the_engine_clean():
    ps = prompts(2, 3)
    drafter = OracleDraft(dict(zip(map(tuple, ps), reference(2, 3), strict=True)), VOCAB)
    engine = Engine(tiny_target(), drafter, spec=SpecConfig(method="eagle", num_steps=3, topk=2, num_draft_tokens=6),
                    max_batch_size=2, kv_pool_tokens=8192, check_every_step=True)
    drafter.engine = engine
    assert engine.scheduler.adaptive is None and engine.spec_shapes == ()  # auto: off on a CPU
    drafter._token_at = lambda req, i: 0  # the measurement's random prompts: any token, it only times
    table = engine.measure_spec_costs([OFF, CHAIN1, TREE], [1, 2], warmup=1, steps=2)
    assert table.shapes == (OFF, CHAIN1, TREE) and table.batches == (1, 2)
    assert all(x > 0 for row in table.seconds for x in row) and table.split_s >= 0
    # timed again at a long context: LONG_COST_CONTEXT cut to the 128-token context length, with
    # the timed iterations' 28 tokens (1 + 2 * 2 steps of up to 4, and 8) after the prompt
    assert LONG_COST_CONTEXT > 99 and (table.context, table.long_context) == (16, 128 - 28 - 1)
    assert len(table.long_seconds) == 3 and all(len(row) == 2 and min(row) > 0 for row in table.long_seconds)
    assert len(engine.trace) == 0 and not engine.has_unfinished()
    assert_all_free(engine)
    # a given long context; none; and a pool too small for long prompts at the largest batch
    assert engine.measure_spec_costs([OFF, CHAIN1], [1, 2], warmup=1, steps=2, long_context=60).long_context == 60
    assert engine.measure_spec_costs([OFF, CHAIN1], [1], warmup=1, steps=1, long_context=0).long_seconds is None
    with pytest.raises(InvalidConfig, match="long_context must be a token count >= 0"):
        engine.measure_spec_costs([OFF, CHAIN1], [1], long_context=-5)
    small = Engine(tiny_target(), drafter, spec=SpecConfig(method="eagle", num_steps=3, topk=2, num_draft_tokens=6),
                   max_batch_size=2, kv_pool_tokens=64)
    drafter.engine = small
    assert small.measure_spec_costs([OFF, CHAIN1], [1, 2], warmup=1, steps=1).long_seconds is None
    assert_all_free(small)


@pytest.mark.parametrize(("kw", "why"), [
    (dict(spec=SpecConfig(method="eagle", adaptive=False), spec_costs=MOVING), "spec_costs was given but"),
    (dict(spec=SpecConfig(method="none", adaptive=True)), "needs a speculative method"),
    (dict(spec=SpecConfig(method="eagle", adaptive=True),
          spec_costs=CostTable((OFF, SpecShape(200, 2, 3)), (1,), ((1.0,), (1.0,)))), "exceeds the draft's vocabulary"),
])
def test_bad_adaptive_settings_are_refused(kw, why):
    drafter = OracleDraft({}, VOCAB)
    draft = None if kw["spec"].method == "none" else drafter
    with pytest.raises(InvalidConfig, match=why):
        Engine(tiny_target(), draft, max_batch_size=2, kv_pool_tokens=4096, **kw)


def test_adaptive_must_be_a_switch():
    with pytest.raises(InvalidConfig, match="adaptive must be True, False or None"):
        SpecConfig(adaptive="yes")
    with pytest.raises(InvalidConfig, match="spec_costs must be a CostTable"):
        Engine(tiny_target(), OracleDraft({}, VOCAB), spec=SpecConfig(method="eagle", adaptive=True),
               spec_costs={"off": 1.0})


def test_measuring_shapes_wider_than_the_engine_is_refused():
    engine, _ = _engine(MOVING, 2)
    with pytest.raises(InvalidConfig, match=r"shapes \['tree K=4 S=3 N=8'\] need more draft branches"):
        engine.measure_spec_costs([OFF, SpecShape(4, 3, 8)], [1])
    with pytest.raises(InvalidConfig, match=r"shapes \['chain S=5'\] need more"):
        engine.measure_spec_costs([SpecShape.chain(5)], [1])


def test_an_iteration_the_budget_cut_short_is_not_counted_as_a_miss():
    engine, ps = _engine(MOVING, 1, OracleDraft)
    budget = 4 * 5 + 2  # a chain of 3 commits 4 tokens, a tree up to 4: the last iteration is cut
    engine.generate(ps, SamplingParams(max_new_tokens=budget, ignore_eos=True))
    assert engine.trace.notes("draft"), "the engine drafted"
    seen = engine.scheduler.adaptive.engine_wide
    assert seen.tries and all(seen.hits[k] == pytest.approx(seen.tries[k]) for k in seen.tries), (seen.hits, seen.tries)


def test_warm_up_captures_every_shape_and_bucket_before_traffic(engine_root):
    bundle = support.arch_bundle(engine_root, "llama")
    ps = support.make_prompts(5, seed=4)
    want = [o.token_ids for o in support.engine_for(bundle, "none", max_batch_size=5).generate(ps, _greedy())]
    engine = support.engine_for(bundle, "eagle3", topk=2, num_steps=3, num_draft_tokens=6, max_batch_size=5,
                                adaptive=True, spec_costs=MOVING, cuda_graphs="emulate")
    assert engine.warm_up(sampled=False) > 0  # greedy batches only: the traffic below is greedy
    assert not engine.scheduler.adaptive.engine_wide.tries  # random prompts taught the policy nothing
    assert engine.scheduler.adaptive.force is None and engine.trace.transitions == []
    held = engine.graph_runner.graph_count()
    # a batch split in two runs its groups through per-phase graphs of other sizes, which
    # warm_up does not cover: per-batch plans only here
    engine.scheduler.adaptive.split = False
    budgets = [8, 16, 24, 32, 40]  # the batch drains from 5 to 1 across shapes
    outs = engine.generate(ps, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets])
    assert [o.token_ids for o in outs] == [w[:n] for w, n in zip(want, budgets, strict=True)]
    assert len({note for note, _ in engine.trace.notes("draft")}) >= 2
    assert engine.graph_runner.graph_count() == held  # nothing captured mid-stream
    assert engine.warm_up() > 0  # batches that sample: graphs of their own
    assert_all_free(engine)
    assert support.engine_for(bundle, "eagle3", adaptive=False).warm_up() == 0  # no graphs: nothing to do


def _oracle_engine(spec: SpecConfig, batch: int, drafter=OracleDraft, **kw):
    ps = prompts(batch, seed=3)
    drafter = drafter(dict(zip(map(tuple, ps), reference(batch, 3), strict=True)), VOCAB)
    engine = Engine(tiny_target(), drafter, spec=spec, max_batch_size=batch, kv_pool_tokens=8192,
                    check_every_step=True, **kw)
    drafter.engine = engine
    return engine, ps


@pytest.mark.parametrize(("topk", "steps", "nodes"), [(1, 4, 5), (2, 3, 6)], ids=["chain", "tree"])
@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_mixed_caps_are_lossless_and_act(topk, steps, nodes, cuda_graphs):
    spec = SpecConfig(method="eagle", num_steps=steps, topk=topk, num_draft_tokens=nodes)
    engine, ps = _oracle_engine(spec, 6, cuda_graphs=cuda_graphs)
    caps = [None, False, 1, None, 0, 2]  # False: speculate=False; an int: max_draft_tokens
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True,
                             **({"speculate": False} if c is False else {"max_draft_tokens": c}))
              for c in caps]
    outs = engine.generate(ps, params)
    assert [tuple(o.token_ids) for o in outs] == list(reference(6, 3))
    longest = steps + 1
    for cap, out in zip(caps, outs, strict=True):
        lens = out.stats.accept_lengths[:-1]  # the last iteration may be cut by the budget
        most = longest if cap is None else (1 if cap is False else min(cap, steps) + 1)
        assert set(lens) == {most}, (cap, out.stats.accept_lengths)
    assert_all_free(engine)


def test_caps_without_speculation_change_nothing():
    engine = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=4, kv_pool_tokens=8192)
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, speculate=i % 2 == 0) for i in range(4)]
    outs = engine.generate(prompts(4, seed=3), params)
    assert [tuple(o.token_ids) for o in outs] == list(reference(4, 3))


def _sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True, **kw)


def test_a_sampled_request_without_speculation_draws_what_only_the_target_chooses():
    """Its root's children are never tried: the same tokens alone, in a batch of speculating
    requests, under a chain or a tree, and under a draft that is never right."""
    base = SpecConfig(method="eagle", num_steps=3, topk=1)
    tree = SpecConfig(method="eagle", num_steps=3, topk=2, num_draft_tokens=6)
    quiet = _sampled(11, speculate=False)
    runs = []
    for spec, drafter, batch in ((base, OracleDraft, 1), (base, OracleDraft, 5), (tree, OracleDraft, 5),
                                 (tree, AdversaryDraft, 5)):
        engine, ps = _oracle_engine(spec, 5, drafter)
        params = [_sampled(100 + i) for i in range(5)]
        params[2] = quiet
        outs = engine.generate(ps[:batch] if batch > 1 else [ps[2]], params[:batch] if batch > 1 else [quiet])
        mine = outs[2] if batch > 1 else outs[0]
        assert set(mine.stats.accept_lengths) == {1}
        runs.append(mine.token_ids)
    assert all(r == runs[0] for r in runs), runs


def test_seeded_speculating_request_is_batch_invariant_among_non_speculating(tmp_path_factory):
    bundle = arch_bundle(tmp_path_factory.getbasetemp() / "engine-checkpoints", "llama")
    ps = make_prompts(4, seed=21)
    params = [_sampled(7 + i, speculate=i != 1) for i in range(4)]

    def run(batch_prompts, batch_params):
        engine = engine_for(bundle, "eagle3", topk=2, num_steps=3, num_draft_tokens=6, page_size=4,
                            max_batch_size=4)
        return engine.generate(batch_prompts, batch_params)

    among = run(ps, params)
    for i in (0, 1):
        alone = run([ps[i]], [params[i]])[0]
        assert alone.token_ids == among[i].token_ids, i


@pytest.mark.parametrize(("kw", "why"), [
    (dict(speculate="no"), "speculate must be True or False"),
    (dict(speculate=None), "speculate must be True or False"),
    (dict(max_draft_tokens=-1), "max_draft_tokens must be None or an integer in [0, 1024]"),
    (dict(max_draft_tokens=2.0), "max_draft_tokens must be None or an integer"),
    (dict(max_draft_tokens=True), "max_draft_tokens must be None or an integer"),
])
def test_bad_speculation_controls_are_refused(kw, why):
    with pytest.raises(InvalidRequest, match=why.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kw)


def test_draft_cap_reads_both_controls():
    assert SamplingParams().draft_cap is None
    assert SamplingParams(speculate=False, max_draft_tokens=3).draft_cap == 0
    assert SamplingParams(max_draft_tokens=3).draft_cap == 3


def test_the_http_api_carries_the_controls():
    pytest.importorskip("pydantic")
    from phasegraph.serving.openai_api import CompletionRequest, completion_params

    params = completion_params(CompletionRequest(model="m", prompt="x", speculate=False, max_draft_tokens=2))
    assert (params.speculate, params.max_draft_tokens, params.draft_cap) == (False, 2, 0)
    assert completion_params(CompletionRequest(model="m", prompt="x")).draft_cap is None


# ------------------------------------------------------------------ re-entry from no drafts

DEMO_CHAIN3 = SpecShape.chain(3)


def _demo_engine():
    from phasegraph.demo import demo_pair_dir

    pair = demo_pair_dir()
    return Engine.from_pretrained(pair / "target", pair / "eagle3", device="cpu", dtype="float32",
                                  spec=SpecConfig(method="eagle3", num_steps=3, topk=1, adaptive=True),
                                  spec_costs=CostTable((OFF, DEMO_CHAIN3), (1,), ((1.0,), (1.0,))))


def _forced_run(prompt, budget: int, shape_at) -> tuple[list[int], list[tuple[str, int, list[int]]]]:
    """One request of the demo pair, each iteration's shape forced by ``shape_at(i)``; returns
    its tokens and, per iteration, (shape name, tokens emitted after it, its accept lengths)."""
    engine = _demo_engine()
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=budget))
    tokens, runs, i = [], [], 0
    while engine.has_unfinished():
        engine.scheduler.adaptive.force = shape = shape_at(i)
        for delta in engine.step():
            tokens += delta.new_token_ids
            runs.append((shape.name, len(tokens), list(delta.accept_lengths)))
        i += 1
    return tokens, runs


def test_a_request_back_from_no_drafts_drafts_as_if_it_never_left():
    """Three iterations without drafts, two with a chain, over and over: the same tokens as a
    run that always drafted, and the first accept length after each re-entry that of a request
    freshly prefilled over every token so far (its draft extended over all of them): decode
    keeps the draft current. (A draft resumed from its old state accepted 1.15 tokens on
    average there, against 2.85 freshly prefilled.)"""
    import torch

    from phasegraph.demo import demo_prompts

    torch.set_num_threads(1)
    budget = 48
    back, fresh = [], []
    for prompt in demo_prompts(3):
        always, _ = _forced_run(prompt, budget, lambda i: DEMO_CHAIN3)
        tokens, runs = _forced_run(prompt, budget, lambda i: OFF if i % 5 >= 2 else DEMO_CHAIN3)
        assert tokens == always
        ids = list(_demo_engine()._encode(prompt))
        for before, (shape, _, lens) in zip(runs, runs[1:], strict=False):
            emitted = before[1]  # its last token is the bonus, which the fresh prefill draws again
            if before[0] != "off" or shape == "off" or budget - emitted < 4:
                continue
            back.append(lens[0])
            fresh.append(_forced_run(ids + tokens[:emitted - 1], 5, lambda i: DEMO_CHAIN3)[1][0][2][0])
    assert len(back) >= 10 and back == fresh, (back, fresh)
