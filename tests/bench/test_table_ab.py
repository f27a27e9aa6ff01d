"""bench/table_ab.py on the CPU: the table it builds from a bench_linear sweep puts the tuned
exact-shape rules between the shipped rules of fewer rows and the rest, so that a lookup finds
the shipped rule below the smallest swept M, the tuned rule for a swept shape, and the shipped
rule for any other shape."""

import torch

from phasegraph.kernels import linear as lin
from tests.bench.scripts import load_bench_script


def _script():
    return load_bench_script("table_ab")  # it imports profile_pair_host beside it


def test_tuned_rules_sit_between_the_shipped_ones(monkeypatch):
    script = _script()
    tf32 = lin.SkinnyConfig(32, 64, 4, 3, True, precision="tf32x3")
    gemv4 = lin.SkinnyConfig(4, 512, 4, 3, False)
    tuned_rows = [  # as bench_linear.py writes them: _asdict() with the config as a list
        {"m_max": 4, "n_range": [8192, 8192], "k_range": [768, 768], "config": list(gemv4),
         "plain": True, "fused": False},
        {"m_max": 16, "n_range": [8192, 8192], "k_range": [768, 768], "config": list(tf32),
         "plain": True, "fused": True},
        {"m_max": 16, "n_range": list(lin._ANY), "k_range": [1, 4096], "config": list(gemv4),
         "plain": False, "fused": False},  # a general rule of the sweep's table: left out
    ]
    shipped = script.PREVIOUS_FP32_CONFIGS
    table = script.merged_table(shipped, tuned_rows, [4, 16])
    assert len(table) == len(shipped) + 2
    monkeypatch.setattr(lin, "FP32_CONFIGS", table)

    def lookup(m, n, k):
        return lin._lookup(m, n, k, torch.float32)

    assert lookup(1, 8192, 768) == shipped[0]  # fewer rows than swept: shipped
    assert lookup(3, 8192, 768).config == gemv4  # the swept shape: tuned, by M bucket
    rule = lookup(9, 8192, 768)
    assert rule.config == tf32 and rule.config.precision == "tf32x3" and rule.fused
    assert lookup(9, 1280, 768) == shipped[2]  # another shape: shipped


def test_the_previous_float32_table_is_the_one_19f556f_shipped():
    """IEEE multiply-sums at 1 and 5..16 rows, cuBLAS at 2..4: what the A/B compares against."""
    table = _script().PREVIOUS_FP32_CONFIGS
    assert [r.m_max for r in table] == [1, 4, 16]
    assert [r.plain for r in table] == [True, False, True]
    assert all(not r.config.dot and r.config.precision == "ieee" for r in table)
    assert lin.FP32_CONFIGS != table  # the shipped table moved on
    assert lin._lookup(9, 5120, 768, torch.float32).config.precision == "tf32x3"


def _bench_linear():
    return load_bench_script("bench_linear")


def test_a_fused_rule_must_beat_the_two_kernel_sequence_the_dispatcher_would_run():
    """bench_linear's tuned table turns a fused prologue on only where it beats the norm / silu
    kernel followed by the *faster* of cuBLAS and the swept Triton product (2026-11-24: a fused
    qkv+norm at 16 rows, 11.7 us, beat norm + cuBLAS, 14.7 us, but not norm + Triton, ~8.6)."""
    bl = _bench_linear()
    cfg = lin.SkinnyConfig(32, 64, 4, 3, True, precision="tf32x3")  # split-K forms never fuse

    def result(fused_us, cublas_seq_us, triton_seq_us):
        return {
            "sweep": [{"shape": "qkv", "n": 1280, "k": 768, "m": 16, "cublas_us": 12.9,
                       "best": {"config": cfg._asdict(), "us": 6.0}}],
            "fused": [{"shape": "qkv", "m": 16, "two_kernels_cublas_us": cublas_seq_us,
                       "two_kernels_triton_us": triton_seq_us,
                       "fused": [{"config": cfg._asdict(), "us": fused_us}],
                       "best": {"config": cfg._asdict(), "us": fused_us}}],
        }

    def rule(res):
        return next(r for r in bl.tuned_table(res) if r.n_range == (1280, 1280))

    assert rule(result(11.7, 14.7, 8.6)).fused is False
    assert rule(result(7.9, 14.7, 8.6)).fused is True
    assert rule(result(11.7, 14.7, None)).fused is True  # no Triton sequence measured: cuBLAS's
