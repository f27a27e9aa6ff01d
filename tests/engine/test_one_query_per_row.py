"""``AttentionMetadata.one_query_per_row`` is a promise the one-launch rotary + attention kernel
(kernels/rope_attention.py) relies on: no two query tokens of a call share a page-table row and
no token reads a slot another token of the call writes (else a program could read a key before
the program that owns it writes it). The phases that make the promise (decode, draft steps) must
keep it on every call of real generations, with every page size and draft kind; the others
(prefill, draft-extend, verify) must not make it. ``tree_block_writes`` is verify's promise for
the one-launch tree kernel (each row's tree nodes are its consecutive tokens, node j writing
position kv_len + j), checked on the same generations."""

from __future__ import annotations

import pytest

from phasegraph.runtime.models import fused_decoder

from .support import arch_bundle, assert_all_free, engine_for, greedy, make_prompts


def _read_slots(meta, token: int) -> set[int]:
    """The slots token ``token`` attends (positions [0, kv_len) of its row; no tree block)."""
    row = int(meta.query_row[token])
    ps = meta.page_size
    return {int(meta.page_table[row, pos // ps]) * ps + pos % ps for pos in range(int(meta.kv_len[token]))}


def _check_tree_block_writes(meta) -> None:
    """The verify promise: rows of E consecutive tokens from a multiple of E, one row and one
    kv_len each, and token j of them writes position kv_len + j of its row."""
    nodes = meta.extra_mask.shape[1]
    rows, kv_len, writes = meta.query_row.tolist(), meta.kv_len.tolist(), meta.write_slots.tolist()
    assert len(rows) % nodes == 0, f"{len(rows)} tokens are not rows of {nodes}"
    ps = meta.page_size
    for t in range(len(rows)):
        base = t - t % nodes
        assert (rows[t], kv_len[t]) == (rows[base], kv_len[base]), f"token {t} leaves its row's block"
        pos = kv_len[t] + t % nodes
        want = int(meta.page_table[rows[t], pos // ps]) * ps + pos % ps
        assert writes[t] == want, f"token {t} writes slot {writes[t]}, not position kv_len + {t % nodes}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("method", "draft", "topk"), [
    ("none", None, 1), ("eagle3", None, 1), ("eagle3", None, 3), ("standalone", None, 2),
])
def test_calls_that_promise_one_query_per_row_keep_it(engine_root, monkeypatch, page_size, method, draft, topk):
    bundle = arch_bundle(engine_root, "llama")
    promised, tree, other = [], [], []
    real = fused_decoder.rope_paged_attention

    def checking(qkv, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache, meta, scale, rope_rows=None):
        if meta.one_query_per_row:
            rows = meta.query_row.tolist()
            assert len(set(rows)) == len(rows), f"rows repeat: {rows}"
            writes = meta.write_slots.tolist()
            for j in range(len(rows)):
                reads = _read_slots(meta, j)
                assert writes[j] in reads, "a token must attend its own slot"
                others = {w for i, w in enumerate(writes) if i != j}
                assert not reads & others, f"token {j} reads a slot another token writes"
            promised.append(len(rows))
        elif meta.tree_block_writes:
            _check_tree_block_writes(meta)
            tree.append(len(meta.query_row))
        else:
            other.append(qkv.shape[0])
        return real(qkv, num_heads, num_kv_heads, head_dim, cos, sin, k_cache, v_cache, meta, scale, rope_rows)

    monkeypatch.setattr(fused_decoder, "rope_paged_attention", checking)
    engine = engine_for(bundle, method, topk=topk, num_steps=3,
                        num_draft_tokens=6 if topk > 1 else None, page_size=page_size, max_batch_size=4)
    prompts = make_prompts([5, 11, 3], seed=4)
    outs = engine.generate(prompts, greedy(20))
    assert [len(o.token_ids) for o in outs] == [20, 20, 20]
    assert_all_free(engine)
    assert promised, "decode / draft steps never took the one-launch path"
    assert other, "prefill must not promise one query per row"
    if method != "none":
        assert tree, "verify never took the one-launch tree path"
