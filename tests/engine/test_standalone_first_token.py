"""A standalone draft that is the target itself gets every draft accepted.

Standalone drafts have a KV lead of 1: their KV row p holds token p at its own position (the
first token included, which with real models is BOS), so with the target as its own draft the
draft sees exactly the target's context (chain and tree).
"""

import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.testing.checkpoints import write_hf_target


@pytest.mark.parametrize(("topk", "nodes", "page_size"), [(1, 4, 1), (1, 4, 16), (1, 4, 4)])
def test_self_draft_accepts_every_draft(tmp_path, topk, nodes, page_size):
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
