"""CUDA graphs of prefill-extend, per (request bucket, token bucket).

An eager prefill launches every kernel of every layer from Python: a 128-token prefill of a
Llama-3-8B shape issues ~330 launches, which on the lent H100 hosts take 20-40 ms against
~7.5 ms of GPU work. A prefill's tokens are ragged (each request brings its
own prompt length), so the per-batch-size graphs of the iteration phases do not fit it. Here a
prefill of ``B`` requests and ``T`` tokens replays the graph captured for the smallest token
bucket ``> T`` (one padded token at least) and the smallest request bucket ``>= B + 1``:

- the ``T`` real tokens come first, then ``bucket_T - T`` padded tokens, all owned by padded
  request ``B``; its row in the page table is the reserved row 0, every entry of which is the
  sink page 0, so padded tokens write and read only the sink (they sit at positions
  ``0 .. bucket_T - T - 1`` of their own causal sequence);
- requests ``B+1 ..`` own no tokens; every padded request selects the last padded token;
- attention, sampling and the feature rows are computed per request or per token, so the real
  rows of the output are those of an eager prefill of the same input (up to the rounding of a
  matrix product of ``bucket_T`` rows instead of ``T``), and are sliced back out (copied: the
  next replay overwrites the static outputs).

Capture leaves the committed state as it found it: prefill writes the KV of the prompt
positions, idempotently (a second run writes the same values), but the first call per bucket
still runs eagerly (the real work, compiling and autotuning nothing inside the capture), the
second warms up on all-padded rows and captures. Prompts longer than the largest token bucket,
batches above the largest request bucket and calls with extra inputs run eagerly.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from phasegraph.phases.schemas import REQUEST, TOKEN
from phasegraph.runtime.cuda_graphs import (
    CAPTURE_ERROR_MODE,
    EmulatedGraph,
    GraphCapture,
    foreach_copy,
    no_garbage_collection,
    warm_up,
)
from phasegraph.statemachine import PhaseSpec, Schema
from phasegraph.statemachine.rows import check_padding, pad_values

DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

@attrs.define
class _CapturedPrefill:
    graph: Any  # torch.cuda.CUDAGraph or EmulatedGraph
    static_in: Schema  # padded PrefillInput
    static_out: Schema  # PrefillResult of the padded input


def token_buckets_for(max_context: int, buckets=DEFAULT_TOKEN_BUCKETS) -> tuple[int, ...]:
    """The token buckets a prefill of at most ``max_context`` tokens per request may use."""
    return tuple(b for b in buckets if b <= max_context)


class PrefillGraph:
    """prefill-extend served from graphs captured per (request bucket, token bucket)."""

    def __init__(self, runner: GraphCapture, spec: PhaseSpec, token_buckets: tuple[int, ...]):
        self.runner = runner
        self.spec = spec
        self.token_buckets = tuple(sorted(set(int(b) for b in token_buckets)))
        # one request bucket past the runner's: the padded request that owns the padded tokens
        self.request_buckets = (*runner.buckets, runner.buckets[-1] + 1)
        self.graphs: dict[tuple, _CapturedPrefill] = {}
        self.warmed: set[tuple] = set()
        self.replays = 0
        self.eager_calls = 0
        self.eager_reasons: dict[str, int] = {}

    # ------------------------------------------------------------------ dispatch
    def _buckets(self, batch: int, tokens: int) -> tuple[int | None, int | None]:
        req_bucket = next((b for b in self.request_buckets if b >= batch + 1), None)
        # at least one padded token: the padded requests select it, never a live token
        tok_bucket = next((b for b in self.token_buckets if b >= tokens + 1), None)
        return req_bucket, tok_bucket

    def _eager(self, reason: str, state: Schema, ctx: Any, extra: dict) -> Schema:
        self.eager_calls += 1
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
        return self.spec.fn(state, ctx, **extra)

    def __call__(self, state: Schema, ctx: Any, **extra: Any) -> Schema:
        batch, tokens = state.seq_lens.shape[0], state.input_ids.shape[0]
        req_bucket, tok_bucket = self._buckets(batch, tokens)
        if not self.runner.enabled:
            return self._eager("graphs disabled", state, ctx, extra)
        if extra:
            return self._eager("extra inputs", state, ctx, extra)
        if batch == 0 or req_bucket is None:
            return self._eager("batch above the largest bucket (or empty)", state, ctx, extra)
        if tok_bucket is None:
            return self._eager("tokens above the largest token bucket", state, ctx, extra)
        key = (req_bucket, tok_bucket, *self.runner.context_key(ctx), state.params.stop_ids.shape[1],
               state.params.logit_bias is not None)
        cap = self.graphs.get(key)
        if cap is None and key not in self.warmed:
            self.warmed.add(key)
            return self._eager("warm-up call", state, ctx, extra)
        if cap is None:
            cap = self._capture(state, ctx, req_bucket, tok_bucket, key)
        else:
            copy_into_padded(cap.static_in, state)
        cap.graph.replay()
        self.replays += 1
        return slice_prefill_result(cap.static_out, state)

    def _capture(self, state: Schema, ctx: Any, req_bucket: int, tok_bucket: int, key: tuple) -> _CapturedPrefill:
        static_in = padded_prefill_input(state, req_bucket, tok_bucket)
        if self.runner.emulate:
            static_out = self.spec.fn(static_in, ctx)
            graph = EmulatedGraph(lambda: self.spec.fn(static_in, ctx), static_out)
        else:
            # warm up on an all-padded input (it writes only the sink page), then capture the
            # real rows (recording, not executing) and replay
            copy_into_padded(static_in, _no_rows(state))
            warm_up(lambda: self.spec.fn(static_in, ctx))
            copy_into_padded(static_in, state)
            graph = torch.cuda.CUDAGraph()
            with no_garbage_collection(), torch.cuda.graph(graph, pool=self.runner.pool, capture_error_mode=CAPTURE_ERROR_MODE):
                static_out = self.spec.fn(static_in, ctx)
        batch, tokens = state.seq_lens.shape[0], state.input_ids.shape[0]
        live = {REQUEST: batch, TOKEN: tokens}
        check_padding(static_in, batch, "prefill graph input", live.__getitem__)
        cap = _CapturedPrefill(graph, static_in, static_out)
        self.graphs[key] = cap
        return cap

    def stats(self) -> dict[str, Any]:
        return {"graphs": len(self.graphs), "replays": self.replays, "eager": self.eager_calls,
                "eager_reasons": dict(self.eager_reasons)}


# ---------------------------------------------------------------------- padding and slicing
def padded_prefill_input(state: Schema, req_bucket: int, tok_bucket: int) -> Schema:
    """A new PrefillInput of ``req_bucket`` requests and ``tok_bucket`` tokens holding ``state``."""
    def rows_of(x: torch.Tensor | None, role) -> torch.Tensor | None:
        if x is None:  # an optional field the batch does without
            return None
        n = req_bucket if role == REQUEST else tok_bucket
        return torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=x.device)

    params = type(state.params)(**{t.name: rows_of(getattr(state.params, t.name), t.role)
                                   for t in type(state.params).__schema__.tensors})
    static = type(state)(params=params, **{t.name: rows_of(getattr(state, t.name), t.role)
                                           for t in type(state).__schema__.tensors})
    copy_into_padded(static, state)
    return static


def copy_into_padded(static: Schema, state: Schema) -> None:
    """Write ``state`` into the padded static input in place: the real rows by one multi-tensor
    copy, then the padded rows from each field's declared padding, with padded request
    ``batch`` owning every padded token as the module docstring describes."""
    batch, tokens = state.seq_lens.shape[0], state.input_ids.shape[0]
    req_bucket, tok_bucket = static.seq_lens.shape[0], static.input_ids.shape[0]
    dev = static.input_ids.device
    owners = {REQUEST: torch.arange(batch, req_bucket, device=dev),
              TOKEN: torch.full((tok_bucket - tokens,), batch, device=dev)}
    live = {REQUEST: batch, TOKEN: tokens}
    dsts, srcs = [], []
    for real, padded in ((state.params, static.params), (state, static)):
        for t in type(real).__schema__.tensors:
            x, rows = getattr(real, t.name), getattr(padded, t.name)
            if x is None:  # absent from the graph's input too: its key says so
                continue
            dsts.append(rows[: x.shape[0]])
            srcs.append(x)
            if t.name in _LAYOUT_FIELDS or rows.shape[0] == live[t.role]:
                continue
            dsts.append(rows[live[t.role]:])
            srcs.append(pad_values(t, rows[live[t.role]:], owners[t.role], 1))
    foreach_copy(dsts, srcs)
    # the padded tokens: one causal sequence of padded request ``batch``, which every padded
    # request selects the last token of
    torch.arange(tok_bucket - tokens, out=static.positions[tokens:])
    static.select_index[batch:].fill_(tok_bucket - 1)
    static.seq_lens[batch:].fill_(1)
    static.seq_lens[batch] = max(tok_bucket - tokens, 1)


# fields whose padded rows follow the ragged layout above instead of their declared padding
_LAYOUT_FIELDS = ("positions", "select_index", "seq_lens")


def _no_rows(state: Schema) -> Schema:
    """A PrefillInput of no request and no token, with ``state``'s widths and dtypes."""
    params = type(state.params)(**{name: x[:0] for name, x in state.params.tensors()})
    return type(state)(params=params, **{name: x[:0] for name, x in state.tensors()})


def slice_prefill_result(static_out: Schema, state: Schema) -> Schema:
    """The real rows of a padded PrefillResult, copied out (one multi-tensor copy); ``params``
    is the real input's."""
    batch, tokens = state.seq_lens.shape[0], state.input_ids.shape[0]
    rows = {REQUEST: batch, TOKEN: tokens + (batch if static_out.lead else 0)}  # lead 1: a row per request more
    srcs, dsts, fields = [], [], {}
    spec = type(static_out).__schema__
    for t in spec.tensors:
        x = getattr(static_out, t.name)
        if x is None:
            fields[t.name] = None
            continue
        src = x[: rows[t.role]]
        fields[t.name] = torch.empty_like(src, memory_format=torch.contiguous_format)
        srcs.append(src)
        dsts.append(fields[t.name])
    foreach_copy(dsts, srcs)
    for v in spec.values:
        fields[v.name] = state.params if v.name == "params" else getattr(static_out, v.name)
    return type(static_out)(**fields)
