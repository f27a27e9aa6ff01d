"""The adaptive speculation policy on synthetic cost tables (no model runs here).

- shapes, cost tables and their checks; linear costs between measured batch sizes;
- ``choose_plan`` maximises expected tokens per second: the tree where verifying it is nearly
  free, a chain where the tree's cost grows, no drafts where drafts lose, and a mixed batch split
  with exactly the poor requests held, only where splitting pays for its overhead; its rate is
  never below any single shape's, the baseline's included (hypothesis);
- acceptance estimates: the geometric model's expected tokens, per-request fits, held requests
  drifting back to the engine's estimate (their first draft after it counts);
- the controller re-plans when the batch changes by more than an eighth and every few iterations.
"""

from __future__ import annotations

import math
import random

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phasegraph.phases.context import TreeShape
from phasegraph.runtime.adaptive import (
    DECAY,
    OFF,
    PRIOR_RATE,
    RESCALE_BELOW,
    Acceptance,
    AdaptiveSpeculation,
    CostTable,
    Plan,
    PolicyInputs,
    SpecShape,
    choose_plan,
    default_shapes,
    expected_tokens,
    parse_shape,
)
from phasegraph.runtime.config import SamplingParams
from phasegraph.runtime.errors import InvalidConfig

CHAIN1, CHAIN3, TREE = SpecShape.chain(1), SpecShape.chain(3), SpecShape(4, 4, 16)
SHAPES = (OFF, CHAIN1, CHAIN3, TREE)
BATCHES = (1, 8, 32, 64)


def table(per_row: dict, base: float = 1.0, split_s: float = 0.0) -> CostTable:
    """Costs ``base + per_row[shape] * batch`` (ms): verified tokens cost per row."""
    return CostTable(SHAPES, BATCHES, [[base + per_row[s] * b for b in BATCHES] for s in SHAPES], split_s)


# tokens each shape is expected to emit for a request with a good draft (a tree beats a chain)
GOOD = (1.0, 1.8, 3.0, 3.8)
POOR = (1.0, 1.01, 1.01, 1.02)


def _inputs(costs, rows, split=True):
    return PolicyInputs(costs, rows, split)


def test_shapes_are_named_parsed_and_checked():
    assert [s.name for s in SHAPES] == ["off", "chain S=1", "chain S=3", "tree K=4 S=4 N=16"]
    assert [parse_shape(t) for t in ("off", "chain:3", "tree:4,4,16")] == [OFF, CHAIN3, TREE]
    assert OFF.off and OFF.tree is None and OFF.accept_width == 1 and OFF.family == "off"
    assert TREE.tree == TreeShape(4, 4, 16) and TREE.family == "tree" and CHAIN3.family == "chain"
    assert default_shapes(TreeShape(4, 4, 16)) == SHAPES
    assert default_shapes(TreeShape(1, 2, 3)) == (OFF, CHAIN1, SpecShape.chain(2))
    with pytest.raises(InvalidConfig, match="num_draft_tokens must be in"):
        SpecShape(2, 3, 40)
    with pytest.raises(InvalidConfig, match="the shape without drafts is SpecShape()"):
        SpecShape(2, 0, 0)
    with pytest.raises(InvalidConfig, match="off, chain:S or tree:K,S,N"):
        parse_shape("chain:x")


@pytest.mark.parametrize(("kw", "why"), [
    (dict(shapes=()), "non-empty list of SpecShape"),
    (dict(shapes=(OFF, OFF)), "names a shape twice"),
    (dict(batches=(8, 1)), "ascending distinct"),
    (dict(batches=(0,)), "ascending distinct"),
    (dict(seconds=((1.0,), (1.0,), (1.0,))), "one row per shape"),
    (dict(seconds=((1.0, 2.0), (1.0, 2.0))), "one row per shape"),
    (dict(seconds=((1.0,), (-1.0,))), "positive and finite"),
    (dict(seconds=((1.0,), (float("nan"),))), "positive and finite"),
    (dict(split_s=-1.0), "split_s must be"),
    (dict(context=0), "context must be a token count >= 1"),
    (dict(long_context=512), "come together"),
    (dict(long_seconds=((2.0,), (3.0,))), "come together"),
    (dict(long_context=16, long_seconds=((2.0,), (3.0,))), "above context"),
    (dict(long_context=512, long_seconds=((2.0,),)), "the shape of seconds"),
    (dict(long_context=512, long_seconds=((2.0,), (0.0,))), "long-context seconds of chain S=1"),
])
def test_cost_tables_are_checked(kw, why):
    base = dict(shapes=(OFF, CHAIN1), batches=(1,), seconds=((1.0,), (1.5,)), split_s=0.0)
    with pytest.raises(InvalidConfig, match=why):
        CostTable(**(base | kw))


def test_costs_are_linear_between_measured_batches():
    t = CostTable((OFF,), (1, 8, 32), ((1.0, 2.0, 5.0),))
    assert t.cost(0, 1) == 1.0 and t.cost(0, 8) == 2.0
    assert t.cost(0, 20) == pytest.approx(3.5)
    assert t.cost(0, 64) == pytest.approx(9.0)  # the last segment's slope above
    assert CostTable.from_dict(t.to_dict()) == t
    assert CostTable.from_dict(table({s: 0.1 for s in SHAPES}).to_dict()).shapes == SHAPES


def test_costs_are_linear_in_the_context_between_the_two_timed():
    t = CostTable((OFF, TREE), (1, 8), ((1.0, 2.0), (1.0, 3.0)), context=16, long_context=516,
                  long_seconds=((1.5, 2.5), (3.0, 9.0)))
    assert t.cost(1, 8) == t.cost(1, 8, 16) == t.cost(1, 8, 4) == 3.0  # no context, or at most the short one
    assert t.cost(1, 8, 266) == pytest.approx(6.0) and t.cost(1, 8, 516) == pytest.approx(9.0)
    assert t.cost(1, 8, 1016) == pytest.approx(15.0)  # the two contexts' slope beyond the long one
    assert t.cost(1, 4, 266) == pytest.approx((1.0 + 2.0 / 7 * 3) + ((3.0 + 6.0 / 7 * 3) - (1.0 + 2.0 / 7 * 3)) / 2)
    assert CostTable.from_dict(t.to_dict()) == t
    short_only = CostTable((OFF,), (1,), ((1.0,),))
    assert short_only.cost(0, 1, 4000) == 1.0 and "long_seconds" not in short_only.to_dict()


@pytest.mark.parametrize("batches", [(1, 8, 32, 64), (4, 16), (8,)])
def test_costs_at_every_batch_size_are_those_of_one_batch_size(batches):
    """The costs the split search reads at every group size in one pass, exactly as priced one
    at a time: between and past the measured sizes, at any context, at the floor included."""
    # the even shapes' costs fall at the last measured size, and past it to the floor
    secs = [[0.5 + 0.1 * i + 0.03 * b if i % 2 or b != batches[-1] else 0.01 for b in batches]
            for i in range(len(SHAPES))]
    longs = [[2.0 + 0.2 * i + (0.5 if j == 1 else 0.01) * b for j, b in enumerate(batches)] for i in range(len(SHAPES))]
    cheaper = [[x * 0.3 for x in row] for row in secs]  # long contexts priced below short: the floor
    for costs in (CostTable(SHAPES, batches, secs), CostTable(SHAPES, batches, secs, 0.0, 16, 400, longs),
                  CostTable(SHAPES, batches, secs, 0.0, 16, 400, cheaper)):
        for context in (None, 8, 16, 100, 1000):
            for shape in range(len(SHAPES)):
                row = costs.costs_up_to(shape, 80, context)
                assert list(row) == [costs.cost(shape, k, context) for k in range(1, 81)]


def test_the_tree_gives_way_to_the_chain_as_contexts_grow():
    """A tree that wins on short prompts loses once its 16 rows read long contexts: priced at
    the batch's own mean context (the requests' committed tokens), the policy moves to the chain."""
    short = [[1.0 + per * b for b in BATCHES] for per in (0.02, 0.06, 0.09, 0.1)]
    long = [[1.0 + per * b for b in BATCHES] for per in (0.03, 0.08, 0.12, 0.6)]
    costs = CostTable(SHAPES, BATCHES, short, context=16, long_context=512, long_seconds=long)
    assert SHAPES[choose_plan(PolicyInputs(costs, [GOOD] * 32, context=20)).shape] == TREE
    assert SHAPES[choose_plan(PolicyInputs(costs, [GOOD] * 32, context=400)).shape] == CHAIN3
    assert SHAPES[choose_plan(PolicyInputs(costs, [GOOD] * 32)).shape] == TREE  # no context: the short table
    ctl = AdaptiveSpeculation(costs, split=False)
    assert SHAPES[ctl.plan([_Req(seq_len=20) for _ in range(32)]).shape] == TREE
    batch = [_Req(seq_len=300 + 5 * i) for i in range(32)]
    assert ctl.inputs(batch).context == pytest.approx(300 + 5 * 31 / 2)
    assert SHAPES[ctl.plan(batch).shape] == CHAIN3


def test_the_tree_where_verifying_it_is_nearly_free():
    costs = table({OFF: 0.001, CHAIN1: 0.002, CHAIN3: 0.003, TREE: 0.004}, base=1.0)
    for b in (1, 8, 64):
        plan = choose_plan(_inputs(costs, [GOOD] * b))
        assert SHAPES[plan.shape] == TREE and not plan.held


def test_the_shape_moves_with_the_batch_as_costs_grow():
    """Per-row costs make the tree best alone, a chain at mid batches, no drafts at 64."""
    costs = table({OFF: 0.02, CHAIN1: 0.06, CHAIN3: 0.09, TREE: 0.2}, base=1.0)
    picks = [SHAPES[choose_plan(_inputs(costs, [GOOD] * b)).shape] for b in BATCHES]
    assert picks == [TREE, CHAIN3, CHAIN3, CHAIN3]
    steep = table({OFF: 0.02, CHAIN1: 0.2, CHAIN3: 0.6, TREE: 2.0}, base=10.0)
    picks = [SHAPES[choose_plan(_inputs(steep, [GOOD] * b)).shape] for b in BATCHES]
    assert picks[0] == TREE and picks[-1] == OFF


def test_no_drafts_when_every_draft_is_poor():
    costs = table({OFF: 0.01, CHAIN1: 0.03, CHAIN3: 0.05, TREE: 0.1}, base=1.0)
    assert SHAPES[choose_plan(_inputs(costs, [POOR] * 8)).shape] == OFF


def test_a_mixed_batch_holds_exactly_its_poor_requests_where_compute_bound():
    costs = table({OFF: 0.1, CHAIN1: 0.15, CHAIN3: 0.25, TREE: 0.9}, base=0.05, split_s=0.05)
    rows = [GOOD if i % 2 == 0 else POOR for i in range(32)]
    plan = choose_plan(_inputs(costs, rows))
    assert plan.held == tuple(range(1, 32, 2))
    assert SHAPES[plan.held_shape] == OFF and SHAPES[plan.shape] == CHAIN3
    together = max(choose_plan(_inputs(costs, rows, split=False)).tokens_per_s, 0)
    assert plan.tokens_per_s > together
    assert not choose_plan(_inputs(costs, rows, split=False)).held


def test_no_split_where_a_second_group_costs_more_than_it_saves():
    costs = table({OFF: 0.001, CHAIN1: 0.002, CHAIN3: 0.003, TREE: 0.004}, base=1.0, split_s=0.2)
    rows = [GOOD if i % 2 == 0 else POOR for i in range(16)]
    assert not choose_plan(_inputs(costs, rows)).held


def _rate(costs, rows, shape):
    return sum(r[shape] for r in rows) / costs.cost(shape, len(rows))


@settings(max_examples=200, deadline=None)
@given(
    per_row=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
    base=st.floats(0.01, 2.0),
    split_s=st.floats(0.0, 1.0),
    rows=st.lists(st.tuples(st.floats(1.0, 1.5), st.floats(1.0, 4.0), st.floats(1.0, 4.0)), min_size=1, max_size=40),
)
def test_the_plan_is_never_slower_than_any_single_shape(per_row, base, split_s, rows):
    costs = table(dict(zip(SHAPES, sorted(per_row), strict=True)), base, split_s)
    expected = [(1.0, 1.0 + a - 1, max(1.0 + a - 1, b), max(b, c)) for a, b, c in rows]
    plan = choose_plan(_inputs(costs, expected))
    for i in range(len(SHAPES)):
        assert plan.tokens_per_s >= _rate(costs, expected, i) * (1 - 1e-12)
    if plan.held:
        kept = [r for i, r in enumerate(expected) if i not in plan.held]
        held = [expected[i] for i in plan.held]
        cost = costs.cost(plan.shape, len(kept)) + costs.cost(plan.held_shape, len(held)) + costs.split_s
        want = (sum(r[plan.shape] for r in kept) + sum(r[plan.held_shape] for r in held)) / cost
        assert plan.tokens_per_s == pytest.approx(want)
        assert costs.cost(plan.held_shape, len(expected)) < costs.cost(plan.shape, len(expected))


def test_expected_tokens_follow_the_geometric_model():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0


def test_expected_tokens_take_one_rate_per_depth():
    assert expected_tokens([0.9, 0.5, 0.2], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert expected_tokens([0.9, 0.5, 0.2], 1) == pytest.approx(1.9)


def test_acceptance_fits_a_conditional_rate_per_depth():
    a = Acceptance(decay=1.0)
    for _ in range(50):
        a.observe("chain", 3, 3)  # depths 1-3 tried and hit
        a.observe("chain", 3, 0)  # depth 1 tried and missed; 2 and 3 never tried
        a.observe("chain", 3, 1)  # depth 1 hit, depth 2 missed
    assert a.rate("chain", 1, 0.5) == pytest.approx((100 + 1.0) / (150 + 2.0))
    assert a.rate("chain", 2, 0.5) == pytest.approx((50 + 1.0) / (100 + 2.0))
    assert a.rate("chain", 3, 0.5) == pytest.approx((50 + 1.0) / (50 + 2.0))
    assert not a.observed("tree", 1) and not a.observed("chain", 4)


class _ReferenceAcceptance:
    """The decayed-counts rule, written plainly: every observation of a family first fades each
    of that family's counts by ``decay``, then adds its tries and hits."""

    def __init__(self, decay: float):
        self.decay, self.hits, self.tries = decay, {}, {}

    def observe(self, family, depth, accepted):
        if depth <= 0:
            return
        accepted = max(0, min(accepted, depth))
        for key in [k for k in self.tries if k[0] == family]:
            self.hits[key] *= self.decay
            self.tries[key] *= self.decay
        for d in range(1, min(accepted + 1, depth) + 1):
            self.hits[family, d] = self.hits.get((family, d), 0.0) + (d <= accepted)
            self.tries[family, d] = self.tries.get((family, d), 0.0) + 1.0

    def fade(self, factor):
        for key in self.tries:
            self.hits[key] *= factor
            self.tries[key] *= factor

    def rate(self, family, depth, prior):
        return (self.hits.get((family, depth), 0.0) + 2.0 * prior) / (self.tries.get((family, depth), 0.0) + 2.0)


@pytest.mark.parametrize("decay", [DECAY, 0.98, 0.5, 1.0])
def test_lazily_decayed_counts_match_the_plain_rule(decay):
    """A long random sequence, past the point where the lazy decay is rescaled many times over,
    gives the rates and evidence of the plain rule."""
    rng = random.Random(7)
    lazy, plain = Acceptance(decay=decay), _ReferenceAcceptance(decay)
    # fades alone take every family's counts past the rescaling point four times
    fade_odds, factor = 0.05, 0.5
    steps = 4 * math.ceil(math.log(RESCALE_BELOW) / (fade_odds * math.log(factor)))
    for i in range(steps):
        if rng.random() < fade_odds:
            lazy.fade(factor)
            plain.fade(factor)
        else:
            family = rng.choice(["chain", "chain", "tree"])
            depth = rng.choice([0, 1, 3, 4, 6])
            accepted = rng.randint(-1, depth + 1)
            lazy.observe(family, depth, accepted)
            plain.observe(family, depth, accepted)
        if i % 97 == 0 or i == steps - 1:
            for family in ("chain", "tree"):
                for depth in range(1, 8):
                    want = plain.rate(family, depth, 0.6)
                    assert lazy.rate(family, depth, 0.6) == pytest.approx(want, rel=1e-9, abs=1e-12)
                    assert lazy.observed(family, depth) == (plain.tries.get((family, depth), 0.0) > 0)
                priors = [0.6 + 0.01 * d for d in range(7)]
                got = lazy.observed_rates(family, priors)
                for d, rate in enumerate(got, 1):
                    if (family, d) in plain.tries and plain.tries[family, d] > 0:
                        assert rate == pytest.approx(plain.rate(family, d, priors[d - 1]), rel=1e-9, abs=1e-12)
                    else:
                        assert rate is None
            want = sum(n for (_, depth), n in plain.tries.items() if depth == 1)
            assert lazy.evidence() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert lazy.tries.keys() == plain.tries.keys()
    assert all(lazy.tries[k] == pytest.approx(plain.tries[k], rel=1e-9, abs=1e-300) for k in plain.tries)
    assert all(lazy.hits[k] == pytest.approx(plain.hits[k], rel=1e-9, abs=1e-300) for k in plain.hits)


class _Req:
    def __init__(self, seq_len: int = 0, **kw):
        self.seq_len = seq_len  # committed tokens: the request's context
        self.params = SamplingParams(**kw)


def test_held_requests_drift_back_and_their_first_draft_counts():
    ctl = AdaptiveSpeculation(table({s: 0.1 for s in SHAPES}))
    good, poor = _Req(), _Req()
    for _ in range(20):
        ctl.observe(good, CHAIN3, 4)
        ctl.observe(poor, CHAIN3, 1)
    low = ctl.expected(poor)[SHAPES.index(CHAIN3)]
    assert low < 1.3 < 3.5 < ctl.expected(good)[SHAPES.index(CHAIN3)]
    ctl.ran_without_drafts(poor)
    faded = ctl.expected(poor)[SHAPES.index(CHAIN3)]
    assert faded > low
    ctl.observe(poor, CHAIN3, 1)  # decode kept its draft current: the first draft after is evidence
    assert ctl.expected(poor)[SHAPES.index(CHAIN3)] < faded
    for _ in range(100):
        ctl.ran_without_drafts(poor)
    assert ctl.expected(poor)[SHAPES.index(CHAIN3)] > 2.0  # near the engine's estimate again


def test_caps_and_unobserved_families():
    ctl = AdaptiveSpeculation(table({s: 0.1 for s in SHAPES}))
    quiet, capped, fresh = _Req(speculate=False), _Req(max_draft_tokens=1), _Req()
    assert ctl.expected(quiet) == (1.0,) * 4
    assert ctl.expected(capped)[2] == ctl.expected(capped)[1]  # chain S=3 capped at 1 draft
    assert ctl.expected(fresh)[2] == pytest.approx(expected_tokens(PRIOR_RATE["chain"], 3))
    for _ in range(30):
        ctl.observe(_Req(), CHAIN3, 1)  # the engine learns chains fail: trees are derived from it
    assert ctl.engine_rate("tree", 1) < PRIOR_RATE["tree"]
    assert ctl.engine_rate("chain", 2) == ctl.engine_rate("chain", 1)  # never tried: the depth above's


def test_the_controller_replans_on_change_and_every_few_iterations():
    ctl = AdaptiveSpeculation(table({s: 0.1 for s in SHAPES}), replan_every=3)
    batch = [_Req(), _Req()]
    first = ctl.plan(batch)
    assert ctl.plan(batch) is first and ctl.plan(batch) is first and ctl.plans == 1
    ctl.plan(batch)
    assert ctl.plans == 2
    ctl.plan(batch[:1])
    assert ctl.plans == 3
    ctl.force = OFF
    assert attrs.evolve(ctl.plan(batch)).shape == 0


def test_a_steady_batch_examines_its_plan_less_and_less_often():
    """Each re-choice that keeps the plan doubles the interval (3, 6, 12, then the cap of 16);
    a different plan, or another batch, brings it back to replan_every."""
    ctl = AdaptiveSpeculation(table({s: 0.1 for s in SHAPES}), replan_every=3, max_replan_every=16)
    batch = [_Req(), _Req()]
    planned_at = []
    for i in range(60):
        before = ctl.plans
        ctl.plan(batch)
        if ctl.plans > before:
            planned_at.append(i)
    assert planned_at == [0, 3, 9, 21, 37, 53]
    ctl.force = None
    ctl.plan(batch[:1])  # another batch: a plan now, the next after replan_every
    plans = ctl.plans
    for _ in range(3):
        ctl.plan(batch[:1])
    assert ctl.plans == plans + 1
    # a re-choice that changes the plan resets the interval: the next comes replan_every later
    ctl._last = ctl._last._replace(plan=Plan(0), interval=16)  # pretend "off" was in force
    for _ in range(16 - ctl._last.since + 1):  # the last of them re-chooses
        ctl.plan(batch[:1])
    assert ctl._last.interval == 3 and ctl._last.plan.shape != 0


def test_a_batch_that_changes_a_little_keeps_its_plan_until_its_next_examination():
    """Under traffic requests leave and join almost every iteration: a batch within an eighth of
    the requests its plan was chosen for (those that left plus those that joined) keeps the plan,
    examined again within replan_every iterations; a larger change, or any change to a batch whose
    plan holds rows apart, is planned at once."""
    ctl = AdaptiveSpeculation(table({s: 0.1 for s in SHAPES}), replan_every=4, max_replan_every=32)
    batch = [_Req() for _ in range(16)]
    first = ctl.plan(batch)
    assert ctl.plans == 1
    for _ in range(3):  # steady: the interval doubles to 8
        ctl.plan(batch)
    ctl.plan(batch)
    assert (ctl.plans, ctl._last.interval) == (2, 8)
    smaller = batch[1:]  # one left
    assert ctl.plan(smaller) is ctl._last.plan and ctl.plans == 2
    churned = [*batch[2:], _Req()]  # two left, one joined: 3 of 16, more than an eighth
    ctl.plan(churned)
    assert ctl.plans == 3
    assert SHAPES[first.shape] == SHAPES[ctl._last.plan.shape]
    # within an eighth, one change after another: the plan is examined again replan_every later
    plans, rows = ctl.plans, list(churned)
    for i in range(4):
        rows = rows[:-1] if i % 2 else [*rows, _Req()]
        ctl.plan(rows)
    assert ctl.plans == plans + 1, "examined again after replan_every iterations"

    split = AdaptiveSpeculation(COMPUTE, replan_every=8)
    good, poor = [_Req() for _ in range(6)], [_Req() for _ in range(2)]
    for _ in range(10):
        for req in good:
            split.observe(req, CHAIN3, 4)
        for req in poor:
            split.observe(req, CHAIN3, 1)
    assert split.plan([*good, *poor]).held == (6, 7)
    split.plan([*good[1:], *poor])  # one of 8 left, but the plan names its held rows
    assert split.plans == 2 and split._last.plan.held == (5, 6)


def test_a_family_a_request_never_ran_follows_its_own_other_family():
    ctl = AdaptiveSpeculation(table({s: 0.1 for s in SHAPES}))
    sure, unsure = _Req(), _Req()
    for _ in range(30):
        ctl.observe(sure, CHAIN3, 4)
        ctl.observe(unsure, CHAIN3, 2)
    for req in (sure, unsure):
        rates = ctl.rates(req)
        assert all(t > c for t, c in zip(rates["tree"], rates["chain"], strict=True))
    # each request's own, not the engine's, which mixes both: both hit depth 1, only one depth 2
    sure_tree, unsure_tree = ctl.rates(sure)["tree"], ctl.rates(unsure)["tree"]
    assert sure_tree[0] == pytest.approx(unsure_tree[0]) and sure_tree[1] > unsure_tree[1] + 0.5


def test_a_batch_without_drafts_lets_the_engine_estimate_drift_back_to_the_prior():
    ctl = AdaptiveSpeculation(table({s: 0.1 for s in SHAPES}))
    for _ in range(60):
        ctl.observe(_Req(), CHAIN3, 1)  # drafts always fail: the policy would choose off
    low = ctl.engine_rate("chain", 1)
    assert low < 0.1
    for _ in range(200):  # off for the whole batch: nothing observed, so the estimate fades
        ctl.batch_ran_without_drafts()
    assert ctl.engine_rate("chain", 1) == pytest.approx(PRIOR_RATE["chain"], abs=0.05)


# ------------------------------------------------------------------------------ hysteresis

# chains of 1 and 3 equally fast for GOOD rows at batch 8: 8 * 1.8 / 4.8 = 8 * 3.0 / 8.0
NEAR = CostTable(SHAPES, BATCHES, [[1.0 + 0.6 * b for b in BATCHES], [0.8 + 0.5 * b for b in BATCHES],
                                   [1.6 + 0.8 * b for b in BATCHES], [50.0 * b for b in BATCHES]])


def _wobble(i: int) -> list[tuple[float, ...]]:
    """GOOD rows whose chain-3 estimate wobbles by 2 % either way, iteration by iteration."""
    x = 1.02 if i % 2 else 0.98
    return [(1.0, 1.8, 3.0 * x, 3.8)] * 8


def _replan(costs, rows_at, iterations: int, margin: float, **kw) -> list[Plan]:
    plans, current = [], None
    for i in range(iterations):
        current = choose_plan(PolicyInputs(costs, rows_at(i), current=current, margin=margin, **kw))
        plans.append(current)
    return plans


def test_near_equal_shapes_do_not_alternate():
    flip_happy = [SHAPES[p.shape] for p in _replan(NEAR, _wobble, 10, margin=0.0)]
    assert flip_happy == [CHAIN1, CHAIN3] * 5  # without a margin: a switch every iteration
    steady = [SHAPES[p.shape] for p in _replan(NEAR, _wobble, 10, margin=0.05)]
    assert steady == [CHAIN1] * 10
    # a gain beyond the margin still switches
    better = [SHAPES[p.shape] for p in _replan(NEAR, lambda i: _wobble(0) if i < 3 else [(1.0, 1.8, 3.3, 3.8)] * 8,
                                               6, margin=0.05)]
    assert better == [CHAIN1] * 3 + [CHAIN3] * 3


# per-row costs far above the fixed part (compute-bound): holding a poor row saves its chain
COMPUTE = table({OFF: 0.2, CHAIN1: 0.3, CHAIN3: 0.4, TREE: 1.0}, base=0.01, split_s=0.01)
# the fixed part dominates (memory-bound): a second group costs a second iteration's fixed part
FIXED = table({OFF: 0.001, CHAIN1: 0.002, CHAIN3: 0.003, TREE: 0.004}, base=1.0, split_s=0.01)


@pytest.mark.parametrize(("costs", "rows", "splits"), [
    (COMPUTE, [GOOD] * 3 + [POOR], True),  # 10.0 tokens / 1.43 s against 10.01 / 1.61 s together
    (FIXED, [GOOD] * 3 + [POOR], False),  # the held row's group costs an iteration: 2 s for 3 % more tokens
    (COMPUTE, [GOOD] * 31 + [POOR], False),  # one row of 32: 1.4 % faster, under the margin
])
def test_a_collapsed_request_is_held_only_where_the_measured_costs_say_it_pays(costs, rows, splits):
    plan = choose_plan(PolicyInputs(costs, rows, margin=0.05, evidence=[10.0] * len(rows), min_evidence=4.0))
    assert (plan.held == (len(rows) - 1,)) if splits else not plan.held, plan
    if splits:
        assert SHAPES[plan.held_shape] == OFF and SHAPES[plan.shape] == CHAIN3
        together = choose_plan(PolicyInputs(costs, rows, split=False))
        assert plan.tokens_per_s > together.tokens_per_s * 1.05


def test_a_request_is_held_only_on_enough_evidence():
    rows = [GOOD] * 3 + [POOR]
    thin = [10.0, 10.0, 10.0, 1.0]  # one unlucky iteration
    assert not choose_plan(PolicyInputs(COMPUTE, rows, evidence=thin, min_evidence=4.0)).held
    assert choose_plan(PolicyInputs(COMPUTE, rows, evidence=[10.0] * 4, min_evidence=4.0)).held == (3,)
    # once held, it stays held while its evidence fades (it drifts back through its estimate)
    held = Plan(SHAPES.index(CHAIN3), (3,), SHAPES.index(OFF))
    assert choose_plan(PolicyInputs(COMPUTE, rows, current=held, evidence=thin, min_evidence=4.0)).held == (3,)


@settings(max_examples=200, deadline=None)
@given(
    per_row=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
    base=st.floats(0.01, 2.0),
    rows=st.lists(st.tuples(st.floats(1.0, 4.0), st.floats(1.0, 4.0)), min_size=2, max_size=20),
    current=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 19)),
    margin=st.floats(0.0, 0.3),
)
def test_hysteresis_costs_at_most_the_margin(per_row, base, rows, current, margin):
    costs = table(dict(zip(SHAPES, sorted(per_row), strict=True)), base, 0.01)
    expected = [(1.0, a, max(a, b), max(a, b) * 1.1) for a, b in rows]
    shape, held_shape, k = current
    incumbent = Plan(shape, tuple(range(min(k, len(rows) - 1))), held_shape)
    free = choose_plan(PolicyInputs(costs, expected, margin=margin))  # the same bar for a split
    plan = choose_plan(PolicyInputs(costs, expected, current=incumbent, margin=margin))
    assert plan.tokens_per_s * (1 + margin) >= free.tokens_per_s * (1 - 1e-12)
    assert plan == free or plan == attrs.evolve(incumbent, tokens_per_s=plan.tokens_per_s)


def test_bad_policy_inputs_are_refused():
    with pytest.raises(InvalidConfig, match="margin must be a number >= 0"):
        PolicyInputs(COMPUTE, [GOOD], margin=-0.1)
    with pytest.raises(InvalidConfig, match="evidence needs one value per row"):
        PolicyInputs(COMPUTE, [GOOD], evidence=[1.0, 2.0])
    with pytest.raises(InvalidConfig, match="current names shapes or rows"):
        PolicyInputs(COMPUTE, [GOOD], current=Plan(0, (3,), 1))
    with pytest.raises(InvalidConfig, match="context must be a token count >= 0 or None"):
        PolicyInputs(COMPUTE, [GOOD], context=-1.0)


def test_the_controller_carries_its_plan_across_batch_changes():
    ctl = AdaptiveSpeculation(COMPUTE, replan_every=1)
    good, poor = [_Req() for _ in range(3)], _Req()
    for _ in range(10):
        for req in good:
            ctl.observe(req, CHAIN3, 4)
        ctl.observe(poor, CHAIN3, 1)
    assert ctl.evidence(poor) >= ctl.min_evidence and ctl.evidence(_Req(speculate=False)) == float("inf")
    plan = ctl.plan([*good, poor])
    assert plan.held == (3,) and SHAPES[plan.shape] == CHAIN3 and SHAPES[plan.held_shape] == OFF
    newcomer = _Req()
    batch = [poor, good[0], newcomer, good[1]]  # the policy sees the plan in force in these rows
    assert ctl.inputs(batch).current == Plan(plan.shape, (0,), plan.held_shape)
    assert ctl.plan(batch).held == (0,)
    assert ctl.inputs([poor]).current == Plan(plan.held_shape)  # alone, the held group is the batch
