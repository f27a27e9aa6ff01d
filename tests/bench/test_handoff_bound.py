"""bench/handoff_bound.py on the CPU: the η bound's arithmetic against the recorded bench run it
is quoted for (bench/RESULTS.md §5), and the checksum its GPU handoff chain is checked with."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN39 = ROOT / "bench" / "results" / "bench-h100-2026-11-26-run39" / "bench.json"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("handoff_bound", ROOT / "bench" / "handoff_bound.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run39():
    return json.loads(RUN39.read_text())


def test_free_handoffs_leave_the_bench_weight_bytes_bound(script, run39):
    """With handoffs free the bound is the bytes ratio the bench itself reports (0.76)."""
    tree = next(r for r in run39["trained_pair"]["rows"]
                if r["batch"] == 1 and r["config"].startswith("EAGLE-3 tree"))
    bound = script.bound_from_bench(run39, handoff_us=0.85)
    assert bound["bounds"]["zero"]["eta_bound"] == pytest.approx(tree["weight_bytes"]["eta_bound"])
    assert bound["bounds"]["zero"]["decode_step_us"] == pytest.approx(
        383855616 / run39["scale"]["copy_bandwidth_Bps"] * 1e6)


def test_bound_falls_with_the_handoff_cost_and_crosses_the_goal_at_break_even(script, run39):
    bound = script.bound_from_bench(run39, handoff_us=0.85)
    counts = bound["handoffs"]
    assert counts["tree iteration"] > counts["decode step"]  # the draft's forwards add handoffs
    args = (bound["step_bytes"], bound["iteration_bytes"], bound["copy_bandwidth_Bps"])
    etas = [script.eta_bound(*args, c, counts)["eta_bound"] for c in (0.0, 0.2, 0.85, 2.5)]
    assert etas == sorted(etas, reverse=True)
    break_even = bound["break_even_handoff_us"]
    assert 0.0 < break_even < 0.85
    assert script.eta_bound(*args, break_even, counts)["eta_bound"] == pytest.approx(0.75)
    assert bound["bounds"]["cheapest measured"]["eta_bound"] < 0.75


def test_handoffs_grow_by_a_layer_per_target_layer_and_a_forward_per_draft_pass(script):
    base = script.handoffs(12, 4)
    deeper, longer = script.handoffs(13, 4), script.handoffs(12, 5)
    assert deeper["decode step"] - base["decode step"] == 4
    assert deeper["tree iteration"] - base["tree iteration"] == 4
    assert longer["decode step"] == base["decode step"]
    assert longer["tree iteration"] - base["tree iteration"] == 5


@pytest.mark.parametrize(("stages", "programs"), [(1, 1), (4, 3), (16, 132)])
def test_expected_checksum_is_what_each_program_reads(script, stages, programs):
    """Replays the kernel's reads in Python: program p reads stage s's value of p + 1."""
    for pid, got in enumerate(script.expected_checksum(stages, programs).tolist()):
        neighbour = (pid + 1) % programs
        assert got == sum(stage * programs + neighbour for stage in range(stages))
