"""Prefill graphs on the CPU (``cuda_graphs="emulate"``, ``prefill_graphs=True``): prefill-extend
padded to a request bucket and a token bucket, replayed and sliced back, must give the outputs of
an eager prefill, for the autoregressive baseline and for drafts with KV lead 0 (EAGLE-3) and 1
(standalone); padded tokens write only the sink row; whatever does not fit runs eagerly."""

from __future__ import annotations

import pytest
import torch

from phasegraph.phases.schemas import TOKEN, PrefillInput
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import InvalidConfig
from phasegraph.runtime.prefill_graph import (
    padded_prefill_input,
    slice_prefill_result,
    token_buckets_for,
)
from phasegraph.testing.checkpoints import (
    write_eagle3_draft,
    write_hf_target,
    write_standalone_draft,
)
from phasegraph.testing.drafters import NoisyOracleDraft
from tests.phases.lossless_support import NEW_TOKENS, VOCAB, prompts, reference, tiny_target


def _generate_three_times(engine, ps, params):
    """Warm-up (eager), capture + replay, replay."""
    return [[tuple(o.token_ids) for o in engine.generate(ps, params)] for _ in range(3)]


@pytest.mark.parametrize("batch", [1, 3])
def test_baseline_with_prefill_graphs_equals_eager(batch):
    ps = prompts(batch)
    engine = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=4, kv_pool_tokens=8192,
                    cuda_graphs="emulate", prefill_graphs=True, check_every_step=True)
    runs = _generate_three_times(engine, ps, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert runs == [list(reference(batch))] * 3
    st = engine.graph_runner.stats()["prefill-extend"]
    assert st["graphs"] == 1 and st["replays"] == 2
    assert st["eager_reasons"] == {"warm-up call": 1}


@pytest.mark.parametrize("page_size", [1, 4])
def test_speculative_with_prefill_graphs_is_lossless(page_size):
    batch = 3
    ps, ref = prompts(batch), reference(batch)
    drafter = NoisyOracleDraft(dict(zip(map(tuple, ps), ref, strict=True)), VOCAB)
    engine = Engine(tiny_target(), drafter, spec=SpecConfig(method="eagle", num_steps=3, topk=2, num_draft_tokens=6),
                    max_batch_size=batch, page_size=page_size, kv_pool_tokens=8192, cuda_graphs="emulate",
                    prefill_graphs=True, check_every_step=True)
    drafter.engine = engine
    runs = _generate_three_times(engine, ps, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert runs == [list(ref)] * 3
    assert engine.graph_runner.stats()["prefill-extend"]["replays"] == 2


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill-graph")
    target = write_hf_target(root / "target", "llama")
    return target, write_eagle3_draft(root / "eagle3", target), write_standalone_draft(root / "draft", target, "llama")


@pytest.mark.parametrize(("draft", "method"), [(1, "eagle3"), (2, "standalone")])
def test_real_drafts_with_prefill_graphs_match_eager_prefill(pair_dirs, draft, method):
    """Lead 0 (EAGLE-3: feature rows) and lead 1 (standalone: one more row per request): the
    graphed prefill feeds draft-extend the rows an eager prefill would."""
    target_dir, draft_dir = pair_dirs[0], pair_dirs[draft]
    spec = SpecConfig(method=method, num_steps=3, topk=2, num_draft_tokens=6)
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)

    def engine(**kw):
        return Engine.from_pretrained(target_dir, draft_dir, spec=spec, max_batch_size=4, kv_pool_tokens=4096,
                                      max_context=128, check_every_step=True, **kw)

    eager = [tuple(o.token_ids) for o in engine().generate(ps, params)]
    graphed = engine(cuda_graphs="emulate", prefill_graphs=True)
    assert _generate_three_times(graphed, ps, params) == [eager] * 3
    assert graphed.graph_runner.stats()["prefill-extend"]["replays"] == 2


def test_padded_tokens_belong_to_the_sink_row():
    """Padded tokens are owned by padded request B, whose page-table row is the reserved row 0;
    they sit at positions 0.. of their own sequence; every padded request selects the last one."""
    params_kw = dict(temperature=torch.zeros(2), top_p=torch.ones(2), top_k=torch.zeros(2, dtype=torch.int64),
                     stop_ids=torch.full((2, 1), -1), seed=torch.tensor([7, 8]), min_p=torch.zeros(2),
                     repetition_penalty=torch.ones(2), frequency_penalty=torch.zeros(2),
                     presence_penalty=torch.zeros(2))
    from phasegraph.phases.schemas import BatchParams

    real = PrefillInput(
        params=BatchParams(req_pool_idx=torch.tensor([3, 5]), **params_kw),
        input_ids=torch.tensor([11, 12, 13, 21, 22]), positions=torch.tensor([0, 1, 2, 0, 1]),
        token_req=torch.tensor([0, 0, 0, 1, 1]), select_index=torch.tensor([2, 4]), seq_lens=torch.tensor([3, 2]),
        prompt_lens=torch.tensor([3, 2]), remaining=torch.tensor([9, 9]), forced_tokens=torch.tensor([-1, -1]),
    )
    padded = padded_prefill_input(real, req_bucket=4, tok_bucket=8)
    assert padded.input_ids.tolist() == [11, 12, 13, 21, 22, 0, 0, 0]
    assert padded.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert padded.token_req.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert padded.params.req_pool_idx.tolist() == [3, 5, 0, 0]
    assert padded.select_index.tolist() == [2, 4, 7, 7]
    assert padded.seq_lens.tolist() == [3, 2, 3, 1]
    assert padded.params.seed.tolist() == [7, 8, 0, 0]
    assert padded.forced_tokens.tolist() == [-1, -1, -1, -1]


def test_outputs_are_copies_of_the_real_rows():
    """A replay overwrites the static outputs: the sliced result holds exactly the static output's
    real rows (the first B request rows, the first T token rows, lead 0), copied into storage of
    its own; params are the real input's."""
    ps = [list(range(1, 8)), list(range(20, 26))]  # 13 tokens: request bucket 3, token bucket 16
    engine = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=2, kv_pool_tokens=4096,
                    cuda_graphs="emulate", prefill_graphs=True)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for _ in range(2):
        engine.generate(ps, params)
    cap = next(iter(engine.graph_runner.prefill.graphs.values()))
    batch, tokens = len(ps), sum(map(len, ps))
    padded = cap.static_in
    assert (padded.seq_lens.shape[0], padded.input_ids.shape[0]) == (3, 16)
    # the real input of the last replay: the first rows of the padded one
    real = PrefillInput(
        params=type(padded.params)(**{name: x[:batch] for name, x in padded.params.tensors()}),
        **{t.name: getattr(padded, t.name)[: tokens if t.role == TOKEN else batch]
           for t in type(padded).__schema__.tensors if getattr(padded, t.name) is not None},  # (no grammar mask)
    )
    assert real.input_ids.tolist() == [i for p in ps for i in p]
    out = cap.static_out
    assert out.lead == 0
    result = slice_prefill_result(out, real)
    assert result.params is real.params and result.lead == 0
    assert [name for name, _ in result.tensors()] == [name for name, _ in out.tensors()]
    for t in type(out).__schema__.tensors:
        name, x, static = t.name, getattr(result, t.name), getattr(out, t.name)
        if static is None:
            assert x is None, name
            continue
        n = tokens if t.role == TOKEN else batch
        assert static.shape[0] > n, name  # the static output has padded rows past the real ones
        assert torch.equal(x, static[:n]), name
        if x.numel():  # (an empty feature tensor has no storage to share)
            assert x.untyped_storage().data_ptr() != static.untyped_storage().data_ptr(), name


def test_what_does_not_fit_runs_eagerly():
    long_prompt = list(range(1, 60))  # 59 tokens: above the largest token bucket of max_context 32
    engine = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=2, kv_pool_tokens=4096,
                    max_context=128, cuda_graphs="emulate", prefill_graphs=True)
    engine.graph_runner.prefill.token_buckets = token_buckets_for(32)
    for _ in range(2):
        engine.generate([long_prompt], SamplingParams(max_new_tokens=2, ignore_eos=True))
    st = engine.graph_runner.stats()["prefill-extend"]
    assert st["graphs"] == 0 and st["eager_reasons"] == {"tokens above the largest token bucket": 2}


def test_token_buckets_stop_at_the_context():
    assert token_buckets_for(128) == (16, 32, 64, 128)
    assert token_buckets_for(100) == (16, 32, 64)


def test_prefill_graphs_need_graphs():
    with pytest.raises(InvalidConfig, match="prefill_graphs=True needs CUDA graphs"):
        Engine(tiny_target(), spec=SpecConfig(method="none"), kv_pool_tokens=1024, cuda_graphs=False,
               prefill_graphs=True)
