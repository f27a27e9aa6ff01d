"""GPU: every kernel gives the CPU reference's result on CUDA tensors, with no host sync.

Run on the device machine with ``pytest -m gpu tests/kernels``. Each CUDA call runs under
``torch.cuda.set_sync_debug_mode("error")``, so a host synchronisation inside a kernel fails.
Every test runs twice: with ``PHASEGRAPH_KERNELS=reference`` (the torch references on CUDA) and
with ``PHASEGRAPH_KERNELS=auto`` (the public names dispatch to the Triton kernels on CUDA). The
CPU side always runs the references.
"""

import contextlib
import os

import pytest
import torch

from phasegraph import kernels as K
from phasegraph.kernels._dispatch import ENV_VAR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(params=["reference", "auto"], autouse=True)
def cuda_kernel_mode(request, monkeypatch):
    """The PHASEGRAPH_KERNELS mode of the CUDA calls (``both`` switches it per side)."""
    monkeypatch.setenv(ENV_VAR, request.param)
    return request.param


@contextlib.contextmanager
def kernel_mode(mode):
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = old


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sync_guard_catches_a_host_sync():
    x = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError), no_sync():
        x.sum().item()


def cuda(x):
    if isinstance(x, torch.Tensor):
        return x.cuda()
    if isinstance(x, list | tuple):
        return type(x)(cuda(v) for v in x)
    return x


def both(fn, *args, **kwargs):
    """(CPU reference result, CUDA result in the test's kernel mode) of ``fn``."""
    mode = os.environ[ENV_VAR]
    with kernel_mode("reference"):
        cpu = fn(*args, **kwargs)
    gpu_args, gpu_kwargs = cuda(args), {name: cuda(v) for name, v in kwargs.items()}
    with kernel_mode(mode), no_sync():
        gpu = fn(*gpu_args, **gpu_kwargs)
    return cpu, gpu


def assert_same(cpu, gpu, exact=True):
    if isinstance(cpu, torch.Tensor):
        cpu, gpu = [cpu], [gpu]
    elif not isinstance(cpu, tuple | list):
        names = [a.name for a in type(cpu).__attrs_attrs__]
        cpu, gpu = [getattr(cpu, n) for n in names], [getattr(gpu, n) for n in names]
    for a, b in zip(cpu, gpu, strict=True):
        if a is None or b is None:  # an optional output (beam_hidden without hidden rows)
            assert a is None and b is None
            continue
        assert b.device.type == "cuda"
        if exact or not a.is_floating_point():
            assert torch.equal(a, b.cpu())
        else:
            assert torch.allclose(a, b.cpu(), atol=1e-6, rtol=1e-5)


def test_draft_tree_verify_pipeline_on_cuda():
    g = torch.Generator().manual_seed(0)
    batch, topk, num_steps, num_nodes, vocab = 64, 4, 4, 12, 50
    draft_p = torch.rand(vocab, vocab, generator=g).softmax(-1)
    q_p, q_i = draft_p.topk(topk, dim=-1)
    roots = torch.randint(0, vocab, (batch,), generator=g)

    cpu, gpu = both(K.first_step_candidates, q_p[roots], q_i[roots])
    assert_same(cpu, gpu)
    steps = [cpu]
    for step in range(1, num_steps):
        prev = steps[-1]
        cpu, gpu = both(
            K.expand_step,
            prev.beam_scores,
            prev.beam_cand,
            q_p[prev.beam_tokens],
            q_i[prev.beam_tokens],
            step,
            topk,
        )
        assert_same(cpu, gpu)
        steps.append(cpu)
    cand = K.concat_candidates(steps[0], steps[1:])
    nodes, gpu = both(K.select_tree_nodes, *cand, num_nodes)
    assert_same(nodes, gpu)
    node_tokens, node_parents, _ = nodes
    seq_lens = torch.randint(0, 100, (batch,), generator=g)
    tree, gpu_tree = both(K.build_tree, roots, node_tokens, node_parents, seq_lens)
    assert_same(tree, gpu_tree)

    lists = (tree.draft_tokens, tree.retrieve_next_token, tree.retrieve_next_sibling)
    logits = torch.randn(batch * num_nodes, vocab, generator=g) * 3
    # make the target agree with the draft often
    logits[torch.arange(batch * num_nodes), q_i[tree.draft_tokens, 0]] += 6
    greedy, gpu = both(K.verify_tree_greedy, *lists, logits.argmax(-1), num_steps)
    assert_same(greedy, gpu)
    assert float(greedy.accept_lens.float().mean()) > 1.5

    temperature = torch.rand(batch, generator=g) + 0.3
    temperature[:8] = 0.0
    top_k = torch.randint(0, 20, (batch,), generator=g)
    top_p = torch.rand(batch, generator=g) * 0.5 + 0.5
    probs, gpu = both(K.target_probs, logits, temperature, top_k, top_p, num_nodes)
    assert_same(probs, gpu, exact=False)
    coins = torch.rand(2, batch, num_steps + 1, generator=g)
    sampled, gpu = both(K.verify_tree_sampling, *lists, probs, coins[0], coins[1], num_steps)
    assert_same(sampled, gpu)

    for out in (greedy, sampled):
        emitted, gpu = both(K.gather_accepted_tokens, out.predict, out.accept_index)
        assert_same(emitted, gpu)
        bonus, gpu = both(K.fill_bonus_tokens, out.predict, out.accept_index, out.accept_lens)
        assert_same(bonus, gpu)
        hidden = torch.randn(batch * num_nodes, 3, 8, generator=g)
        compacted, gpu = both(K.compact_to_front, hidden, out.accept_index)
        assert_same(compacted, gpu)


def test_kv_and_slot_kernels_on_cuda():
    g = torch.Generator().manual_seed(1)
    batch, topk, num_steps, page_size = 8, 4, 5, 4
    width, num_nodes = num_steps + 1, 16
    region = K.draft_region_pages(page_size, num_steps)
    max_pages = 16
    pages = torch.randperm(batch * (max_pages + topk * region), generator=g) + 1
    page_table = torch.zeros(batch + 1, max_pages, dtype=torch.int64)
    page_table[1:] = pages[: batch * max_pages].view(batch, max_pages)
    region_pages = pages[batch * max_pages :].view(batch, topk, region)
    rows = torch.arange(1, batch + 1)
    seq_lens = torch.randint(0, 40, (batch,), generator=g)

    positions = seq_lens[:, None] + torch.arange(num_nodes)
    node_slots, gpu = both(K.row_slots, page_table, rows, positions, page_size)
    assert_same(node_slots, gpu)
    front_slots = K.row_slots(page_table, rows, positions[:, :width], page_size)
    layout, gpu = both(
        K.assign_draft_cache_locs, page_table, rows, seq_lens, region_pages, page_size, num_steps
    )
    assert_same(layout, gpu)
    beam_parent = torch.randint(0, topk, (batch, topk), generator=g)
    reorder, gpu = both(K.reorder_branches, region_pages, beam_parent, page_size)
    assert_same(reorder, gpu)
    moves = (reorder.src, reorder.dst)
    # the draft phase's forms: regions read from the pool's table, hidden rows carried per beam
    region_table = torch.zeros(batch + 1, topk, region, dtype=torch.int64)
    region_table[rows] = region_pages
    hidden = torch.randn(batch, 24, generator=g)
    carried, gpu = both(K.assign_draft_cache_locs, page_table, rows, seq_lens, region_table,
                        page_size, num_steps, region_table=True, hidden=hidden)
    assert_same(carried, gpu)
    assert torch.equal(carried.region_pages, region_pages)
    reordered, gpu = both(K.reorder_branches, region_pages, beam_parent, page_size,
                          hidden=carried.beam_hidden)
    assert_same(reordered, gpu)
    assert torch.equal(reordered.hidden.view(batch, topk, 24),
                       hidden[:, None].expand(batch, topk, 24))  # every beam of b had b's row

    accept_lens = torch.randint(1, width + 1, (batch,), generator=g)
    accept_index = torch.full((batch, width), -1)
    for b in range(batch):
        n = int(accept_lens[b])
        nodes = torch.cat(
            [
                torch.zeros(1, dtype=torch.int64),
                torch.randperm(num_nodes - 1, generator=g)[: n - 1].sort().values + 1,
            ]
        )
        accept_index[b, :n] = b * num_nodes + nodes
    (src, dst), gpu = both(
        K.accepted_kv_moves, accept_index, accept_lens, node_slots.view(-1), front_slots.view(-1)
    )
    assert_same((src, dst), gpu)

    num_slots = int(pages.max()) * page_size + page_size
    k_pool = torch.randn(num_slots, 2, 8, generator=g)
    v_pool = torch.randn(num_slots, 2, 8, generator=g)
    k_gpu, v_gpu = k_pool.cuda(), v_pool.cuda()
    for s, d in [(src, dst), moves, (layout.tail_src, layout.tail_dst)]:
        with kernel_mode("reference"):
            K.move_kv([k_pool, v_pool], s, d)
        s_gpu, d_gpu = s.cuda(), d.cuda()
        with no_sync():
            K.move_kv([k_gpu, v_gpu], s_gpu, d_gpu)
        assert torch.equal(k_gpu.cpu(), k_pool)
        assert torch.equal(v_gpu.cpu(), v_pool)

    fixed, gpu = both(K.extend_positions, seq_lens, width)
    assert_same(fixed, gpu)
    ragged, gpu = both(
        K.ragged_extend_positions, seq_lens, accept_lens, int(accept_lens.sum()) + 3
    )
    assert_same(ragged, gpu)


@pytest.mark.parametrize("rows", [1, 2, 16, 63, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_take_rows_and_embed_copy_the_rows_exactly(rows, dtype):
    """Both forms take_rows picks between (index_select, advanced indexing) give index_select's rows."""
    from phasegraph.runtime.models.take_rows import embed, take_rows

    g = torch.Generator().manual_seed(rows)
    table = torch.randn(1000, 48, generator=g).to(dtype)
    index = torch.randint(0, 1000, (rows,), generator=g)
    cpu, gpu = both(take_rows, table, index)
    assert_same(cpu, gpu)
    assert torch.equal(cpu, table.index_select(0, index))
    module = torch.nn.Embedding.from_pretrained(table.cuda())
    index = index.cuda()
    with no_sync():
        rows_of = embed(module, index)
    assert torch.equal(rows_of.cpu(), cpu)
