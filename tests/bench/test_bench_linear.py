"""bench_linear.py on the CPU: the tuned table it derives from a sweep, and how it merges that\ntable into a GPU's table file (``--write-table``)."""

import torch

from phasegraph.bench.common import load_bench_script
from phasegraph.kernels import linear as lin
from phasegraph.kernels import tile_tables


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


# ------------------------------------------------------------------------------------------
# Merging a run's rules into a table file (--write-table)

C = lin.SkinnyConfig
R = tile_tables.SkinnyRule


def _shipped(name: str) -> tile_tables.TileTables:
    return tile_tables.read_tables(tile_tables.shipped_file(name))


def _picks(rules, shapes, rows=range(1, lin.MAX_M + 1)):
    return {(m, n, k): tile_tables.match_skinny(rules, m, n, k)[3:] for n, k in shapes for m in rows}


def test_merging_the_h200_rules_into_the_h100_table_picks_what_the_h200_file_does():
    """The H200's own rules (its 8B tiles at one row and at 2..4 rows) merged into the H100's
    table give, row count by row count, the H200's picks: each rule takes its shape's rows up
    to its m_max that shared a rule with them, and nothing else moves."""
    h100, h200 = _shipped("NVIDIA_H100_80GB_HBM3.json").skinny_half, _shipped("NVIDIA_H200.json").skinny_half
    own = tuple(r for r in h200 if r not in h100)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (768, 768),
              (5120, 768), (40, 96), (4096, 1024)]
    merged = _bench_linear().merge_rules(h100, own)
    assert len(merged) == len(h200) and _picks(merged, shapes) == _picks(h200, shapes)
    assert _picks(merged, shapes) != _picks(h100, shapes)


def test_merge_replaces_in_place_skips_what_the_table_picks_and_appends_where_nothing_matches():
    bl = _bench_linear()
    table = (R(1, tile_tables.ANY, (1, 4096), C(1, 4096, 4, 1, False), True, True),
             R(4, (768, 768), (768, 768), C(2, 1024, 4, 3, False), True, False),
             R(16, tile_tables.ANY, (1, 4096), C(32, 256, 4, 4, True), True, False))
    again = R(4, (768, 768), (768, 768), C(4, 512, 4, 3, False), True, False)
    same = R(16, (1280, 1280), (768, 768), C(32, 256, 4, 4, True), True, False)
    long_k = R(4, (4096, 4096), (14336, 14336), C(8, 256, 4, 3, False), True, False)
    two_rows = R(2, (768, 768), (768, 768), C(8, 256, 4, 3, False), False, False)
    merged = bl.merge_rules(table, (again, same, long_k, two_rows))
    assert merged == (table[0], two_rows, again, table[2], long_k)
    for m, want in ((1, table[0]), (2, two_rows), (3, again), (4, again), (5, table[2])):
        assert tile_tables.match_skinny(merged, m, 768, 768) == want, m
    assert tile_tables.match_skinny(merged, 5, 4096, 14336) is None  # long K: cuBLAS, as before


SUMS4 = C(8, 256, 4, 3, False)


def _result(device="NVIDIA A100-SXM4-80GB", m=4, cfg=SUMS4, us=3.0):
    """A float32 sweep: o at ``m`` rows won by ``cfg``, down without a Triton config that ran."""
    return {"device": device, "fused": [],
            "sweep": [{"shape": "o", "n": 768, "k": 768, "m": m, "cublas_us": 4.0,
                       "best": {"config": cfg._asdict(), "us": us}},
                      {"shape": "down", "n": 768, "k": 2560, "m": m, "cublas_us": 4.0, "best": None}]}


def test_write_table_starts_a_new_gpu_from_generic_and_updates_it_in_place(tmp_path):
    bl = _bench_linear()
    path = tmp_path / "NVIDIA_A100_SXM4_80GB.json"
    command = "benchmarks/bench_linear.py --dtype float32 --shape-set pair --ms 4"
    generic = _shipped(tile_tables.GENERIC)
    bl.write_table(_result(), str(path), command, torch.float32)
    first = tile_tables.read_tables(path)
    rule = R(4, (768, 768), (768, 768), SUMS4, True, False)
    assert first.skinny_float32 == bl.merge_rules(generic.skinny_float32, (rule,)) != generic.skinny_float32
    assert (first.skinny_half, first.tiled_float32) == (generic.skinny_half, generic.tiled_float32)
    assert first.sources["skinny_float32"].endswith(f"{command} on an NVIDIA A100-SXM4-80GB")
    assert first.sources["skinny_half"] == generic.sources["skinny_half"]
    # a second run: the same rule retuned where it stands, a 16-row rule added, the note once
    faster = C(4, 512, 4, 3, False)
    bl.write_table(_result(cfg=faster), str(path), command, torch.float32)
    bl.write_table(_result(m=16, cfg=C(16, 64, 4, 3, False), us=9.0), str(path), command, torch.float32)
    second = tile_tables.read_tables(path)
    assert tile_tables.match_skinny(second.skinny_float32, 3, 768, 768).config == faster
    assert tile_tables.match_skinny(second.skinny_float32, 9, 768, 768).config == C(16, 64, 4, 3, False)
    at = first.skinny_float32.index(rule)  # before the general 4-row rule that took o
    assert second.skinny_float32[at] == rule._replace(config=faster)
    assert second.sources["skinny_float32"] == first.sources["skinny_float32"]
    assert path.read_text() == tile_tables.format_tables(second)


def test_a_split_k_rule_never_fuses_a_prologue():
    """A table's ``fused`` covers the norm prologue too, which takes no split-K: a split-K win
    with the silu prologue still runs the silu kernel, then the split product."""
    split = C(32, 64, 4, 3, True, precision="tf32x3", split_k=4)
    res = {"sweep": [{"shape": "down", "n": 768, "k": 2560, "m": 16, "cublas_us": 18.9,
                      "best": {"config": split._asdict(), "us": 8.1}}],
           "fused": [{"shape": "down", "m": 16, "two_kernels_cublas_us": 20.0,
                      "two_kernels_triton_us": 10.0, "fused": [{"config": split._asdict(), "us": 8.5}],
                      "best": {"config": split._asdict(), "us": 8.5}}]}
    (rule,) = _bench_linear().tuned_rules(res)
    assert rule.config == split and rule.plain and not rule.fused
