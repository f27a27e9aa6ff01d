"""phasegraph.kernels.commit_path on the CPU: the reference cuts each accepted path after its
first stop token and at its budget, and derives the request state from the cut; bad input fails
by name. The Triton kernel is compared in tests/gpu/test_triton_kernels.py (GPU or interpreter)."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels.commit_path import (
    DRAFT_NONFINITE,
    NONFINITE_LOGITS,
    commit_path,
    commit_path_reference,
)

T = torch.tensor


def _path(accept_index, accept_lens, stop_ids, remaining, lead=0):
    predict = torch.arange(100, 100 + 4 * 8)  # node n emits token 100 + n
    stops = torch.as_tensor(stop_ids, dtype=torch.int64).view(2, -1)
    return commit_path(predict, T(accept_index), T(accept_lens), stops, T(remaining), T([10, 20]), lead)


def test_cuts_after_the_first_stop_token_and_at_the_budget():
    p = _path([[0, 2, 5, -1], [8, 9, 11, 12]], [3, 4], [[102, -1], [111, 112]], [9, 9])
    assert p.lens.tolist() == [2, 3]  # row 0 stops at its 2nd token (102), row 1 at its 3rd (111)
    assert p.finished.tolist() == [True, True]
    assert p.accept_index.tolist() == [[0, 2, -1, -1], [8, 9, 11, -1]]
    assert p.emitted.tolist() == [[100, 102, -1, -1], [108, 109, 111, -1]]
    assert p.bonus_tokens.tolist() == [102, 111]
    assert p.seq_lens.tolist() == [12, 23] and p.remaining.tolist() == [7, 6]
    assert p.select_index.tolist() == [1, 6]  # b * W + lens - 1

    budget = _path([[0, 2, 5, -1], [8, 9, 11, 12]], [3, 4], [[-1, -1], [-1, -1]], [2, 0], lead=1)
    assert budget.lens.tolist() == [2, 1]  # a spent budget still commits one token (overlap)
    assert budget.finished.tolist() == [True, True] and budget.remaining.tolist() == [0, 0]
    assert budget.select_index.tolist() == [2, 6]  # b * (W + 1) + lens - 1 + 1

    free = _path([[0, 2, 5, -1], [8, -1, -1, -1]], [3, 1], [[-1, -1], [-1, -1]], [9, 9])
    assert free.lens.tolist() == [3, 1] and free.finished.tolist() == [False, False]


def test_non_finite_nodes_cut_the_emitted_tokens_at_the_first_accepted_one():
    predict = torch.arange(100, 100 + 2 * 8)
    index, lens = T([[0, 2, 5, -1], [8, 9, 11, 12]]), T([3, 4])
    finite = torch.ones(16, dtype=torch.bool)
    finite[[5, 7]] = False  # row 0: its third accepted node; node 7 is off every path
    finite[[8]] = False  # row 1: its root
    no_stops = T([[-1], [-1]])
    p = commit_path(predict, index, lens, no_stops, T([9, 9]), T([10, 20]), 0, node_finite=finite)
    assert p.emitted.tolist() == [[100, 102, -2, -1], [-2, -1, -1, -1]]
    # the rest of the path's state is cut as without the flags (the host drops the request)
    clean = commit_path(predict, index, lens, no_stops, T([9, 9]), T([10, 20]), 0)
    assert p.lens.tolist() == clean.lens.tolist() and p.seq_lens.tolist() == clean.seq_lens.tolist()
    # a stop token before the bad node ends the path first: nothing is flagged
    stopped = commit_path(predict, index, lens, T([[102], [-1]]), T([9, 9]), T([10, 20]), 0,
                          node_finite=finite)
    assert stopped.emitted.tolist()[0] == [100, 102, -1, -1]
    assert NONFINITE_LOGITS == -2


def test_a_draft_that_was_not_finite_marks_the_padding_of_its_row_only():
    predict = torch.arange(100, 100 + 3 * 8)
    index, lens = T([[0, -1, -1, -1], [8, 9, 11, 12], [16, 17, -1, -1]]), T([1, 4, 2])
    no_stops, budget, seq = T([[-1]] * 3), T([9, 9, 9]), T([10, 20, 30])
    draft_finite = T([False, False, True])
    p = commit_path(predict, index, lens, no_stops, budget, seq, 0, draft_finite=draft_finite)
    # row 0: every slot past its one token; row 1: its full path is cut by one to make room
    assert p.emitted.tolist() == [[100, -3, -3, -3], [108, 109, 111, -3], [116, 117, -1, -1]]
    clean = commit_path(predict, index, lens, no_stops, budget, seq, 0)
    for name in ("lens", "finished", "accept_index", "bonus_tokens", "select_index", "seq_lens", "remaining"):
        assert torch.equal(getattr(p, name)[[0, 2]], getattr(clean, name)[[0, 2]]), name
    # the cut row is what a budget of three tokens would have left it
    cut = commit_path(predict, index, lens, no_stops, T([9, 3, 9]), seq, 0)
    assert p.lens.tolist()[1] == 3 and p.finished.tolist()[1] is False
    for name in ("accept_index", "bonus_tokens", "select_index", "seq_lens"):
        assert torch.equal(getattr(p, name)[1], getattr(cut, name)[1]), name
    assert p.remaining.tolist()[1] == 6
    # a cut at non-finite target logits keeps its NONFINITE_LOGITS; the padding after it is marked
    finite = torch.ones(24, dtype=torch.bool)
    finite[9] = False
    both = commit_path(predict, index, lens, no_stops, budget, seq, 0, node_finite=finite,
                       draft_finite=draft_finite)
    assert both.emitted.tolist()[1] == [108, NONFINITE_LOGITS, -3, -3]
    assert DRAFT_NONFINITE == -3


def test_no_stop_ids_at_all():
    p = _path([[0, 1, -1, -1], [8, -1, -1, -1]], [2, 1], [], [5, 5])
    assert p.lens.tolist() == [2, 1] and p.finished.tolist() == [False, False]


def test_cpu_tensors_go_to_the_reference_and_cuda_ones_would_go_to_triton(monkeypatch):
    """The dispatch itself: the public name calls the reference for CPU tensors (the Triton
    kernel is compared with the reference on the GPU, tests/gpu)."""
    import phasegraph.kernels.commit_path as module
    from tests.kernels.commit_path_cases import commit_path_case

    calls = []

    def spy(name, fn):
        def run(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(module, "commit_path_reference", spy("reference", commit_path_reference))
    monkeypatch.setattr(module, "commit_path_triton", spy("triton", module.commit_path_triton))
    case = commit_path_case(torch.Generator().manual_seed(0), batch=6, width=5, nodes=9, stops=3, lead=0)
    commit_path(*case)
    assert calls == ["reference"]
    monkeypatch.setattr(module, "use_triton", lambda x: True)  # what a CUDA tensor gets
    with pytest.raises(Exception):  # noqa: B017, PT011 - Triton cannot launch on CPU tensors here
        commit_path(*case)
    assert calls == ["reference", "triton"]


@pytest.mark.parametrize(("change", "match"), [
    ({"predict": T([[1]])}, "predict: expected 1-d"),
    ({"accept_lens": T([1, 1, 1])}, r"accept_lens: expected shape \(2,\)"),
    ({"stop_ids": T([[1]])}, "stop_ids: expected 2 rows, got 1"),
    ({"remaining": T([1.0, 2.0])}, "remaining: expected dtype torch.int64"),
    ({"lead": 2}, "lead: expected 0 or 1, got 2"),
    ({"node_finite": torch.ones(8)}, "node_finite: expected dtype torch.bool"),
    ({"node_finite": torch.ones(7, dtype=torch.bool)}, r"node_finite: expected shape \(8,\)"),
    ({"draft_finite": torch.ones(2)}, "draft_finite: expected dtype torch.bool"),
    ({"draft_finite": torch.ones(3, dtype=torch.bool)}, r"draft_finite: expected shape \(2,\)"),
])
def test_bad_input_fails_by_name(change, match):
    args = {"predict": torch.arange(8), "accept_index": T([[0, -1], [4, 5]]), "accept_lens": T([1, 2]),
            "stop_ids": T([[-1], [-1]]), "remaining": T([3, 3]), "seq_lens": T([1, 1]), "lead": 0}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        commit_path(**args)
