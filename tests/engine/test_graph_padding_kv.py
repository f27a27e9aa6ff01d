"""Padded graph rows leave every live request's KV exactly as an eager run leaves it.

A batch of B requests replays the graph of the smallest bucket >= B; the padded rows run the
same phases on the reserved KV row. Had a padded row addressed a live request (a token row of
draft-extend numbered 0, request 0's batch row, instead of its own padded request), it would
write into that request's draft KV, which no output shows but acceptance does. So after every
step, every live request's pages in the target and the draft pool must equal, bit for bit in
float32, those of the same requests run eagerly, and so must the accept lengths.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.support import arch_bundle, engine_for, greedy, make_prompts

BUCKETS = (1, 2, 4, 8)


def _live_pages(engine, row: int) -> list[int]:
    """The pages of a request's own KV (not its draft branch regions: per-iteration scratch that
    each draft step rewrites, in whose rounding the matrix products' row count shows)."""
    return list(engine.kv.table.owned[row])


def assert_live_kv_equal(eager, graphed, atol: float = 0.0) -> float:
    """Every page a live request owns holds the same K and V in both engines (page tables too):
    bit for bit with ``atol=0``, else within ``atol``. Returns the largest difference."""
    rows = sorted(r.row for r in eager.scheduler.running)
    assert rows == sorted(r.row for r in graphed.scheduler.running)
    page = eager.kv.page_size
    largest = 0.0
    for row in rows:
        pages = _live_pages(eager, row)
        assert pages == _live_pages(graphed, row), f"row {row}: pages differ"
        slots = (torch.tensor(pages)[:, None] * page + torch.arange(page)).reshape(-1)
        for name, a, b in (("target", eager.kv.target_pool, graphed.kv.target_pool),
                           ("draft", eager.kv.draft_pool, graphed.kv.draft_pool)):
            for layer in range(a.num_layers):
                for kind, x, y in (("K", a.k[layer], b.k[layer]), ("V", a.v[layer], b.v[layer])):
                    gap = (x[slots.to(x.device)] - y[slots.to(y.device)]).abs().flatten(1).amax(dim=1).cpu()
                    bad = gap > atol
                    assert not bool(bad.any()), (
                        f"{name} {kind} of layer {layer}, row {row}: slots {slots[bad].tolist()[:8]} "
                        f"differ from the eager run by up to {float(gap.max()):.3g}"
                    )
                    largest = max(largest, float(gap.max()) if gap.numel() else 0.0)
    return largest


def run_lockstep(bundle, method: str, draft: str, batch: int, scope: str, topk: int, steps: int = 3,
                 graphs: bool | str = "emulate", atol: float = 0.0):
    """An eager engine and a graphed one (emulated on the CPU) stepped side by side on the same
    requests; live KV compared after every step (within ``atol``). Returns both engines, their
    outputs and the largest KV difference seen."""
    nodes = 4 if topk == 1 else 8
    kw = dict(topk=topk, num_steps=steps, num_draft_tokens=nodes, draft=draft, max_batch_size=8,
              graph_buckets=BUCKETS)
    eager = engine_for(bundle, method, cuda_graphs=False, **kw)
    graphed = engine_for(bundle, method, cuda_graphs=graphs, graph_scope=scope, **kw)
    prompts = make_prompts(batch, seed=11)
    for engine in (eager, graphed):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy(24))
    outputs = {e: {} for e in (eager, graphed)}  # request -> (tokens, accept lengths)
    largest = 0.0
    while eager.has_unfinished() or graphed.has_unfinished():
        for engine in (eager, graphed):
            for d in engine.step():
                tokens, accepts = outputs[engine].setdefault(d.request_id, ([], []))
                tokens.extend(d.new_token_ids)
                accepts.extend(d.accept_lengths)
        largest = max(largest, assert_live_kv_equal(eager, graphed, atol))
    return eager, graphed, outputs, largest


@pytest.mark.parametrize("scope", ["phase", "iteration"])
# mtp: chained layers, each step fed the previous step's hidden state (SGLang #22041: a graph
# runner that updated its own copy of the hidden states, not the captured buffer)
@pytest.mark.parametrize(("method", "draft"), [("eagle3", "eagle3"), ("standalone", "self"), ("eagle", "eagle"),
                                               ("mtp", "mtp")])
@pytest.mark.parametrize("topk", [1, 4])
@pytest.mark.parametrize("batch", [3, 6])
def test_padded_rows_leave_live_kv_and_acceptance_as_eager(engine_root, scope, method, draft, topk, batch):
    bundle = arch_bundle(engine_root, "llama")
    eager, graphed, outputs, _ = run_lockstep(bundle, method, draft, batch, scope, topk)
    assert outputs[graphed] == outputs[eager]  # tokens and per-request accept lengths
    assert all(len(accepts) > 0 for _, accepts in outputs[eager].values())
    stats = graphed.graph_runner.stats()
    replays = stats["iteration"]["replays"] if scope == "iteration" else stats["draft-extend"]["replays"]
    assert replays > 0, "no padded replay ran"
