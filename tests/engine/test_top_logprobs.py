"""Top logprobs and prompt logprobs (``SamplingParams(logprobs=k, prompt_logprobs=k)``).

Logprobs are log_softmax of the target's raw logits at each position. Under chain and tree
speculation (the target as its own draft, so that accepted paths are long and, in the tree, run
through nodes out of node order) they must equal those of the target alone within 1e-5 in
float32, also with CUDA graphs emulated (the graph key holds k); and they must equal
transformers' own rescoring of the generated sequence, for sampled requests too. A retracted
and resumed request reports its prompt logprobs once and loses no generated position's.
"""

from __future__ import annotations

import functools

import pytest
import torch

from phasegraph.runtime.config import SamplingParams
from tests.engine.support import assert_all_free, text_bundle
from tests.engine.test_stop_logprobs import PROMPTS, _engine

TOL = 1e-5  # float32, target alone against speculation
HF_TOL = 1e-5  # against transformers' forward (another attention and matmul order: ~2e-6 here)

GREEDY = [
    SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=5, prompt_logprobs=3),
    SamplingParams(max_new_tokens=19, ignore_eos=True, logprobs=20),
    SamplingParams(max_new_tokens=21, ignore_eos=True, logprobs=True, prompt_logprobs=0),
    SamplingParams(max_new_tokens=9, ignore_eos=True),  # no logprobs asked in the same batch
]
SPECULATIVE = ["self-chain", "self-tree", "eagle3-tree"]


@functools.cache
def _hf_model(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


def _hf_logprobs(target, ids) -> torch.Tensor:
    """log_softmax of transformers' logits over the sequence ``ids`` [len(ids), V]."""
    with torch.no_grad():
        return torch.log_softmax(_hf_model(target)(torch.tensor([list(ids)])).logits[0].float(), dim=-1)


def _assert_top_close(got, want, tol):
    """Two lists of (token id, logprob) lists: the same ids in the same order, close logprobs."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=tol)


def _check_shapes(out, params: SamplingParams):
    n = len(out.token_ids)
    if not params.wants_logprobs:
        assert out.logprobs is None and out.top_logprobs is None
    else:
        assert len(out.logprobs) == n
        if params.top_logprobs:
            assert len(out.top_logprobs) == n
            assert all(len(t) == params.top_logprobs for t in out.top_logprobs)
            for top, lp, tok in zip(out.top_logprobs, out.logprobs, out.token_ids, strict=True):
                values = [v for _, v in top]
                assert values == sorted(values, reverse=True)  # most likely first
                assert all(v <= 0 for v in values)
                if tok in dict(top):  # the chosen token's logprob, where it is among the top
                    assert dict(top)[tok] == pytest.approx(lp, abs=1e-6)
        else:
            assert out.top_logprobs is None
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None and out.prompt_top_logprobs is None
    else:
        p = len(out.prompt_token_ids)
        assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == p
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        assert all(len(t) == params.prompt_logprobs for t in out.prompt_top_logprobs[1:])


@pytest.fixture(scope="module")
def alone(engine_root):
    """The target alone: the greedy batch's outputs."""
    eng = _engine(engine_root, "none")
    outs = eng.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]], GREEDY)
    for o, sp in zip(outs, GREEDY, strict=True):
        _check_shapes(o, sp)
    return outs


def test_the_target_alone_equals_transformers_rescoring(engine_root, alone):
    target, _, _ = text_bundle(engine_root)
    for o, sp in zip(alone, GREEDY, strict=True):
        if not sp.wants_logprobs and sp.prompt_logprobs is None:
            continue
        ref = _hf_logprobs(target, o.prompt_token_ids + o.token_ids)
        p = len(o.prompt_token_ids)
        rows = torch.arange(p - 1, p - 1 + len(o.token_ids))
        assert o.logprobs == pytest.approx(ref[rows, torch.tensor(o.token_ids)].tolist(), abs=HF_TOL)
        if sp.top_logprobs:
            values, ids = ref[rows].topk(sp.top_logprobs, dim=-1)
            want = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
            _assert_top_close(o.top_logprobs, want, HF_TOL)
        if sp.prompt_logprobs is not None:
            prompt_rows = torch.arange(p - 1)
            want = ref[prompt_rows, torch.tensor(o.prompt_token_ids[1:])].tolist()
            assert o.prompt_logprobs[1:] == pytest.approx(want, abs=HF_TOL)
            values, ids = ref[prompt_rows].topk(sp.prompt_logprobs, dim=-1)
            want = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
            _assert_top_close(o.prompt_top_logprobs[1:], want, HF_TOL)


@pytest.mark.parametrize("cuda_graphs", [None, "emulate"])
@pytest.mark.parametrize("method", SPECULATIVE)
def test_speculation_reports_the_logprobs_of_the_target_alone(engine_root, alone, method, cuda_graphs):
    eng = _engine(engine_root, method, cuda_graphs=cuda_graphs)
    for _ in range(2 if cuda_graphs else 1):  # emulated graphs: warm-up, then capture and replay
        outs = eng.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]], GREEDY)
        for o, want, sp in zip(outs, alone, GREEDY, strict=True):
            _check_shapes(o, sp)
            assert o.token_ids == want.token_ids
            if sp.wants_logprobs:
                assert o.logprobs == pytest.approx(want.logprobs, abs=TOL)
            if sp.top_logprobs:
                _assert_top_close(o.top_logprobs, want.top_logprobs, TOL)
            if sp.prompt_logprobs is not None:
                assert o.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=TOL)
                _assert_top_close(o.prompt_top_logprobs[1:], want.prompt_top_logprobs[1:], TOL)
    if cuda_graphs:
        assert eng.graph_runner.iteration.replays > 0
    assert_all_free(eng)


@pytest.mark.parametrize("method", ["self-tree", "self-chain"])
def test_sampled_tokens_have_the_targets_top_logprobs(engine_root, method):
    """Sampled speculative outputs differ from the target alone's; rescoring them checks each
    accepted position's logprobs (compacted along paths out of node order in the tree)."""
    target, _, _ = text_bundle(engine_root)
    eng = _engine(engine_root, method)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=4, temperature=0.4, seed=s)
              for s in range(3)]
    outs = eng.generate(PROMPTS, params)
    assert sum(sum(o.stats.accept_lengths) - len(o.stats.accept_lengths) for o in outs) > 10  # drafts accepted
    for o, sp in zip(outs, params, strict=True):
        _check_shapes(o, sp)
        ref = _hf_logprobs(target, o.prompt_token_ids + o.token_ids)
        p = len(o.prompt_token_ids)
        rows = torch.arange(p - 1, p - 1 + len(o.token_ids))
        assert o.logprobs == pytest.approx(ref[rows, torch.tensor(o.token_ids)].tolist(), abs=HF_TOL)
        values, ids = ref[rows].topk(4, dim=-1)
        want = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        _assert_top_close(o.top_logprobs, want, HF_TOL)


def test_the_graph_key_holds_k(engine_root):
    """A graph captured for k top logprobs is not replayed for another k."""
    eng = _engine(engine_root, "self-tree", cuda_graphs="emulate")
    for k in (3, 3, 7, 7, 3):
        out = eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=k))[0]
        assert all(len(t) == k for t in out.top_logprobs)
    assert len(eng.graph_runner.iteration.graphs) == 2


@pytest.mark.parametrize("method", ["none", "self-tree"])
def test_retraction_keeps_every_logprob_and_reports_the_prompts_once(engine_root, method):
    """Two forced retractions: the resumed request re-prefills its prompt and its output, yet
    reports its prompt logprobs once and every generated position's logprobs, as streamed."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    want = _engine(engine_root, method).generate(PROMPTS[2], params)[0]
    eng = _engine(engine_root, method)
    eng.add_request("r", PROMPTS[2], params)
    req = eng._requests["r"]  # the request itself: its output once it has left the engine
    streamed, streamed_top = [], []
    while eng.has_unfinished():
        for d in eng.step():
            streamed += d.logprobs
            streamed_top += [list(t) for t in d.top_logprobs]
        if req.stats.retractions < 2 and len(req.output) > 5 + 8 * req.stats.retractions:
            assert eng.retract("r")
    out = req.to_output()
    assert out.stats.retractions == 2
    assert out.token_ids == want.token_ids
    assert out.logprobs == pytest.approx(want.logprobs, abs=TOL)
    _assert_top_close(out.top_logprobs, want.top_logprobs, TOL)
    assert streamed == out.logprobs and streamed_top == out.top_logprobs
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)  # once, not per prefill
    assert out.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=TOL)
    _assert_top_close(out.prompt_top_logprobs[1:], want.prompt_top_logprobs[1:], TOL)
    assert_all_free(eng)
