"""GPU: the phasegraph attention backend under CUDA-graph capture, and no host syncs.

Target decode + tree verify and an EAGLE-3 draft step are captured with static metadata
buffers; refilling the buffers in place and replaying equals an eager forward. The eager
forwards run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from phasegraph.kernels.attention import AttentionMetadata
from phasegraph.runtime.kv_pool import KVCacheManager
from phasegraph.runtime.models.eagle3 import Eagle3Draft
from phasegraph.runtime.models.target import HFTarget
from phasegraph.testing.checkpoints import write_eagle3_draft, write_hf_target
from tests.runtime.pg_runtime_helpers import causal_meta, make_meta

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def static_copy(meta: AttentionMetadata) -> AttentionMetadata:
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return AttentionMetadata(
        write_slots=clone(meta.write_slots),
        page_table=meta.page_table,
        query_row=clone(meta.query_row),
        kv_len=clone(meta.kv_len),
        extra_mask=clone(meta.extra_mask),
        page_size=meta.page_size,
    )


def refill(static: AttentionMetadata, meta: AttentionMetadata) -> None:
    for name in ("write_slots", "query_row", "kv_len", "extra_mask"):
        dst = getattr(static, name)
        if dst is not None:
            dst.copy_(getattr(meta, name))


def capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("page_size", [1, 16])
def test_target_and_eagle3_capture_replay_equals_eager(tmp_path, page_size):
    dev = "cuda"
    with no_sync(), pytest.raises(RuntimeError):  # the check is live: a real sync raises
        torch.ones(1, device=dev).item()
    tdir = write_hf_target(tmp_path / "t", "llama")
    target = HFTarget.from_pretrained(tdir, device=dev, feature_mode="eagle3")
    draft = Eagle3Draft.from_pretrained(
        write_eagle3_draft(tmp_path / "e3", tdir, draft_vocab_size=40), target
    )
    m = KVCacheManager(
        num_pages=64,
        page_size=page_size,
        max_reqs=4,
        max_pages_per_req=64 // page_size,
        target=target.kv_spec,
        draft=draft.kv_spec,
        device=dev,
    )
    target.attach_kv(m.target_pool)
    draft.attach_kv(m.draft_pool)
    lens = [5, 13]
    rows = [m.admit(n + 12) for n in lens]
    rt = m.req_to_page
    gen = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 128, (n,), generator=gen) for n in lens]
    row_of = [r for r, n in zip(rows, lens, strict=True) for _ in range(n)]
    pos = torch.cat([torch.arange(n) for n in lens])
    pre_ids = torch.cat(toks).to(dev)
    pre_pos = pos.to(dev)
    pre_meta = to(causal_meta(rt, page_size, row_of, pos), dev)
    with no_sync():
        pre = target.forward(pre_ids, pre_pos, pre_meta)
        draft.forward(pre_ids, pre.features, pre_pos, pre_meta, from_target=True, step=0)

    # -- target decode step, captured
    def decode_inputs(step):
        p = torch.tensor([n + step for n in lens])
        ids = torch.randint(0, 128, (2,), generator=gen)
        return ids.to(dev), p.to(dev), to(causal_meta(rt, page_size, rows, p), dev)

    replays_equal_eager(target.forward, [decode_inputs(step) for step in range(3)], ["logits"])

    # -- tree verify (extra_mask) captured once, replayed for two trees refilled in place
    n = 4
    branching = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
    vrows = [r for r in rows for _ in range(n)]

    def verify_inputs(offset, mask):
        seq = torch.tensor([n_ + 3 + offset for n_ in lens])
        depth = mask.sum(1) - 1  # a node's ancestors, itself excluded
        wpos = torch.cat([s + torch.arange(n) for s in seq])
        vmeta = to(make_meta(rt, page_size, vrows, wpos, seq.repeat_interleave(n), mask.repeat(2, 1)), dev)
        vids = torch.randint(0, 128, (2 * n,), generator=gen).to(dev)
        return vids, (seq.repeat_interleave(n) + depth.repeat(2)).to(dev), vmeta

    replays_equal_eager(target.forward, [verify_inputs(0, branching), verify_inputs(2, chain)], ["logits"])

    # -- EAGLE-3 draft step captured once, replayed for two steps refilled in place
    def draft_inputs(offset):
        seq = torch.tensor([n_ + 3 + offset for n_ in lens])
        hidden = torch.randn(2, 64, generator=gen).to(dev)
        dids = torch.randint(0, 128, (2,), generator=gen).to(dev)
        return dids, hidden, seq.to(dev), to(causal_meta(rt, page_size, rows, seq), dev)

    draft_step = lambda ids, hidden, pos, meta: draft.forward(ids, hidden, pos, meta, from_target=False, step=0)  # noqa: E731
    replays_equal_eager(draft_step, [draft_inputs(0), draft_inputs(1)], ["logits", "hidden"])


def replays_equal_eager(forward, cases, fields) -> None:
    """Captures ``forward`` on static copies of the first case's arguments; then for every case in
    order refills them in place (tensors copied, metadata buffers refilled), replays, and checks
    each output field against an eager call on the case's own arguments."""
    static = [static_copy(x) if isinstance(x, AttentionMetadata) else x.clone() for x in cases[0]]
    graph, g_out = capture(lambda: forward(*static))
    for case in cases:
        for dst, src in zip(static, case, strict=True):
            refill(dst, src) if isinstance(dst, AttentionMetadata) else dst.copy_(src)
        graph.replay()
        replayed = {name: getattr(g_out, name).clone() for name in fields}
        with no_sync():
            eager = forward(*case)
        for name in fields:
            torch.testing.assert_close(replayed[name], getattr(eager, name), atol=1e-5, rtol=0)


def to(meta: AttentionMetadata, device) -> AttentionMetadata:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return AttentionMetadata(
        write_slots=move(meta.write_slots),
        page_table=move(meta.page_table),
        query_row=move(meta.query_row),
        kv_len=move(meta.kv_len),
        extra_mask=move(meta.extra_mask),
        page_size=meta.page_size,
    )
