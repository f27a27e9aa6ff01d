"""Cost of one validated phase transition with a DraftState of B=64, per validation mode.

    python benchmarks/bench_transition.py [--batch 64] [--repeat 20000]

The phase body returns a prebuilt output, so the figure is the machine's own cost: the legality
lookup, the boundary checks of the mode, the mutation check (strict) and the trace hook. The
output carries its input's BatchParams, as decode and the speculative phases do; strict mode
checks the invariants of a nested schema only where a phase built a new one (prefill, merge,
filter, retract), which costs those transitions ~25 us more on a 2-core CPU.
Goal: strict <= 50 us, off <= 3 us per transition on the CPU machine.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import attrs
import torch

from phasegraph.phases.eagle import EDGES
from phasegraph.statemachine import Machine, PhaseGraph
from phasegraph.testing import synthetic as syn


def build(batch: int):
    base = syn.synthetic_eagle_graph()
    a = syn.draft_state(batch, K=4, hd=256)
    b = syn.draft_state(batch, K=4, hd=256).replace(params=a.params)  # params carried, as decode does
    outputs = {True: b, False: a}
    flip = {"v": True}

    def decode_body(state, ctx):
        flip["v"] = not flip["v"]
        return outputs[flip["v"]]

    phases = [attrs.evolve(p, fn=decode_body) if p.name == "decode" else p for p in base]
    return PhaseGraph("bench", phases, EDGES, entry="prefill-extend"), a


def time_mode(graph, state, mode: str, repeat: int) -> float:
    m = Machine(graph, validate=mode)
    m.reset("decode", state)
    for _ in range(1000):
        m.advance("decode")
    samples = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(repeat):
            m.advance("decode")
        samples.append((time.perf_counter_ns() - t0) / repeat / 1000)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    graph, state = build(args.batch)
    print(f"phase transition cost, DraftState B={args.batch}, K=4, Hd=256 ({platform.processor() or platform.machine()}, torch {torch.__version__})")
    for mode in ("strict", "boundary", "off"):
        us = time_mode(graph, state, mode, args.repeat if mode != "strict" else args.repeat // 10)
        print(f"  {mode:<8} {us:8.2f} us / transition")


if __name__ == "__main__":
    main()
