"""bench/ncu_sass_summary.py on the CPU: totals, stall reasons and the ranking of SASS lines from
an Nsight Compute source-page export shaped like the one bench/ncu_gluon_chain.sh writes."""

import csv

import pytest

from tests.bench.scripts import load_bench_script

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "L1 Wavefronts Shared Excessive", "L1 Wavefronts Shared", "stall_long_sb",
          "stall_long_sb (Not Issued)", "stall_barrier", "stall_barrier (Not Issued)"]
LINES = [  # a spin-wait, a conflicting store, a clean ldmatrix, a line ncu left blank
    ["0x10", "ISETP.GE.AND P4, PT, R6, 0x50, PT", "1,529", "213,234", "0", "0", "1500", "1490", "29", "0"],
    ["0x20", "STS [R53+UR4+0x1e000], R36", "53", "6,400", "96,000", "102,400", "3", "3", "50", "50"],
    ["0x30", "LDSM.16.M88.4 R20, [R90+UR4+0x18000]", "32", "6,400", "0", "25,600", "0", "0", "32", "32"],
    ["0x40", "NOP", "", "", "", "", "", "", "", ""],
]


@pytest.fixture(scope="module")
def summarise():
    return load_bench_script("ncu_sass_summary").summarise


@pytest.fixture
def export(tmp_path):
    path = tmp_path / "sass.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "_gluon_chain_ksplit_kernel"])
        writer.writerow(HEADER)
        writer.writerows(LINES)
    return path


def test_totals_count_every_line_and_read_thousands_separators(summarise, export):
    first = summarise(str(export)).splitlines()[0]
    assert first == "warp stall samples 1614, shared wavefronts 128000 (excessive 96000)"


def test_stall_reasons_leave_out_the_not_issued_copies_and_come_largest_first(summarise, export):
    reasons = summarise(str(export)).splitlines()[1]
    assert reasons == "stall reasons: long_sb 1503, barrier 111"


def test_lines_rank_by_samples_then_by_shared_wavefronts(summarise, export):
    text = summarise(str(export)).splitlines()
    by_samples = text[text.index("by samples: samples, shared wavefronts (excessive), warp "
                                 "executions, top stall, SASS") + 1:text.index("by shared wavefronts:") - 1]
    sources = ["ISETP.GE.AND P4, PT, R6, 0x50, PT", "STS [R53+UR4+0x1e000], R36",
               "LDSM.16.M88.4 R20, [R90+UR4+0x18000]", "NOP"]
    for line, source, stall in zip(by_samples, sources, ["long_sb", "barrier", "barrier", None],
                                   strict=True):
        assert line.endswith(source)
        if stall:
            assert f" {stall} " in line
    by_wavefronts = text[text.index("by shared wavefronts:") + 1:]
    assert by_wavefronts[0].replace(" ", "").startswith("102400(96000)6400STS")
    assert by_wavefronts[1].replace(" ", "").startswith("25600(0)6400LDSM")
