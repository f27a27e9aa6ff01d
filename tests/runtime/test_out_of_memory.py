"""phasegraph.runtime.errors.is_out_of_memory: the one test of "memory ran out" that the engine's
KV allocation, the bench's warm-up and ``python -m phasegraph.train`` share."""

from __future__ import annotations

import pytest
import torch

from phasegraph.runtime.errors import is_out_of_memory


@pytest.mark.parametrize("exc", [
    MemoryError(),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB."),
    RuntimeError("CUDA error: out of memory"),  # a CUDA call's own, e.g. a graph's instantiation
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 103079215104 bytes."),
])
def test_memory_that_ran_out_is_recognised(exc):
    assert is_out_of_memory(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("boom"),
    RuntimeError("expected scalar type Float but found BFloat16"),
    ValueError("out of range"),
])
def test_other_errors_are_not_taken_for_running_out_of_memory(exc):
    assert not is_out_of_memory(exc)
