"""Engine.generate (greedy) is token-identical to transformers' own greedy ``generate``.

Every target architecture (llama, qwen2 sharded + tied, qwen3, mistral sharded) x every draft
kind (EAGLE-1, EAGLE-3 with and without a d2t/t2d vocabulary map, chained MTP, a standalone
draft model) x {chain (topk=1), tree (topk=4)} x page size {1, 16}, plus ``method="none"``, on a
batch of four prompts of lengths 1, 9, 23 and 14 with 27 new tokens each. The reference is
computed once per architecture (``support.arch_bundle``). Each run also checks the per-request
statistics (accept lengths within [1, S+1] and adding up to the emitted tokens) and that every
KV page and page-table row is free afterwards.

The ``self`` draft is the target loaded as its own standalone draft: it agrees with the target
often, which exercises multi-token acceptance (KV compaction, draft-extend over W rows) on the
real models of each architecture. (It would agree always, but the phases hand a standalone draft
the prompt from its second token on; see the report of issue 4.)

A standalone draft that is the target itself gets every draft accepted.

Standalone drafts have a KV lead of 1: their KV row p holds token p at its own position (the
first token included, which with real models is BOS), so with the target as its own draft the
draft sees exactly the target's context (chain and tree)."""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.testing.checkpoints import write_hf_target
from tests.engine.support import (
    ARCHS,
    DRAFT_KINDS,
    NEW_TOKENS,
    SHAPES,
    arch_bundle,
    assert_all_free,
    engine_for,
    greedy,
)


def _check_run(engine, bundle, spec_steps: int | None):
    outs = engine.generate([list(p) for p in bundle.prompts], greedy())
    got = [tuple(o.token_ids) for o in outs]
    for i, (g, want) in enumerate(zip(got, bundle.reference, strict=True)):
        assert g == want, f"prompt {i} (length {len(bundle.prompts[i])}): {list(g)} != transformers {list(want)}"
    for o in outs:
        assert o.finish_reason == "length"
        assert o.prompt_token_ids == list(bundle.prompts[outs.index(o)])
        lens = o.stats.accept_lengths
        if spec_steps is None:
            assert lens == [] and o.stats.mean_accept_length is None
        else:
            assert lens and all(1 <= n <= spec_steps + 1 for n in lens)
            # the first token comes from prefill, every other one from a verify step
            assert sum(lens) + 1 == NEW_TOKENS
        assert o.stats.phase_time_s and all(t >= 0 for t in o.stats.phase_time_s.values())
    assert_all_free(engine)
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", DRAFT_KINDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_greedy_equals_transformers(engine_root, arch, kind, shape, page_size):
    bundle = arch_bundle(engine_root, arch)
    spec = SHAPES[shape]
    engine = engine_for(bundle, kind, page_size=page_size, **spec)
    _check_run(engine, bundle, spec["num_steps"])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_target_alone_equals_transformers(engine_root, arch, page_size):
    bundle = arch_bundle(engine_root, arch)
    _check_run(engine_for(bundle, "none", page_size=page_size), bundle, None)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_self_draft_accepts_every_draft(engine_root, arch, shape):
    bundle = arch_bundle(engine_root, arch)
    spec = SHAPES[shape]
    engine = engine_for(bundle, "standalone", draft="self", page_size=16 if shape == "tree" else 1, **spec)
    outs = _check_run(engine, bundle, spec["num_steps"])
    lens = [n for o in outs for n in o.stats.accept_lengths]
    # multi-token acceptance happened, up to the full chain / the deepest the tree holds
    assert max(lens) >= (spec["num_steps"] + 1 if shape == "chain" else spec["num_steps"])
    assert sum(lens) / len(lens) > 1.5


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_bfloat16_draft_beside_float32_target_keeps_the_output(engine_root, kind):
    """``draft_dtype``: the draft runs (weights, KV pool, hidden state) in bfloat16 while the target
    stays float32; the draft only proposes, so the output is still transformers' greedy one."""
    import torch

    bundle = arch_bundle(engine_root, "qwen3")  # EAGLE-3 with a reduced vocabulary (d2t)
    engine = engine_for(bundle, kind, topk=4, num_steps=3, num_draft_tokens=8,
                        dtype="float32", draft_dtype="bfloat16")
    assert engine.target.dtype == torch.float32
    assert engine.draft.dtype == torch.bfloat16
    assert engine.kv.draft_pool.k[0].dtype == torch.bfloat16
    assert engine.kv.target_pool.k[0].dtype == torch.float32
    _check_run(engine, bundle, 3)


def test_unknown_draft_dtype_is_refused(engine_root):
    from phasegraph.runtime.errors import InvalidConfig

    bundle = arch_bundle(engine_root, "llama")
    with pytest.raises(InvalidConfig, match="draft_dtype must be one of"):
        engine_for(bundle, "eagle3", draft_dtype="float8")


@pytest.mark.parametrize(("topk", "nodes", "page_size"), [(1, 4, 1), (1, 4, 16), (1, 4, 4)])
def test_standalone_self_draft_with_kv_lead_one_accepts_every_draft(tmp_path, topk, nodes, page_size):
    torch.set_num_threads(1)
    target = write_hf_target(tmp_path / "t", "llama")
    spec = SpecConfig(method="standalone", num_steps=3, topk=topk, num_draft_tokens=nodes)
    eng = Engine.from_pretrained(target, target, spec=spec, page_size=page_size, check_every_step=True)
    prompts = [[3, 14, 15, 92, 65, 35], [89, 79], [1]]
    ref = Engine.from_pretrained(target, spec=SpecConfig(method="none")).generate(
        prompts, SamplingParams(max_new_tokens=25, ignore_eos=True)
    )
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=25, ignore_eos=True))
    for out, want in zip(outs, ref, strict=True):
        assert out.token_ids == want.token_ids
        # every verify step but the last (cut at the budget) accepts all 3 drafts
        assert out.stats.accept_lengths[:-1] == [4] * (len(out.stats.accept_lengths) - 1), out.stats.accept_lengths


def test_self_draft_tree_is_lossless_and_accepts_deeply(tmp_path):
    """With a tree the N-1 best candidates need not hold the whole greedy chain (siblings can
    outscore deep nodes), but every draft the target agrees with is accepted."""
    torch.set_num_threads(1)
    target = write_hf_target(tmp_path / "t", "llama")
    spec = SpecConfig(method="standalone", num_steps=3, topk=4, num_draft_tokens=8)
    eng = Engine.from_pretrained(target, target, spec=spec, page_size=4, check_every_step=True)
    prompts = [[3, 14, 15, 92, 65, 35], [89, 79], [1]]
    ref = Engine.from_pretrained(target, spec=SpecConfig(method="none")).generate(
        prompts, SamplingParams(max_new_tokens=25, ignore_eos=True)
    )
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=25, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    lens = [n for o in outs for n in o.stats.accept_lengths[:-1]]
    assert min(lens) >= 2  # the draft's top-1 child of the root is always the target's choice
