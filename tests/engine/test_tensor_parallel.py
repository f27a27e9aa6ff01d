"""Tensor parallelism on the CPU: gloo, two ranks, tiny float32 models.

The engine starts rank 1 itself (``tensor_parallel_size=2``) and must produce exactly the tokens
of the same engine at TP=1, with and without speculation (EAGLE-3 and standalone drafts, chain
and tree), at page size 1 and 16, with retraction forced by a tight KV pool, greedy and seeded
sampling alike; ``tp_check=True`` compares the ranks' tokens after every step. A rank that dies
raises :class:`WorkerDied` in the caller, within the collectives' timeout.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from phasegraph.bench.common import shape_counts
from phasegraph.runtime.adaptive import OFF, CostTable, SpecShape
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import InvalidConfig, UnsupportedModel, WorkerDied
from phasegraph.runtime.models.fused_decoder import head_split
from phasegraph.testing.checkpoints import write_hf_target
from tests.engine.support import make_prompts, small_config, write_arch
from tests.engine.tp_ranks import diverging_rank

N_REQUESTS = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The llama target (2 query heads, 1 kv head: the kv head is replicated on both ranks)
    with its drafts."""
    return write_arch(tmp_path_factory.mktemp("tp-llama"), "llama")


def _workload():
    prompts = make_prompts(N_REQUESTS, seed=21)
    params = []
    for i in range(N_REQUESTS):
        budget = 10 + (5 * i) % 13
        if i % 2:
            params.append(SamplingParams(max_new_tokens=budget, temperature=0.8, top_p=0.9, seed=500 + i,
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(max_new_tokens=budget, ignore_eos=True))
    return prompts, params


CASES = {
    # name: (method, spec kwargs, page size, pool tokens: a tight pool forces retraction)
    "none-P16-retract": ("none", {}, 16, 112),
    "eagle3-tree-P1-retract": ("eagle3", dict(topk=2, num_steps=3, num_draft_tokens=6), 1, 96),
    "eagle3-chain-P16": ("eagle3", dict(topk=1, num_steps=3), 16, 4096),
    "standalone-tree-P16-retract": ("standalone", dict(topk=2, num_steps=2, num_draft_tokens=4), 16, 128),
    "standalone-chain-P1": ("standalone", dict(topk=1, num_steps=3), 1, 4096),
    "mtp-chain-P1": ("mtp", dict(topk=1, num_steps=2), 1, 4096),  # the last-hidden features (EAGLE-1 too)
}


TARGET_PHASES = ("prefill-extend", "decode", "verify")
DRAFT_PHASES = ("draft-extend", "draft")


def _check_collective_time(trace, draft_split: bool) -> None:
    """Rank 0's trace: every run of a phase that runs the target (or a split draft) spent time in
    the all-reduces; every other run exactly none."""
    assert len(trace) > 0
    for t in trace:
        collective = TARGET_PHASES + (DRAFT_PHASES if draft_split else ())
        if t.target in collective:
            assert t.collective_s > 0, f"{t.target} recorded no all-reduce time"
        else:
            assert t.collective_s == 0.0, f"{t.target} recorded all-reduce time {t.collective_s}"


def _engine(target, drafts, method, spec, page_size, pool, **kw) -> Engine:
    config = SpecConfig(method="none") if method == "none" else SpecConfig(method=method, **spec)
    draft = None if method == "none" else drafts[method]
    return Engine.from_pretrained(target, draft, spec=config, page_size=page_size, kv_pool_tokens=pool,
                                  dtype="float32", max_batch_size=N_REQUESTS, **kw)


def _generate_checked(two, one, prompts, params, pool: int, draft_split: bool):
    """``two``'s outputs, after checking its retractions match ``one``'s where the pool is tight,
    its invariants, and the all-reduce time its trace recorded."""
    got = two.generate(prompts, params)
    if pool < 4096:
        assert two.num_retractions >= 1, "the pool is not tight enough to retract"
        assert two.num_retractions == one.num_retractions
    two.check()
    _check_collective_time(two.trace, draft_split=draft_split)
    return got


# alone the tree costs least; from 2 requests on far more (a chain of 3 then): as the requests
# finish the plan moves
TREE3 = SpecShape(2, 3, 6)
MOVING = CostTable((OFF, SpecShape.chain(1), SpecShape.chain(3), TREE3), (1, 2, 4, 8),
                   [(1.0, 1.1, 1.2, 1.4), (1.0, 1.15, 1.3, 1.6), (1.0, 1.2, 1.4, 1.8), (0.9, 5.0, 10.0, 20.0)])
ADAPTIVE = dict(topk=2, num_steps=3, num_draft_tokens=6, adaptive=True)


def _self_drafted_adaptive(pair, **kw) -> Engine:
    """Adaptive speculation with the target as its own standalone draft (every draft accepted
    when greedy: the longest paths)."""
    target, drafts = pair
    return _engine(target, {"standalone": drafts["self"]}, "standalone", ADAPTIVE, 16, 4096, **kw)


def test_tp2_adaptive_with_given_costs_equals_tp1(pair):
    """Adaptive speculation under TP plans alike on every rank from one cost table, so the
    sampled requests too draw TP=1's tokens, shape for shape; tp_check compares the plans."""
    prompts, params = _workload()
    one = _self_drafted_adaptive(pair, spec_costs=MOVING)
    want = one.generate(prompts, params)
    with _self_drafted_adaptive(pair, spec_costs=MOVING, tensor_parallel_size=2, tp_check=True) as two:
        got = two.generate(prompts, params)
        ran = shape_counts(two.trace)
    assert len(ran) >= 2, f"the plan never moved: {ran}"
    assert ran == shape_counts(one.trace)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} differs at TP=2"
        assert g.stats.accept_lengths == w.stats.accept_lengths


def test_tp2_adaptive_measures_one_cost_table_for_every_rank(pair):
    """Costs measured at start-up under TP: each rank times the shapes, rank 0's timings
    become every rank's, so the plans agree (tp_check) and greedy outputs are TP=1's."""
    target, drafts = pair
    prompts = make_prompts(N_REQUESTS, seed=21)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = _engine(target, drafts, "standalone", ADAPTIVE, 16, 4096).generate(prompts, params)
    with _engine(target, drafts, "standalone", ADAPTIVE, 16, 4096, tensor_parallel_size=2, tp_check=True) as two:
        costs = two.scheduler.adaptive.costs
        assert costs.shapes == (OFF, SpecShape.chain(1), SpecShape.chain(3), TREE3)
        assert costs.batches == (1, N_REQUESTS)
        got = two.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_tp2_warm_up_captures_every_shape_on_every_rank(pair):
    """warm_up under TP: the workers warm up in step with the leader (else its collectives
    would wait for them), so the same graphs exist before traffic and none is captured
    mid-stream, for greedy and sampled batches alike; the outputs stay TP=1's."""
    prompts, params = _workload()
    # a split batch's groups run per-phase graphs that warm_up leaves: whole-batch plans only
    whole = CostTable(MOVING.shapes, MOVING.batches, MOVING.seconds, split_s=1e3)
    kw = dict(spec_costs=whole, cuda_graphs="emulate", graph_buckets=[4, N_REQUESTS])  # two buckets: enough
    one = _self_drafted_adaptive(pair, **kw)
    captured = one.warm_up()
    assert captured > 0
    want = one.generate(prompts, params)
    assert one.graph_runner.graph_count() == captured, "a graph was captured mid-stream at TP=1"
    with _self_drafted_adaptive(pair, **kw, tensor_parallel_size=2, tp_check=True) as two:
        assert two.warm_up() == captured
        got = two.generate(prompts, params)
        assert len(shape_counts(two.trace)) >= 2, "the plan never moved"
        assert two.graph_runner.graph_count() == captured, "a graph was captured mid-stream"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} differs at TP=2"


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_outputs_equal_tp1(pair, case):
    target, drafts = pair
    method, spec, page_size, pool = CASES[case]
    prompts, params = _workload()
    one = _engine(target, drafts, method, spec, page_size, pool)
    want = one.generate(prompts, params)
    with _engine(target, drafts, method, spec, page_size, pool, tensor_parallel_size=2, tp_check=True,
                 check_every_step=True) as two:
        assert two.target.kv_spec.num_kv_heads == 1  # 1 kv head: replicated, not split
        got = _generate_checked(two, one, prompts, params, pool, draft_split=False)
    assert all(t.collective_s is None for t in one.trace)  # no group: nothing to measure
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} differs at TP=2"
        assert g.stats.accept_lengths == w.stats.accept_lengths


def test_tp2_step_api_abort_and_retract(pair):
    """The step API drives the worker too: abort and a forced retraction mid-run."""
    target, drafts = pair
    spec = dict(topk=2, num_steps=3, num_draft_tokens=6)
    prompts, params = _workload()
    one = _engine(target, drafts, "eagle3", spec, 1, 4096)
    want = one.generate(prompts[:3], params[:3])
    with _engine(target, drafts, "eagle3", spec, 1, 4096, tensor_parallel_size=2, tp_check=True) as two:
        for i in range(3):
            two.add_request(f"r{i}", prompts[i], params[i])
        two.add_request("gone", prompts[3], params[3])
        got = {f"r{i}": [] for i in range(3)}
        steps = 0
        while two.has_unfinished():
            for delta in two.step():
                if delta.request_id in got:
                    got[delta.request_id] += delta.new_token_ids
            steps += 1
            if steps == 2:
                assert two.abort("gone")
                assert two.retract("r1")
        two.check()
    assert [got[f"r{i}"] for i in range(3)] == [w.token_ids for w in want]


def test_tp2_splits_kv_heads_where_they_divide(tmp_path):
    """4 query heads and 2 kv heads: each rank holds one kv head and two query heads."""
    values = small_config("llama") | dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    target = write_hf_target(tmp_path / "t", "llama", **values)
    prompts = make_prompts(3, seed=4)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    want = Engine.from_pretrained(target, dtype="float32").generate(prompts, params)
    with Engine.from_pretrained(target, dtype="float32", page_size=16, tensor_parallel_size=2) as two:
        assert two.target.kv_spec.num_kv_heads == 1
        assert two.target.fused_layers[0].num_heads == 2
        got = two.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_bf16_partial_sums_reduced_in_float32_follow_tp1(tmp_path):
    """A bfloat16 target: with ``tp_reduce_dtype="float32"`` (the default) each layer's output is
    rounded once, after the ranks' sum, as at TP=1, so far more greedy outputs equal TP=1's than
    when the partial sums are rounded to bfloat16 first and summed in bfloat16."""
    from safetensors.torch import load_file, save_file

    target = write_hf_target(tmp_path / "t", "llama", seed=11, hidden_size=256, intermediate_size=512,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
                             max_position_embeddings=1024, tie_word_embeddings=False)
    state = load_file(str(target / "model.safetensors"))
    state["lm_head.weight"] *= 4.0  # sharper logits: fewer near-ties, as the GPU suite's target
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (32,), generator=g)]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    kw = dict(dtype="bfloat16", max_batch_size=32, kv_pool_tokens=8192)
    want = [o.token_ids for o in Engine.from_pretrained(target, **kw).generate(prompts, params)]
    same = {}
    for reduce_dtype, expected in (("float32", torch.float32), ("model", None)):
        with Engine.from_pretrained(target, tensor_parallel_size=2, tp_reduce_dtype=reduce_dtype, **kw) as two:
            assert two.tp.reduce_dtype == expected
            got = [o.token_ids for o in two.generate(prompts, params)]
        same[reduce_dtype] = sum(a == b for a, b in zip(got, want, strict=True))
    assert same["float32"] >= same["model"] + 8, same
    with pytest.raises(InvalidConfig, match="tp_reduce_dtype must be one of float32, model; got 'fp8'"):
        Engine.from_pretrained(target, dtype="float32", tp_reduce_dtype="fp8")


def test_shutdown_destroys_the_graphs_before_leaving_the_group(pair, monkeypatch):
    """NCCL frees a communicator only once every CUDA graph holding one of its collectives is
    destroyed, so a rank drops its graphs (emulated here) before it leaves the group."""
    from phasegraph.runtime import tensor_parallel

    seen = []
    leave = tensor_parallel._leave_group
    engine = Engine.from_pretrained(pair[0], dtype="float32", tensor_parallel_size=2, cuda_graphs="emulate",
                                    max_batch_size=4)
    monkeypatch.setattr(tensor_parallel, "_leave_group", lambda t: seen.append(engine.graph_runner.graph_count())
                        or leave(t))
    engine.generate(make_prompts(2, seed=3), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert engine.graph_runner.graph_count() > 0
    engine.shutdown()
    assert seen == [0] and engine.graph_runner.graph_count() == 0


def test_killed_worker_raises_worker_died(pair):
    target, _ = pair
    two = Engine.from_pretrained(target, dtype="float32", tensor_parallel_size=2, tp_timeout_s=20)
    try:
        two.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
        (worker,) = two.tp.workers
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(WorkerDied, match="rank 1 exited") as info:
            two.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
        assert info.value.rank == 1
        # a collective with the dead rank fails too, within the timeout, never hangs
        with pytest.raises(WorkerDied):
            two.tp.all_reduce_(torch.ones(4))
        assert time.monotonic() - start < 20
    finally:
        two.shutdown()
    with pytest.raises(WorkerDied, match="shut down"):
        two.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))


def test_worker_that_fails_to_load_reports_its_error(pair, tmp_path):
    """Rank 1 cannot read a checkpoint that rank 0 read: the caller gets rank 1's traceback."""
    target, _ = pair

    class Vanishing(os.PathLike):  # rank 1 is handed a path that does not exist
        def __fspath__(self):
            return str(target) if os.getpid() == leader else str(tmp_path / "missing")

        def __reduce__(self):
            return (str, (str(tmp_path / "missing"),))

    leader = os.getpid()
    with pytest.raises(WorkerDied, match="rank 1") as info:
        Engine.from_pretrained(Vanishing(), dtype="float32", tensor_parallel_size=2, tp_timeout_s=30)
    assert "missing" in str(info.value)


def test_head_split():
    assert head_split(8, 4, 1, 2) == (4, 4, 2, 2)  # kv heads split
    assert head_split(8, 2, 3, 4) == (6, 2, 1, 1)  # kv heads split, one each
    assert head_split(8, 1, 1, 2) == (4, 4, 0, 1)  # one kv head, replicated
    assert head_split(8, 2, 3, 8) == (3, 1, 0, 1)  # query heads 0..3 read kv head 0
    assert head_split(8, 2, 4, 8) == (4, 1, 1, 1)
    with pytest.raises(UnsupportedModel):
        head_split(6, 6, 0, 4)  # 4 divides neither the query heads nor is a multiple of the kv heads


def test_tp_options_are_checked(pair):
    target, _ = pair
    with pytest.raises(InvalidConfig, match="tp_timeout_s"):
        Engine.from_pretrained(target, tensor_parallel_size=2, tp_timeout_s=0)
    with pytest.raises(InvalidConfig, match="tensor_parallel_size"):
        Engine.from_pretrained(target, tensor_parallel_size=0)
    loaded = Engine.from_pretrained(target, dtype="float32")
    with pytest.raises(InvalidConfig, match="from_pretrained"):
        Engine(loaded.target, tensor_parallel_size=2)


def test_check_same_raises_rank_divergence():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(diverging_rank, args=(port,), nprocs=2, join=True)


@pytest.mark.parametrize("draft_tp", ["1", "2"])
def test_torchrun_spmd_generate_equals_tp1(pair, capsys, draft_tp):
    """``torchrun --nproc-per-node 2 -m phasegraph generate --tp 2``: every rank runs the command
    (SPMD, nothing sent between ranks), rank 0 alone prints, the tokens are TP=1's; with
    ``--draft-tp 2`` the EAGLE-3 head is split too."""
    import subprocess
    import sys
    from pathlib import Path

    from phasegraph.cli import main

    target, drafts = pair
    args = ["generate", "--device", "cpu", "--target", str(target), "--draft", str(drafts["eagle3"]),
            "--topk", "2", "--num-steps", "3", "--prompt-ids", "1,2,3", "--prompt-ids", "5,6,7,8",
            "--max-new-tokens", "14", "--ignore-eos"]
    assert main(args) == 0
    want = capsys.readouterr().out
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run([str(torchrun), "--nproc-per-node", "2", "-m", "phasegraph", *args, "--tp", "2",
                          "--draft-tp", draft_tp],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == want  # once: rank 1 prints nothing
    assert want.count("completion") == 2


def test_symmetric_memory_all_reduce_is_refused_without_gpus(pair):
    target, _ = pair
    with pytest.raises(InvalidConfig, match="tp_all_reduce must be one of nccl, symm_mem"):
        Engine.from_pretrained(target, tp_all_reduce="nvls")
    with pytest.raises(InvalidConfig, match="several ranks"):
        Engine.from_pretrained(target, dtype="float32", tp_all_reduce="symm_mem")
    with pytest.raises(InvalidConfig, match="needs CUDA devices"):
        Engine.from_pretrained(target, dtype="float32", tensor_parallel_size=2, tp_all_reduce="symm_mem")


def test_a_second_symmetric_memory_group_is_refused_before_any_rank_starts(pair, monkeypatch):
    """A leader whose group used symmetric memory closes; a later symm_mem engine of the same
    process (which hung on GPUs) is refused by name, and no rank is started."""
    from phasegraph.runtime import tensor_parallel
    from phasegraph.runtime.errors import TensorParallelError

    monkeypatch.setitem(tensor_parallel._SYMM_LEFT, "left", False)
    tensor_parallel.check_symmetric_memory_fresh()
    group = tensor_parallel.TensorParallelGroup(0, 2, "gloo", torch.device("cpu"), 10.0, "leader",
                                                symm=[torch.zeros(4)])
    group.close()
    started = []
    monkeypatch.setattr(tensor_parallel, "launch", lambda *a, **k: started.append(a))
    target = pair[0]
    with pytest.raises(TensorParallelError, match="second tensor-parallel engine of one process hung"):
        Engine.from_pretrained(target, dtype="float32", tensor_parallel_size=2, tp_all_reduce="symm_mem")
    assert started == []


def test_moe_target_is_refused_by_name(tmp_path):
    """Routed experts take no fused path, which tensor parallelism splits: UnsupportedModel, and
    the started rank is stopped."""
    values = small_config("llama") | dict(num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=2)
    target = write_hf_target(tmp_path / "moe", "mixtral", **values)
    with pytest.raises(UnsupportedModel, match="fused decoder path"):
        Engine.from_pretrained(target, dtype="float32", tensor_parallel_size=2)


DRAFT_TP_CASES = {
    # name: as in CASES; the draft split over both ranks too (draft_tensor_parallel_size=2)
    "eagle3-tree-P1-retract": CASES["eagle3-tree-P1-retract"],
    "eagle3-chain-P16": CASES["eagle3-chain-P16"],
    "standalone-tree-P16-retract": CASES["standalone-tree-P16-retract"],
}


@pytest.mark.parametrize("case", list(DRAFT_TP_CASES))
def test_draft_tp2_outputs_equal_tp1(pair, case):
    """The draft split like the target (the EAGLE-3 head's 4 query and 2 kv heads split in
    halves; the standalone draft's 2 query heads split, its kv head replicated): greedy and
    seeded-sampling tokens are TP=1's."""
    target, drafts = pair
    method, spec, page_size, pool = DRAFT_TP_CASES[case]
    prompts, params = _workload()
    one = _engine(target, drafts, method, spec, page_size, pool)
    want = one.generate(prompts, params)
    with _engine(target, drafts, method, spec, page_size, pool, tensor_parallel_size=2,
                 draft_tensor_parallel_size=2, tp_check=True, check_every_step=True) as two:
        assert two.draft.tp is two.tp
        if method == "eagle3":
            assert (two.draft.fused_layer.num_heads, two.draft.kv_spec.num_kv_heads) == (2, 1)
        else:
            assert (two.draft.model.fused_layers[0].num_heads, two.draft.kv_spec.num_kv_heads) == (1, 1)
        got = _generate_checked(two, one, prompts, params, pool, draft_split=True)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} differs with the draft split"
        assert g.stats.accept_lengths == w.stats.accept_lengths


def test_draft_tp_values_are_checked_before_any_rank_starts(pair):
    import multiprocessing

    target, drafts = pair
    eagle3 = SpecConfig(method="eagle3", topk=1, num_steps=2)
    with pytest.raises(InvalidConfig, match=r"must be 1 \(the draft replicated\) or tensor_parallel_size=2; got 3"):
        Engine.from_pretrained(target, drafts["eagle3"], spec=eagle3, tensor_parallel_size=2,
                               draft_tensor_parallel_size=3)
    with pytest.raises(InvalidConfig, match=r"or tensor_parallel_size=1; got 2"):
        Engine.from_pretrained(target, drafts["eagle3"], spec=eagle3, draft_tensor_parallel_size=2)
    with pytest.raises(InvalidConfig, match=r"draft_tensor_parallel_size must be an integer in \[1, 64\]; got 0"):
        Engine.from_pretrained(target, drafts["eagle3"], spec=eagle3, draft_tensor_parallel_size=0)
    for method in ("mtp", "eagle"):  # their layers run transformers' modules, which are not split
        with pytest.raises(InvalidConfig, match=f"standalone and EAGLE-3 drafts only; method '{method}'"):
            Engine.from_pretrained(target, drafts[method], spec=SpecConfig(method=method, topk=1, num_steps=2),
                                   tensor_parallel_size=2, draft_tensor_parallel_size=2)
    with pytest.raises(InvalidConfig, match="method 'none' has no draft split"):
        Engine.from_pretrained(target, tensor_parallel_size=2, draft_tensor_parallel_size=2)
    assert multiprocessing.active_children() == []


def test_draft_tp_flag_reaches_the_engine(pair, capsys):
    from phasegraph.cli import main

    target, drafts = pair
    args = ["generate", "--device", "cpu", "--target", str(target), "--draft", str(drafts["eagle3"]),
            "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--tp", "2", "--draft-tp", "3"]
    assert main(args) == 2
    assert "draft_tensor_parallel_size must be 1 (the draft replicated) or tensor_parallel_size=2; got 3" in \
        capsys.readouterr().err


def test_eagle3_head_without_the_fused_path_refuses_the_split(pair):
    """The split runs the fused layer; a head on transformers' modules says why not."""
    from phasegraph.runtime.models.drafts import load_draft
    from phasegraph.runtime.models.target import HFTarget
    from phasegraph.runtime.tensor_parallel import TensorParallelGroup

    target, drafts = pair
    head = load_draft(drafts["eagle3"], HFTarget.from_pretrained(target, feature_mode="eagle3"), "eagle3",
                      fused=False)
    group = TensorParallelGroup(0, 2, "gloo", torch.device("cpu"), 30, "spmd")  # no collective is made
    with pytest.raises(UnsupportedModel, match="splits the fused EAGLE-3 layer, which this head does not take: "
                                               "switched off"):
        head.split(group)
    assert head.tp is None


def test_graph_overlay_shows_the_all_reduce_time(pair, tmp_path, capsys):
    """``phasegraph graph --trace`` over a TP=2 engine's saved trace: the phases that run the
    target show the time rank 0 spent in the all-reduces, the others none."""
    from phasegraph.cli import main

    target, drafts = pair
    with _engine(target, drafts, "eagle3", dict(topk=1, num_steps=2), 16, 4096, tensor_parallel_size=2) as two:
        two.generate(make_prompts(2, seed=3), SamplingParams(max_new_tokens=6, ignore_eos=True))
        path = two.save_trace(tmp_path / "trace.json")
        verify = two.trace.collective_mean("verify")
    assert verify > 0
    assert main(["graph", "--trace", str(path)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if "visits=" in line}
    for phase in ("prefill-extend", "verify"):
        shown = lines[phase].split("collectives=")[1]
        assert shown != "0.0 µs" and shown.endswith(("µs", "ms", " s")), lines[phase]
    for phase in ("draft-extend", "draft", "finalize-tree-path"):
        assert lines[phase].endswith("collectives=0.0 µs"), lines[phase]
    assert "collectives" not in lines["decode"]  # never ran: nothing measured
