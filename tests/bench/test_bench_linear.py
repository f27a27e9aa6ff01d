"""bench_linear.py on the CPU: the tuned table it writes from a sweep."""

from phasegraph.kernels import linear as lin
from tests.bench.scripts import load_bench_script


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
