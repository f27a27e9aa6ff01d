"""bench/streamed_chain.py on the CPU: the chains it launches (one per product, in the bench
pair's dataflow order), the checksum every launch is checked against (replayed in numpy), and
the summary and report of a recorded result."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.bench.scripts import load_bench_script

ROOT = Path(__file__).resolve().parents[2]
RUN47 = ROOT / "bench" / "results" / "bench-h100-2026-11-26-run47" / "bench.json"
DTYPES = {"target": 4, "head": 2}


@pytest.fixture(scope="module")
def script():
    return load_bench_script("streamed_chain")


@pytest.fixture(scope="module")
def weight_bytes(script):
    return script.batch1_tree_row(json.loads(RUN47.read_text()))["weight_bytes"]


def test_one_launch_per_product_and_handoff(script, weight_bytes):
    chains = script.chains(weight_bytes, DTYPES)
    handoff = load_bench_script("handoff_bound").handoffs(12, weight_bytes["draft_passes"])
    assert len(chains["decode step"]) == handoff["decode step"]
    for name in ("tree iteration, one head weight set", "tree iteration, head from DRAM"):
        chain = chains[name]
        assert len(chain) == handoff["tree iteration"]
        assert sum(b for _, b, _ in chain) == weight_bytes["iteration"]
        # the verify reads the decode step's very weights, with the 16 rows' input
        assert [(s, b) for s, b, _ in chain[:49]] == [(s, b) for s, b, _ in chains["decode step"]]
        assert {w for _, _, w in chain[:49]} == {16 * 768}
        assert {w for _, _, w in chain[49:]} == {4 * 768 // 2}
    assert {w for _, _, w in chains["decode step"]} == {768}
    shared = {s for s, _, _ in chains["tree iteration, one head weight set"][49:]}
    apart = {s for s, _, _ in chains["tree iteration, head from DRAM"][49:]}
    assert len(shared) == 1 + 5 and len(apart) == 1 + 4 * 5  # fc, then the forwards' products
    # the verify and the draft alone, to split the iteration
    assert chains["the verify alone"] + chains["the draft alone, one head weight set"] == chains[
        "tree iteration, one head weight set"]


@pytest.mark.parametrize("in_words", [[768] * 5, [768, 12288, 1536, 1536], [3, 7, 5, 2, 9]])
def test_expected_checksum_is_what_every_launch_reads(script, in_words):
    """Replay the chain's mail in numpy: launch i writes stage·OUT + index for the next launch's
    OUT words, each program sums the whole input it reads (int32, wrapping)."""
    checksum = np.int32(0)
    previous = np.zeros(max(in_words), dtype=np.int32)
    for i, words in enumerate(in_words):
        checksum = np.int32(checksum + previous[:words].sum(dtype=np.int32))
        out = in_words[(i + 1) % len(in_words)]
        previous = (i * out + np.arange(out)).astype(np.int32)
    assert int(checksum) == script.expected_checksum(in_words)


def test_chunks_cover_each_product_in_aligned_slices(script):
    for nbytes, programs in ((3_932_160, 132), (77, 4), (25_165_824, 528), (64 * 132, 132)):
        chunk = script._chunk_words(nbytes, programs)
        assert chunk % 16 == 0  # every slice 64-byte aligned
        assert programs * chunk * 4 >= nbytes > programs * (chunk - 16) * 4


def _row(chain, warps, streamed, us):
    return {"chain": chain, "warps": warps, "streamed": streamed, "launches": 49, "bytes": 4e8,
            "us": us}


def test_the_summary_takes_each_chain_at_its_fastest_warps(script):
    dram = "tree iteration, head from DRAM"
    rows = [_row("decode step", "8", True, 150.0), _row("decode step", "16", True, 140.0),
            _row(dram, "8", True, 180.0), _row(dram, "verify 16, draft 8", True, 175.0),
            _row("decode step", "8", False, 210.0), _row(dram, "16", False, 300.0)]
    summary = script.summary(rows)
    assert summary["streamed"]["decode step"] == {"us": 140.0, "warps": "16", "eta": None}
    assert summary["streamed"][dram] == {"us": 175.0, "warps": "verify 16, draft 8",
                                         "eta": pytest.approx(140 / 175)}
    assert summary["serial"][dram]["eta"] == pytest.approx(0.7)
    text = script.report({"device": "GPU", "torch": "t", "triton": "3.6", "bench_commit": "c",
                          "rows": rows, "summary": summary})
    assert "| decode step | streamed | 16 | 49 | 400.0 | 140.0 |" in text
    assert f"| streamed | {dram} | verify 16, draft 8 | 175.0 | 0.800 |" in text
    assert "| streamed | decode step | 16 | 140.0 | – |" in text


def test_without_a_gpu_it_says_so(script, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(script, "triton", None)
    assert script.main(["--out", str(tmp_path)]) == 2
    assert "needs Triton and a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path), "--bench-json", str(tmp_path / "missing.json")])
    assert "missing.json: no such file" in capsys.readouterr().err
