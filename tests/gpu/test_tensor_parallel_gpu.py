"""Tensor parallelism on two GPUs: NCCL, CUDA graphs (iteration graphs with the all-reduces
captured), overlap scheduling.

    bash scripts/gpu_checks.sh tp-tests

About a minute a test (two engines each): that part runs ``-k`` selections side by side in one
10-minute device call, each symm_mem test in a process of its own (a second symm_mem engine in
a process is refused: it hung on 2×H200). The engine starts rank 1 on GPU 1 itself. float32: TP=2
produces exactly TP=1's tokens for no speculation, EAGLE-3 and standalone drafts, chain and
tree, page size 1 and 16, with retraction forced and seeded sampling, also with the draft split
over both GPUs (draft_tensor_parallel_size=2); bfloat16 (partial sums reduced in float32): a
prompt differs only where it takes a token within a near-tie of TP=1's best logit (on this
model TP=1 alone, one prompt at a time against 64 at once, agrees on about half of 64 prompts:
another summation order, the same near-ties); on the single-GPU suite's model, whose 96-token
vocabulary ties far less, at least 95 % of 64 prompts identical, that suite's bar. warm_up
captures every graph on both ranks before traffic.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.testing.checkpoints import (
    write_eagle3_draft,
    write_hf_target,
    write_standalone_draft,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

VOCAB = 1024
TARGET = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=False)


def _sharp_target(directory, seed: int, **config):
    """A random llama checkpoint whose lm_head is scaled by 4 (as the single-GPU suite's target):
    sharper logits, so rounding moves fewer near-ties."""
    target = write_hf_target(directory, "llama", seed=seed, **config)
    path = target / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"] *= 4.0
    save_file(state, str(path), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """8 query heads and 2 kv heads: one kv head and 4 query heads per rank."""
    root = tmp_path_factory.mktemp("tp-gpu")
    target = _sharp_target(root / "target", 11, **TARGET)
    drafts = {
        "eagle3": write_eagle3_draft(root / "eagle3", target),
        "standalone": write_standalone_draft(root / "standalone", target),
        "self": target,  # every draft accepted: the longest paths
    }
    return target, drafts


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


def _workload(n=16):
    params = []
    for i in range(n):
        budget = 24 + (7 * i) % 25
        sampled = dict(temperature=0.8, top_p=0.9, seed=700 + i) if i % 2 else {}
        params.append(SamplingParams(max_new_tokens=budget, ignore_eos=True, **sampled))
    return _prompts(n, seed=3), params


CASES = {
    # name: (method, draft, spec kwargs, page size, pool tokens: tight ones force retraction)
    "none-P16-retract": ("none", None, {}, 16, 448),
    "eagle3-tree-P1-retract": ("eagle3", "eagle3", dict(topk=4, num_steps=3, num_draft_tokens=8), 1, 400),
    "eagle3-chain-P16": ("eagle3", "eagle3", dict(topk=1, num_steps=3), 16, 16384),
    "standalone-self-tree-P16": ("standalone", "self", dict(topk=2, num_steps=3, num_draft_tokens=6), 16, 16384),
    "standalone-chain-P1": ("standalone", "standalone", dict(topk=1, num_steps=4), 1, 16384),
}


def _engine(pair, method, draft, spec, page_size, pool, dtype="float32", batch=16, **kw):
    target, drafts = pair
    # one fixed shape at both sizes: an adaptive TP=1 engine (on by default on a GPU, off under
    # tensor parallelism) draws other random numbers for its sampled requests than the fixed shape
    config = SpecConfig(method="none") if method == "none" else SpecConfig(method=method, adaptive=False, **spec)
    return Engine.from_pretrained(target, None if draft is None else drafts[draft], spec=config, device="cuda",
                                  dtype=dtype, page_size=page_size, kv_pool_tokens=pool, max_batch_size=batch, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_fp32_equals_tp1_with_graphs(pair, case):
    method, draft, spec, page_size, pool = CASES[case]
    prompts, params = _workload()
    one = _engine(pair, method, draft, spec, page_size, pool)
    want = one.generate(prompts, params)
    with _engine(pair, method, draft, spec, page_size, pool, tensor_parallel_size=2, tp_check=True) as two:
        got = two.generate(prompts, params)
        assert two.target.kv_spec.num_kv_heads == 1
        assert sum(p["replays"] for p in two.graph_runner.stats().values()) > 0
        if pool < 16384:
            assert two.num_retractions >= 1, "the pool is not tight enough to retract"
        two.check()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} differs at TP=2"


def test_tp2_bf16_differs_from_tp1_only_at_near_ties(pair):
    """bf16 TP=2 sums o and down in another order than TP=1 (two half sums, then the all-reduce):
    a token may differ only where TP=2's choice was within a near-tie of TP=1's best logit. A
    shard in the wrong place, a stale KV page or a missing all-reduce differs at a wide margin."""
    prompts = _prompts(64, seed=5)
    spec = dict(topk=4, num_steps=3, num_draft_tokens=8)
    one = _engine(pair, "eagle3", "eagle3", spec, 16, 32768, dtype="bfloat16", batch=64)
    want = one.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True, logprobs=5))
    with _engine(pair, "eagle3", "eagle3", spec, 16, 32768, dtype="bfloat16", batch=64,
                 tensor_parallel_size=2, tp_check=True) as two:
        got = two.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
    same = 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.token_ids == w.token_ids:
            same += 1
            continue
        at = next(k for k, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=True)) if a != b)
        top = dict(w.top_logprobs[at])  # TP=1's five best at the first difference
        assert g.token_ids[at] in top, f"prompt {i}: TP=2's token {at} is not among TP=1's five best"
        margin = max(top.values()) - top[g.token_ids[at]]
        assert margin < 0.25, f"prompt {i} differs at token {at}, {margin:.3f} below TP=1's best logit"
    print(f"bf16 TP=2 = TP=1 for {same}/64 prompts")


# the single-GPU suite's model (tests/gpu/test_cuda_graphs.py: 96 tokens, lm_head x 4), under
# that suite's bf16 bar; its small vocabulary leaves far fewer near-ties than the 1,024 above
def test_tp2_warm_up_captures_before_traffic(pair):
    """Adaptive speculation (one given cost table, so both sizes plan alike): warm_up on the
    leader and its worker captures every shape's NCCL graphs, greedy and sampled, and the traffic
    after it captures none; the tokens stay TP=1's."""
    from phasegraph.runtime.adaptive import OFF, CostTable, SpecShape

    tree = SpecShape(4, 3, 8)
    costs = CostTable((OFF, SpecShape.chain(1), SpecShape.chain(3), tree), (1, 8, 16),
                      [(1.0, 1.1, 1.2), (1.1, 1.2, 1.4), (1.2, 1.3, 1.6), (0.9, 5.0, 10.0)], split_s=1e3)
    prompts, params = _workload()
    spec = dict(topk=4, num_steps=3, num_draft_tokens=8)
    kw = dict(spec_costs=costs, graph_buckets=[8, 16])
    target, drafts = pair
    config = SpecConfig(method="eagle3", adaptive=True, **spec)

    def engine(**more):
        return Engine.from_pretrained(target, drafts["eagle3"], spec=config, device="cuda", dtype="float32",
                                      kv_pool_tokens=16384, max_batch_size=16, **kw, **more)

    one = engine()
    captured = one.warm_up()
    want = one.generate(prompts, params)
    with engine(tensor_parallel_size=2, tp_check=True) as two:
        assert two.warm_up() == captured > 0
        got = two.generate(prompts, params)
        assert two.graph_runner.graph_count() == captured, "a graph was captured mid-stream"
    assert one.graph_runner.graph_count() == captured
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.token_ids == w.token_ids, f"request {i} differs at TP=2"


SINGLE_GPU_TARGET = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def single_gpu_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-gpu-96")
    target = _sharp_target(root / "target", 1234, **SINGLE_GPU_TARGET)
    return target, {"eagle3": write_eagle3_draft(root / "eagle3", target)}


def test_tp2_bf16_meets_the_single_gpu_bar(single_gpu_pair):
    """bf16, EAGLE-3 tree, 64 prompts x 64 tokens: TP=2 equals TP=1 for at least 95 % of them,
    the single-GPU suite's bar on its model."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (k,), generator=g).tolist() for k in torch.randint(3, 20, (64,), generator=g).tolist()]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    spec = dict(topk=4, num_steps=3, num_draft_tokens=8)
    one = _engine(single_gpu_pair, "eagle3", "eagle3", spec, 16, 32768, dtype="bfloat16", batch=64)
    want = [o.token_ids for o in one.generate(prompts, params)]
    with _engine(single_gpu_pair, "eagle3", "eagle3", spec, 16, 32768, dtype="bfloat16", batch=64,
                 tensor_parallel_size=2, tp_check=True) as two:
        got = [o.token_ids for o in two.generate(prompts, params)]
    same = sum(a == b for a, b in zip(got, want, strict=True))
    assert same >= 0.95 * len(prompts), f"{same}/64 identical"


@pytest.mark.parametrize("case", ["none-P16-retract", "eagle3-tree-P1-retract"])
def test_tp2_symmetric_memory_all_reduce_equals_tp1(pair, case):
    """tp_all_reduce="symm_mem": the small all-reduces through torch's symmetric memory (one-shot,
    no multicast), captured in the graphs; the tokens are TP=1's."""
    method, draft, spec, page_size, pool = CASES[case]
    prompts, params = _workload()
    want = _engine(pair, method, draft, spec, page_size, pool).generate(prompts, params)
    with _engine(pair, method, draft, spec, page_size, pool, tensor_parallel_size=2, tp_check=True,
                 tp_all_reduce="symm_mem") as two:
        got = two.generate(prompts, params)
        assert two.tp.symm, "the symmetric buffers were not set up"
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


@pytest.mark.parametrize(("case", "all_reduce"), [("eagle3-tree-P1-retract", "nccl"), ("standalone-chain-P1", "nccl"),
                                                  ("eagle3-tree-P1-retract", "symm_mem")])
def test_draft_tp2_fp32_equals_tp1_with_graphs(pair, case, all_reduce):
    """The draft split over both GPUs too (draft_tensor_parallel_size=2), its all-reduces in the
    same iteration graphs: the tokens are TP=1's."""
    method, draft, spec, page_size, pool = CASES[case]
    prompts, params = _workload()
    want = _engine(pair, method, draft, spec, page_size, pool).generate(prompts, params)
    with _engine(pair, method, draft, spec, page_size, pool, tensor_parallel_size=2, draft_tensor_parallel_size=2,
                 tp_check=True, tp_all_reduce=all_reduce) as two:
        got = two.generate(prompts, params)
        assert two.draft.tp is two.tp
        assert sum(p["replays"] for p in two.graph_runner.stats().values()) > 0
        if pool < 16384:
            assert two.num_retractions >= 1, "the pool is not tight enough to retract"
        two.check()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
