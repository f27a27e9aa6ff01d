"""Prefill graphs on the GPU (``prefill_graphs=True``): captured prefill-extend replays give the
outputs of an eager prefill, for the baseline and a standalone draft (KV lead 1), in float32.

    python -m pytest -m gpu tests/gpu/test_prefill_graph_gpu.py -q
"""

from __future__ import annotations

import pytest

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine

from .test_cuda_graphs import _noisy_self_draft, _prompts, _reference, _target

pytestmark = pytest.mark.gpu

SPECS = {"baseline": SpecConfig(method="none"), "tree": SpecConfig(method="standalone", num_steps=3, topk=4,
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
