"""phasegraph.kernels.commit_path on the CPU: the reference cuts each accepted path after its
first stop token and at its budget, and derives the request state from the cut; bad input fails
by name. The Triton kernel is compared in tests/gpu/test_triton_kernels.py (GPU or interpreter)."""

from __future__ import annotations

import pytest
import torch

from phasegraph.kernels.commit_path import commit_path, commit_path_reference

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


def test_no_stop_ids_at_all():
    p = _path([[0, 1, -1, -1], [8, -1, -1, -1]], [2, 1], [], [5, 5])
    assert p.lens.tolist() == [2, 1] and p.finished.tolist() == [False, False]


def test_public_name_is_the_reference_off_cuda():
    from tests.kernels.commit_path_cases import commit_path_case

    case = commit_path_case(torch.Generator().manual_seed(0), batch=6, width=5, nodes=9, stops=3, lead=0)
    for a, b in zip(commit_path(*case), commit_path_reference(*case), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("change", "match"), [
    ({"predict": T([[1]])}, "predict: expected 1-d"),
    ({"accept_lens": T([1, 1, 1])}, r"accept_lens: expected shape \(2,\)"),
    ({"stop_ids": T([[1]])}, "stop_ids: expected 2 rows, got 1"),
    ({"remaining": T([1.0, 2.0])}, "remaining: expected dtype torch.int64"),
    ({"lead": 2}, "lead: expected 0 or 1, got 2"),
])
def test_bad_input_fails_by_name(change, match):
    args = {"predict": torch.arange(8), "accept_index": T([[0, -1], [4, 5]]), "accept_lens": T([1, 2]),
            "stop_ids": T([[-1], [-1]]), "remaining": T([3, 3]), "seq_lens": T([1, 1]), "lead": 0}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        commit_path(**args)
