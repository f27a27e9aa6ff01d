"""Sliding-window attention (Mistral ``sliding_window``, Qwen2 ``use_sliding_window``, Mixtral's)
past the window: greedy outputs equal transformers' ``generate`` in float32, on the fused and the modules
path, with and without speculation (chain and tree; EAGLE-3, and a standalone draft whose own
config has a window), on CUDA graphs emulated on the CPU too.

The window is 8 tokens and the prompts are 30 to 41 tokens long, so every token after the first
few attends a strict subset of its prefix. ``test_the_window_changes_the_output`` shows the
references differ from full attention, so the parity tests cannot pass by attending in full.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from phasegraph.kernels.attention import (
    AttentionMetadata,
    paged_attention_reference,
    window_of,
)
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import InvalidConfig
from phasegraph.runtime.models.target import HFTarget
from phasegraph.testing.checkpoints import (
    write_eagle3_draft,
    write_hf_target,
    write_standalone_draft,
)
from tests.engine.support import SHAPES

WINDOW = 8
NEW_TOKENS = 24
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=96, max_position_embeddings=256)
WINDOWED = {
    "mistral": dict(sliding_window=WINDOW),
    # layers from max_window_layers on slide; layer 0 attends in full
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}


def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (30, 41, 33)]


def hf_greedy(directory, prompt_list, new_tokens=NEW_TOKENS):
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    out = []
    for p in prompt_list:
        ids = torch.tensor([p])
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    target = write_hf_target(root / "target", arch, **SIZES, **WINDOWED[arch])
    return arch, target, hf_greedy(target, prompts()), root


def run(engine):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts(), params)]


def test_the_window_changes_the_output(windowed, tmp_path):
    arch, _, want, _ = windowed
    unwindowed = {"mistral": dict(sliding_window=None), "qwen2": dict(use_sliding_window=False)}[arch]
    full = write_hf_target(tmp_path / "full", arch, **SIZES, **unwindowed)
    assert hf_greedy(full, prompts()) != want


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "modules"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_target_alone_equals_transformers_past_the_window(windowed, fused, page_size):
    _, target_dir, want, _ = windowed
    target = HFTarget.from_pretrained(target_dir, feature_mode="none", fused=fused)
    assert target.sliding_window == WINDOW
    assert (target.fused_layers is not None) == (fused is None)
    engine = Engine(target, spec=SpecConfig(method="none"), page_size=page_size, kv_pool_tokens=1024)
    assert run(engine) == want




@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["eager", "graphs"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("method", ["eagle3", "standalone"])
def test_speculation_is_lossless_past_the_window(windowed, method, shape, graphs):
    arch, target_dir, want, root = windowed
    if method == "eagle3":
        draft = write_eagle3_draft(root / "eagle3", target_dir)
    else:  # a whole causal LM of the same family, with its own window
        draft = write_standalone_draft(root / "standalone", target_dir, arch, num_hidden_layers=2,
                                       **WINDOWED[arch])
    engine = Engine.from_pretrained(target_dir, draft, spec=SpecConfig(method=method, **SHAPES[shape]),
                                    dtype="float32", kv_pool_tokens=1024, cuda_graphs=graphs)
    if method == "standalone":
        assert engine.draft.model.sliding_window == WINDOW
    assert run(engine) == want


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    target = write_hf_target(root / "target", "mixtral", **SIZES, sliding_window=WINDOW)
    return target, hf_greedy(target, prompts()), root


@pytest.mark.parametrize("shape", [None, *SHAPES])
def test_mixtral_equals_transformers_past_the_window(mixtral, shape, tmp_path):
    """Mixtral (routed experts through transformers' modules) keeps its window alone and under
    EAGLE-3 speculation."""
    target_dir, want, root = mixtral
    if shape is None:
        full = write_hf_target(tmp_path / "full", "mixtral", **SIZES, sliding_window=None)
        assert hf_greedy(full, prompts()) != want  # the window shows in the reference
        engine = Engine.from_pretrained(target_dir, spec=SpecConfig(method="none"), dtype="float32",
                                        kv_pool_tokens=1024)
    else:
        draft = write_eagle3_draft(root / f"eagle3-{shape}", target_dir)
        engine = Engine.from_pretrained(target_dir, draft, spec=SpecConfig(method="eagle3", **SHAPES[shape]),
                                        dtype="float32", kv_pool_tokens=1024)
    assert engine.target.sliding_window == WINDOW
    assert run(engine) == want


def test_a_draft_path_longer_than_the_window_is_refused(windowed):
    _, target_dir, _, root = windowed
    draft = write_eagle3_draft(root / "eagle3-long", target_dir)
    with pytest.raises(InvalidConfig, match=f"num_steps={WINDOW} reaches past the target's sliding window"):
        Engine.from_pretrained(target_dir, draft, spec=SpecConfig(method="eagle3", num_steps=WINDOW),
                               dtype="float32", kv_pool_tokens=1024)


@pytest.mark.parametrize("page_size", [1, 4])
def test_reference_attention_reads_only_the_window(page_size):
    """The reference kernel with a window equals dense attention over the window's keys, and a
    tree block behind the prefix stays visible."""
    gen = torch.Generator().manual_seed(0)
    length, heads, kv_heads, dim, window = 21, 4, 2, 8, 5
    pages = -(-(length + 3) // page_size)
    k_cache = torch.randn(pages * page_size + page_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(1, pages + 1)[None]  # page 0 is the sink
    positions = torch.arange(length)
    q = torch.randn(length, heads, dim, generator=gen)
    meta = AttentionMetadata(write_slots=table[0, positions // page_size] * page_size + positions % page_size,
                             page_table=table, query_row=torch.zeros(length, dtype=torch.int64),
                             kv_len=positions + 1, extra_mask=None, page_size=page_size)
    got = paged_attention_reference(q, k_cache, v_cache, window_of(meta, positions, window), 0.5)
    slots = meta.write_slots
    keys, values = k_cache[slots].repeat_interleave(2, 1), v_cache[slots].repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 0.5
    rel = positions[:, None] - positions[None, :]
    visible = (rel >= 0) & (rel < window)
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # one query past a prefix of 10 with a tree block of 3 (nodes 0 and 2 visible)
    tree = AttentionMetadata(write_slots=slots[:1], page_table=table, query_row=torch.zeros(1, dtype=torch.int64),
                             kv_len=torch.tensor([10]), extra_mask=torch.tensor([[True, False, True]]),
                             page_size=page_size)
    out = paged_attention_reference(q[:1], k_cache, v_cache, window_of(tree, torch.tensor([12]), window), 0.5)
    read = torch.tensor([8, 9, 10, 12])  # prefix positions > 12 - 5, then the tree nodes
    scores = torch.einsum("hd,khd->hk", q[0], keys[read]) * 0.5
    torch.testing.assert_close(out[0], torch.einsum("hk,khd->hd", scores.softmax(-1), values[read]),
                               atol=1e-5, rtol=1e-5)
