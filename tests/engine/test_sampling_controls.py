"""min_p, logit bias and repetition / frequency / presence penalties through the engine.

- The target alone equals a plain greedy loop over transformers' logits with the penalties
  written out (and transformers' own ``repetition_penalty`` where it has one).
- Greedy requests with penalties are token-identical under chain and tree speculation (with the
  target as its own draft, so that long paths are accepted and each node's own ancestry
  matters), with CUDA graphs emulated too, in batches that mix requests with and without them.
- The count state survives retraction: after every step of a run under a KV pool too small for
  its workload, every request's device counts equal its output's (``check_every_step``), and the
  outputs equal those of the unconstrained run.
- Sampling stays lossless: the tokens of a self-draft tree have the distribution of plain
  sampling with the same controls (two-sample chi-square, as test_sampling_distribution).
"""

from __future__ import annotations

import functools

import pytest
import torch

from phasegraph.runtime.config import SamplingParams
from tests.engine.support import VOCAB, arch_bundle, assert_all_free, engine_for, make_prompts
from tests.engine.test_sampling_distribution import P_THRESHOLD, two_sample_pvalue

NEW = 24
# greedy requests of one batch: several controls, one request with none
CONTROLS = [
    dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
    dict(logit_bias={5: -100.0, 17: 3.0, 60: 1.5}, repetition_penalty=0.8),
    dict(),
    dict(frequency_penalty=2.0),
    dict(presence_penalty=-1.0, logit_bias={42: -2.0}),
]


def _greedy(max_new_tokens: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


@functools.cache
def _hf_model(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


def _plain_greedy(target, prompt, params: SamplingParams, new: int = NEW) -> list[int]:
    """Greedy decoding over transformers' logits with the bias and penalties written out."""
    model = _hf_model(target)
    ids = list(prompt)
    out: list[int] = []
    bias = torch.zeros(VOCAB, dtype=torch.float64)
    for token, value in params.logit_bias or ():
        bias[token] = value
    in_prompt = torch.zeros(VOCAB, dtype=torch.bool)
    in_prompt[list(prompt)] = True
    with torch.no_grad():
        for _ in range(new):
            x = model(torch.tensor([ids])).logits[0, -1].double() + bias
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=VOCAB).double()
            seen = in_prompt | (counts > 0)
            x = torch.where(seen, torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty), x)
            x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
            token = int(x.argmax())
            out.append(token)
            ids.append(token)
    return out


@pytest.fixture(scope="module")
def bundle(engine_root):
    return arch_bundle(engine_root, "llama")


@pytest.fixture(scope="module")
def alone(bundle):
    """The target alone on the mixed greedy batch."""
    eng = engine_for(bundle, "none", check_every_step=True)
    outs = eng.generate(list(bundle.prompts) + [bundle.prompts[0]], [_greedy(**c) for c in CONTROLS])
    return [o.token_ids for o in outs]


def test_the_target_alone_equals_a_plain_loop_over_transformers(bundle, alone):
    prompts = list(bundle.prompts) + [bundle.prompts[0]]
    for tokens, prompt, controls in zip(alone, prompts, CONTROLS, strict=True):
        assert tokens == _plain_greedy(bundle.target, prompt, _greedy(**controls)), controls
    assert alone[0] != list(bundle.reference[0][:NEW])  # the penalties change the output
    # transformers' own repetition penalty (over prompt and output, the CTRL form)
    eng = engine_for(bundle, "none")
    prompt = list(bundle.prompts[1])
    ours = eng.generate(prompt, _greedy(repetition_penalty=1.5))[0].token_ids
    ids = torch.tensor([prompt])
    theirs = _hf_model(bundle.target).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
        repetition_penalty=1.5, pad_token_id=0,
    )[0, len(prompt):].tolist()
    assert ours == theirs


SPECULATIVE = {
    # name: (method, draft, spec kwargs)
    "self-chain": ("standalone", "self", dict(topk=1, num_steps=4)),
    "self-tree": ("standalone", "self", dict(topk=4, num_steps=3, num_draft_tokens=10)),
    "eagle3-tree": ("eagle3", None, dict(topk=4, num_steps=3, num_draft_tokens=8)),
}
# drafts accepted in the mixed batch, at least: the target as its own draft proposes its
# unpenalised argmax, accepted wherever the penalties leave it first; a random EAGLE-3 head less
ACCEPTED_AT_LEAST = {"self-chain": NEW, "self-tree": NEW, "eagle3-tree": 1}


@pytest.mark.parametrize("cuda_graphs", [None, "emulate"])
@pytest.mark.parametrize("case", list(SPECULATIVE))
def test_greedy_with_penalties_is_token_identical_under_speculation(bundle, alone, case, cuda_graphs):
    method, draft, spec = SPECULATIVE[case]
    eng = engine_for(bundle, method, draft=draft, check_every_step=True, cuda_graphs=cuda_graphs, **spec)
    prompts = list(bundle.prompts) + [bundle.prompts[0]]
    for _ in range(2 if cuda_graphs else 1):  # emulated graphs: warm-up, then capture and replay
        outs = eng.generate(prompts, [_greedy(**c) for c in CONTROLS])
        assert [o.token_ids for o in outs] == alone
    accepted = sum(sum(o.stats.accept_lengths) - len(o.stats.accept_lengths) for o in outs)
    assert accepted >= ACCEPTED_AT_LEAST[case], f"only {accepted} drafts accepted: the tree's penalties were barely used"
    if cuda_graphs:
        assert eng.graph_runner.iteration.replays > 0
    assert_all_free(eng)


@pytest.mark.parametrize("case", ["none", "self-tree"])
def test_requests_with_and_without_controls_share_batches(bundle, case):
    """Requests join running batches that do and do not carry the count state (merge fills the
    side without it), and leave them (the state goes once no request uses it); each output is
    the one it has alone, and the device counts equal the outputs after every step."""
    method, draft, spec = ("none", None, {}) if case == "none" else SPECULATIVE[case]
    prompts = make_prompts([6, 11, 3, 9], seed=21)
    params = [_greedy(), _greedy(**CONTROLS[0]), _greedy(max_new_tokens=8), _greedy(**CONTROLS[1])]
    solo_engine = engine_for(bundle, method, draft=draft, **spec)
    solo = [solo_engine.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    eng = engine_for(bundle, method, draft=draft, check_every_step=True, **spec)
    tokens: dict[str, list[int]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(f"r{i}", p, sp)  # each joins the batch the earlier ones left it
        for _ in range(3):
            for d in eng.step():
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        carried = eng.scheduler.machine.state.output_counts is not None
        assert carried == any(r.params.uses_penalties for r in eng.scheduler.running), i  # none unless used
    while eng.has_unfinished():
        for d in eng.step():
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert [tokens[f"r{i}"] for i in range(4)] == solo
    assert_all_free(eng)


def _workload():
    prompts = make_prompts(24, seed=5)
    params = []
    for i in range(24):
        budget = 12 + (5 * i) % 17
        controls = CONTROLS[i % len(CONTROLS)]
        if i % 3 == 1:
            params.append(SamplingParams(max_new_tokens=budget, temperature=0.9, min_p=0.05, seed=500 + i,
                                         ignore_eos=True, **controls))
        else:
            params.append(_greedy(max_new_tokens=budget, **controls))
    return prompts, params


@pytest.mark.parametrize(("method", "spec", "page_size", "pool", "overlap"), [
    ("none", {}, 16, 160, False),
    ("eagle3", dict(topk=4, num_steps=3, num_draft_tokens=8), 1, 150, False),
    # the device one iteration ahead of the host: flags and counts follow each issued iteration
    ("eagle3", dict(topk=4, num_steps=3, num_draft_tokens=8), 1, 150, True),
])
def test_penalty_state_survives_retraction(bundle, method, spec, page_size, pool, overlap):
    prompts, params = _workload()
    free = engine_for(bundle, method, page_size=page_size, max_batch_size=24, kv_pool_tokens=8192, **spec)
    want = free.generate(prompts, params)
    tight = engine_for(bundle, method, page_size=page_size, max_batch_size=24, kv_pool_tokens=pool,
                       check_every_step=True, overlap=overlap, **spec)  # device counts == host output, every step
    got = tight.generate(prompts, params)
    assert tight.num_retractions >= 5, f"only {tight.num_retractions} retractions: the pool is not tight"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} changed under retraction ({g.stats.retractions} retractions)"
    assert_all_free(tight)


@pytest.mark.parametrize("case", ["none", "self-tree"])
def test_a_forced_retraction_resumes_with_the_counts_of_the_unretracted_run(bundle, case):
    """Retracted after 8 tokens, the request is prefilled again from its prompt and output: its
    device counts are then those of the unretracted run at the same length, and it ends with
    the same output, greedy and sampled."""
    method, draft, spec = ("none", None, {}) if case == "none" else SPECULATIVE[case]
    prompt = list(bundle.prompts[2])
    for params in (_greedy(**CONTROLS[0]),
                   SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=9, ignore_eos=True, **CONTROLS[1])):
        want = engine_for(bundle, method, draft=draft, **spec).generate(prompt, params)[0].token_ids
        eng = engine_for(bundle, method, draft=draft, check_every_step=True, **spec)
        eng.add_request("r", prompt, params)
        req = eng._requests["r"]  # the request itself: its output once it has left the engine
        while len(req.output) < 8:
            eng.step()
        assert eng.retract("r")
        eng.step()  # resumes: prefilled again, then one more iteration
        state = eng.scheduler.machine.state
        n = len(req.output)
        assert state.output_counts[0].tolist() == torch.bincount(torch.tensor(want[:n]), minlength=VOCAB).tolist()
        assert state.prompt_mask[0].nonzero()[:, 0].tolist() == sorted(set(prompt))
        while eng.has_unfinished():
            eng.step()
        assert req.output == want and req.stats.retractions == 1
        assert_all_free(eng)


def test_prefill_graphs_carry_the_controls_and_prompt_logprobs(bundle, alone):
    """Prefill replayed from emulated graphs (padded requests and tokens): the count state it
    makes, the biased first token and the prompt logprobs are those of an eager prefill."""
    prompts = list(bundle.prompts) + [bundle.prompts[0]]
    params = [_greedy(prompt_logprobs=2, logprobs=2, **c) for c in CONTROLS]
    eager = engine_for(bundle, "none", max_context=128).generate(prompts, params)
    assert [o.token_ids for o in eager] == alone
    eng = engine_for(bundle, "standalone", draft="self", topk=4, num_steps=3, num_draft_tokens=10, max_context=128,
                     cuda_graphs="emulate", prefill_graphs=True, check_every_step=True)
    for _ in range(3):  # warm-up, capture, replay
        outs = eng.generate(prompts, params)
        for o, want in zip(outs, eager, strict=True):
            assert o.token_ids == want.token_ids
            assert o.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-5)
            assert [[t for t, _ in top] for top in o.prompt_top_logprobs[1:]] == \
                [[t for t, _ in top] for top in want.prompt_top_logprobs[1:]]
            assert o.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert eng.graph_runner.stats()["prefill-extend"]["replays"] >= 1


REQUESTS = 3000
SAMPLED = dict(temperature=1.0, min_p=0.08, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4,
               logit_bias={5: -1.0, 17: 0.8, 42: 1.2})


def _sampled(bundle, method: str, **kw) -> torch.Tensor:
    eng = engine_for(bundle, method, max_batch_size=64, **kw)
    prompt = list(bundle.prompts[1])
    params = [SamplingParams(max_new_tokens=4, seed=s, ignore_eos=True, **SAMPLED) for s in range(REQUESTS)]
    return torch.tensor([o.token_ids for o in eng.generate([prompt] * REQUESTS, params)])


def test_sampling_with_controls_has_the_distribution_of_plain_sampling(bundle):
    plain = _sampled(bundle, "none")
    tree = _sampled(bundle, "standalone", draft="self", topk=4, num_steps=3, num_draft_tokens=8)
    assert torch.equal(tree[:, 0], plain[:, 0])  # prefill's token: the same coin in both
    assert not torch.equal(tree[:, 1:], plain[:, 1:])  # later tokens: other coins (a real test)
    pvalues = [two_sample_pvalue(plain[:, i], tree[:, i], VOCAB) for i in range(1, 4)]
    assert min(pvalues) > P_THRESHOLD, pvalues
