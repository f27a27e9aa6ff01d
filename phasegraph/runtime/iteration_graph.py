"""One CUDA graph per speculative iteration: draft -> verify -> finalize-tree-path -> draft-extend.

Per-phase graphs (:class:`~phasegraph.runtime.cuda_graphs.GraphedPhase`) launch four graphs an
iteration and copy each phase's input into its static buffers; at batch 1 that host work is
what the GPU waits on. Here the four phases are captured back to back as
one graph per bucket, so an iteration costs one input copy and one launch.

The state machine still advances phase by phase, with every legality check and schema check:

- ``draft`` copies its input into the static input and replays the whole iteration, copies
  all four phases' outputs out of the static buffers (one multi-tensor copy per dtype; nested
  inputs pointing at the real objects, as a per-phase replay would), and returns the draft's;
- ``verify``, ``finalize-tree-path`` and ``draft-extend`` return the already copied output of
  their phase, *only* when their input is the object the previous phase of the same replay
  returned; any other input runs the per-phase path (``fallback``), so nothing is ever served
  from a replay that did not see it.

The device-side effects of a replay (tree KV written by verify, the accepted KV moved to the
front by finalize, draft KV written by draft-extend) land at draft time rather than at each
phase; all of them write slots past the request's committed length, so an iteration stopped
after ``draft`` leaves only scratch behind. finalize-tree-path's KV move is not idempotent, so
a bucket is never warmed up on real input: its first iteration runs phase by phase (the real
work), and the next one warms the iteration up on all-padded rows (which write only the
reserved sink page), captures it on the real rows (recording, not executing) and replays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs
import torch

from phasegraph.runtime.cuda_graphs import (
    CAPTURE_ERROR_MODE,
    EmulatedGraph,
    GraphCapture,
    InputCopier,
    OutputCopier,
    SegmentedGraph,
    copy_inputs_in,
    copy_into_static,
    copy_outputs_out,
    fill_neutral,
    no_garbage_collection,
    pad_schema,
    warm_up,
)
from phasegraph.statemachine import PhaseSpec, Schema

ITERATION = ("draft", "verify", "finalize-tree-path", "draft-extend")


@attrs.define
class _CapturedIteration:
    graph: Any  # torch.cuda.CUDAGraph or EmulatedGraph (over the list of outputs)
    static_in: Schema  # padded DraftState
    static_outs: list[Schema]  # the four phases' outputs, in ITERATION order
    copiers: dict[int, OutputCopier] = attrs.field(factory=dict)  # per batch size
    input_copiers: dict[int, InputCopier] = attrs.field(factory=dict)  # per batch size


class IterationGraph:
    """Serves the four phases of a speculative iteration from one graph per bucket."""

    def __init__(self, runner: GraphCapture, specs: dict[str, PhaseSpec], fallback: dict[str, Callable]):
        self.runner = runner
        self.specs = specs
        self.fallback = fallback  # per-phase path (GraphedPhase or the plain function)
        self.graphs: dict[tuple, _CapturedIteration] = {}
        self.warmed: set[tuple] = set()
        self.replays = 0
        self.served = {name: 0 for name in ITERATION}
        self.fallback_calls = {name: 0 for name in ITERATION}
        # what the next phase may be served: (phase name, expected input object, the replay's outputs, index)
        self._pending: tuple | None = None

    def release(self) -> None:
        """Drop every captured graph and the outputs of the last replay (a shut-down engine)."""
        self.graphs.clear()
        self._pending = None

    def phase_fn(self, name: str) -> Callable:
        def run(state: Schema, ctx: Any, **extra: Any) -> Schema:
            return self._draft(state, ctx, extra) if name == "draft" else self._next(name, state, ctx, extra)

        run.__name__ = f"iteration_graph[{name}]"
        return run

    # ------------------------------------------------------------------ draft: replay the iteration
    def _draft(self, state: Schema, ctx: Any, extra: dict) -> Schema:
        self._pending = None
        batch = state.batch_size or 0
        bucket = self.runner.bucket_for(batch)
        if bucket is None or extra or not self.runner.enabled:
            return self._fall_back("draft", state, ctx, extra)
        key = self.runner.graph_key(state, ctx, batch, bucket)
        cap = self.graphs.get(key)
        if cap is None and key not in self.warmed:
            self.warmed.add(key)  # warm-up: this iteration runs phase by phase, for real
            return self._fall_back("draft", state, ctx, extra)
        replay = True
        if cap is None:
            cap = self._capture(state, ctx, batch, bucket, key)
            replay = not self.runner.emulate  # an emulated capture has executed the iteration
        else:
            copy_inputs_in(cap.input_copiers, cap.static_in, state, batch, bucket)
        if replay:
            cap.graph.replay()
        self.replays += 1
        # every phase's output copied out now, in one multi-tensor copy per dtype
        return self._serve(0, copy_outputs_out(cap.copiers, cap.static_outs, cap.static_in, state, batch, bucket))

    def _capture(self, state: Schema, ctx: Any, batch: int, bucket: int, key: tuple) -> _CapturedIteration:
        static_in = pad_schema(state, batch, bucket)

        def run_iteration() -> list[Schema]:
            outs, x = [], static_in
            for name in ITERATION:
                x = self.specs[name].fn(x, ctx)
                outs.append(x)
            return outs

        # structured output: the graph is cut at each grammar call, which runs on the host
        segmented = (SegmentedGraph(ctx, run_iteration, self.runner.pool, self.runner.emulate)
                     if getattr(ctx, "grammar", None) is not None else None)
        if self.runner.emulate:
            if segmented is not None:
                graph, static_outs = segmented, segmented.capture()
            else:
                static_outs = run_iteration()
                graph = EmulatedGraph(run_iteration, static_outs)
        else:
            # warm up on all-padded rows (they write only the sink page), so that nothing is
            # compiled, autotuned or lazily initialised inside the capture; then the real rows
            fill_neutral(static_in)
            with contextlib.nullcontext() if segmented is None else segmented.warm_up_masks():
                warm_up(run_iteration)
            copy_into_static(static_in, state, batch, bucket)
            if segmented is not None:
                graph, static_outs = segmented, segmented.capture()
            else:
                graph = torch.cuda.CUDAGraph()
                with no_garbage_collection(), torch.cuda.graph(graph, pool=self.runner.pool,
                                                               capture_error_mode=CAPTURE_ERROR_MODE):
                    static_outs = run_iteration()
        cap = _CapturedIteration(graph, static_in, static_outs)
        self.graphs[key] = cap
        return cap

    # ------------------------------------------------------------------ the other three phases
    def _next(self, name: str, state: Schema, ctx: Any, extra: dict) -> Schema:
        pending, self._pending = self._pending, None
        if pending is None or extra or pending[0] != name or pending[1] is not state:
            return self._fall_back(name, state, ctx, extra)
        _, _, outs, index = pending
        return self._serve(index, outs)

    def _serve(self, index: int, outs: list[Schema]) -> Schema:
        """Phase ``index``'s output of the replay; the next phase may be served only if its
        input is this very object."""
        self.served[ITERATION[index]] += 1
        if index + 1 < len(ITERATION):
            self._pending = (ITERATION[index + 1], outs[index], outs, index + 1)
        return outs[index]

    def _fall_back(self, name: str, state: Schema, ctx: Any, extra: dict) -> Schema:
        self.fallback_calls[name] += 1
        return self.fallback[name](state, ctx, **extra)

    def stats(self) -> dict[str, Any]:
        return {"graphs": len(self.graphs), "replays": self.replays, "served": dict(self.served),
                "fallback": dict(self.fallback_calls)}
