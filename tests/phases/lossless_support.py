"""Shared pieces of the lossless tests: a tiny target, prompts, and reference continuations."""

from __future__ import annotations

import functools

import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.models.target import HFTarget, build_causal_lm
from phasegraph.testing.checkpoints import tiny_target_config

VOCAB = 96
NEW_TOKENS = 64


@functools.cache
def tiny_target() -> HFTarget:
    config = tiny_target_config(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )
    torch.manual_seed(1234)
    model = build_causal_lm(config, dtype=torch.float32, device="cpu", init=True)
    # sharpen the random logits so greedy decoding has clear winners
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return HFTarget(model, feature_mode="none")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 20, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (length,), generator=g).tolist() for length in lens]


@functools.cache
def reference(n: int, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """Target-only greedy continuations (our autoregressive engine, itself checked against
    transformers' generate in tests/runtime)."""
    eng = Engine(tiny_target(), spec=SpecConfig(method="none"), max_batch_size=16, kv_pool_tokens=8192)
    outs = eng.generate(prompts(n, seed), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return tuple(tuple(o.token_ids) for o in outs)


def run_spec(drafter_cls, spec: SpecConfig, page_size: int, batch: int, *, seed: int = 0,
             validate: str | None = None, engine_kw: dict | None = None, **kw):
    """(outputs, reference, engine) of speculative greedy decoding of ``batch`` prompts with a
    scripted drafter; KV accounting is checked after every step."""
    ps = prompts(batch, seed)
    ref = reference(batch, seed)
    drafter = drafter_cls(dict(zip(map(tuple, ps), ref, strict=True)), VOCAB, **kw)
    engine = Engine(
        tiny_target(), drafter, spec=spec, max_batch_size=batch, page_size=page_size,
        kv_pool_tokens=8192, check_every_step=True, validate=validate, **(engine_kw or {}),
    )
    drafter.engine = engine
    outs = engine.generate(ps, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return [tuple(o.token_ids) for o in outs], ref, engine, outs
