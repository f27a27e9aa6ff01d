"""bench/handoff_bound.py on the CPU: the ideal-execution arithmetic against the recorded bench run
it is quoted for (bench/RESULTS.md §5), the recomputation from a recorded measurement, and the
checksum its GPU handoff chain is checked with."""

import json
from pathlib import Path

import pytest

from tests.bench.scripts import load_bench_script

ROOT = Path(__file__).resolve().parents[2]
RUN39 = ROOT / "bench" / "results" / "bench-h100-2026-11-26-run39" / "bench.json"
MEASURED = ROOT / "bench" / "results" / "handoff-bound-h100-2026-11-26" / "round1" / "handoff_bound.json"
DRAM = "every weight from DRAM"


@pytest.fixture(scope="module")
def script():
    return load_bench_script("handoff_bound")


@pytest.fixture(scope="module")
def run39():
    return json.loads(RUN39.read_text())


def test_free_handoffs_leave_the_bench_weight_bytes_bound(script, run39):
    """With handoffs free the ideal η is the bytes ratio the bench itself reports (0.76)."""
    tree = script.batch1_tree_row(run39)
    assert tree["config"].startswith("EAGLE-3 tree") and tree["batch"] == 1
    models = script.bound_from_bench(run39, handoff_us=0.85)["models"]
    free = models[f"{DRAM}, handoffs free"]
    assert free["eta_bound"] == pytest.approx(tree["weight_bytes"]["eta_bound"])
    assert free["decode_step_us"] == pytest.approx(
        tree["weight_bytes"]["step"] / run39["scale"]["copy_bandwidth_Bps"] * 1e6)


def test_eta_falls_with_the_handoff_cost_and_crosses_the_goal_at_break_even(script, run39):
    bound = script.bound_from_bench(run39, handoff_us=0.85)
    counts = bound["handoffs"]
    assert counts["tree iteration"] > counts["decode step"]  # the draft's forwards add handoffs
    args = (bound["step_bytes"], bound["iteration_bytes"], bound["copy_bandwidth_Bps"])
    etas = [script.ideal_times_us(*args, c, counts)["eta_bound"] for c in (0.0, 0.2, 0.85, 2.5)]
    assert etas == sorted(etas, reverse=True)
    break_even = bound["break_even_handoff_us"]
    assert 0.0 < break_even < 0.85
    assert script.ideal_times_us(*args, break_even, counts)["eta_bound"] == pytest.approx(0.75)
    assert bound["models"][DRAM]["eta_bound"] < 0.75


def test_a_head_held_in_l2_reads_only_its_first_forward_from_dram(script, run39):
    models = script.bound_from_bench(run39, handoff_us=0.85)["models"]
    held = models["the head's weights held in L2 after its first forward"]
    saved_us = held["tree_iteration_us"] - models[DRAM]["tree_iteration_us"]
    tree = script.batch1_tree_row(run39)
    three_forwards = 3 * tree["weight_bytes"]["draft_pass"]
    assert -saved_us == pytest.approx(three_forwards / run39["scale"]["copy_bandwidth_Bps"] * 1e6)
    assert held["decode_step_us"] == models[DRAM]["decode_step_us"]


def test_handoffs_grow_by_four_per_target_layer_and_five_per_draft_forward(script):
    base = script.handoffs(12, 4)
    deeper, longer = script.handoffs(13, 4), script.handoffs(12, 5)
    assert deeper["decode step"] - base["decode step"] == 4
    assert deeper["tree iteration"] - base["tree iteration"] == 4
    assert longer["decode step"] == base["decode step"]
    assert longer["tree iteration"] - base["tree iteration"] == 5


def test_the_bound_is_recomputed_from_a_recorded_measurement(script, tmp_path):
    """``--measured`` runs without a GPU and takes the cheapest all-SM handoff it recorded."""
    assert script.main(["--out", str(tmp_path), "--bench-json", str(RUN39),
                        "--measured", str(MEASURED)]) == 0
    result = json.loads((tmp_path / "handoff_bound.json").read_text())
    recorded = json.loads(MEASURED.read_text())
    cheapest = min(row["us_per_handoff"] for row in recorded["handoff"] + recorded["boundary"]
                   if row["programs"] == recorded["sms"])
    assert result["bound"]["models"][DRAM]["handoff_us"] == cheapest
    assert "| every weight from DRAM |" in (tmp_path / "handoff_bound.md").read_text()


@pytest.mark.parametrize(("stages", "programs"), [(1, 1), (4, 3), (16, 132)])
def test_expected_checksum_is_what_each_program_reads(script, stages, programs):
    """Replays the kernel's reads in Python: program p reads stage s's value of p + 1."""
    for pid, got in enumerate(script.expected_checksum(stages, programs).tolist()):
        neighbour = (pid + 1) % programs
        assert got == sum(stage * programs + neighbour for stage in range(stages))


def test_a_missing_input_file_is_named(script, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--out", str(tmp_path), "--measured", str(tmp_path / "none.json")])
    assert exit_info.value.code == 2
    assert "none.json: no such file" in capsys.readouterr().err


@pytest.mark.parametrize(("stages", "words"), [(1, 5), (3, 1536), (256, 12288)])
def test_expected_vector_checksum_is_the_kernels_int32_sum(script, stages, words):
    """Replays a vector kernel's sums in int32, as the GPU wraps them: an accumulator per word
    over the stages (stage s carries s·W + w), then one sum over the words."""
    import numpy as np

    w = np.arange(words, dtype=np.int32)
    with np.errstate(over="ignore"):
        per_word = sum((np.int32(stage * words) + w for stage in range(stages)),
                       np.zeros(words, np.int32))
        assert script.expected_vector_checksum(stages, words) == int(per_word.sum(dtype=np.int32))


@pytest.mark.parametrize("words", [1536, 12288, 5])
def test_every_vector_word_has_exactly_one_writer(script, words):
    shape = script._vector_shape(words, 132)
    assert shape["WP"] >= words and shape["WP"] & (shape["WP"] - 1) == 0
    assert shape["VP"] >= shape["V"] and shape["VP"] & (shape["VP"] - 1) == 0
    written = [pid * shape["V"] + lane for pid in range(132) for lane in range(shape["VP"])
               if lane < shape["V"] and pid * shape["V"] + lane < words]
    assert sorted(written) == list(range(words))


@pytest.mark.parametrize("pack", [1, 8, 64])
def test_the_spin_asm_names_each_operand_its_constraints_declare(script, pack):
    import re

    asm, constraints = script._spin_asm(pack), script._spin_constraints(pack).split(",")
    assert len(constraints) == 3 * pack and constraints[:pack] == ["=r"] * pack
    used = sorted({int(n) for n in re.findall(r"\$(\d+)", asm)})
    assert used == list(range(3 * pack))
    assert asm.count("ld.relaxed.gpu.global.b64") == pack
    assert asm.count("setp.ne") == pack and asm.rstrip().endswith("@p bra LL_SPIN;\n}")


def test_a_recorded_vector_measurement_is_reported_row_by_row(script, tmp_path):
    recorded_path = ROOT / "bench" / "results" / "handoff-vector-h100-2026-11-26" / "round1" / "handoff_bound.json"
    assert script.main(["--out", str(tmp_path), "--measured", str(recorded_path)]) == 0
    text = (tmp_path / "handoff_bound.md").read_text()
    recorded = json.loads(recorded_path.read_text())
    assert len(recorded["vector"]) == 8
    for row in recorded["vector"]:
        assert f"| {row['handoff']} | {row['words']} |" in text
        assert f"{row['us_per_handoff']:.3f} |" in text


def test_handoffs_carrying_their_inputs_cost_what_was_measured_for_each_size(script, run39):
    """At one cost for every size the carrying model is the plain one; a dearer verify handoff
    adds its difference once per verify handoff (as many as a decode step has) to the iteration
    only."""
    words = script.carried_words(768)
    assert words == {"decode step": 768, "tree verify": 16 * 768, "head forward": 4 * 768 // 2}
    flat = {w: 0.9 for w in words.values()}
    dear = {**flat, words["tree verify"]: 1.7}
    plain = script.bound_from_bench(run39, handoff_us=0.9)["models"][DRAM]
    models = script.bound_from_bench(run39, handoff_us=0.9, carried_us=flat)["models"]
    same = models["every weight from DRAM, each handoff carrying its input"]
    assert same["decode_step_us"] == pytest.approx(plain["decode_step_us"])
    assert same["tree_iteration_us"] == pytest.approx(plain["tree_iteration_us"])
    counts = script.bound_from_bench(run39, handoff_us=0.9)["handoffs"]
    dearer = script.bound_from_bench(run39, handoff_us=0.9, carried_us=dear)["models"][
        "every weight from DRAM, each handoff carrying its input"]
    assert dearer["decode_step_us"] == pytest.approx(plain["decode_step_us"])
    assert dearer["tree_iteration_us"] - plain["tree_iteration_us"] == pytest.approx(
        counts["decode step"] * 0.8)
    # a size that was not measured leaves the carrying models out
    partial = {w: us for w, us in flat.items() if w != words["decode step"]}
    assert len(script.bound_from_bench(run39, 0.9, carried_us=partial)["models"]) == 3


STREAMED = "each carrying handoff streaming the next product's weights"


def test_stage_bytes_split_the_bench_bytes_into_one_product_per_handoff(script, run39):
    """Every product of the decode step and of a head forward is preceded by one handoff, and the
    products add up to the bytes the bench JSON reports."""
    weight_bytes = script.batch1_tree_row(run39)["weight_bytes"]
    stages = script.stage_bytes(weight_bytes, {"target": 4, "head": 2})
    counts = script.handoffs(12, weight_bytes["draft_passes"])
    assert len(stages["decode step"]) == counts["decode step"]
    per_forward = len(stages["head fc"]) + weight_bytes["draft_passes"] * len(stages["head forward"])
    assert counts["decode step"] + per_forward == counts["tree iteration"]
    assert sum(stages["decode step"]) == weight_bytes["step"]
    assert sum(stages["head forward"]) == weight_bytes["draft_pass"]
    assert stages["head fc"] == [weight_bytes["draft_once"]]
    # float32 target, vocabulary 8192 x 768 tied: lm_head is the table plus the norms' weights
    assert stages["decode step"][-1] - 8192 * 768 * 4 == 4 * 768 * (2 * 12 + 1)
    assert stages["decode step"][:4] == [768 * 1280 * 4, 768 * 768 * 4, 768 * 5120 * 4, 2560 * 768 * 4]
    with pytest.raises(ValueError, match="not the bench pair's"):
        script.stage_bytes({**weight_bytes, "step": weight_bytes["step"] // 2},
                           {"target": 4, "head": 2})


def test_streaming_weights_during_handoffs_costs_the_larger_of_the_two(script, run39):
    """Free handoffs leave the bytes-only bound; handoffs dearer than every product's bytes
    leave only the handoffs; in between each product costs max(bytes, handoff), never more than
    the serial (bytes after the wait) model."""
    words = script.carried_words(768)
    bandwidth = run39["scale"]["copy_bandwidth_Bps"]
    weight_bytes = script.batch1_tree_row(run39)["weight_bytes"]
    stages = script.stage_bytes(weight_bytes, {"target": 4, "head": 2})
    counts = script.handoffs(12, weight_bytes["draft_passes"])

    def streamed(cost, in_l2=False):
        return script.ideal_streamed_us(stages, weight_bytes["draft_passes"], bandwidth, words,
                                        {w: cost for w in words.values()}, in_l2)

    free = streamed(0.0)
    assert free["decode_step_us"] == pytest.approx(weight_bytes["step"] / bandwidth * 1e6)
    assert free["eta_bound"] == pytest.approx(weight_bytes["eta_bound"])
    slow = streamed(1e3)  # every product hidden under its handoff
    assert slow["decode_step_us"] == pytest.approx(counts["decode step"] * 1e3)
    assert slow["tree_iteration_us"] == pytest.approx(counts["tree iteration"] * 1e3)
    models = script.bound_from_bench(run39, 1.2, carried_us={w: 1.2 for w in words.values()})[
        "models"]
    for where in (DRAM, "the head in L2"):
        serial = models[f"{where}, each handoff carrying its input"]
        overlapped = models[f"{where}, {STREAMED}"]
        assert overlapped["decode_step_us"] < serial["decode_step_us"]
        assert overlapped["tree_iteration_us"] < serial["tree_iteration_us"]
        assert overlapped["decode_step_us"] > free["decode_step_us"]  # o's bytes hide under 1.2 µs
    held = streamed(1.2, in_l2=True)
    assert held == models[f"the head in L2, {STREAMED}"]
    # with the head in L2 its three later forwards are handoffs only: 5 each
    assert (streamed(1.2)["tree_iteration_us"] - held["tree_iteration_us"]) == pytest.approx(
        3 * (sum(max(b / bandwidth * 1e6, 1.2) for b in stages["head forward"]) - 5 * 1.2))
