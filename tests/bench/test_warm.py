"""The kernel warm-up process of `phasegraph bench` (phasegraph/bench/warm.py): how part 1 waits
for it. Its pair and engines are tested beside the quick run (test_bench_quick.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from phasegraph.bench import warm


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_finished_warm_up_is_recorded_with_its_exit_status():
    started = time.perf_counter()
    record = warm.finish(_child("raise SystemExit(3)"), started, timeout_s=60)
    assert record["returncode"] == 3
    assert 0 <= record["waited_s"] <= record["wall_s"] < 60


def test_a_warm_up_past_its_time_is_killed_not_waited_for():
    """Part 1 waits at most WARM_WAIT_S for the warm-up after training; past that it kills the
    process (a kernel left uncompiled only costs part 1 its compile time)."""
    started = time.perf_counter()
    proc = _child("import time; time.sleep(60)")
    record = warm.finish(proc, started, timeout_s=0.5)
    assert proc.poll() is not None and record["returncode"] != 0
    assert record["waited_s"] < 10


def test_accept_lengths_cover_every_width_of_an_accepted_path():
    assert warm.accept_lengths({"method": "none"}) == [None]
    assert warm.accept_lengths({"method": "eagle3", "num_steps": 3, "topk": 1}) == [None, 2, 3, 4]
    assert warm.accept_lengths({"method": "eagle3", "num_steps": 4, "topk": 4, "num_draft_tokens": 16}) == [
        None, 2, 3, 4, 5]


def test_wait_for_memory_polls_until_enough_is_free_or_the_time_is_up():
    readings = iter([1 << 30, 3 << 30, 9 << 30])
    slept = []
    assert warm.wait_for_memory(8 << 30, timeout_s=60, free_bytes=lambda: next(readings),
                                sleep=slept.append, poll_s=2.0)
    assert slept == [2.0, 2.0]  # two polls short of 8 GiB, the third enough
    assert warm.wait_for_memory(8 << 30, timeout_s=0.0, free_bytes=lambda: 1 << 30,
                                sleep=slept.append) is False
    assert warm.wait_for_memory(8 << 30, timeout_s=0.0, free_bytes=lambda: None)  # no CUDA


def _fake_pair(tmp_path):
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "target" / "config.json").write_text('{"vocab_size": 32}')
    return {"target": tmp_path / "target", "eagle3": tmp_path / "eagle3", "draft": tmp_path / "draft"}


def test_a_configuration_out_of_memory_is_tried_again_when_memory_frees_up(monkeypatch, tmp_path):
    """Run 26: the training beside the warm-up held 76.8 of 79.2 GiB and the standalone
    configuration's engine ran out of memory, which ended the warm-up. Now that configuration
    waits for the memory (part 1 releases the training's cache when it ends) and runs again."""
    import torch

    tries = []

    def fake_config(spec, dirs, spec_kw, draft_key, params, vocab, g):
        tries.append(spec_kw["method"])
        if spec_kw["method"] == "standalone" and tries.count("standalone") == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
        return 2

    monkeypatch.setattr(warm, "_warm_config", fake_config)
    readings = iter([1 << 30, 12 << 30])
    lines = []
    calls = warm.run_configs({"seed": 0}, _fake_pair(tmp_path), log=lambda m, **k: lines.append(m),
                             free_bytes=lambda: next(readings), sleep=lambda s: None)
    assert tries == ["none", "eagle3", "eagle3", "standalone", "standalone"]
    assert calls == 4 * 2
    assert "standalone draft chain S=3: out of device memory" in lines[3]
    assert lines[4].endswith("(second try)")


def test_a_configuration_that_runs_out_twice_is_skipped_with_a_message(monkeypatch, tmp_path):
    import torch

    def fake_config(spec, dirs, spec_kw, draft_key, params, vocab, g):
        if spec_kw["method"] == "eagle3" and spec_kw["topk"] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return 1

    monkeypatch.setattr(warm, "_warm_config", fake_config)
    lines = []
    calls = warm.run_configs({"seed": 0}, _fake_pair(tmp_path), log=lambda m, **k: lines.append(m),
                             free_bytes=lambda: 80 << 30, sleep=lambda s: None)
    assert calls == 3  # baseline, chain, standalone
    assert lines[-1] == ("warm-up: EAGLE-3 tree K=4 S=4 N=16: skipped, out of device memory again "
                         "(part 1 compiles its kernels itself)")
    monkeypatch.setattr(warm, "RETRY_WAIT_S", 0.0)
    lines.clear()
    warm.run_configs({"seed": 0}, _fake_pair(tmp_path), log=lambda m, **k: lines.append(m),
                     free_bytes=lambda: 1 << 30, sleep=lambda s: None)
    assert lines[-1].startswith("warm-up: EAGLE-3 tree K=4 S=4 N=16: skipped, 8 GiB of device memory "
                                "were not free within 0 s")


def test_any_other_error_of_a_configuration_still_ends_the_warm_up(monkeypatch, tmp_path):
    import pytest

    def fake_config(spec, dirs, spec_kw, draft_key, params, vocab, g):
        raise RuntimeError("Triton compile failed")

    monkeypatch.setattr(warm, "_warm_config", fake_config)
    with pytest.raises(RuntimeError, match="Triton compile failed"):
        warm.run_configs({"seed": 0}, _fake_pair(tmp_path), log=lambda m, **k: None,
                         free_bytes=lambda: 80 << 30, sleep=lambda s: None)
