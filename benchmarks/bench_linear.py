"""The skinny Triton product (phasegraph/kernels/linear.py) against cuBLAS at decode shapes.

    python benchmarks/bench_linear.py [--out DIR] [--quick] [--ms 1,4,16]
    python benchmarks/bench_linear.py --dtype float32 --shape-set pair --ms 4,16 --no-pdl
    python benchmarks/bench_linear.py --ms 1,4,16 --write-table   # into this GPU's table file

Shapes: the four weight products of a Llama-3-8B-shaped layer (bf16): qkv 6144x4096,
o 4096x4096, gate_up 28672x4096, down 4096x14336, at M = 1, 4, 16 token rows. ``--shape-set
8b-vocab``: the 8B target's lm_head over 128256 tokens. ``--shape-set
pair``: those of the bench-pair target (hidden 768, 4 kv heads, MLP 2560, vocabulary 8192) and
of its EAGLE-3 head (fc 768x2304, qkv 1280x1536), which run in float32 in `phasegraph bench`
part 1 (``--dtype float32``: the multiply-sum tiles, the three-pass TF32 ``tl.dot`` tiles and
their split-K forms against cuBLAS; the float32 rules of the tables come from these sweeps).

Timing: every op runs inside a captured CUDA graph, ``ROUNDS`` rounds over ``COPIES`` weight
copies (so L2, 50-60 MB, never serves the weights), and the replay time over the launches is
the time per op, graph launch gaps included (as a decode step replays them). Bandwidth: the
bytes the op must move (weight, activations read, outputs written) over that time, and its
share of the copy bandwidth measured at the start (a 2 GiB device-to-device copy, read + write
bytes over time).

Parts:
- ``sweep``: cuBLAS ``F.linear`` and the Triton kernel over a grid of launch configs
  (``--quick``: only the config linear.py's table picks); the best per shape and M;
- ``fused``: the fused prologue forms against the two-kernel sequences they replace
  (``add_rms_norm`` + product, ``silu_mul`` + product);
- ``layer``: the products and prologue kernels of one decoder layer (attention left out), the
  current sequence against the fused one.

The short table is printed last; ``--out`` writes everything as JSON (bench_linear.json).
``--write-table`` writes the rules the sweep implies (per shape and M the fastest config, where
it beats cuBLAS) into this GPU's file in ``phasegraph/kernels/configs/`` (a new file starts from
``generic.json``), for the run's dtype and shapes only; every other rule stays where it is.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from phasegraph.kernels import linear as lin  # noqa: E402
from phasegraph.kernels import tile_tables  # noqa: E402
from phasegraph.kernels.activation import silu_mul_triton  # noqa: E402
from phasegraph.kernels.rms_norm import add_rms_norm_triton  # noqa: E402

DEVICE = torch.device("cuda")
CONFIG_DIR = os.path.join(REPO, "phasegraph", "kernels", "configs")  # the checkout's table files
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# read at import so that the spawned compile workers use it too (main() sets it from --dtype)
DTYPE = DTYPES[os.environ.get("BENCH_LINEAR_DTYPE", "bfloat16")]
SHAPE_SETS = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "8b-vocab": {"lm_head": (128256, 4096)},  # the 8B target's lm_head (cuBLAS in the table)
    "pair": {"qkv": (1280, 768), "o": (768, 768), "gate_up": (5120, 768), "down": (768, 2560),
             "lm_head": (8192, 768), "head_fc": (768, 2304), "head_qkv": (1280, 1536)},
}
SHAPES = SHAPE_SETS["8b"]
COPIES = 8
ROUNDS = 6
EPS = 1e-5
C = lin.SkinnyConfig

GEMV_CONFIGS = [  # broadcast multiply-sum, M <= 4
    C(4, 1024, 4, 1, False), C(8, 512, 4, 1, False), C(8, 1024, 4, 1, False),
    C(8, 1024, 8, 1, False), C(16, 256, 4, 1, False), C(16, 512, 4, 1, False),
    C(16, 512, 8, 1, False), C(16, 1024, 8, 1, False), C(32, 256, 4, 1, False),
    C(32, 256, 8, 1, False), C(32, 512, 8, 1, False), C(8, 1024, 4, 3, False),
    C(16, 512, 4, 3, False), C(32, 256, 4, 3, False), C(16, 512, 8, 4, False),
    C(2, 4096, 4, 1, False), C(4, 4096, 4, 1, False), C(8, 4096, 8, 1, False),
    C(1, 4096, 2, 1, False), C(1, 4096, 4, 1, False), C(2, 4096, 2, 1, False),
    C(2, 4096, 8, 1, False), C(4, 4096, 8, 1, False), C(2, 2048, 4, 1, False),
    C(2, 2048, 4, 2, False),
    C(1, 16384, 4, 1, False), C(1, 16384, 8, 1, False), C(2, 16384, 8, 1, False),  # K > 4096
]
FUSED_EXTRA = [  # M > 1: the fused prologues on other forms (the pipelined tl.dot one was slow)
    C(32, 256, 4, 1, True), C(32, 256, 4, 2, True), C(64, 128, 4, 4, True, True),
    C(64, 256, 4, 2, True, True),
]
GEMV4_CONFIGS = [  # M = 4 rows (a [4, BLOCK_N, BLOCK_K] accumulator)
    C(8, 256, 4, 1, False), C(16, 128, 4, 1, False), C(8, 512, 8, 1, False),
    C(16, 256, 8, 1, False), C(4, 512, 4, 1, False), C(8, 256, 4, 3, False),
]
GEMV4_LONG_K = [  # M = 2..4 with few weight rows per program and long K tiles (the M = 1
    # optimum, one weight row and the whole K in one load, carried to 4 rows of x)
    C(1, 4096, 4, 1, False), C(1, 4096, 8, 1, False), C(2, 4096, 8, 1, False),
    C(1, 2048, 4, 2, False), C(2, 2048, 8, 2, False), C(2, 1024, 4, 3, False),
    C(4, 1024, 8, 3, False), C(4, 512, 4, 3, False),
]
GEMV16_CONFIGS = [  # M = 5..16 rows (a [16, BLOCK_N, BLOCK_K] accumulator): float32 products,
    # whose IEEE tl.dot runs on FMA units, not tensor cores
    C(4, 64, 4, 1, False), C(4, 128, 4, 1, False), C(8, 64, 4, 1, False), C(8, 64, 4, 3, False),
    C(16, 32, 4, 1, False), C(16, 64, 4, 2, False), C(8, 128, 8, 1, False), C(4, 256, 8, 2, False),
    C(2, 256, 4, 1, False), C(32, 32, 8, 2, False),
]
DOT_CONFIGS = [  # tl.dot on a 16-row tile
    C(16, 256, 4, 4, True), C(16, 512, 4, 3, True), C(32, 128, 4, 4, True),
    C(32, 256, 4, 3, True), C(32, 256, 4, 4, True), C(32, 128, 4, 6, True),
    C(64, 128, 4, 4, True), C(64, 128, 4, 6, True), C(64, 256, 4, 3, True),
    C(64, 128, 8, 4, True), C(128, 64, 4, 6, True), C(128, 128, 8, 3, True),
    C(64, 128, 4, 4, True, True), C(64, 256, 4, 3, True, True),
    C(128, 128, 4, 3, True, True), C(128, 64, 4, 5, True, True),
]

TF32X3_CONFIGS = [  # float32, M = 2..16: tl.dot on tensor cores in three TF32 passes (a 16-row
    # tile; narrow column blocks keep enough programs on the pair's 768-wide products)
    C(bn, bk, w, st, True, swap, precision="tf32x3")
    for bn, bk, w, st, swap in (
        (16, 64, 4, 3, False), (16, 128, 4, 3, False), (16, 256, 4, 2, False),
        (32, 64, 4, 3, False), (32, 128, 4, 3, False), (32, 256, 4, 2, False),
        (64, 64, 4, 3, False), (64, 128, 4, 3, False), (16, 128, 2, 3, False),
        (64, 64, 4, 3, True), (64, 128, 4, 3, True), (128, 64, 4, 3, True),
    )
]

SPLIT_K_CONFIGS = [  # float32, M = 2..16: K in slices, one program each, for the 768- and
    # 1280-wide products whose column blocks alone leave most SMs idle
    *(C(32, 64, 4, 3, True, precision="tf32x3", split_k=sk) for sk in (2, 4, 8)),
    C(64, 64, 4, 3, True, precision="tf32x3", split_k=4),
    C(16, 64, 4, 3, True, precision="tf32x3", split_k=4),
    *(C(8, 64, 4, 3, False, split_k=sk) for sk in (2, 4)),
    *(C(4, 256, 8, 2, False, split_k=sk) for sk in (2, 4)),
    C(4, 512, 4, 3, False, split_k=2), C(2, 1024, 4, 3, False, split_k=2),
]

BF16_SPLIT_K_CONFIGS = [  # bfloat16, M = 2..4: K in slices (float32 partials), so that the 4-row
    # tiles of the 8B products keep 2-4x as many programs in flight as their column blocks give
    *(C(bn, bk, 4, st, True, split_k=sk)
      for bn, bk, st in ((32, 256, 4), (32, 128, 4), (16, 256, 4)) for sk in (2, 4)),
    *(C(64, bk, 4, st, True, True, split_k=2) for bk, st in ((128, 4), (256, 3))),
    *(C(8, 256, 4, 3, False, split_k=sk) for sk in (2, 4)),
    C(4, 512, 4, 3, False, split_k=2), C(2, 1024, 4, 3, False, split_k=2),
]


def candidates(m: int, k: int) -> list[lin.SkinnyConfig]:
    if DTYPE == torch.float32:  # an IEEE tl.dot runs on FMA units: 2x slower than cuBLAS
        out = TF32X3_CONFIGS + SPLIT_K_CONFIGS if m > 1 else []
    else:
        out = list(DOT_CONFIGS)
    if m == 1:
        out += [c for c in GEMV_CONFIGS
                if c.block_k < 4096 or (c.block_k == 4096 and k <= 4096)
                or (c.block_k > 4096 and 4096 < k <= c.block_k)]
    elif m <= 4:
        out += GEMV4_CONFIGS + [c for c in GEMV4_LONG_K if c.block_k < 4096 or k <= 4096]
        out += BF16_SPLIT_K_CONFIGS if DTYPE == torch.bfloat16 else []
    else:
        out += GEMV16_CONFIGS
    return out


def copy_bandwidth() -> float:
    n = 2 * 1024**3 // 2
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / sorted(times)[len(times) // 2]


def time_graph(step, copies: int | None = None, rounds: int = ROUNDS) -> float:
    """Seconds per ``step(i)`` call (i = weight copy), replayed in a CUDA graph."""
    copies = copies or COPIES  # read at call time: main() raises it for small weights
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            step(i)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for i in range(copies):
                step(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return sorted(times)[len(times) // 2] / (copies * rounds)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


class Case:
    """Weights (``COPIES`` of them) and activations of one shape and M."""

    def __init__(self, weights: list[torch.Tensor], m: int, gen: torch.Generator):
        self.weights = weights
        (self.n, self.k), self.m = weights[0].shape, m
        k = self.k
        self.x = torch.randn(m, k, generator=gen).to(DTYPE).to(DEVICE)
        self.residual = torch.randn(m, k, generator=gen).to(DTYPE).to(DEVICE)
        self.norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(DTYPE).to(DEVICE)
        self.gate_up = (2 * torch.randn(m, 2 * k, generator=gen)).to(DTYPE).to(DEVICE)

    def bytes(self, prologue: str = "") -> int:
        extra = {"": self.m * self.k, "norm": 3 * self.m * self.k + self.k,
                 "silu": 2 * self.m * self.k}[prologue]
        return DTYPE.itemsize * (self.n * self.k + self.m * self.n + extra)


def _compile_jobs(jobs) -> int:
    """Worker process: compile (n, k, m, config, kind) jobs into Triton's on-disk cache."""
    tensors: dict = {}
    done = 0
    for n, k, m, cfg, kind in jobs:
        if (n, k) not in tensors:
            tensors[n, k] = torch.empty(n, k, dtype=DTYPE, device=DEVICE)
        case = Case([tensors[n, k]], m, torch.Generator().manual_seed(0))
        try:
            run_triton(case, lin.SkinnyConfig(*cfg), kind, 0, warmup=True)
            done += 1
        except Exception as exc:  # noqa: BLE001 - the config is reported when it is timed
            print(f"compile failed {cfg} {kind}: {exc!r}"[:200], flush=True)
    return done


def precompile(jobs, workers: int = 14) -> None:
    """Compile every (case, config, kind) in parallel processes (Triton's compiler holds the GIL;
    the main process then loads the kernels from the disk cache)."""
    specs = list(dict.fromkeys((c.n, c.k, c.m, tuple(cfg), kind) for c, cfg, kind in jobs))
    if not specs:
        return
    t0 = time.time()
    workers = max(1, min(workers, len(specs), (os.cpu_count() or 2) - 1))
    chunks = [specs[i::workers] for i in range(workers)]
    ctx = multiprocessing.get_context("spawn")
    try:
        with ctx.Pool(workers) as pool:
            done = sum(pool.map(_compile_jobs, chunks))
    except Exception as exc:  # noqa: BLE001 - fall back to compiling on first launch
        print(f"precompile failed: {exc!r}")
        return
    print(f"compiled {done}/{len(specs)} variants in {time.time() - t0:.1f} s", flush=True)


def run_triton(case: Case, cfg, kind: str, i: int, warmup: bool = False):
    w = case.weights[i]
    if kind == "plain":
        return lin.linear_triton(case.x, w, config=cfg, warmup=warmup)
    if kind == "norm":
        return lin.add_rms_norm_linear_triton(case.x, case.residual, case.norm_w, EPS, w,
                                              config=cfg, warmup=warmup)[0]
    return lin.silu_mul_linear_triton(case.gate_up, w, config=cfg, warmup=warmup)


def reference(case: Case, kind: str, i: int):
    w = case.weights[i]
    if kind == "plain":
        return F.linear(case.x, w)
    if kind == "norm":
        return lin.add_rms_norm_linear_reference(case.x, case.residual, case.norm_w, EPS, w)[0]
    return lin.silu_mul_linear_reference(case.gate_up, w)


def two_kernels(case: Case, kind: str, i: int, product):
    """The sequence a fused form replaces: Triton norm / silu kernel, then ``product``."""
    w = case.weights[i]
    if kind == "norm":
        normed, _ = add_rms_norm_triton(case.x, case.residual, case.norm_w, EPS)
        return product(normed, w)
    return product(silu_mul_triton(case.gate_up), w)


def measure_triton(case: Case, cfg, kind: str) -> dict:
    try:
        out = run_triton(case, cfg, kind, 0)
        err = rel_err(out, reference(case, kind, 0))
        if not err <= (1e-5 if DTYPE == torch.float32 else 1e-2):  # float32: tf32x3's bound
            return {"config": cfg._asdict(), "error": f"relative error {err:.2e}"}
        t = time_graph(lambda i: run_triton(case, cfg, kind, i))
    except Exception as exc:  # noqa: BLE001 - out of resources and the like: skip the config
        return {"config": cfg._asdict(), "error": repr(exc)[:300]}
    return {"config": cfg._asdict(), "us": t * 1e6, "rel_err": err}


def cfg_of(row) -> lin.SkinnyConfig:
    return lin.SkinnyConfig(**row["config"])


FUSED_KINDS = {"qkv": "norm", "gate_up": "norm", "down": "silu"}


def tuned_rules(result) -> tuple:
    """This run's rules: per swept shape and M the fastest config, Triton where it beats cuBLAS
    (plain) or the two-kernel sequence (fused); each takes its shape's rows up to that M."""
    fused = {(e["shape"], e["m"]): e for e in result["fused"]}
    rules = []
    for e in sorted(result["sweep"], key=lambda e: (e["n"], e["k"], e["m"])):
        if not e["best"]:
            continue
        cfg = cfg_of(e["best"])
        plain = e["best"]["us"] < e["cublas_us"]
        f = fused.get((e["shape"], e["m"]))
        fused_ok = False  # unmeasured prologue (an A/B found one slower): norm / silu kernel first
        if f is not None and f["best"]:
            unfused = min(u for u in (f["two_kernels_cublas_us"], f.get("two_kernels_triton_us")) if u)
            fused_ok = f["best"]["us"] < unfused  # against the faster two-kernel sequence
            if fused_ok and f["best"]["us"] < f["fused"][0].get("us", float("inf")) * 0.98:
                cfg = cfg_of(f["best"])  # the prologue moved the optimum
        if cfg.split_k > 1:  # `fused` covers both prologues, and the norm takes no split-K: the
            fused_ok = False  # norm / silu kernel runs, then the split product
        rules.append(tile_tables.SkinnyRule(e["m"], (e["n"], e["n"]), (e["k"], e["k"]), cfg, plain,
                                            fused_ok))
    return tuple(rules)


def merge_rules(table: tuple, new: tuple) -> tuple:
    """``table`` with the rules of ``new`` (each for one shape, rows up to its m_max) in place:
    a rule of the same shape and m_max is replaced where it stands; else the new rule goes just
    before the rule that takes its m_max rows today, so it also takes the rows below that shared
    that rule, and no others (first match wins). A rule that would pick what the table picks
    already is left out."""
    table = list(table)
    for rule in new:
        n, k = rule.n_range[0], rule.k_range[0]
        key = (rule.m_max, rule.n_range, rule.k_range)
        same = next((i for i, r in enumerate(table) if (r.m_max, r.n_range, r.k_range) == key), None)
        if same is not None:
            table[same] = rule
            continue
        now = tile_tables.match_skinny(table, rule.m_max, n, k)
        if now is not None and now[3:] == rule[3:]:  # the same config, plain and fused
            continue
        table.insert(len(table) if now is None else table.index(now), rule)
    return tuple(table)


def tuned_table(result) -> tuple:
    """This GPU's table for the run's dtype with this run's rules merged in (what
    ``--write-table`` writes)."""
    return merge_rules(table_of_dtype(), tuned_rules(result))


def write_table(result, path: str, command: str, dtype: torch.dtype | None = None):
    """Write this run's rules into the table file at ``path`` (a new file starts from
    generic.json): the table of ``dtype`` (the run's) gets them, and its source names the
    command; every other rule and table stays as it is. Returns the tables written."""
    dtype = dtype or DTYPE
    seed = path if os.path.exists(path) else os.path.join(CONFIG_DIR, tile_tables.GENERIC)
    tables = tile_tables.read_tables(seed)
    field = "skinny_float32" if dtype == torch.float32 else "skinny_half"
    note = f"{command} on an {result['device']}"
    source = tables.sources[field]
    if note not in source:
        source = f"{source}; the rules of the shapes swept by {note}"
    merged = merge_rules(getattr(tables, field), tuned_rules(result))
    tables = dataclasses.replace(tables, **{field: merged}, sources={**tables.sources, field: source})
    tile_tables.write_tables(path, tables)
    return tables


def table_of_dtype() -> tuple:
    """The skinny product's rules for this run's dtype on this GPU (its file in
    phasegraph/kernels/configs/, else generic.json)."""
    return tile_tables.tables_for().skinny(DTYPE)


@contextlib.contextmanager
def table_in_use(rules: tuple):
    """Inside the block the library reads ``rules`` for this run's dtype: a temporary file with
    the GPU's other tables, named by PHASEGRAPH_TILE_TABLE."""
    tables = tile_tables.tables_for()
    field = "skinny_float32" if DTYPE == torch.float32 else "skinny_half"
    before = os.environ.get(tile_tables.ENV_VAR)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "table.json")
        tile_tables.write_tables(path, dataclasses.replace(tables, **{field: tuple(rules)}))
        os.environ[tile_tables.ENV_VAR] = path
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(tile_tables.ENV_VAR)
            else:
                os.environ[tile_tables.ENV_VAR] = before
            tile_tables.clear_cache()


def layer_step(cases, m, h, attn_out):
    qkv, o, gu, down = (cases[s, m] for s in ("qkv", "o", "gate_up", "down"))

    def old(i):
        normed, res = add_rms_norm_triton(h, qkv.residual, qkv.norm_w, EPS)
        F.linear(normed, qkv.weights[i])
        a = F.linear(attn_out, o.weights[i])
        normed, res = add_rms_norm_triton(a, res, gu.norm_w, EPS)
        g = F.linear(normed, gu.weights[i])
        return F.linear(silu_mul_triton(g), down.weights[i])

    def new(i):
        _, res = lin.add_rms_norm_linear(h, qkv.residual, qkv.norm_w, EPS, qkv.weights[i])
        a = lin.linear(attn_out, o.weights[i])
        g, res = lin.add_rms_norm_linear(a, res, gu.norm_w, EPS, gu.weights[i])
        return lin.silu_mul_linear(g, down.weights[i])

    return old, new, sum(c.bytes() for c in (qkv, o, gu, down))


def with_pdl(rules) -> tuple:
    return tuple(r._replace(config=r.config._replace(pdl=True)) for r in rules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--quick", action="store_true", help="time only the table's configs")
    parser.add_argument("--ms", default="1,4,16")
    parser.add_argument("--shapes", help="names within the shape set (default: all of them)")
    parser.add_argument("--shape-set", choices=sorted(SHAPE_SETS), default="8b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--no-pdl", action="store_true", help="skip the PDL measurements")
    parser.add_argument("--write-table", nargs="?", const="", metavar="PATH",
                        help="write this run's rules for its dtype and shapes into this GPU's "
                             "table file in phasegraph/kernels/configs/ (or PATH), other rules kept")
    args = parser.parse_args()
    if args.quick and args.write_table is not None:
        parser.error("--write-table needs the sweep (not --quick)")
    global DTYPE, COPIES
    DTYPE = DTYPES[args.dtype]
    if args.shape_set == "pair":
        COPIES = 64  # the pair's weights are small: 64 copies keep even o (2.4 MB) out of L2
    os.environ["BENCH_LINEAR_DTYPE"] = args.dtype  # the spawned compile workers
    ms = [int(v) for v in args.ms.split(",")]
    shape_set = SHAPE_SETS[args.shape_set]
    names = args.shapes.split(",") if args.shapes else list(shape_set)
    unknown = sorted(set(names) - set(shape_set))
    if unknown:
        parser.error(f"--shapes: {unknown} not in the {args.shape_set} set {sorted(shape_set)}")
    shapes = {name: shape_set[name] for name in names}
    gen = torch.Generator().manual_seed(0)
    t_start = time.time()
    name = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{name}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    result = {"device": name, "copy_bandwidth": bw, "torch": torch.__version__, "dtype": args.dtype,
              "shape_set": args.shape_set, "sweep": [],
              "fused": [], "layer": [], "pdl": []}

    def save():
        result["seconds"] = time.time() - t_start
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_linear.json"), "w") as f:
                json.dump(result, f, indent=1, default=str)

    weights = {}  # COPIES random [n, k] weights per shape, shared by every M
    cuda_gen = torch.Generator(device=DEVICE).manual_seed(0)
    for s, (n, k) in shapes.items():
        weights[s] = [(torch.randn(n, k, generator=cuda_gen, device=DEVICE) / k**0.5).to(DTYPE)
                      for _ in range(COPIES)]
    cases = {(s, m): Case(weights[s], m, gen) for s in shapes for m in ms}
    plans = {}
    for (s, m), case in cases.items():
        plans[s, m] = [lin.pick_config(m, case.n, case.k, DTYPE)]
        if not args.quick:
            plans[s, m] = list(dict.fromkeys(plans[s, m] + candidates(m, case.k)))
    jobs = [(case, cfg, "plain") for key, case in cases.items() for cfg in plans[key]]
    jobs += [(case, lin.pick_config(m, case.n, case.k, DTYPE), FUSED_KINDS[s])
             for (s, m), case in cases.items() if s in FUSED_KINDS]
    precompile(jobs)

    # 1. sweep: cuBLAS and the Triton configs, plain products
    best = {}
    for (s, m), case in cases.items():
        t_cublas = time_graph(lambda i, case=case: F.linear(case.x, case.weights[i]))
        rows = [measure_triton(case, cfg, "plain") for cfg in plans[s, m]]
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        table_cfg = lin.pick_config(m, case.n, case.k, DTYPE)
        table_row = next((r for r in ok if cfg_of(r) == table_cfg), None)
        entry = {"shape": s, "n": case.n, "k": case.k, "m": m, "bytes": case.bytes(),
                 "cublas_us": t_cublas * 1e6, "triton": rows,
                 "best": ok[0] if ok else None, "table": table_row}
        result["sweep"].append(entry)
        best[s, m] = [cfg_of(r) for r in ok[:3]]
        if ok:
            print(f"{s:8s} M={m:2d} cuBLAS {t_cublas * 1e6:7.2f} us  best {ok[0]['us']:7.2f} us "
                  f"{ok[0]['config']}  ({len(ok)}/{len(rows)} configs ran)", flush=True)
        for r in rows:
            if "error" in r:
                print(f"   skipped {r['config']}: {r['error'][:120]}")
    save()

    # 2. fused prologues against the two-kernel sequences: the sweep's best 3 configs
    fused_jobs = []
    for (s, m), case in cases.items():
        if s in FUSED_KINDS:
            extra = FUSED_EXTRA + (GEMV4_CONFIGS[:1] + GEMV4_CONFIGS[-1:] if m <= 4 else [])
            extra = extra if m > 1 and not args.quick else []
            kind = FUSED_KINDS[s]  # split-K takes the silu prologue, not the norm
            plain_best = [c for c in best[s, m] if c.split_k == 1 or kind == "silu"]
            best[s, m, "fused"] = list(dict.fromkeys(plain_best + extra))
            fused_jobs += [(case, cfg, FUSED_KINDS[s]) for cfg in best[s, m, "fused"]]
        if best[s, m] and not args.no_pdl:
            fused_jobs.append((case, best[s, m][0]._replace(pdl=True), "plain"))
    precompile(fused_jobs)
    for (s, m), case in cases.items():
        if s not in FUSED_KINDS:
            continue
        kind = FUSED_KINDS[s]
        t_seq = time_graph(lambda i, case=case, kind=kind: two_kernels(case, kind, i, F.linear))
        # the sequence the dispatcher runs where the fused form is off: the norm / silu kernel,
        # then the sweep's best plain Triton product (what a fused rule must beat, not cuBLAS)
        t_tri = None
        if best[s, m]:
            cfg0 = best[s, m][0]
            t_tri = time_graph(lambda i, case=case, kind=kind, cfg0=cfg0: two_kernels(
                case, kind, i, lambda x, w: lin.linear_triton(x, w, config=cfg0)))
        rows = [measure_triton(case, cfg, kind) for cfg in best[s, m, "fused"]]
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        entry = {"shape": s, "m": m, "kind": kind, "bytes": case.bytes(kind),
                 "two_kernels_cublas_us": t_seq * 1e6,
                 "two_kernels_triton_us": None if t_tri is None else t_tri * 1e6, "fused": rows,
                 "best": ok[0] if ok else None}
        result["fused"].append(entry)
        if ok:
            tri = "" if t_tri is None else f"  {kind}+Triton {t_tri * 1e6:7.2f} us"
            print(f"{s:8s} M={m:2d} {kind}+cuBLAS {t_seq * 1e6:7.2f} us{tri}  fused "
                  f"{ok[0]['us']:7.2f} us {ok[0]['config']}", flush=True)
        for r in rows:
            if "error" in r:
                print(f"   skipped {r['config']}: {r['error'][:120]}")
    save()

    # 3. one decoder layer's products and prologue kernels (attention left out): the current
    # sequence, the fused one with linear.py's table, and with the table tuned by this run
    tuned = tuned_table(result) if not args.quick else table_of_dtype()
    result["tuned_table"] = [r._asdict() for r in tuned]
    if args.write_table is not None:
        path = args.write_table or os.path.join(CONFIG_DIR, tile_tables.file_name(name))
        command = (f"benchmarks/bench_linear.py --dtype {args.dtype} --shape-set {args.shape_set} "
                   f"--ms {args.ms}" + (f" --shapes {args.shapes}" if args.shapes else ""))
        write_table(result, path, command)
        result["table_file"] = path
        print(f"wrote {path}", flush=True)
    layers = [m for m in ms if all((s, m) in cases for s in SHAPES)]
    for m in layers:
        h = torch.randn(m, cases["qkv", m].k, generator=gen).to(DTYPE).to(DEVICE)
        attn_out = torch.randn(m, cases["o", m].k, generator=gen).to(DTYPE).to(DEVICE)
        old, new, layer_bytes = layer_step(cases, m, h, attn_out)
        row = {"m": m, "bytes": layer_bytes, "old_us": time_graph(old) * 1e6,
               "table_us": time_graph(new) * 1e6}
        if not args.quick:
            with table_in_use(tuned):
                row["tuned_us"] = time_graph(new) * 1e6
        result["layer"].append(row)
        print(f"layer M={m:2d}: {row}", flush=True)
    save()

    # 4. programmatic dependent launch: the tuned configs launched with PDL (last: a failure
    # here must not cost the numbers above)
    if not args.no_pdl:
        for (s, m), case in cases.items():
            if not best.get((s, m)):
                continue
            cfg = best[s, m][0]._replace(pdl=True)
            row = measure_triton(case, cfg, "plain")
            row.update(shape=s, m=m)
            result["pdl"].append(row)
            print(f"pdl {s:8s} M={m:2d}: {row.get('us', row.get('error'))}", flush=True)
        for row in result["layer"]:
            m = row["m"]
            h = torch.randn(m, cases["qkv", m].k, generator=gen).to(DTYPE).to(DEVICE)
            attn_out = torch.randn(m, cases["o", m].k, generator=gen).to(DTYPE).to(DEVICE)
            _, new, _ = layer_step(cases, m, h, attn_out)
            try:
                with table_in_use(with_pdl(tuned)):
                    row["tuned_pdl_us"] = time_graph(new) * 1e6
            except Exception as exc:  # noqa: BLE001
                row["tuned_pdl_error"] = repr(exc)[:300]
        save()

    def pct(nbytes, us):
        return 100 * nbytes / (us * 1e-6) / bw

    print(f"\n{name}, copy bandwidth {bw / 1e12:.3f} TB/s, {args.dtype}, time per op in a CUDA graph "
          f"(launch gaps included), {COPIES} rotating weight copies")
    print(f"{'shape':8s} {'M':>3s} | {'cuBLAS us':>9s} {'%bw':>5s} | {'Triton us':>9s} {'%bw':>5s} "
          f"| {'PDL us':>7s} {'%bw':>5s} | best config (block_n, block_k, warps, stages, dot, swap)")
    pdl = {(r["shape"], r["m"]): r for r in result["pdl"]}
    for e in result["sweep"]:
        b = e["best"]
        p = pdl.get((e["shape"], e["m"]), {})
        bs = f"{b['us']:9.2f} {pct(e['bytes'], b['us']):5.1f}" if b else f"{'-':>9s} {'-':>5s}"
        ps = f"{p['us']:7.2f} {pct(e['bytes'], p['us']):5.1f}" if "us" in p else f"{'-':>7s} {'-':>5s}"
        cfg = tuple(b["config"].values())[:6] if b else "-"
        print(f"{e['shape']:8s} {e['m']:3d} | {e['cublas_us']:9.2f} "
              f"{pct(e['bytes'], e['cublas_us']):5.1f} | {bs} | {ps} | {cfg}")
    print(f"\n{'fused':14s} {'M':>3s} | {'2 kernels (cuBLAS) us':>21s} | {'fused us':>8s} {'%bw':>5s} "
          "| config")
    for e in result["fused"]:
        b = e["best"]
        if b:
            print(f"{e['shape'] + '+' + e['kind']:14s} {e['m']:3d} | "
                  f"{e['two_kernels_cublas_us']:21.2f} | {b['us']:8.2f} "
                  f"{pct(e['bytes'], b['us']):5.1f} | {tuple(b['config'].values())[:6]}")
    print(f"\n{'layer (no attention)':20s} {'M':>3s} | {'current':>13s} | {'table':>13s} | "
          f"{'tuned':>13s} | {'tuned+PDL':>13s}   (us, %bw)")
    for e in result["layer"]:
        cells = []
        for key in ("old_us", "table_us", "tuned_us", "tuned_pdl_us"):
            cells.append(f"{e[key]:7.2f} {pct(e['bytes'], e[key]):5.1f}" if key in e else f"{'-':>13s}")
        print(f"{'':20s} {e['m']:3d} | " + " | ".join(cells))
    print("\ntuned table:")
    for r in tuned:
        print(f"    {r!r},")
    print(f"bench_linear: {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
