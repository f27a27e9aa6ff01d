"""The engine's CUDA graphs: every phase of an iteration graphed, per batch-size bucket.

:class:`GraphRunner` builds the EAGLE graph over graphed phases: per-phase graphs
(:class:`~phasegraph.runtime.cuda_graphs.GraphedPhase`), with scope ``"iteration"`` the four
phases of a speculative iteration as one graph
(:class:`~phasegraph.runtime.iteration_graph.IterationGraph`), and with prefill token buckets
prefill-extend's graphs (:class:`~phasegraph.runtime.prefill_graph.PrefillGraph`). It sits
above all three, which share only :class:`~phasegraph.runtime.cuda_graphs.GraphCapture`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from phasegraph.phases.eagle import EDGES, PHASES
from phasegraph.phases.schemas import PrefillResult
from phasegraph.runtime.config import GRAPH_SCOPES
from phasegraph.runtime.cuda_graphs import DEFAULT_BUCKETS, GraphCapture, GraphedPhase
from phasegraph.runtime.iteration_graph import ITERATION, IterationGraph
from phasegraph.runtime.prefill_graph import PrefillGraph
from phasegraph.statemachine import PhaseGraph, PhaseSpec, Schema


class GraphRunner(GraphCapture):
    """Owns the captured graphs, their static buffers and the shared memory pool."""

    def __init__(
        self,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        enabled: bool = True,
        emulate: bool = False,
        scope: str = "iteration",
        prefill_token_buckets: Sequence[int] = (),
        phases: Sequence[PhaseSpec] = PHASES,
    ):
        if scope not in GRAPH_SCOPES:
            raise ValueError(f"graph scope must be one of {GRAPH_SCOPES}, got {scope!r}")
        super().__init__(buckets, enabled, emulate)
        self.scope = scope
        self.iteration = None  # the IterationGraph, with scope "iteration"
        # prefill-extend graphs per (request bucket, token bucket); none: prefill runs eagerly
        self.prefill_token_buckets = tuple(prefill_token_buckets)
        self.prefill = None  # the PrefillGraph, with prefill token buckets
        self.phases: dict[str, GraphedPhase] = {}
        self.source = tuple(phases)  # the phases to graph: the EAGLE graph's, or a method's own

    def wrap(
        self, spec: PhaseSpec, when: Callable[[Schema], bool] | None = None, idempotent: bool = True
    ) -> PhaseSpec:
        """``spec`` with a graphed function; ``when(state)`` False runs the call eagerly."""
        graphed = GraphedPhase(self, spec, when, idempotent)
        self.phases[spec.name] = graphed
        return attrs.evolve(spec, fn=graphed)

    @functools.cached_property
    def graph(self) -> PhaseGraph:
        """The EAGLE graph with every phase of an iteration graphed (draft, verify,
        finalize-tree-path, draft-extend after decode, decode): the same phases, edges and
        schemas, another execution."""

        def after_decode(state: Schema) -> bool:
            return not isinstance(state, PrefillResult)  # prefill's rows are ragged

        when = {"draft": None, "verify": None, "finalize-tree-path": None,
                "draft-extend": after_decode, "decode": None}
        not_idempotent = {"finalize-tree-path"}  # it moves KV within the request's own slots
        phases = [
            self.wrap(p, when[p.name], p.name not in not_idempotent) if p.name in when else p
            for p in self.source
        ]
        if self.prefill_token_buckets:
            self.prefill = PrefillGraph(self, next(p for p in self.source if p.name == "prefill-extend"),
                                        self.prefill_token_buckets)
            phases = [attrs.evolve(p, fn=self.prefill) if p.name == "prefill-extend" else p for p in phases]
        if self.scope == "iteration":
            plain = {p.name: p for p in self.source if p.name in ITERATION}
            fallback = {p.name: p.fn for p in phases if p.name in ITERATION}
            self.iteration = IterationGraph(self, plain, fallback)
            phases = [attrs.evolve(p, fn=self.iteration.phase_fn(p.name)) if p.name in ITERATION else p
                      for p in phases]
        return PhaseGraph("eagle", phases, EDGES, entry="prefill-extend")

    def graph_count(self) -> int:
        """CUDA graphs held: per phase, whole iterations and prefill."""
        return sum(v["graphs"] for v in self.stats().values())

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per graphed phase: graphs, replays, eager calls and why (prefill-extend too when its
        graphs are on); with scope "iteration" also ``"iteration"``: its graphs, replays, and per
        phase how many calls it served."""
        out: dict[str, dict[str, Any]] = {
            name: {"graphs": len(p.graphs), "replays": p.replays, "eager": p.eager_calls,
                   "eager_reasons": dict(p.eager_reasons)}
            for name, p in self.phases.items()
        }
        if self.iteration is not None:
            out["iteration"] = self.iteration.stats()
        if self.prefill is not None:
            out["prefill-extend"] = self.prefill.stats()
        return out

    def release(self) -> None:
        """Drop every captured graph (a shut-down tensor-parallel engine: NCCL frees a
        communicator only once each graph that captured one of its collectives is destroyed)."""
        for holder in (*self.phases.values(), self.prefill):
            if holder is not None:
                holder.graphs.clear()
        if self.iteration is not None:
            self.iteration.release()
        self.enabled = False  # nothing captures again
