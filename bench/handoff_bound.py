"""What a grid-wide handoff costs on this GPU, and the batch-1 tree η an ideal execution of the
bench pair would reach (bench/RESULTS.md §5, "What limits the goals that are not met").

A product ``y = W x`` spread over every SM for bandwidth needs all of ``x`` in each SM, so each
dependent step of a forward is a handoff from every producer to every consumer: a kernel
boundary today, a release / acquire on a counter in a persistent kernel (the route §5 names).
This measures both, side by side, in CUDA graphs:

- ``point to point``: two programs hand a flag back and forth (release, then the other's
  acquire): the floor of any handoff between SMs;
- ``handoff``: one persistent launch of ``P`` programs (at most one wave) passing ``S`` stages.
  In each stage every program writes a value, arrives on a counter (release), spins until all
  ``P`` have arrived, acquires, and reads a neighbour's value, which is checked afterwards.
  Cost per handoff = the slope over ``S``;
- ``boundary``: ``S`` launches of a trivial kernel of ``P`` programs, each reading what the one
  before wrote, with programmatic dependent launch on (as phasegraph ships) and off;
- ``vector``: the same three ways of handing a whole W-word vector (a product's input) from all
  programs to all, plus tagged words: each 8-byte word carries its value and its stage, stored
  at once, so readers spin on the data itself with no fence and no counter (the "LL" protocol
  of NCCL's low-latency collectives), polled by the whole program or by each thread.

It then gives the batch-1 tree η of an ideal execution of the bench pair (``bound_from_bench``):
every weight byte at the copy bandwidth the bench measured, arithmetic and attention free, and
only the handoffs the dataflow cannot avoid (``handoffs``), each at the cheapest all-SM cost
measured, after its stage's bytes (a kernel that reads its weights after its wait):

    decode step     = B_step / BW + H_step · c
    tree iteration  = B_iter / BW + H_iter · c

B (weight bytes) and BW come from a ``phasegraph bench`` JSON. Three readings: every weight from
DRAM; the same with free handoffs; and the EAGLE-3 head's weights held in L2 after its first
forward (they fit). Given the measured vector handoffs, four more in which each handoff costs
what handing on its input costs: weights read after the wait (as above), or streamed in during
the handoff before each product (``ideal_streamed_us``: a product costs max(bytes, handoff)). EAGLE-3 (Li et al., 2025, arXiv:2503.01840) drafts the tree with S
sequential head forwards, each a decoder layer with the same handoffs as a target layer.

    python bench/handoff_bound.py --out DIR --bench-json bench/results/<run>/bench.json
    python bench/handoff_bound.py --out DIR --bench-json ... --measured DIR/handoff_bound.json
                                                      # the bound again, from a recorded run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phasegraph.bench.common import PG_CONFIGS, TREE  # noqa: E402
from phasegraph.kernels._dispatch import next_pow2, pdl_enter, pdl_options  # noqa: E402
from phasegraph.train.presets import PRESETS  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # the bound's arithmetic still runs, and is tested, on the CPU
    triton = None
else:  # the done-counter's release and spin-then-acquire of the one-launch chain experiment
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from weight_stationary_chain import _publish, _wait  # noqa: E402

STAGE_COUNTS = (16, 64, 256)
REPLAYS = 200


def _spin_asm(pack: int) -> str:
    """PTX for one thread's ``pack`` tagged words: load them all (relaxed, gpu scope), and
    load them all again until every tag equals the one asked for; outputs the values.
    Operands: $0.. the values, then the word addresses, then the tags (one per word)."""
    loads = "".join(f"ld.relaxed.gpu.global.b64 w{i}, [${pack + i}];\n" for i in range(pack))
    unpack = "".join(f"mov.b64 {{${i}, t{i}}}, w{i};\n" for i in range(pack))
    test = f"setp.ne.b32 p, t0, ${2 * pack};\n" + "".join(
        f"setp.ne.or.b32 p, t{i}, ${2 * pack + i}, p;\n" for i in range(1, pack))
    return (f"{{ .reg .pred p; .reg .b64 w<{pack}>; .reg .b32 t<{pack}>;\nLL_SPIN:\n"
            + loads + unpack + test + "@p bra LL_SPIN;\n}")


def _spin_constraints(pack: int) -> str:
    """The operands of :func:`_spin_asm`: ``pack`` values out, addresses and tags in."""
    return ",".join(["=r"] * pack + ["l"] * pack + ["r"] * pack)


if triton is not None:
    @triton.jit
    def _handoff_kernel(counter_ptr, mail_ptr, checksum_ptr, STAGES, P: tl.constexpr):
        """``STAGES`` grid-wide handoffs among ``P`` resident programs; the checksum is the sum of
        what each program read from its neighbour, stage by stage."""
        pid = tl.program_id(0)
        neighbour = (pid + 1) % P
        checksum = 0
        for stage in range(STAGES):
            slot = (stage % 2) * P  # two mailboxes: a stage's writes never meet the last one's reads
            tl.store(mail_ptr + slot + pid, stage * P + pid)
            _publish(counter_ptr)
            _wait(counter_ptr, (stage + 1) * P)
            checksum += tl.load(mail_ptr + slot + neighbour, cache_modifier=".cg")
        tl.store(checksum_ptr + pid, checksum)

    @triton.jit
    def _pingpong_kernel(flag_ptr, STAGES):
        """Two programs hand one flag back and forth: ``2 · STAGES`` one-way handoffs, each a
        release by one program and an acquire by the other; the floor of any handoff."""
        pid = tl.program_id(0)
        for stage in range(STAGES):
            turn = 2 * stage + pid  # program 0 moves on even turns, program 1 on odd ones
            _wait(flag_ptr, turn)
            tl.atomic_xchg(flag_ptr, turn + 1, sem="release", scope="gpu")

    @triton.jit
    def _boundary_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
        """One step of a launch chain: each program copies its neighbour's value, plus one."""
        pdl_enter(PDL)
        pid = tl.program_id(0)
        neighbour = (pid + 1) % tl.num_programs(0)
        tl.store(dst_ptr + pid, tl.load(src_ptr + neighbour) + 1)


    # --- handing a whole vector to every program (what a product's input needs) ----------------

    @triton.jit
    def _store_tagged(ptr, word):
        """One 8-byte word by a relaxed gpu-scope store of all 64 bits, so a reader sees the whole
        word or none of it."""
        return tl.inline_asm_elementwise("st.relaxed.gpu.global.b64 [$1], $2; mov.b32 $0, 0;",
                                         "=r,l,l", [ptr, word], dtype=tl.int32, is_pure=False,
                                         pack=1)

    @triton.jit
    def _load_tagged(ptr, tag, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, PACK: tl.constexpr):
        """The values of the tagged words at ``ptr`` once each carries ``tag``: every thread
        spins on its own words only (no reduction across the program)."""
        return tl.inline_asm_elementwise(ASM, CONSTRAINTS, [ptr, tag], dtype=tl.int32,
                                         is_pure=False, pack=PACK)

    @triton.jit
    def _own_words(pid, W: tl.constexpr, V: tl.constexpr, VP: tl.constexpr):
        """The indices of the (at most V) words of the W-word vector program ``pid`` writes, and
        which of the VP lanes hold one."""
        lane = tl.arange(0, VP)
        index = pid * V + lane
        return index, (lane < V) & (index < W)

    @triton.jit
    def _vector_tagged_kernel(mail_ptr, checksum_ptr, STAGES, P: tl.constexpr, W: tl.constexpr,
                              WP: tl.constexpr, V: tl.constexpr, VP: tl.constexpr,
                              PER_THREAD: tl.constexpr, SPIN_ASM: tl.constexpr,
                              SPIN_CONSTRAINTS: tl.constexpr, PACK: tl.constexpr):
        """``STAGES`` handoffs of a W-word vector among ``P`` resident programs, each word sent
        with its stage as a tag in the same 8-byte store (the "LL" protocol of NCCL's
        low-latency collectives): no fence and no counter. Each program writes its V words, then
        loads all W (relaxed, past L1) until every tag is this stage's: with PER_THREAD each
        thread spins on its own PACK words, else the program polls them all and tests them with
        one reduction across its threads."""
        pid = tl.program_id(0)
        index, mine = _own_words(pid, W, V, VP)
        every = tl.arange(0, WP)
        read = tl.where(every < W, every, 0)  # pad lanes re-read word 0
        checksum = tl.zeros([WP], dtype=tl.int32)
        for stage in range(STAGES):
            slot = mail_ptr + (stage % 2) * W  # two mailboxes, as in _handoff_kernel
            tag = stage + 1  # the mailboxes start zeroed: no tag yet
            value = (stage * W + index).to(tl.int64)
            # lanes without a word of this program write a scratch word past both mailboxes
            _store_tagged(tl.where(mine, slot + index, mail_ptr + 2 * W),
                          (tag.to(tl.int64) << 32) | value)
            if PER_THREAD:
                values = _load_tagged(slot + read, tl.full([WP], tag, tl.int32), SPIN_ASM,
                                      SPIN_CONSTRAINTS, PACK)
                # no thread may write the next stage's words while another still waits for
                # this one's: two stages on, the mailbox is rewritten (and the wait never ends)
                tl.debug_barrier()
            else:  # the whole program polls: all words, then one test across its threads
                words = tl.load(slot + read, volatile=True)
                while tl.min(((words >> 32) == tag).to(tl.int32)) == 0:
                    words = tl.load(slot + read, volatile=True)
                values = words.to(tl.int32)
            checksum += tl.where(every < W, values, 0)
        tl.store(checksum_ptr + pid, tl.sum(checksum))

    @triton.jit
    def _vector_counter_kernel(counter_ptr, mail_ptr, checksum_ptr, STAGES, P: tl.constexpr,
                               W: tl.constexpr, WP: tl.constexpr, V: tl.constexpr,
                               VP: tl.constexpr):
        """The same handoffs through a done-counter, as a persistent kernel does them today:
        write V plain words, arrive (release), spin, acquire, then read all W words from L2."""
        pid = tl.program_id(0)
        index, mine = _own_words(pid, W, V, VP)
        every = tl.arange(0, WP)
        checksum = tl.zeros([WP], dtype=tl.int32)
        for stage in range(STAGES):
            slot = mail_ptr + (stage % 2) * W
            tl.store(slot + index, stage * W + index, mask=mine)
            _publish(counter_ptr)
            _wait(counter_ptr, (stage + 1) * P)
            checksum += tl.load(slot + every, mask=every < W, other=0, cache_modifier=".cg")
        tl.store(checksum_ptr + pid, tl.sum(checksum))

    @triton.jit
    def _vector_boundary_kernel(src_ptr, dst_ptr, checksum_ptr, stage, W: tl.constexpr,
                                WP: tl.constexpr, V: tl.constexpr, VP: tl.constexpr,
                                PDL: tl.constexpr):
        """One launch of a chain of vector handoffs by kernel boundaries, as phasegraph ships
        them: read all W words the launch before wrote into this program's checksum, then write
        this stage's V words."""
        pdl_enter(PDL)
        pid = tl.program_id(0)
        index, mine = _own_words(pid, W, V, VP)
        every = tl.arange(0, WP)
        total = tl.sum(tl.load(src_ptr + every, mask=every < W, other=0))
        tl.store(checksum_ptr + pid, tl.load(checksum_ptr + pid) + total)
        tl.store(dst_ptr + index, stage * W + index, mask=mine)


def expected_checksum(stages: int, programs: int) -> torch.Tensor:
    """What each program of ``_handoff_kernel`` must have summed: Σ_s (s·P + neighbour)."""
    neighbour = (torch.arange(programs) + 1) % programs
    return stages * (stages - 1) // 2 * programs + stages * neighbour


def graph_time_us(work, replays: int = REPLAYS) -> float:
    """Mean GPU time of one replay of a CUDA graph of ``work()``, by events around ``replays``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def slope_us(times: dict[int, float]) -> float:
    """Least-squares slope of time over stage count: the cost of one more stage."""
    return statistics.linear_regression(list(times), list(times.values())).slope


def time_chains(work, check) -> dict[int, float]:
    """µs per replay of a CUDA graph of ``work(stages)`` for each of STAGE_COUNTS, with
    ``check(stages)`` run on what the replays left (it raises where a chain went wrong)."""
    times = {}
    for stages in STAGE_COUNTS:
        times[stages] = graph_time_us(functools.partial(work, stages))
        check(stages)
    return times


def measure_handoff(programs: int) -> dict:
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    mail = torch.zeros(2 * programs, dtype=torch.int32, device="cuda")
    checksum = torch.zeros(programs, dtype=torch.int32, device="cuda")

    def work(stages):
        counter.zero_()
        _handoff_kernel[(programs,)](counter, mail, checksum, stages, P=programs)

    def check(stages):
        if not torch.equal(checksum.cpu(), expected_checksum(stages, programs).to(torch.int32)):
            raise AssertionError(f"handoff chain of {programs} programs, {stages} stages: "
                                 "a program read a value from the wrong stage")

    times = time_chains(work, check)
    return {"programs": programs, "us_by_stages": times, "us_per_handoff": slope_us(times)}


def measure_pingpong() -> dict:
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    def work(stages):
        flag.zero_()
        _pingpong_kernel[(2,)](flag, stages)

    def check(stages):
        if flag.item() != 2 * stages:
            raise AssertionError(f"ping-pong of {stages} rounds ended at turn {flag.item()}")

    times = time_chains(work, check)
    # two one-way handoffs per stage
    return {"programs": 2, "us_by_stages": times, "us_per_handoff": slope_us(times) / 2}


def measure_boundary(programs: int, pdl: bool) -> dict:
    buffers = [torch.zeros(programs, dtype=torch.int32, device="cuda") for _ in range(2)]
    options = pdl_options() if pdl else {"PDL": False}

    def work(stages):
        buffers[0].zero_()
        for step in range(stages):
            _boundary_kernel[(programs,)](buffers[step % 2], buffers[(step + 1) % 2], **options)

    def check(stages):
        if not bool((buffers[stages % 2] == stages).all()):
            raise AssertionError(f"launch chain of {stages}: a kernel ran before its input")

    times = time_chains(work, check)
    return {"programs": programs, "pdl": pdl and options.get("PDL", False),
            "us_by_stages": times, "us_per_handoff": slope_us(times)}


def carried_words(hidden: int) -> dict[str, int]:
    """The 32-bit words of the input a handoff hands to every SM at batch 1: the decode step's
    one float32 row, the tree verify's N float32 rows, and a head forward's K bfloat16 rows (two
    to a word; the fc's larger input is counted as these, which favours η)."""
    tree = {label: kwargs for label, kwargs, _ in PG_CONFIGS}[TREE]
    return {"decode step": hidden, "tree verify": tree["num_draft_tokens"] * hidden,
            "head forward": tree["topk"] * hidden // 2}


# a product's whole input, in 32-bit words, for each kind of handoff of the bench pair
PAIR_WORDS = carried_words(PRESETS["bench-pair"].target.hidden_size)
VECTOR_WORDS = tuple(sorted(set(PAIR_WORDS.values())))
VECTOR_WARPS = 8


def expected_vector_checksum(stages: int, words: int) -> int:
    """What each program of a vector chain sums over ``stages`` stages, stage s carrying the
    values s·W + w (w < W): Σ_s (s·W² + W(W−1)/2), wrapped to int32 as the kernels add."""
    total = words * words * stages * (stages - 1) // 2 + stages * words * (words - 1) // 2
    return (total + 2**31) % 2**32 - 2**31


def _vector_shape(words: int, programs: int) -> dict:
    """The constexprs of the vector kernels: W words, V = ⌈W / programs⌉ written by each program,
    and the power-of-two widths (WP, VP) of the ranges that hold them."""
    per_program = -(-words // programs)
    return {"W": words, "WP": next_pow2(words), "V": per_program, "VP": next_pow2(per_program)}


def _check_vector(checksum: torch.Tensor, stages: int, words: int, name: str) -> None:
    want = expected_vector_checksum(stages, words)
    got = checksum.cpu()
    if not bool((got == want).all()):
        raise AssertionError(f"{name} of {words} words, {stages} stages: a program summed "
                             f"{got.tolist()[:4]}..., not {want}")


def measure_vector_handoffs(programs: int, words: int) -> list[dict]:
    """Handoffs of a ``words``-word vector among ``programs`` programs three ways: tagged words
    (no fence, no counter), a done-counter then a read from L2, and kernel boundaries under PDL."""
    shape = _vector_shape(words, programs)
    checksum = torch.zeros(programs, dtype=torch.int32, device="cuda")
    tagged_mail = torch.zeros(2 * words + 1, dtype=torch.int64, device="cuda")  # + a scratch word
    plain_mail = torch.zeros(2 * words, dtype=torch.int32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    pack = shape["WP"] // (32 * VECTOR_WARPS)  # the words of one thread

    def tagged(stages, per_thread):
        tagged_mail.zero_()
        _vector_tagged_kernel[(programs,)](tagged_mail, checksum, stages, P=programs,
                                           PER_THREAD=per_thread, SPIN_ASM=_spin_asm(pack),
                                           SPIN_CONSTRAINTS=_spin_constraints(pack), PACK=pack,
                                           num_warps=VECTOR_WARPS, **shape)

    def counted(stages):
        counter.zero_()
        _vector_counter_kernel[(programs,)](counter, plain_mail, checksum, stages, P=programs,
                                            num_warps=VECTOR_WARPS, **shape)

    options = pdl_options()

    def launched(stages):
        checksum.zero_()
        plain_mail.zero_()
        for stage in range(stages):
            src, dst = plain_mail[(stage + 1) % 2 * words:], plain_mail[stage % 2 * words:]
            _vector_boundary_kernel[(programs,)](src, dst, checksum, stage,
                                                 num_warps=VECTOR_WARPS, **shape, **options)

    rows = []
    for name, work, stages_read in (("tagged words, the program polls",
                                      lambda s: tagged(s, False), lambda s: s),
                                     ("tagged words, each thread spins on its own",
                                      lambda s: tagged(s, True), lambda s: s),
                                     ("done-counter, then read", counted, lambda s: s),
                                     ("kernel boundary, PDL on", launched, lambda s: s - 1)):
        times = time_chains(work, lambda s, name=name, stages_read=stages_read: _check_vector(
            checksum, stages_read(s), words, name))
        rows.append({"handoff": name, "programs": programs, "words": words,
                     "pdl": options.get("PDL", False) if work is launched else None,
                     "us_by_stages": times, "us_per_handoff": slope_us(times)})
    return rows


def handoffs(layers: int, draft_forwards: int) -> dict[str, int]:
    """The all-to-all handoffs a batch-1 step cannot avoid, counted so as to favour η.

    A decoder layer has four: attention output -> o, o's residual -> gate/up (the norm needs the
    whole row), gate/up -> down, down's residual -> the next product (norm, qkv and attention
    share one: a KV head's columns can stay on one group of SMs). A decode step adds lm_head ->
    the next step (each consumer reduces the partial argmaxes itself). The tree iteration has
    the target's, the EAGLE-3 head's fc (3 features -> 1) before its first forward, and per head
    forward its layer's four plus lm_head -> the next forward (top-k, acceptance and the tree's
    assembly folded into their consumers the same way)."""
    decode = 4 * layers + 1
    iteration = decode + 1 + draft_forwards * (4 + 1)
    return {"decode step": decode, "tree iteration": iteration}


def ideal_times_us(step_bytes: int, iteration_bytes: int, bandwidth: float, handoff_us: float,
                   counts: dict[str, int]) -> dict:
    """Decode step and tree iteration as their bytes at ``bandwidth`` plus their handoffs, one
    after the other (a kernel that reads its weights only after its wait), arithmetic free."""
    step_us = step_bytes / bandwidth * 1e6 + counts["decode step"] * handoff_us
    iteration_us = iteration_bytes / bandwidth * 1e6 + counts["tree iteration"] * handoff_us
    return {"handoff_us": handoff_us, "decode_step_us": step_us, "tree_iteration_us": iteration_us,
            "eta_bound": step_us / iteration_us}


def break_even_handoff_us(step_bytes: int, iteration_bytes: int, bandwidth: float,
                          counts: dict[str, int], goal: float = 0.75) -> float:
    """The handoff cost at which ``ideal_times_us``' η falls to ``goal``."""
    surplus_us = (goal * iteration_bytes - step_bytes) / bandwidth * 1e6
    return surplus_us / (counts["decode step"] - goal * counts["tree iteration"])


def batch1_tree_row(bench: dict) -> dict:
    """The bench JSON's trained-pair row of phasegraph's EAGLE-3 tree at batch 1."""
    return next(row for row in bench["trained_pair"]["rows"]
                if row["config"] == TREE and row["batch"] == 1 and row["engine"] == "phasegraph")


def ideal_carrying_us(step_bytes: int, iteration_bytes: int, bandwidth: float,
                      counts: dict[str, int], words: dict[str, int],
                      carried_us: dict[int, float]) -> dict:
    """As :func:`ideal_times_us`, each handoff at the measured cost of handing on its input
    (``carried_us``: µs by words): the verify's as many as the decode step's, the rest the
    head's."""
    step_us = (step_bytes / bandwidth * 1e6
               + counts["decode step"] * carried_us[words["decode step"]])
    iteration_us = (iteration_bytes / bandwidth * 1e6
                    + counts["decode step"] * carried_us[words["tree verify"]]
                    + (counts["tree iteration"] - counts["decode step"])
                    * carried_us[words["head forward"]])
    return {"handoff_us": {k: carried_us[v] for k, v in words.items()},
            "decode_step_us": step_us, "tree_iteration_us": iteration_us,
            "eta_bound": step_us / iteration_us}


def _layer_products(spec, input_width: int) -> list[tuple[str, int]]:
    """A decoder layer's four products in dataflow order, as (name, parameters): qkv (whose
    input is ``input_width`` wide), o, gate/up, down."""
    heads = spec.num_heads or spec.hidden_size // spec.head_dim
    query, kv = heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return [("qkv", input_width * (query + 2 * kv)), ("o", query * spec.hidden_size),
            ("gate/up", spec.hidden_size * 2 * spec.intermediate_size),
            ("down", spec.intermediate_size * spec.hidden_size)]


def pair_dtype_bytes(bench: dict) -> dict[str, int]:
    """The element sizes of the bench JSON's trained pair: "target" and "head" (its draft)."""
    pair = bench["trained_pair"]
    return {"target": getattr(torch, pair["dtype"]).itemsize,
            "head": getattr(torch, pair["draft_dtype"]).itemsize}


def stage_bytes(weight_bytes: dict, dtype_bytes: dict[str, int]) -> dict[str, list[int]]:
    """The weight bytes of each product, in dataflow order, for the bench pair: the target's
    decode step (each layer's four products, then lm_head), the EAGLE-3 head's fc, and one head
    forward (a decoder layer whose qkv reads the token's embedding and a hidden state, then its
    lm_head). Each lm_head is what is left of the bench JSON's bytes (norm weights included),
    so the stages add up to them exactly. ``dtype_bytes``: "target" and "head" element sizes."""
    target = PRESETS["bench-pair"].target
    head = dataclasses.replace(target, num_heads=PRESETS["bench-pair"].head.num_heads,
                        num_kv_heads=PRESETS["bench-pair"].head.num_kv_heads,
                        intermediate_size=PRESETS["bench-pair"].head.intermediate_size)
    layer = [n * dtype_bytes["target"] for _, n in _layer_products(target, target.hidden_size)]
    step = layer * target.num_layers
    head_layer = [n * dtype_bytes["head"] for _, n in _layer_products(head, 2 * head.hidden_size)]
    stages = {"decode step": step + [weight_bytes["step"] - sum(step)],
              "head fc": [weight_bytes["draft_once"]],
              "head forward": head_layer + [weight_bytes["draft_pass"] - sum(head_layer)]}
    if min(stages["decode step"][-1], stages["head forward"][-1]) <= 0:
        raise ValueError("the bench JSON's weight bytes are not the bench pair's")
    return stages


def ideal_streamed_us(stages: dict[str, list[int]], draft_passes: int, bandwidth: float,
                      words: dict[str, int], carried_us: dict[int, float],
                      head_in_l2: bool) -> dict:
    """As :func:`ideal_carrying_us`, but each product's weights stream in *during* the handoff
    before it (what a kernel that loads its weights before its PDL wait does), so a product
    costs the larger of its bytes' time and its handoff's, not their sum. Only the next
    product's weights are streamed ahead (the SMs hold ~30 MB; a target layer's products are
    up to 16 MB). With ``head_in_l2``, head forwards after the first read no DRAM bytes."""
    def chain_us(products: list[int], handoff_us: float) -> float:
        return sum(max(b / bandwidth * 1e6, handoff_us) for b in products)

    verify_us, head_us = carried_us[words["tree verify"]], carried_us[words["head forward"]]
    step_us = chain_us(stages["decode step"], carried_us[words["decode step"]])
    first_forward_us = chain_us(stages["head fc"] + stages["head forward"], head_us)
    later_forward = [0] * len(stages["head forward"]) if head_in_l2 else stages["head forward"]
    iteration_us = (chain_us(stages["decode step"], verify_us) + first_forward_us
                    + (draft_passes - 1) * chain_us(later_forward, head_us))
    return {"handoff_us": {k: carried_us[v] for k, v in words.items()},
            "decode_step_us": step_us, "tree_iteration_us": iteration_us,
            "eta_bound": step_us / iteration_us}


def bound_from_bench(bench: dict, handoff_us: float,
                     carried_us: dict[int, float] | None = None) -> dict:
    """Ideal times for the bench JSON's batch-1 tree row at its measured copy bandwidth, under
    three readings of where the bytes come from and what a handoff costs; with ``carried_us``
    (µs per handoff by the words it hands on, measured), two more in which each handoff carries
    its input."""
    tree = batch1_tree_row(bench)
    weight_bytes = tree["weight_bytes"]
    layers = PRESETS["bench-pair"].target.num_layers
    counts = handoffs(layers, weight_bytes["draft_passes"])
    bandwidth = bench["scale"]["copy_bandwidth_Bps"]
    step, iteration = weight_bytes["step"], weight_bytes["iteration"]
    # the head's weights fit in L2 (50 MB on an H100): only its first forward reads them from DRAM
    head_in_l2 = step + weight_bytes["draft_pass"] + weight_bytes["draft_once"]
    models = {
        "every weight from DRAM": ideal_times_us(step, iteration, bandwidth, handoff_us, counts),
        "every weight from DRAM, handoffs free": ideal_times_us(step, iteration, bandwidth, 0.0,
                                                                counts),
        "the head's weights held in L2 after its first forward": ideal_times_us(
            step, head_in_l2, bandwidth, handoff_us, counts),
    }
    words = PAIR_WORDS
    if carried_us is not None and all(w in carried_us for w in words.values()):
        models["every weight from DRAM, each handoff carrying its input"] = ideal_carrying_us(
            step, iteration, bandwidth, counts, words, carried_us)
        models["the head in L2, each handoff carrying its input"] = ideal_carrying_us(
            step, head_in_l2, bandwidth, counts, words, carried_us)
        stages = stage_bytes(weight_bytes, pair_dtype_bytes(bench))
        for name, in_l2 in (("every weight from DRAM", False), ("the head in L2", True)):
            models[f"{name}, each carrying handoff streaming the next product's weights"] = (
                ideal_streamed_us(stages, weight_bytes["draft_passes"], bandwidth, words,
                                  carried_us, in_l2))
    return {"bench_commit": bench["env"].get("git_commit"), "step_bytes": step,
            "iteration_bytes": iteration, "copy_bandwidth_Bps": bandwidth, "handoffs": counts,
            "measured_eta": tree["eta"],
            "break_even_handoff_us": break_even_handoff_us(step, iteration, bandwidth, counts),
            "models": models}


def report(result: dict) -> str:
    lines = [f"Device: {result['device']}; torch {result['torch']}, triton {result['triton']}", "",
             "| chain | programs | µs by stage count | µs per handoff |", "|---|---|---|---|"]
    for row in [result["pingpong"]] + result["handoff"] + result["boundary"]:
        if row["programs"] == 2:
            name = "point to point (one program to one other; µs per stage = 2 handoffs)"
        elif "pdl" in row:
            name = f"kernel boundary, PDL {'on' if row['pdl'] else 'off'}"
        else:
            name = "persistent handoff, every program to every other"
        stages = ", ".join(f"{s}: {t:.1f}" for s, t in row["us_by_stages"].items())
        lines.append(f"| {name} | {row['programs']} | {stages} | {row['us_per_handoff']:.3f} |")
    if result.get("vector"):
        lines += ["", "A whole vector handed to every program (a product's input), "
                  f"{result['vector'][0]['programs']} programs:", "",
                  "| handoff | words (32-bit) | µs by stage count | µs per handoff |",
                  "|---|---|---|---|"]
        for row in result["vector"]:
            stages = ", ".join(f"{s}: {t:.1f}" for s, t in row["us_by_stages"].items())
            lines.append(f"| {row['handoff']} | {row['words']} | {stages} | "
                         f"{row['us_per_handoff']:.3f} |")
    if "bound" in result:
        bound = result["bound"]
        lines += ["", f"Bench run {bound['bench_commit']}: {bound['step_bytes'] / 1e6:.1f} MB per "
                  f"decode step, {bound['iteration_bytes'] / 1e6:.1f} MB per tree iteration, "
                  f"{bound['copy_bandwidth_Bps'] / 1e12:.3f} TB/s; handoffs "
                  f"{bound['handoffs']['decode step']} per step, "
                  f"{bound['handoffs']['tree iteration']} per iteration; measured η "
                  f"{bound['measured_eta']:.2f}. With every weight from DRAM, η reaches 0.75 only "
                  f"with handoffs of at most {bound['break_even_handoff_us']:.3f} µs.", "",
                  "| ideal (arithmetic free, bytes at the copy bandwidth) | handoff | decode step "
                  "| tree iteration | η |", "|---|---|---|---|---|"]
        for name, row in bound["models"].items():
            cost = row["handoff_us"]
            cost = (" / ".join(f"{us:.3f}" for us in cost.values()) if isinstance(cost, dict)
                    else f"{cost:.3f}")
            lines.append(f"| {name} | {cost} µs | {row['decode_step_us']:.1f} µs "
                         f"| {row['tree_iteration_us']:.1f} µs | {row['eta_bound']:.3f} |")
        if any(isinstance(row["handoff_us"], dict) for row in bound["models"].values()):
            lines += ["", "Where each handoff carries its input, its cost is the cheapest measured "
                      "for the words handed on: decode step / tree verify / head forward."]
    return "\n".join(lines) + "\n"


def measured_handoff_us(result: dict) -> float:
    """The cheapest handoff among every program of the GPU: persistent or kernel boundary."""
    return min(row["us_per_handoff"] for row in result["handoff"] + result["boundary"]
               if row["programs"] == result["sms"])


def carried_handoff_us(result: dict) -> dict[int, float]:
    """The cheapest measured way of handing a vector to every program, by its words."""
    cheapest: dict[int, float] = {}
    for row in result.get("vector", []):
        cheapest[row["words"]] = min(row["us_per_handoff"],
                                     cheapest.get(row["words"], float("inf")))
    return cheapest


def write_result(out: Path, name: str, result: dict, text: str) -> None:
    """``name``.json (every figure) and ``name``.md (the report) into ``out``; the report printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bench-json", type=Path, help="a phasegraph bench JSON to bound")
    parser.add_argument("--measured", type=Path,
                        help="a handoff_bound.json recorded on a GPU: recompute its bound here "
                             "(on any machine) instead of measuring")
    args = parser.parse_args(argv)
    for given in (args.bench_json, args.measured):
        if given is not None and not given.is_file():
            parser.error(f"{given}: no such file")
    if args.measured:
        result = json.loads(args.measured.read_text())
    elif triton is None or not torch.cuda.is_available():
        print("handoff_bound.py: needs Triton and a CUDA GPU (or --measured FILE)",
              file=sys.stderr)
        return 2
    else:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "triton": triton.__version__, "sms": sms,
                  "pingpong": measure_pingpong(),
                  "handoff": [measure_handoff(p) for p in (1, 32, sms)],
                  "boundary": [measure_boundary(sms, pdl) for pdl in (True, False)],
                  "vector": [row for words in VECTOR_WORDS
                             for row in measure_vector_handoffs(sms, words)]}
    if args.bench_json:
        result["bound"] = bound_from_bench(json.loads(args.bench_json.read_text()),
                                           measured_handoff_us(result), carried_handoff_us(result))
    write_result(args.out, "handoff_bound", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
