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
