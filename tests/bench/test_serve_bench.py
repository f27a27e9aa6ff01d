"""`phasegraph bench --serve --quick` on the CPU: the real server under Poisson arrivals with
the embedded pair, speculation on and off; and the figures' arithmetic on made-up streams."""

from __future__ import annotations

import json

import pytest

from phasegraph.bench.serve import ITL_GOAL_RATIO, _percentile, _Stream, evaluate_goals, summarize
from phasegraph.cli import main

RATES = (3.0, 12.0)
REQUESTS = 3
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def serve_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_bench")
    code = main(["bench", "--serve", "--quick", "--out", str(out), "--serve-rates", ",".join(map(str, RATES)),
                 "--serve-requests", str(REQUESTS), "--new-tokens", str(NEW_TOKENS)])
    return out, code


def test_every_request_streams_every_token_in_both_modes(serve_run):
    out, code = serve_run
    assert code == 0
    r = json.loads((out / "serve_bench.json").read_text())
    assert r["quick"] is True and r["pair"] == "the embedded demo pair"
    assert set(r["modes"]) == {"speculative", "baseline"}
    for mode in r["modes"].values():
        assert [row["rate"] for row in mode["rows"]] == list(RATES)
        for row in mode["rows"]:
            # greedy, ignore_eos: exactly the budget arrives in every stream, none lost or doubled
            assert row["requests"] == REQUESTS and row["failed"] == 0
            assert row["tokens"] == REQUESTS * NEW_TOKENS
            assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
            assert 0 < row["itl_p50_s"] <= row["itl_p99_s"]
            assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["wall_s"])
        assert mode["bare_step_s"] > 0 and mode["served_step_s"] > 0
        assert mode["http_overhead"] == pytest.approx(mode["served_step_s"] / mode["bare_step_s"] - 1)
    goals = r["goals"]
    assert len(goals) == 3 and all(isinstance(g["met"], bool) for g in goals)
    spec, base = r["modes"]["speculative"]["rows"], r["modes"]["baseline"]["rows"]
    assert goals[0]["value"] == pytest.approx(spec[0]["itl_p50_s"] / base[0]["itl_p50_s"])
    assert goals[0]["met"] == (goals[0]["value"] <= ITL_GOAL_RATIO)


def test_markdown_and_plot(serve_run):
    out, _ = serve_run
    md = (out / "serve_bench.md").read_text()
    assert md.count("| speculative |") == len(RATES) + 1 and md.count("| baseline |") == len(RATES) + 1
    assert "asyncio + HTTP" in md and "p50 ITL with speculation" in md
    png = out / "serve_latency.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_chunk_gap_is_shared_between_its_tokens():
    a = _Stream(sent=0.0, chunks=[(0.1, 1), (0.13, 3), (0.14, 1)])
    b = _Stream(sent=0.0, error="HTTP 500")
    row = summarize(2.0, [a, b], wall=0.5)
    assert row["failed"] == 1 and row["tokens"] == 5 and row["tokens_per_s"] == pytest.approx(10.0)
    assert row["ttft_p50_s"] == pytest.approx(0.1)
    assert row["itl_p50_s"] == pytest.approx(0.01)  # 30 ms over 3 tokens, three times; then 10 ms
    assert row["chunk_gap_p99_s"] == pytest.approx(0.03 - 0.02 * 0.01, abs=1e-9)
    assert _percentile([3.0, 1.0, 2.0], 50) == 2.0 and _percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_goals_compare_the_modes():
    def mode(itl, tps, overhead):
        rows = [{"rate": r, "itl_p50_s": itl, "tokens_per_s": t} for r, t in zip((1, 8), tps, strict=True)]
        return {"rows": rows, "http_overhead": overhead}

    goals = evaluate_goals({"modes": {"speculative": mode(0.005, (100, 390), 0.02),
                                      "baseline": mode(0.01, (60, 400), 0.01)}})
    assert [g["met"] for g in goals] == [True, False, True]
    assert goals[1]["value"] == pytest.approx(390 / 400) and "8 req/s" in goals[1]["goal"]


@pytest.mark.parametrize(("bad", "message"), [
    (["--serve-rates", "0,2"], "--serve-rates"),
    (["--serve-rates", "fast"], "--serve-rates"),
    (["--serve-requests", "0"], "--serve-requests"),
])
def test_bad_options_fail_before_anything_runs(tmp_path, capsys, bad, message):
    assert main(["bench", "--serve", "--quick", "--out", str(tmp_path / "o"), *bad]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
