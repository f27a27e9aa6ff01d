"""Per-request speculation control: ``SamplingParams(speculate=False)`` and ``max_draft_tokens``.

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

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import InvalidRequest
from phasegraph.testing.drafters import AdversaryDraft, OracleDraft
from tests.engine.support import arch_bundle, assert_all_free, engine_for, make_prompts
from tests.phases.lossless_support import NEW_TOKENS, VOCAB, prompts, reference, tiny_target


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
