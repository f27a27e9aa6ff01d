"""The bench's profiler sessions leave CUPTI detached (TEARDOWN_CUPTI=1), so that rows timed after
another row's GPU-busy probe pay no profiler cost on every launch."""

import os

import torch

from phasegraph.bench.common import (
    CUPTI_TEARDOWN_VAR,
    detach_cupti_after_profiling,
    load_bench_scale,
)


def test_sets_teardown_when_the_environment_is_silent(monkeypatch):
    monkeypatch.delenv(CUPTI_TEARDOWN_VAR, raising=False)  # monkeypatch restores it afterwards
    detach_cupti_after_profiling()
    assert os.environ[CUPTI_TEARDOWN_VAR] == "1"


def test_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setenv(CUPTI_TEARDOWN_VAR, "0")
    detach_cupti_after_profiling()
    assert os.environ[CUPTI_TEARDOWN_VAR] == "0"


def test_the_gpu_busy_probe_sets_it_before_its_session(monkeypatch):
    """bench_scale.gpu_busy_seconds (part 1's and part 2's probe) opens its profiler session only
    once teardown is set."""
    monkeypatch.delenv(CUPTI_TEARDOWN_VAR, raising=False)
    seen = []

    class FakeProfile:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            seen.append(os.environ.get(CUPTI_TEARDOWN_VAR))
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return []

    monkeypatch.setattr("torch.profiler.profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    calls = []
    busy, activities = load_bench_scale().gpu_busy_seconds(lambda: calls.append(1), 3)
    assert seen == ["1"]
    assert len(calls) == 3
    assert (busy, activities) == (0.0, 0)
