"""Experiment: the bench pair's decode step and tree iteration as chains of launches that do
nothing but stream each product's weights and hand on its input: the floor of a kernel-boundary
execution with free arithmetic (bench/RESULTS.md §5, "What limits the goals that are not met").

``bench/handoff_bound.py``'s streamed readings (``ideal_streamed_us``) add up, per product, the
larger of its bytes' time and its measured handoff. This measures the same thing on the GPU.
There is one launch per product of the pair (``stage_bytes``: 49 for a decode step; 49 + 1 +
4·5 for a tree iteration), each of P programs, in a CUDA graph. Each launch:

- reads its 1/P of the product's weights (int32 zeros, one buffer per product, so the target's
  384 MB stream from DRAM as they do in a step), either before its PDL wait ("streamed", as the
  shipped one-tile products load theirs) or after it ("serial");
- waits for the launch before, then lets the next one launch (PDL, as phasegraph ships);
- reads the whole input the launch before wrote, and writes its share of the next launch's.
  Inputs are 768 words for a decode step, 12288 for the verify's 16 rows and 1536 for a head
  forward's (``carried_words``).

Checksums check that every launch read what the one before wrote. The head's weights are either
one set for all four forwards, so later forwards may find them in L2 as the shipped head's do,
or four sets ("head from DRAM"). One program per SM, of 4, 8, 16 or 32 warps; then each tree
iteration again with the verify's and the draft's products each at the warps that ran them
fastest alone. One more chain, the decode step's weights in a single launch, gives the bytes'
time alone.

    python bench/streamed_chain.py --out DIR [--bench-json RUN/bench.json]   # GPU only
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from handoff_bound import (  # noqa: E402
    PAIR_WORDS,
    batch1_tree_row,
    graph_time_us,
    pair_dtype_bytes,
    stage_bytes,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from phasegraph.kernels._dispatch import next_pow2, pdl_enter, pdl_options  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # the chains' arithmetic is still tested on the CPU
    triton = None

DEFAULT_BENCH = ROOT / "bench" / "results" / "bench-h100-2026-11-26-run47" / "bench.json"
WARPS = (4, 8, 16, 32)  # per program, one program per SM
ITERATIONS = ("tree iteration, one head weight set", "tree iteration, head from DRAM")
VERIFY, DRAFT = "the verify alone", "the draft alone, one head weight set"
ONE_LAUNCH = "the decode step's weights in one launch"
CHUNK_ALIGN = 16  # words
WORDS_PER_THREAD = 8  # int32 weight words each thread loads per block: two 16-byte loads

if triton is not None:
    @triton.jit
    def _chunk_lane_sums(chunk_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """A program's CHUNK weight words loaded BLOCK at a time (unrolled, so that every load can
        be in flight at once) and added up by lane: [BLOCK] partial sums."""
        block = tl.arange(0, BLOCK)
        weights = tl.zeros([BLOCK], dtype=tl.int32)
        for b in tl.static_range(0, CHUNK, BLOCK):
            weights += tl.load(chunk_ptr + b + block, mask=b + block < CHUNK, other=0)
        return weights

    @triton.jit
    def _streamed_stage_kernel(weight_ptr, src_ptr, dst_ptr, checksum_ptr, stage,
                               CHUNK: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr,
                               WP: tl.constexpr, OUT: tl.constexpr, V: tl.constexpr,
                               VP: tl.constexpr, STREAMED: tl.constexpr, PDL: tl.constexpr):
        """One product of a chain: its CHUNK weight words (before or after the wait), the W-word
        input into this program's checksum, then this program's V of the OUT output words."""
        pid = tl.program_id(0)
        if STREAMED:
            weights = _chunk_lane_sums(weight_ptr + pid * CHUNK, CHUNK, BLOCK)
        pdl_enter(PDL)
        if not STREAMED:
            weights = _chunk_lane_sums(weight_ptr + pid * CHUNK, CHUNK, BLOCK)
        every = tl.arange(0, WP)
        total = tl.sum(tl.load(src_ptr + every, mask=every < W, other=0)) + tl.sum(weights)
        tl.store(checksum_ptr + pid, tl.load(checksum_ptr + pid) + total)
        mine = tl.arange(0, VP)
        index = pid * V + mine
        tl.store(dst_ptr + index, stage * OUT + index, mask=(mine < V) & (index < OUT))


def chains(weight_bytes: dict, dtype_bytes: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """The launches of each chain as (weight set, bytes, input words): a decode step, and a tree
    iteration with the head's weights shared by its forwards or one set per forward. A weight
    set names a buffer: chains that name the same set read the same weights."""
    stages = stage_bytes(weight_bytes, dtype_bytes)
    words = PAIR_WORDS
    passes = weight_bytes["draft_passes"]

    def target(in_words):
        return [(f"target {i}", b, in_words) for i, b in enumerate(stages["decode step"])]

    def head(sets):
        fc = [("head fc", stages["head fc"][0], words["head forward"])]
        return fc + [(f"head {sets[p]} {i}", b, words["head forward"])
                     for p in range(passes) for i, b in enumerate(stages["head forward"])]

    verify = target(words["tree verify"])
    return {"decode step": target(words["decode step"]),
            ITERATIONS[0]: verify + head([0] * passes),
            ITERATIONS[1]: verify + head(list(range(passes))),
            VERIFY: verify, DRAFT: head([0] * passes),
            ONE_LAUNCH: [("one launch", weight_bytes["step"], words["decode step"])]}


def expected_checksum(in_words: list[int]) -> int:
    """What every program of a chain sums: launch i > 0 reads the ``in_words[i]`` words launch
    i - 1 wrote, (i - 1)·W + w for w < W (launch 0 reads zeros, every weight is 0), wrapped to
    int32 as the kernel adds."""
    total = sum((i - 1) * w * w + w * (w - 1) // 2 for i, w in enumerate(in_words) if i > 0)
    return (total + 2**31) % 2**32 - 2**31


def _chunk_words(nbytes: int, programs: int) -> int:
    """Weight words per program: ⌈bytes / 4 / programs⌉ rounded up to 16 words, so that every
    program's slice starts 64-byte aligned (the last block of each is masked)."""
    words = -(-nbytes // (4 * programs))
    return -(-words // CHUNK_ALIGN) * CHUNK_ALIGN


def _launch_chain(chain, warps_by_words, buffers, mail, zeros, checksum, streamed, options):
    """Launch every product of ``chain`` once (one program per SM, ``warps_by_words[W]`` warps
    for a product whose input is W words), each reading the input the launch before wrote."""
    programs = checksum.numel()
    checksum.zero_()
    for i, (name, nbytes, words) in enumerate(chain):
        out = chain[(i + 1) % len(chain)][2]
        per_program = -(-out // programs)
        src = zeros if i == 0 else mail[(i - 1) % 2]
        warps = warps_by_words[words]
        _streamed_stage_kernel[(programs,)](
            buffers[name], src, mail[i % 2], checksum, i,
            CHUNK=_chunk_words(nbytes, programs), BLOCK=32 * warps * WORDS_PER_THREAD, W=words,
            WP=next_pow2(words), OUT=out, V=per_program, VP=next_pow2(per_program),
            STREAMED=streamed, num_warps=warps, **options)


def measure(weight_bytes: dict, dtype_bytes: dict[str, int]) -> list[dict]:
    """µs per replay of each chain at each of WARPS, streamed and serial (the single launch:
    serial only), then each tree iteration with the verify's and the draft's products each at
    the warps that ran them fastest alone; every chain's checksums checked."""
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    launches = chains(weight_bytes, dtype_bytes)
    buffers = {name: torch.zeros(programs * _chunk_words(b, programs), dtype=torch.int32,
                                 device="cuda")
               for chain in launches.values() for name, b, _ in chain}
    max_words = max(w for chain in launches.values() for _, _, w in chain)
    mail = torch.zeros(2, max_words, dtype=torch.int32, device="cuda")
    zeros = torch.zeros(max_words, dtype=torch.int32, device="cuda")
    checksum = torch.zeros(programs, dtype=torch.int32, device="cuda")
    options = pdl_options()

    def run(chain_name: str, warps_by_words: dict[int, int], label: str, streamed: bool) -> dict:
        chain = launches[chain_name]
        us = graph_time_us(functools.partial(_launch_chain, chain, warps_by_words, buffers, mail,
                                             zeros, checksum, streamed, options))
        want = expected_checksum([w for _, _, w in chain])
        if not bool((checksum == want).all()):
            raise AssertionError(f"{chain_name}, warps {label}: a launch read "
                                 f"{checksum[:4].tolist()}..., not {want}")
        return {"chain": chain_name, "warps": label, "streamed": streamed,
                "launches": len(chain), "us": us,
                "bytes": sum(programs * 4 * _chunk_words(b, programs) for _, b, _ in chain)}

    every_size = {w for chain in launches.values() for _, _, w in chain}
    rows = [run(name, dict.fromkeys(every_size, warps), str(warps), streamed)
            for warps in WARPS for name in launches
            for streamed in ((False,) if name == ONE_LAUNCH else (True, False))]
    words = PAIR_WORDS
    for streamed in (True, False):
        alone = {part: min((r for r in rows if r["chain"] == part and r["streamed"] == streamed),
                           key=lambda r: r["us"])["warps"] for part in (VERIFY, DRAFT)}
        mixed = {words["tree verify"]: int(alone[VERIFY]), words["head forward"]: int(alone[DRAFT])}
        label = f"verify {alone[VERIFY]}, draft {alone[DRAFT]}"
        rows += [run(name, mixed, label, streamed) for name in ITERATIONS]
    return rows


def summary(rows: list[dict]) -> dict[str, dict]:
    """For streamed and serial: each chain at its fastest warps, and for a tree iteration
    η = decode step / iteration (each at its fastest)."""
    out = {}
    for streamed in (True, False):
        best = {}
        for row in rows:
            if row["streamed"] == streamed and (row["chain"] not in best
                                                or row["us"] < best[row["chain"]]["us"]):
                best[row["chain"]] = row
        step = best["decode step"]["us"]
        out["streamed" if streamed else "serial"] = {
            name: {"us": row["us"], "warps": row["warps"],
                   "eta": step / row["us"] if name in ITERATIONS else None}
            for name, row in best.items()}
    return out


def report(result: dict) -> str:
    lines = [f"Device: {result['device']}; torch {result['torch']}, triton {result['triton']}; "
             f"bytes of bench run {result['bench_commit']}", "",
             "| chain | weights | warps | launches | MB | µs per chain |",
             "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['chain']} | {'streamed' if row['streamed'] else 'serial'} | "
                     f"{row['warps']} | {row['launches']} | "
                     f"{row['bytes'] / 1e6:.1f} | "
                     f"{row['us']:.1f} |")
    lines += ["", "Each chain at its fastest warps, and η = decode step / tree iteration:", "",
              "| weights | chain | warps | µs | η |", "|---|---|---|---|---|"]
    for mode, chains_ in result["summary"].items():
        for name, row in chains_.items():
            eta = "–" if row["eta"] is None else f"{row['eta']:.3f}"
            lines.append(f"| {mode} | {name} | {row['warps']} | {row['us']:.1f} | {eta} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bench-json", type=Path, default=DEFAULT_BENCH,
                        help="the phasegraph bench JSON whose weight bytes the chains stream")
    args = parser.parse_args(argv)
    if not args.bench_json.is_file():
        parser.error(f"{args.bench_json}: no such file")
    if triton is None or not torch.cuda.is_available():
        print("streamed_chain.py: needs Triton and a CUDA GPU", file=sys.stderr)
        return 2
    bench = json.loads(args.bench_json.read_text())
    rows = measure(batch1_tree_row(bench)["weight_bytes"], pair_dtype_bytes(bench))
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": triton.__version__, "bench_commit": bench["env"].get("git_commit"),
              "rows": rows, "summary": summary(rows)}
    write_result(args.out, "streamed_chain", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
