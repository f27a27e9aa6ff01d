"""CUDA graph capture of draft, verify, draft-extend and decode (issue 5), on the GPU machine.

    python -m pytest -m gpu tests/gpu/test_cuda_graphs.py -q

Checks: replay equals eager bitwise (fp32) for every bucket on the same padded input; padded
batches between buckets give the eager tokens; capture leaves positions, seq_lens, committed
KV and every static buffer as it found them; poisoned padded rows change no real request; the
lossless matrix with graphs on equals target-only greedy; bf16 speculative vs bf16 AR.

Prefill graphs on the GPU (``prefill_graphs=True``): captured prefill-extend replays give the
outputs of an eager prefill, for the baseline and a standalone draft (KV lead 1), in float32."""

from __future__ import annotations

import hashlib

import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.cuda_graphs import copy_into_static, pad_schema
from phasegraph.runtime.engine import Engine

pytestmark = pytest.mark.gpu

VOCAB = 96


def _target(dtype=torch.float32):
    from phasegraph.runtime.models.target import HFTarget, build_causal_lm
    from phasegraph.testing.checkpoints import tiny_target_config

    config = tiny_target_config(
        "llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    torch.manual_seed(1234)
    model = build_causal_lm(config, dtype=torch.float32, device="cuda", init=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return HFTarget(model.to(dtype), feature_mode="none")


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 20, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


def _reference(target, prompts, new_tokens=64):
    eng = Engine(target, spec=SpecConfig(method="none"), max_batch_size=len(prompts), kv_pool_tokens=16384, cuda_graphs=False)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    return [tuple(o.token_ids) for o in outs]


def _noisy_self_draft(target, noise=0.35, seed=99):
    """A standalone draft that is the target with noise on its lm_head: it agrees with the
    target often but not always, so acceptance stops at every depth (and it is a real model,
    so the draft loop can be captured; scripted test drafters read the host)."""
    import copy

    from phasegraph.runtime.models.standalone import StandaloneDraft
    from phasegraph.runtime.models.target import HFTarget

    model = copy.deepcopy(target.model)
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        w = model.lm_head.weight
        w.add_(noise * w.float().std() * torch.randn(w.shape, generator=g, device="cuda").to(w.dtype))
    return StandaloneDraft(HFTarget(model, feature_mode="none"), target)


def _spec_engine(target, prompts, ref, spec, page_size, graphs, batch, scope="phase"):
    draft = _noisy_self_draft(target)
    return Engine(target, draft, spec=spec, max_batch_size=batch, page_size=page_size,
                  kv_pool_tokens=16384, cuda_graphs=graphs, check_every_step=True, graph_scope=scope)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


# the baseline has no speculative iteration: it runs with one scope only
@pytest.mark.parametrize(("method", "topk", "scope"), [
    ("none", 1, "phase"),
    ("standalone", 1, "phase"), ("standalone", 1, "iteration"),
    ("standalone", 4, "phase"), ("standalone", 4, "iteration"),
])
def test_graphs_on_equals_graphs_off_and_target_greedy(method, topk, scope):
    target = _target()
    for batch in (1, 3, 8, 13):  # 3 and 13 are padded to buckets 4 and 16
        prompts = _prompts(batch, seed=batch)
        ref = _reference(target, prompts)
        spec = SpecConfig(method="none") if method == "none" else SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=topk, num_draft_tokens=4 if topk == 1 else 12)
        outs = {}
        for graphs in (False, True):
            if method == "none":
                eng = Engine(target, spec=spec, max_batch_size=batch, kv_pool_tokens=16384, cuda_graphs=graphs, check_every_step=True)
            else:
                eng = _spec_engine(target, prompts, ref, spec, 16, graphs, batch, scope)
            res = eng.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
            outs[graphs] = [tuple(o.token_ids) for o in res]
            if graphs:
                st = eng.graph_runner.stats()
                assert sum(p["replays"] for p in st.values()) > 0, st
                if scope == "iteration":
                    assert st["iteration"]["served"]["finalize-tree-path"] > 0, st
        assert outs[True] == outs[False] == ref


def test_replay_is_bitwise_eager_on_the_same_padded_input():
    """For every bucket: the graphed verify/draft/draft-extend reproduce an eager run on the same
    padded static input bit for bit (fp32)."""
    target = _target()
    prompts = _prompts(5, seed=7)
    ref = _reference(target, prompts)
    spec = SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=4, num_draft_tokens=12)
    eng = _spec_engine(target, prompts, ref, spec, 16, True, 5)
    for r, p in enumerate(prompts):
        eng.add_request(f"r{r}", p, SamplingParams(max_new_tokens=64, ignore_eos=True))
    for _ in range(4):
        eng.step()
    runner = eng.graph_runner
    assert runner.phases["verify"].graphs, "verify was never captured"
    for name, graphed in runner.phases.items():
        for cap in graphed.graphs.values():
            cap.graph.replay()
            torch.cuda.synchronize()
            replayed = [x.clone() for _, x in cap.static_out.tensors()]
            eager = graphed.spec.fn(cap.static_in, eng.ctx)
            for (fname, a), b in zip(eager.tensors(), replayed, strict=True):
                assert torch.equal(a, b), f"{name}: field {fname} differs between replay and eager"


def _captured_iteration(target, prompts, ref, spec):
    """An engine of whole-iteration graphs after four steps of ``prompts`` (its buckets
    captured), and its iteration graph."""
    eng = _spec_engine(target, prompts, ref, spec, 16, True, 5, scope="iteration")
    for r, p in enumerate(prompts):
        eng.add_request(f"r{r}", p, SamplingParams(max_new_tokens=64, ignore_eos=True))
    for _ in range(4):
        eng.step()
    it = eng.graph_runner.iteration
    assert it.graphs, "the iteration was never captured"
    return eng, it


def _assert_replays_equal_eager_phases(eng, it, differs: str) -> None:
    """For every captured bucket: a replay's outputs, phase by phase, equal the phases run
    eagerly on the same padded static input, bit for bit."""
    from phasegraph.runtime.iteration_graph import ITERATION

    for cap in it.graphs.values():
        cap.graph.replay()
        torch.cuda.synchronize()
        replayed = [[x.clone() for _, x in out.tensors()] for out in cap.static_outs]
        x = cap.static_in
        for name, want in zip(ITERATION, replayed, strict=True):
            x = it.specs[name].fn(x, eng.ctx)
            for (fname, a), b in zip(x.tensors(), want, strict=True):
                assert torch.equal(a, b), f"{name}: field {fname} differs {differs}"


def test_iteration_replay_is_bitwise_eager_on_the_same_padded_input():
    """For every captured bucket: replaying the whole-iteration graph gives, for each of the four
    phases, the outputs of running the phases eagerly on the same padded static input (fp32)."""
    target = _target()
    prompts = _prompts(5, seed=8)
    ref = _reference(target, prompts)
    spec = SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=4, num_draft_tokens=12)
    eng, it = _captured_iteration(target, prompts, ref, spec)
    _assert_replays_equal_eager_phases(eng, it, "between replay and eager")


def test_pdl_replay_is_bitwise_the_plain_eager_phases(monkeypatch):
    """Programmatic dependent launch (PHASEGRAPH_PDL) changes when kernels are placed on the
    SMs, never what they compute: the whole-iteration graph captured with it on gives, phase by
    phase, bit for bit the outputs of the phases run eagerly with it off on the same padded
    input (fp32), and generate emits the same tokens with it on and off."""
    from phasegraph.kernels._dispatch import pdl_options

    monkeypatch.setenv("PHASEGRAPH_PDL", "on")
    target = _target()
    assert pdl_options()["PDL"], "this GPU does not launch early: the test would compare nothing"
    prompts = _prompts(5, seed=9)
    ref = _reference(target, prompts)
    spec = SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=4, num_draft_tokens=12)
    eng, it = _captured_iteration(target, prompts, ref, spec)
    monkeypatch.setenv("PHASEGRAPH_PDL", "off")
    _assert_replays_equal_eager_phases(eng, it, "PDL on vs off")
    tokens = {}
    for setting in ("on", "off"):
        monkeypatch.setenv("PHASEGRAPH_PDL", setting)
        engine = _spec_engine(target, prompts, ref, spec, 16, True, 5, scope="iteration")
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
        tokens[setting] = [tuple(o.token_ids) for o in outs]
    assert tokens["on"] == tokens["off"] == ref


def test_capture_leaves_state_and_committed_kv_unchanged():
    target = _target()
    prompts = _prompts(3, seed=11)
    ref = _reference(target, prompts)
    spec = SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=2, num_draft_tokens=6)
    eng = _spec_engine(target, prompts, ref, spec, 4, True, 8)
    for r, p in enumerate(prompts):
        eng.add_request(f"r{r}", p, SamplingParams(max_new_tokens=64, ignore_eos=True))
    eng.step()  # prefill + the first iteration (captures bucket 4)
    state = eng.scheduler.machine.state
    P = eng.kv.page_size
    slots = torch.tensor([int(eng.kv.req_to_page[r.row, pos // P]) * P + pos % P
                          for r in eng.scheduler.running for pos in range(r.seq_len)], device="cuda")
    pools = eng.ctx.memory.target_caches() + eng.ctx.memory.draft_caches()
    runner = eng.graph_runner

    def digests():
        statics = {(name, key): _digest([x for _, x in cap.static_in.tensors()] + [x for _, x in cap.static_out.tensors()])
                   for name, g in runner.phases.items() for key, cap in g.graphs.items()}
        return (_digest([state.seq_lens, state.bonus_tokens, state.topk_p, state.topk_index,
                         state.params.req_pool_idx]),
                _digest([c[slots] for c in pools]), statics)

    before = digests()
    runner.buckets = (3, 8, 16)  # a bucket never captured: the next call captures it
    graphed = runner.phases["draft"]
    n_graphs = len(graphed.graphs)
    out_graph = graphed(state, eng.ctx)
    assert len(graphed.graphs) == n_graphs + 1
    after = digests()
    assert before[0] == after[0], "capture changed the draft state (positions/seq_lens class)"
    assert before[1] == after[1], "capture changed committed KV"
    for key, digest in before[2].items():  # every static buffer captured before is untouched
        assert after[2][key] == digest, f"capture changed the static buffers of {key[0]}"
    out_eager = graphed.spec.fn(state, eng.ctx)
    assert torch.equal(out_graph.draft_tokens, out_eager.draft_tokens)
    assert torch.equal(out_graph.positions, out_eager.positions)


def test_iteration_capture_leaves_state_and_committed_kv_unchanged():
    """Capturing the whole iteration for a new bucket (warm-up on all-padded rows, capture, one
    replay on the real rows) leaves the draft state, the committed KV and every static buffer
    of the graphs captured before as they were."""
    target = _target()
    prompts = _prompts(3, seed=12)
    ref = _reference(target, prompts)
    spec = SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=2, num_draft_tokens=6)
    eng = _spec_engine(target, prompts, ref, spec, 4, True, 8, scope="iteration")
    for r, p in enumerate(prompts):
        eng.add_request(f"r{r}", p, SamplingParams(max_new_tokens=64, ignore_eos=True))
    eng.step()
    eng.step()  # the second iteration of bucket 4 captures it
    it = eng.graph_runner.iteration
    assert it.graphs
    state = eng.scheduler.machine.state
    P = eng.kv.page_size
    slots = torch.tensor([int(eng.kv.req_to_page[r.row, pos // P]) * P + pos % P
                          for r in eng.scheduler.running for pos in range(r.seq_len)], device="cuda")
    pools = eng.ctx.memory.target_caches() + eng.ctx.memory.draft_caches()

    def digests():
        statics = {key: _digest([x for _, x in cap.static_in.tensors()]
                                + [x for out in cap.static_outs for _, x in out.tensors()])
                   for key, cap in it.graphs.items()}
        return (_digest([state.seq_lens, state.bonus_tokens, state.topk_p, state.topk_index,
                         state.params.req_pool_idx]),
                _digest([c[slots] for c in pools]), statics)

    before = digests()
    eng.graph_runner.buckets = (3, 8, 16)  # a bucket never captured
    draft = it.phase_fn("draft")
    draft(state, eng.ctx)  # the bucket's warm-up call: the per-phase path
    n_graphs = len(it.graphs)
    out = draft(state, eng.ctx)  # captures the iteration for bucket 8 and replays it
    assert len(it.graphs) == n_graphs + 1
    after = digests()
    assert before[0] == after[0], "capture changed the draft state"
    assert before[1] == after[1], "capture changed committed KV"
    for key, digest in before[2].items():
        assert after[2][key] == digest, "capture changed the static buffers of another bucket"
    eager = it.specs["draft"].fn(state, eng.ctx)
    assert torch.equal(out.draft_tokens, eager.draft_tokens)


@pytest.mark.parametrize("scope", ["phase", "iteration"])
def test_poisoned_padded_rows_change_no_real_request(scope):
    target = _target()
    prompts = _prompts(3, seed=3)
    ref = _reference(target, prompts)
    spec = SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=4, num_draft_tokens=12)
    eng = _spec_engine(target, prompts, ref, spec, 16, True, 3, scope)
    runner = eng.graph_runner
    import phasegraph.runtime.cuda_graphs as cg
    import phasegraph.runtime.iteration_graph as ig

    original_copy = cg.copy_inputs_in
    poisoned = []

    def poisoning_copy(copiers, static, real, batch, bucket):
        # stale garbage from an earlier, bigger batch: NaN floats, out-of-range ids
        for _, x in static.tensors():
            if x.shape[0] > batch:
                if x.is_floating_point():
                    x[batch:].fill_(float("nan"))
                elif x.dtype == torch.int64:
                    x[batch:].fill_(VOCAB + 7)
        poisoned.append(batch)
        original_copy(copiers, static, real, batch, bucket)

    cg.copy_inputs_in = ig.copy_inputs_in = poisoning_copy
    try:
        outs = eng.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
    finally:
        cg.copy_inputs_in = ig.copy_inputs_in = original_copy
    assert [tuple(o.token_ids) for o in outs] == ref
    assert poisoned, "no replay copied its input: the poison was never applied"
    assert sum(p["replays"] for p in runner.stats().values()) > 0


def test_pad_and_slice_round_trip_on_gpu():
    from phasegraph.testing import synthetic as syn

    d = syn.draft_state(3, K=4, device="cuda")
    static = pad_schema(d, 3, 8)
    assert static.seq_lens.shape[0] == 8 and torch.equal(static.seq_lens[:3], d.seq_lens)
    assert (static.params.req_pool_idx[3:] == 0).all()
    static.topk_p[3:].fill_(float("nan"))
    copy_into_static(static, d, 3, 8)
    assert torch.isfinite(static.topk_p).all()


@pytest.mark.parametrize("rows", [1, 3, 20])
def test_bf16_target_logits_keep_the_float32_sums(rows):
    """A bfloat16 lm_head's logits are its float32 sums, not rounded to bfloat16 first (whose
    ties and one-ulp steps would decide greedy tokens), at the skinny and the cuBLAS row counts."""
    target = _target(torch.bfloat16)
    hidden = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16).cuda()
    got = target.logits(hidden)
    want = hidden.double() @ target.model.lm_head.weight.double().t()
    assert got.dtype == torch.float32
    err = float((got.double() - want).norm() / want.norm())
    assert err < 1e-5, f"relative error {err:.1e} (bfloat16 logits: ~1e-3)"


def test_bf16_speculative_matches_bf16_autoregressive():
    """≥ 95% of 64 prompts × 64 tokens identical; divergences only after a near-tie."""
    target = _target(torch.bfloat16)
    prompts = _prompts(64, seed=5)
    ar = Engine(target, spec=SpecConfig(method="none"), max_batch_size=64, kv_pool_tokens=32768, cuda_graphs=True)
    ref = [tuple(o.token_ids) for o in ar.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))]
    spec = SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=4, num_draft_tokens=12)
    eng = _spec_engine(target, prompts, ref, spec, 16, True, 64)
    outs = [tuple(o.token_ids) for o in eng.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))]
    same = sum(a == b for a, b in zip(outs, ref, strict=True))
    assert same >= 0.95 * len(prompts), f"{same}/64 identical"
    # where a prompt diverges, the target's top-2 logits at the first differing step are close
    for p, a, b in zip(prompts, outs, ref, strict=True):
        if a == b:
            continue
        i = next(k for k in range(len(a)) if a[k] != b[k])
        ids = torch.tensor([p + list(b[:i])], device="cuda")
        target.model.set_attn_implementation("sdpa")
        try:
            logits = target.model(ids).logits[0, -1].float()
        finally:
            target.model.set_attn_implementation("phasegraph")
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < 0.25, f"diverged after a margin of {float(top2[0] - top2[1]):.3f}"


def test_the_host_copies_of_emitted_tokens_reuse_pinned_buffers():
    """Every iteration copies its emitted tokens into pinned host memory; the buffers are reused
    once read, so a long generation allocates one per iteration in flight (two with overlap),
    and its tokens are still the target's greedy ones."""
    target = _target()
    prompts = _prompts(1, seed=11)
    ref = _reference(target, prompts)
    eng = Engine(target, spec=SpecConfig(method="none"), max_batch_size=4, kv_pool_tokens=4096, cuda_graphs=True)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert [tuple(o.token_ids) for o in outs] == ref
    buffers = eng.scheduler.host_buffers
    assert 1 <= buffers.allocated <= 2, buffers.allocated
    assert sum(len(v) for v in buffers.free.values()) == buffers.allocated  # all given back


@pytest.mark.parametrize("scope", ["phase", "iteration"])
@pytest.mark.parametrize(("method", "draft"), [("eagle3", "eagle3"), ("standalone", "self")])
@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("batch", [3, 6])
def test_padded_replays_leave_live_kv_and_acceptance_as_eager(tmp_path_factory, scope, method, draft, topk, batch):
    """Real graphs at buckets 4 and 8 with 3 and 6 requests: after every step each live
    request's target and draft KV equals an eager run's, and so do its tokens and accept lengths
    (float32). Equal within rounding, not bit for bit: the products pick their tiles by row
    count, and a padded replay has more rows than the eager batch (the CPU suite checks the
    same bit for bit on emulated graphs). A padded row writing into a live request's KV differs
    by O(1)."""
    from tests.engine.support import arch_bundle
    from tests.engine.test_graph_padding_kv import run_lockstep

    bundle = arch_bundle(tmp_path_factory.getbasetemp() / "padding-kv", "llama")
    eager, graphed, outputs, largest = run_lockstep(bundle, method, draft, batch, scope, topk, graphs=True,
                                                    atol=1e-4)
    print(f"largest live KV difference from eager: {largest:.3g}")
    assert outputs[graphed] == outputs[eager]
    stats = graphed.graph_runner.stats()
    replays = stats["iteration"]["replays"] if scope == "iteration" else stats["draft-extend"]["replays"]
    assert replays > 0



SPECS = {"baseline": SpecConfig(method="none"), "tree": SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=4,
                                                                    num_draft_tokens=12)}


@pytest.fixture(scope="module")
def setup():
    target = _target()
    prompts = _prompts(5, seed=11)
    return target, _noisy_self_draft(target), prompts, _reference(target, prompts)


@pytest.mark.parametrize("name", list(SPECS))
def test_graphed_prefill_is_lossless(setup, name):
    target, draft, prompts, ref = setup
    eng = Engine(target, None if name == "baseline" else draft, spec=SPECS[name], max_batch_size=8,
                 kv_pool_tokens=16384, cuda_graphs=True, prefill_graphs=True)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for _ in range(3):  # eager warm-up, capture + replay, replay
        assert [tuple(o.token_ids) for o in eng.generate(prompts, params)] == ref
        eng.check()
    st = eng.graph_runner.stats()["prefill-extend"]
    assert st["replays"] == 2 and st["graphs"] == 1


@pytest.mark.parametrize(("name", "scope"), [("none", "iteration"), ("eagle3-chain", "iteration"),
                                             ("eagle3-tree", "iteration"), ("eagle3-tree", "phase"),
                                             ("standalone-tree", "iteration"), ("ngram-chain", "iteration")])
def test_grammar_batches_replay_graphs_cut_at_their_masks(tmp_path_factory, name, scope):
    """Structured output from real CUDA graphs cut at each grammar call: the constrained greedy
    tokens of graphs off, a valid object each, and every grammar batch's iteration replayed."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    import json

    from phasegraph.runtime.cuda_graphs import SegmentedGraph
    from tests.engine.test_structured_output import CUT_AT, PROMPTS, SCHEMAS, _engine

    root = tmp_path_factory.mktemp("grammar-graphs")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    params = [SamplingParams(max_new_tokens=48, json_schema=s) for s in SCHEMAS]
    eager = _engine(root, name, device="cuda", cuda_graphs=False).generate(prompts, params)
    engine = _engine(root, name, device="cuda", cuda_graphs=True, graph_scope=scope, prefill_graphs=True)
    for _ in range(3):  # eager warm-up, capture + replay, replay
        outs = engine.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
        engine.check()
    for out, schema in zip(outs, SCHEMAS, strict=True):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    runner = engine.graph_runner
    graphed = [c for p in runner.phases.values() for c in p.graphs.values()]
    graphed += [] if runner.iteration is None else list(runner.iteration.graphs.values())
    cut = [c.graph for c in graphed if isinstance(c.graph, SegmentedGraph)]
    assert cut and {call.name for g in cut for call in g.calls} == CUT_AT.get(name, CUT_AT["eagle3-tree"])
    assert runner.stats()["prefill-extend"]["replays"] > 0
