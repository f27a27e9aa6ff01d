"""Overlap scheduling on the GPU (the default there): lossless, and no hidden host sync.

    python -m pytest -m gpu tests/gpu/test_overlap_gpu.py -q

With ``overlap=True`` a step issues iteration i+1 before it waits for iteration i's tokens; any
other host synchronisation inside a step (a pageable host-to-device copy, a ``.tolist()`` of a
device tensor, a boolean-mask index) would make the host wait for the iteration it has just
issued and quietly undo the overlap. So the steady-state steps here run under
``torch.cuda.set_sync_debug_mode("error")``, except inside ``Scheduler._collect``: the one
synchronisation of an iteration.
"""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.scheduler import Scheduler
from tests.gpu.test_cuda_graphs import _noisy_self_draft, _prompts, _reference, _target

pytestmark = pytest.mark.gpu

SPECS = {
    "baseline": SpecConfig(method="none"),
    "chain": SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=1),
    "tree": SpecConfig(method="standalone", adaptive=False, num_steps=3, topk=4, num_draft_tokens=12),
}


@pytest.fixture(scope="module")
def setup():
    target = _target()
    prompts = _prompts(5, seed=7)
    return target, _noisy_self_draft(target), prompts, _reference(target, prompts)


def _engine(setup, name, **kw):
    target, draft, _, _ = setup
    spec = SPECS[name]
    return Engine(target, None if name == "baseline" else draft, spec=spec, max_batch_size=8,
                  kv_pool_tokens=16384, cuda_graphs=True, **kw)


@pytest.mark.parametrize("name", list(SPECS))
def test_overlapped_engine_is_lossless(setup, name):
    _, _, prompts, ref = setup
    eng = _engine(setup, name)
    assert eng.overlap, "overlap scheduling is the default on a GPU"
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert [tuple(o.token_ids) for o in outs] == ref
    eng.check()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name", list(SPECS))
def test_steady_state_step_syncs_only_to_collect(setup, name, overlap, monkeypatch):
    _, _, prompts, _ = setup
    eng = _engine(setup, name, overlap=overlap)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(f"s{i}", p, SamplingParams(max_new_tokens=200, ignore_eos=True))
    for _ in range(4):  # prefill, the eager first iteration, capture
        eng.step()
    collect = Scheduler._collect

    def collect_allowed_to_sync(self, done):
        mode = torch.cuda.get_sync_debug_mode()  # "error" inside the steps; not in check()'s drain
        torch.cuda.set_sync_debug_mode("default")
        try:
            return collect(self, done)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(Scheduler, "_collect", collect_allowed_to_sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(r.output) > 6 for r in eng.scheduler.running)
    eng.check()
