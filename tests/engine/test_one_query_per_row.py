"""``AttentionMetadata.one_query_per_row`` is a promise the one-launch rotary + attention kernel
(kernels/rope_attention.py) relies on: no two query tokens of a call share a page-table row, no
token reads a slot another token of the call writes (else a program could read a key before the
program that owns it writes it), and there is no tree block: each token's own slot is the last
position it reads, ``kv_len - 1``. Decode and the draft steps make it; the others (prefill,
draft-extend, verify) must not. ``tree_block_writes`` is verify's promise for the one-launch tree
kernel (each row's tree nodes are its consecutive tokens, node j writing position kv_len + j).
Both are checked on real generations of every draft kind and page size, wherever the metadata
reaches attention: the fused layers (target, EAGLE-3, standalone) and transformers' layers under
the "phasegraph" attention backend (EAGLE-1, MTP), which have no one-launch path.

Only the fused layers' draft steps take the one-launch path. EAGLE-1's and MTP's heads run
transformers' decoder layers (draft_base.run_decoder_layer): the module rotates q and k itself
before attention_backend.phasegraph_attention sees them, which then runs write_kv +
paged_attention, so there is nothing to fold. EAGLE-1 passes the draft phase's metadata on as it
is, the promise included, and it holds. MTP's draft steps do not promise it
(MTPDraft.step_metadata): a step attends the prefix plus only the ancestors that ran the same MTP
layer, so its metadata cuts kv_len back to the prefix and puts the ancestors and the token's own
slot in a tree block, which the one-launch kernel does not read."""

from __future__ import annotations

import attrs
import pytest

from phasegraph.runtime.models import attention_backend, fused_decoder
from phasegraph.testing.checkpoints import write_mtp_draft
from tests.engine.support import arch_bundle, assert_all_free, engine_for, greedy, make_prompts


def _slot(meta, row: int, pos: int) -> int:
    ps = meta.page_size
    return int(meta.page_table[row, pos // ps]) * ps + pos % ps


def _read_slots(meta, token: int) -> set[int]:
    """The slots token ``token`` attends (positions [0, kv_len) of its row; no tree block)."""
    row = int(meta.query_row[token])
    return {_slot(meta, row, pos) for pos in range(int(meta.kv_len[token]))}


def _check_one_query_per_row(meta) -> None:
    assert meta.extra_mask is None, "the one-launch kernel reads no tree block"
    rows = meta.query_row.tolist()
    assert len(set(rows)) == len(rows), f"rows repeat: {rows}"
    writes = meta.write_slots.tolist()
    for j in range(len(rows)):
        reads = _read_slots(meta, j)
        assert writes[j] == _slot(meta, rows[j], int(meta.kv_len[j]) - 1), \
            "a token's own slot must be the last position it attends"
        others = {w for i, w in enumerate(writes) if i != j}
        assert not reads & others, f"token {j} reads a slot another token writes"


def _check_tree_block_writes(meta) -> None:
    """The verify promise: rows of E consecutive tokens from a multiple of E, one row and one
    kv_len each, and token j of them writes position kv_len + j of its row."""
    nodes = meta.extra_mask.shape[1]
    rows, kv_len, writes = meta.query_row.tolist(), meta.kv_len.tolist(), meta.write_slots.tolist()
    assert len(rows) % nodes == 0, f"{len(rows)} tokens are not rows of {nodes}"
    for t in range(len(rows)):
        base = t - t % nodes
        assert (rows[t], kv_len[t]) == (rows[base], kv_len[base]), f"token {t} leaves its row's block"
        want = _slot(meta, rows[t], kv_len[t] + t % nodes)
        assert writes[t] == want, f"token {t} writes slot {writes[t]}, not position kv_len + {t % nodes}"


def _check_mtp_step(meta) -> bool:
    """An MTP draft step (no promise): one token per row, whose own slot is the last node of its
    tree block (position kv_len + E - 1), not kv_len - 1. True where the block skips an ancestor
    (a layout a bare kv_len cannot express)."""
    extra = meta.extra_mask
    rows, kv_len, writes = meta.query_row.tolist(), meta.kv_len.tolist(), meta.write_slots.tolist()
    nodes = extra.shape[1]
    assert len(set(rows)) == len(rows), f"rows repeat: {rows}"
    for t in range(len(rows)):
        assert bool(extra[t, nodes - 1]), f"token {t} does not attend its own slot"
        assert writes[t] == _slot(meta, rows[t], kv_len[t] + nodes - 1), \
            f"token {t} does not write the last node of its tree block"
    return not bool(extra.all())


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("method", "topk"), [
    ("none", 1), ("eagle", 1), ("eagle", 3), ("eagle3", 1), ("eagle3", 3), ("mtp", 1), ("mtp", 3),
    ("standalone", 2),
])
def test_calls_that_promise_one_query_per_row_keep_it(engine_root, tmp_path, monkeypatch, page_size,
                                                      method, topk):
    bundle = arch_bundle(engine_root, "llama")
    if method == "mtp":
        # three layers, so that step 1 (layer 2) skips step 0's position (layer 1 wrote it): the
        # shared two-layer draft runs one layer in every step and its tree blocks have no gap
        bundle = attrs.evolve(bundle, drafts={**bundle.drafts,
                                              "mtp": write_mtp_draft(tmp_path / "mtp3", bundle.target, num_layers=3)})
    seen = {(path, kind): [] for path in ("fused", "modules") for kind in ("promised", "tree", "other")}
    mtp_steps, mtp_gaps = [], []

    def record(path, meta, tokens):
        if meta.one_query_per_row:
            _check_one_query_per_row(meta)
            kind = "promised"
        elif meta.tree_block_writes:
            _check_tree_block_writes(meta)
            kind = "tree"
        else:
            kind = "other"
            if path == "modules" and meta.extra_mask is not None:  # an MTP draft step
                mtp_gaps.append(_check_mtp_step(meta))
                mtp_steps.append(tokens)
        seen[path, kind].append(tokens)

    real_fused = fused_decoder.rope_paged_attention
    real_modules = attention_backend.paged_attention

    def fused(qkv, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache, meta, scale, rope_rows=None):
        record("fused", meta, qkv.shape[0])
        return real_fused(qkv, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache, meta, scale,
                          rope_rows)

    def modules(q, k_cache, v_cache, meta, scale):
        record("modules", meta, q.shape[0])
        return real_modules(q, k_cache, v_cache, meta, scale)

    monkeypatch.setattr(fused_decoder, "rope_paged_attention", fused)
    monkeypatch.setattr(attention_backend, "paged_attention", modules)
    engine = engine_for(bundle, method, topk=topk, num_steps=3,
                        num_draft_tokens=6 if topk > 1 else None, page_size=page_size, max_batch_size=4)
    prompts = make_prompts([5, 11, 3], seed=4)
    outs = engine.generate(prompts, greedy(20))
    assert [len(o.token_ids) for o in outs] == [20, 20, 20]
    assert_all_free(engine)

    assert seen["fused", "other"], "prefill must not promise one query per row"
    if method != "none":
        assert seen["fused", "tree"], "verify never took the one-launch tree path"
    if method in ("none", "eagle3", "standalone"):  # fused layers: decode / draft steps take it
        assert seen["fused", "promised"], "decode / draft steps never took the one-launch path"
        assert not any(seen["modules", kind] for kind in ("promised", "tree", "other"))
        return
    # EAGLE-1 / MTP: the target's verify and prefill are the only fused calls (no decode phase)
    assert not seen["fused", "promised"], "only the draft steps of a transformers-layer head promise it"
    assert seen["modules", "other"], "draft-extend must not promise one query per row"
    assert not seen["modules", "tree"]
    if method == "eagle":  # the draft phase's promise reaches attention unchanged, and holds
        assert seen["modules", "promised"], "EAGLE-1's draft steps lost the promise"
        assert not mtp_steps
    else:  # MTP: every draft step comes as a tree block, some of them with a gap
        assert not seen["modules", "promised"], "an MTP draft step's tree block is not one query per row"
        assert mtp_steps and any(mtp_gaps), "MTP draft steps never attended a tree block with a gap"
