"""bench/cluster_handoff.py on the CPU: its report of a recorded H100 run, the kernel's size
checks as the launcher states them, and a clear message where no GPU is present."""

import json
from pathlib import Path

import pytest

from tests.bench.scripts import load_bench_script

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "bench" / "results" / "cluster-handoff-h100-2026-11-26" / "run4" / "cluster_handoff.json"


@pytest.fixture(scope="module")
def script():
    return load_bench_script("cluster_handoff")


def test_the_recorded_run_is_reported_row_by_row(script):
    recorded = json.loads(RECORDED.read_text())
    text = script.report(recorded)
    assert len(recorded["rows"]) == len(script.VECTOR_WORDS) * len(script.VARIANTS)
    for row in recorded["rows"]:
        cluster = row["cluster"] or "none"
        pdl = "on" if row["pdl"] else "off"
        assert (f"| {row['words']} | {cluster} | {pdl} | {row['gather']} "
                f"| {row['max_active_clusters']} |" in text)
        assert f"| {row['us_per_handoff']:.3f} |" in text


def test_every_measured_size_splits_into_16_byte_pieces_over_every_cluster(script):
    """The launcher refuses a size the kernel cannot split; the sizes measured all pass."""
    assert "words % (4 * c) || programs % c" in script.CUDA_SOURCE
    for words in script.VECTOR_WORDS:
        for cluster in script.CLUSTERS:
            c = cluster or 1
            assert words % (4 * c) == 0 and script.PROGRAMS % c == 0
            assert words <= 4 * 16 * script.THREADS  # MAX_LOADS 16-byte loads per thread


def test_only_clusters_of_one_take_the_vector_in_without_the_cluster_barrier(script):
    """The launcher refuses the other gathers in a real cluster (a CTA would read peers' slices
    before they were stored); every measured variant respects that."""
    assert "(gather != SHARED_CLUSTER_SYNC && c != 1)" in script.CUDA_SOURCE
    assert script.GATHERS[0] == "shared, cluster sync"  # Gather's value 0
    for cluster, _, gather in script.VARIANTS:
        assert gather == script.GATHERS[0] or (cluster or 1) == 1


def test_without_a_gpu_it_says_what_it_needs(script, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    assert script.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
