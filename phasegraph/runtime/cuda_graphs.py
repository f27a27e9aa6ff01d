"""CUDA graph capture of whole phases, per batch-size bucket.

:class:`~phasegraph.runtime.graph_runner.GraphRunner` wraps a phase function in a
:class:`GraphedPhase` so that, for a batch of ``B`` requests, the phase
replays a CUDA graph captured for the smallest bucket ``>= B``; batches larger than the largest
bucket run eagerly. The runner owns every static buffer (SGLang #22041: one owner, addressed only
through it): the padded copy of the phase's input schema and the outputs the capture produced.

Replay protocol, per call:

1. copy the real input's tensors into rows ``[0, B)`` of the static input; fill the padded rows
   ``[B, bucket)`` as each field declares (:class:`~phasegraph.statemachine.Pad`): the reserved
   KV row 0, whose pages are the sink page 0, and row numbers into the padded request's own
   rows, so padded rows never read or write a live request's KV (checked once per plan and
   after capture, :func:`~phasegraph.statemachine.rows.check_padding`);
2. replay the graph;
3. return the output schema with every tensor sliced back to ``B`` rows and copied out into
   fresh memory (a later replay overwrites the static outputs), nested schemas pointing at the
   real input (:class:`OutputCopier`, planned once per graph and batch size).

Capture leaves the persistent state as it found it (SGLang #25015's class): phases never mutate their
inputs (checked in strict mode), and the warm-up and capture runs write KV only where the replay
that follows writes the same values or into scratch: verify writes the tree nodes behind each
prefix, draft writes its branch regions, draft-extend writes the positions of the path it
extends, and padded rows write to the reserved page 0. finalize-tree-path moves accepted KV to
the front of each request, which is not idempotent (a second run would read slots the first
overwrote), so it is never warmed up on the real input: its first call for a bucket runs eagerly
(the real work, which also compiles its kernels), and the next call captures (capture records,
it does not execute) and replays. Tests compare hashes of positions, seq_lens, the committed KV
and every static buffer before and after capture.

Structured output (:class:`SegmentedGraph`): a grammar request's iteration asks the requests'
xgrammar matchers (host state) for masks between device work: after each draft step, after the
tree, after the tokens verify accepted. A CUDA graph cannot hold a host call, so its capture is
cut there: piece k records the device work up to the k-th call, the call gets a static output
buffer, and capture goes on into piece k+1 of the same memory pool. A replay runs piece 0, then
the call on the batch's current masks (reading its static device inputs: a host sync), then
piece 1, and so on. A call's buffer lies outside the pool, so that no kernel of the graph
writes it.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from phasegraph.phases.schemas import REQUEST
from phasegraph.runtime.errors import PhasegraphRuntimeError
from phasegraph.statemachine import PhaseSpec, Schema
from phasegraph.statemachine.rows import check_padding, padding_plan

# A capture refuses unsafe CUDA calls from this thread only: another thread's (a process group's
# watchdog polling its events, under tensor parallelism) would otherwise invalidate it at random.
CAPTURE_ERROR_MODE = "thread_local"

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def _rows_per_request(t, x: torch.Tensor, batch: int) -> int | None:
    """How many leading rows one request owns in field ``t``'s tensor ``x`` (None: not
    batch-indexed)."""
    if t.role is None:
        return None
    if t.role == REQUEST:
        return 1
    return x.shape[0] // batch if batch else None


def shape_key(state: Schema, batch: int) -> tuple:
    """Per-request widths that change the captured shapes (stop ids, hidden presence)."""
    key = []
    for name, x in state.tensors():
        per = x.shape[0] // batch if batch else x.shape[0]
        key.append((name, per, tuple(x.shape[1:])))
    for v in type(state).__schema__.values:
        if v.nested:
            key.append((v.name, shape_key(getattr(state, v.name), batch)))
    return tuple(key)


def warm_up(run: Callable[[], Any], times: int = 2) -> None:
    """Run ``run`` on a side stream before a capture, so that allocation, autotuning and lazy
    initialisation happen outside it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            run()
    torch.cuda.current_stream().wait_stream(stream)


@contextlib.contextmanager
def no_garbage_collection():
    """Python's cyclic GC paused for the block (a capture): a collection during capture may free
    an old engine's graphs or pool memory, an operation a capturing stream does not allow."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def foreach_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, as one multi-tensor copy per (dtype, device) group
    (``torch._foreach_copy_`` takes its fast path only when every source shares one dtype)."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        if dst.dtype != src.dtype or dst.shape != src.shape or not (dst.is_contiguous() and src.is_contiguous()):
            dst.copy_(src)
            continue
        group = groups.setdefault((dst.dtype, dst.device, src.device), ([], []))
        group[0].append(dst)
        group[1].append(src)
    for group_dsts, group_srcs in groups.values():
        torch._foreach_copy_(group_dsts, group_srcs)


def copy_into_static(static: Schema, real: Schema, batch: int, bucket: int) -> None:
    """Copy ``real`` (``batch`` requests) into the padded ``static`` instance in place.

    All copies go out as one ``torch._foreach_copy_`` per dtype (a few multi-tensor launches
    instead of one per field, which at batch 1 is most of a phase's host time); padded rows are
    filled after. A replay uses :func:`copy_inputs_in`, which plans this once per graph and
    batch size.
    """
    InputCopier(static, real, batch, bucket)(real)


class InputCopier:
    """Copies a real input of ``batch`` requests into a graph's padded static input, with what
    depends only on the shapes worked out once per graph and batch size: which rows of which
    static buffers receive which field of the input (grouped by dtype for one
    ``torch._foreach_copy_`` each), and the padded rows' values, made from each field's
    declared :class:`~phasegraph.statemachine.Pad` (:func:`padding_plan`) and checked once
    (:func:`check_padding`) so that no padded row addresses a live request. Planning on every
    replay would put the field walk on the host's critical path at batch 1.

    A graph is chosen by its input's per-request widths (``shape_key``), so every input a
    copier sees has the shapes it was planned for; ``_foreach_copy_`` copies like ``copy_``
    where dtypes or layouts differ.
    """

    def __init__(self, static: Schema, real: Schema, batch: int, bucket: int):
        # per (dtype, device) of the static buffers: the input's field paths, the static rows
        self.groups: dict[tuple, tuple[list[tuple[str, ...]], list[torch.Tensor]]] = {}
        self._plan(static, real, batch, ())
        plan = padding_plan(static, batch)  # padded rows [batch, bucket) and their values
        self.pad_rows = [rows for _, rows, _ in plan]
        self.pad_values = [values for _, _, values in plan]
        self.static, self.batch = static, batch
        self.checked = False

    def _plan(self, static: Schema, real: Schema, batch: int, path: tuple[str, ...]) -> None:
        spec = type(static).__schema__
        for t in spec.tensors:
            dst = getattr(static, t.name)
            if dst is None:
                continue
            per = _rows_per_request(t, getattr(real, t.name), batch)
            if per is not None:
                if not batch * per:
                    continue
                dst = dst[: batch * per]
            paths, dsts = self.groups.setdefault((dst.dtype, dst.device), ([], []))
            paths.append((*path, t.name))
            dsts.append(dst)
        for v in spec.values:
            if v.nested:
                self._plan(getattr(static, v.name), getattr(real, v.name), batch, (*path, v.name))

    def __call__(self, real: Schema) -> None:
        for paths, dsts in self.groups.values():
            srcs = []
            for path in paths:
                x = real
                for name in path:
                    x = getattr(x, name)
                srcs.append(x)
            torch._foreach_copy_(dsts, srcs)
        if self.pad_rows:
            foreach_copy(self.pad_rows, self.pad_values)
        if not self.checked:  # once per plan: the padding is the same on every later call
            self.checked = True
            check_padding(self.static, self.batch, "graph input")


def copy_inputs_in(copiers: dict[int, InputCopier], static: Schema, real: Schema, batch: int,
                   bucket: int) -> None:
    """``real`` copied into a captured graph's ``static`` input by the copier of this batch size
    in ``copiers``, planned on first use."""
    copier = copiers.get(batch)
    if copier is None:
        copier = copiers[batch] = InputCopier(static, real, batch, bucket)
    copier(real)


def fill_neutral(static: Schema) -> None:
    """Make every row of a padded static instance a padded row (the reserved KV row, neutral
    values): running a phase on it writes only the reserved sink page. Used to warm up a
    capture whose phases are not idempotent on real input."""
    plan = padding_plan(static, 0)
    foreach_copy([rows for _, rows, _ in plan], [values for _, _, values in plan])


def pad_schema(real: Schema, batch: int, bucket: int) -> Schema:
    """A new instance of ``real``'s schema padded from ``batch`` to ``bucket`` requests."""
    spec = type(real).__schema__
    fields: dict[str, Any] = {}
    for t in spec.tensors:
        x = getattr(real, t.name)
        if x is None:
            fields[t.name] = None
            continue
        per = _rows_per_request(t, x, batch)
        if per is None:
            fields[t.name] = x.clone()
            continue
        shape = (bucket * per, *x.shape[1:])
        fields[t.name] = torch.empty(shape, dtype=x.dtype, device=x.device)
    for v in spec.values:
        val = getattr(real, v.name)
        fields[v.name] = pad_schema(val, batch, bucket) if v.nested else val
    static = type(real)(**fields)
    copy_into_static(static, real, batch, bucket)
    return static


_ALIGN_BYTES = 16  # every copied-out tensor starts on a 16-byte boundary (Triton's divisibility)
_BUILD, _REAL, _TENSOR, _NONE, _VALUE = range(5)
# copied-out memory an OutputCopier keeps for reuse; where every kept set is still referenced,
# a call takes fresh memory as if there were none
OUTPUT_SETS_KEPT = 4


class OutputCopier:
    """Copies the first ``batch`` requests of a chain of static outputs (one phase's, or the four
    of an iteration, each the next one's input) out of a graph's buffers, with everything that
    depends only on the shapes worked out once per graph and batch size: which rows of which
    static buffers to copy, and how to rebuild each output schema.

    The outputs are carved out of one byte buffer per device (each tensor 16-byte aligned) and
    filled by a single ``_foreach_copy_`` of byte views, whatever their dtypes. At batch 1 the
    host time of this copy is on the critical path of every iteration, so the buffer and its
    typed views are kept and reused (:class:`_OutputSet`): a later call refills a kept set only
    when nothing outside the copier still refers to it, neither one of its tensors (a schema
    somebody holds) nor its memory (a view made from one of them); otherwise it takes another
    set, or fresh memory. What was handed out is therefore never overwritten while anything can
    still read it, as if every call allocated; the copies go in stream order after every earlier
    read of the set.

    The outputs are never the static buffers (a later replay overwrites those); a static tensor
    that sits in several outputs (passed on unchanged by a phase) is copied once and shared by
    them, as in the eager phases. A nested schema that is the static input (or, in each output
    after the first, the previous static output), or a schema nested in it, is the real object
    instead.
    """

    def __init__(self, statics: Sequence[Schema], static_input: Schema, batch: int, bucket: int):
        self.batch, self.bucket = batch, bucket
        # per device: the contiguous sources as bytes, and per source (index, shape, dtype, byte offset)
        self.layouts: dict[torch.device, tuple[list[torch.Tensor], list[tuple], list[int]]] = {}
        self.strided: list[tuple[int, torch.Tensor]] = []  # non-contiguous sources: copy_ each
        self.count = 0
        self.registered: dict[tuple, int] = {}  # the static view each index copies
        self.kept: list[_OutputSet] = []
        for static in statics:  # planned after the first replay: the outputs hold its values
            check_padding(static, batch, "graph output")
        tokens = _nested_tokens(static_input, ("in", ()), {})
        self.recipes = []
        for k, static in enumerate(statics):
            self.recipes.append(self._plan(static, tokens))
            tokens = _nested_tokens(static, ("out", k, ()), {})

    def _plan(self, static: Schema, tokens: dict[int, tuple]) -> tuple:
        token = tokens.get(id(static))
        if token is not None:
            return (_REAL, token)
        spec = type(static).__schema__
        fields = []
        for t in spec.tensors:
            x = getattr(static, t.name)
            if x is None:
                fields.append((t.name, _NONE, None))
                continue
            per = _rows_per_request(t, x, self.bucket)
            fields.append((t.name, _TENSOR, self._register(x if per is None else x[: self.batch * per])))
        for v in spec.values:
            val = getattr(static, v.name)
            if v.nested and val is not None:
                fields.append((v.name, _BUILD, self._plan(val, tokens)))
            else:
                fields.append((v.name, _VALUE, val))
        return (_BUILD, (type(static), fields))

    def _register(self, src: torch.Tensor) -> int:
        # a tensor that a phase passed on unchanged sits in two outputs (accept_lens, say): one
        # copy serves both, so the outputs alias each other as the eager phases' do
        key = (src.untyped_storage().data_ptr(), src.storage_offset(), tuple(src.shape), src.stride(), src.dtype)
        if key in self.registered:
            return self.registered[key]
        index, self.count = self.count, self.count + 1
        self.registered[key] = index
        if not src.is_contiguous():
            self.strided.append((index, src))
            return index
        src_bytes, places, end = self.layouts.setdefault(src.device, ([], [], [0]))
        nbytes = src.numel() * src.element_size()
        places.append((index, tuple(src.shape), src.dtype, end[0], nbytes))
        src_bytes.append(src.reshape(-1).view(torch.uint8))  # a view: src is contiguous
        end[0] += -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES
        return index

    def __call__(self, real_input: Schema) -> list[Schema]:
        out_set = self._free_set()
        for device, (src_bytes, _, _) in self.layouts.items():
            torch._foreach_copy_(out_set.dst_bytes[device], src_bytes)
        dsts = out_set.views
        if self.strided:
            dsts = list(dsts)
            for index, src in self.strided:
                dsts[index] = torch.empty_like(src, memory_format=torch.contiguous_format).copy_(src)
        outs: list[Schema] = []
        for recipe in self.recipes:
            outs.append(_build(recipe, real_input, outs, dsts))
        return outs

    def _free_set(self) -> _OutputSet:
        for kept in self.kept:
            if kept.unreferenced():
                return kept
        fresh = _OutputSet(self.layouts, self.count)
        if len(self.kept) < OUTPUT_SETS_KEPT:
            self.kept.append(fresh)
        return fresh


class _OutputSet:
    """One allocation of an :class:`OutputCopier`'s outputs: a byte buffer per device, the typed
    views the outputs hand out and the byte views the copy fills. It may be refilled only while
    no reference to it exists outside itself: each view's Python reference count and each
    buffer's storage use count (tensors made from its memory) are what they were when it was
    made (:meth:`unreferenced`)."""

    def __init__(self, layouts: dict, count: int):
        self.views: list[torch.Tensor | None] = [None] * count
        self.dst_bytes: dict[torch.device, list[torch.Tensor]] = {}
        self.buffers: list[torch.Tensor] = []
        for device, (_, places, end) in layouts.items():
            flat = torch.empty(end[0], dtype=torch.uint8, device=device)
            self.buffers.append(flat)
            dst = self.dst_bytes[device] = []
            for index, shape, dtype, offset, nbytes in places:
                raw = flat[offset : offset + nbytes]
                dst.append(raw)
                self.views[index] = raw.view(dtype).view(shape)
        self.held = self._references()

    def _references(self) -> tuple[list[int], list[int]]:
        return ([sys.getrefcount(v) for v in self.views if v is not None],
                [torch._C._storage_Use_Count(b.untyped_storage()._cdata) for b in self.buffers])

    def unreferenced(self) -> bool:
        return self._references() == self.held


def copy_outputs_out(copiers: dict[int, OutputCopier], statics: Sequence[Schema], static_input: Schema,
                     real_input: Schema, batch: int, bucket: int) -> list[Schema]:
    """``statics`` copied out for ``real_input`` by the copier of this batch size in
    ``copiers`` (a captured graph's), planned on first use."""
    copier = copiers.get(batch)
    if copier is None:
        copier = copiers[batch] = OutputCopier(statics, static_input, batch, bucket)
    return copier(real_input)


def _nested_tokens(static: Schema, token: tuple, out: dict[int, tuple]) -> dict[int, tuple]:
    """Maps ``id`` of ``static`` and of every schema nested in it to a reference to the real
    object that stands for it: ``("in", path)`` (the real input) or ``("out", k, path)`` (output
    ``k`` of the chain), ``path`` the attribute names from there."""
    out[id(static)] = token
    for v in type(static).__schema__.values:
        val = getattr(static, v.name)
        if v.nested and val is not None:
            _nested_tokens(val, (*token[:-1], (*token[-1], v.name)), out)
    return out


def _build(recipe: tuple, real_input: Schema, outs: list[Schema], dsts: list) -> Any:
    kind, arg = recipe
    if kind == _REAL:
        obj = real_input if arg[0] == "in" else outs[arg[1]]
        for name in arg[-1]:
            obj = getattr(obj, name)
        return obj
    cls, fields = arg
    values = {}
    for name, how, what in fields:
        if how == _TENSOR:
            values[name] = dsts[what]
        elif how == _BUILD:
            values[name] = _build(what, real_input, outs, dsts)
        else:
            values[name] = what
    return cls(**values)


class EmulatedGraph:
    """CPU stand-in for a captured graph: replay reruns the captured function on the static
    input and writes the results into the static output buffers (one schema, or a list of them
    for a whole iteration), as a real replay would. It lets the CPU suite test padding, neutral
    rows and output slicing."""

    def __init__(self, run: Callable[[], Any], static_out: Any):
        self.run = run
        self.static_out = static_out

    def replay(self) -> None:
        outs, static = self.run(), self.static_out
        if isinstance(static, list):
            for dst, src in zip(static, outs, strict=True):
                copy_outputs(dst, src)
        else:
            copy_outputs(static, outs)


def copy_outputs(dst: Schema, src: Schema) -> None:
    for name, x in src.tensors():
        getattr(dst, name).copy_(x)
    for v in type(dst).__schema__.values:
        if v.nested and getattr(dst, v.name) is not getattr(src, v.name):
            copy_outputs(getattr(dst, v.name), getattr(src, v.name))


@attrs.define
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph or EmulatedGraph
    static_in: Schema
    static_out: Schema
    key: tuple
    copiers: dict[int, OutputCopier] = attrs.field(factory=dict)  # per batch size
    input_copiers: dict[int, InputCopier] = attrs.field(factory=dict)  # per batch size


class GraphedPhase:
    """A phase function that replays per-bucket CUDA graphs (see the module docstring).

    ``idempotent``: running the phase twice on the same input leaves the same state (so it can
    be warmed up on the real input before capture); a phase that is not is warmed up by one
    eager call per bucket instead.
    """

    def __init__(
        self,
        runner: GraphCapture,
        spec: PhaseSpec,
        when: Callable[[Schema], bool] | None = None,
        idempotent: bool = True,
    ):
        self.runner = runner
        self.spec = spec
        self.when = when
        self.idempotent = idempotent
        self.warmed: set[tuple] = set()
        self.graphs: dict[tuple, _Captured] = {}
        self.replays = 0
        self.eager_calls = 0
        self.eager_reasons: dict[str, int] = {}

    def _eager_reason(self, state: Schema, ctx: Any, bucket: int | None, extra: dict) -> str | None:
        if not self.runner.enabled:
            return "graphs disabled"
        if bucket is None:
            return "batch above the largest bucket (or empty)"
        if extra:
            return "extra inputs"
        if self.when is not None and not self.when(state):
            return "input not capturable (ragged)"
        return None

    def __call__(self, state: Schema, ctx: Any, **extra: Any) -> Schema:
        batch = state.batch_size or 0
        bucket = self.runner.bucket_for(batch)
        reason = self._eager_reason(state, ctx, bucket, extra)
        if reason is not None:
            self.eager_calls += 1
            self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
            return self.spec.fn(state, ctx, **extra)
        key = self.runner.graph_key(state, ctx, batch, bucket)
        cap = self.graphs.get(key)
        if cap is None and not self.idempotent and key not in self.warmed:
            self.warmed.add(key)  # warm-up by doing the real work once, eagerly
            self.eager_calls += 1
            self.eager_reasons["warm-up call"] = self.eager_reasons.get("warm-up call", 0) + 1
            return self.spec.fn(state, ctx, **extra)
        if cap is None:
            cap = self._capture(state, ctx, batch, bucket, key)
            # an emulated capture executes the phase: do not run a non-idempotent one twice
            replay = not (self.runner.emulate and not self.idempotent)
        else:
            copy_inputs_in(cap.input_copiers, cap.static_in, state, batch, bucket)
            replay = True
        if replay:
            cap.graph.replay()
            self.replays += 1
        return copy_outputs_out(cap.copiers, [cap.static_out], cap.static_in, state, batch, bucket)[0]

    def _capture(self, state: Schema, ctx: Any, batch: int, bucket: int, key: tuple) -> _Captured:
        static_in = pad_schema(state, batch, bucket)
        if getattr(ctx, "grammar", None) is not None:
            return self._capture_segmented(static_in, state, ctx, batch, bucket, key)
        if self.runner.emulate:
            static_out = self.spec.fn(static_in, ctx)
            graph = EmulatedGraph(lambda: self.spec.fn(static_in, ctx), static_out)
            cap = _Captured(graph, static_in, static_out, key)
            self.graphs[key] = cap
            return cap
        if self.idempotent:
            warm_up(lambda: self.spec.fn(static_in, ctx))
        graph = torch.cuda.CUDAGraph()
        with no_garbage_collection(), torch.cuda.graph(graph, pool=self.runner.pool, capture_error_mode=CAPTURE_ERROR_MODE):
            static_out = self.spec.fn(static_in, ctx)
        cap = _Captured(graph, static_in, static_out, key)
        self.graphs[key] = cap
        copy_into_static(static_in, state, batch, bucket)
        return cap

    def _capture_segmented(self, static_in: Schema, state: Schema, ctx: Any, batch: int, bucket: int,
                           key: tuple) -> _Captured:
        """A structured-output batch's graph, cut at each grammar call (its masks come from the
        host between the pieces: :class:`SegmentedGraph`)."""
        graph = SegmentedGraph(ctx, lambda: self.spec.fn(static_in, ctx), self.runner.pool, self.runner.emulate)
        if self.idempotent and not self.runner.emulate:
            with graph.warm_up_masks():
                warm_up(graph.run)
        cap = _Captured(graph, static_in, graph.capture(), key)
        self.graphs[key] = cap
        return cap


class GraphCapture:
    """What every captured graph of an engine shares: the batch buckets, whether graphs are on
    (or emulated on the CPU), the memory pool, and the key that selects a captured graph.
    :class:`~phasegraph.runtime.graph_runner.GraphRunner` is the one an engine builds."""

    def __init__(self, buckets: Sequence[int] = DEFAULT_BUCKETS, enabled: bool = True,
                 emulate: bool = False):
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.emulate = emulate
        self.enabled = enabled and (emulate or torch.cuda.is_available())
        self.pool = torch.cuda.graph_pool_handle() if self.enabled and not emulate else None
        # every context flag that changes what a phase computes, or the shape of its outputs
        self.context_key: Callable[[Any], tuple] = lambda ctx: (
            getattr(ctx, "tree", None),  # the iteration's shape (adaptive speculation changes it)
            bool(getattr(ctx, "greedy_only", False)),
            bool(getattr(ctx, "return_logprobs", False)),
            int(getattr(ctx, "top_logprobs", 0)),
            getattr(ctx, "prompt_logprobs", None),
            bool(getattr(ctx, "penalties", False)),
            bool(getattr(ctx, "min_p", False)),
            bool(getattr(ctx, "return_routed_experts", False)),
            getattr(ctx, "grammar", None) is not None,  # structured output: graphs cut at its masks
        )

    def graph_key(self, state: Schema, ctx: Any, batch: int, bucket: int) -> tuple:
        """What selects a captured graph: the bucket, the context flags, the per-request widths."""
        return (bucket, *self.context_key(ctx), *shape_key(state, batch))

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b if batch > 0 else None
        return None


# ---------------------------------------------------------------------- graphs cut at grammar calls
# rows of each GrammarMasks call's [R, Vw] output, from its arguments
_OUTPUT_ROWS: dict[str, Callable[..., int]] = {
    "next_token_bitmask": lambda rows: rows,
    "beam_bitmask": lambda beam_tokens, beam_parent=None: beam_tokens.numel(),
    "next_token_bitmask_after": lambda new_tokens: new_tokens.shape[0],
    "tree_bitmask": lambda draft_tokens, parents: draft_tokens.numel(),
}


class GrammarCallError(PhasegraphRuntimeError, RuntimeError):
    """A phase asked the grammar something a segmented graph cannot replay (an argument that is
    neither a device tensor nor a row count), or asked in another order than when captured."""


@attrs.define
class _HostCall:
    name: str
    args: tuple  # the static device tensors (or the row count) the call reads
    out: torch.Tensor  # [R, Vw] int32: the static buffer that the pieces after the call read

    def run(self, grammar: Any) -> None:
        self.out.copy_(getattr(grammar, self.name)(*self.args), non_blocking=True)


def _check_args(args: tuple) -> None:
    for a in args:
        if a is not None and not isinstance(a, (torch.Tensor, int)):
            raise GrammarCallError(f"a grammar call in a CUDA graph takes device tensors or row counts; got {type(a).__name__}")


class _Proxy:
    """Stands in for ``ctx.grammar`` while a segmented graph is warmed up, captured or (emulated)
    replayed: every GrammarMasks call goes to ``on_call(name, args)``."""

    def __init__(self, on_call: Callable[[str, tuple], torch.Tensor]):
        self._on_call = on_call

    def __getattr__(self, name: str):
        if name not in _OUTPUT_ROWS:
            raise AttributeError(name)
        return lambda *args: self._on_call(name, args)


class SegmentedGraph:
    """A phase (or a whole iteration) captured in pieces cut at its grammar calls; ``replay()``
    runs the pieces and the calls in order on ``ctx.grammar`` of the moment. Emulated on the
    CPU (``emulate``): replay reruns the function, each call writing the buffer captured for it,
    so the suite tests the buffers, their rows and the order of the calls."""

    def __init__(self, ctx: Any, run: Callable[[], Any], pool=None, emulate: bool = False):
        self.ctx, self.run, self.pool, self.emulate = ctx, run, pool, emulate
        self.pieces: list[torch.cuda.CUDAGraph] = []
        # every call, in the order the function makes them; captured, calls[k] runs between
        # piece k and piece k+1
        self.calls: list[_HostCall] = []
        self.static_out: Any = None
        self._emulated: EmulatedGraph | None = None
        self._stamp: torch.Tensor | None = None
        self._real: Any = None  # the batch's GrammarMasks while a stand-in takes its place

    # ------------------------------------------------------------------ capture
    def capture(self) -> Any:
        """Run (emulated) or capture ``run`` once; returns its static outputs."""
        if self.emulate:
            with self._grammar(self._record):
                self.static_out = self.run()
            self._emulated = EmulatedGraph(self._rerun, self.static_out)
            return self.static_out
        words = self.ctx.grammar.words
        self._stamp = torch.zeros(1, dtype=torch.int32, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        with no_garbage_collection(), torch.cuda.stream(stream), self._grammar(lambda n, a: self._cut(n, a, words)):
            self._begin()
            try:
                self.static_out = self.run()
            finally:
                self.pieces[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return self.static_out

    def warm_up_masks(self) -> contextlib.AbstractContextManager:
        """``ctx.grammar`` answering every call with all-allowed masks, for the warm-up runs
        before a capture (on padded rows, whose tokens no matcher may read)."""
        words = self.ctx.grammar.words

        def allow_all(name: str, args: tuple) -> torch.Tensor:
            rows = _OUTPUT_ROWS[name](*args)
            return torch.full((rows, words), -1, dtype=torch.int32, device=self._device(args))

        return self._grammar(allow_all)

    @contextlib.contextmanager
    def _grammar(self, on_call: Callable[[str, tuple], torch.Tensor]):
        self._real = self.ctx.grammar
        self.ctx.grammar = _Proxy(on_call)
        try:
            yield
        finally:
            self.ctx.grammar, self._real = self._real, None

    def _device(self, args: tuple) -> torch.device:
        for a in args:
            if isinstance(a, torch.Tensor):
                return a.device
        return self._real.device

    def _begin(self) -> None:
        piece = torch.cuda.CUDAGraph()
        piece.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE)
        self._stamp.add_(1)  # no piece is empty: a call right after another still has one kernel
        self.pieces.append(piece)

    def _cut(self, name: str, args: tuple, words: int) -> torch.Tensor:
        _check_args(args)
        self.pieces[-1].capture_end()
        # allocated outside the capture: memory of the pool may be a temporary that a kernel
        # of an earlier piece writes at replay, after the call has filled it
        out = torch.empty((_OUTPUT_ROWS[name](*args), words), dtype=torch.int32, device="cuda")  # [R, Vw]
        call = _HostCall(name, args, out)
        self.calls.append(call)
        self._begin()
        return out

    def _record(self, name: str, args: tuple) -> torch.Tensor:
        _check_args(args)
        call = _HostCall(name, args, getattr(self._real, name)(*args).clone())  # [R, Vw]
        self.calls.append(call)
        return call.out

    # ------------------------------------------------------------------ replay
    def replay(self) -> None:
        if self._emulated is not None:
            self._emulated.replay()
            return
        grammar = self.ctx.grammar
        for k, piece in enumerate(self.pieces):
            piece.replay()
            if k < len(self.calls):  # one that reads no device tensor overlaps the piece on the GPU
                self.calls[k].run(grammar)

    def _rerun(self) -> Any:
        calls = iter(self.calls)

        def replayed(name: str, args: tuple) -> torch.Tensor:
            call = next(calls, None)
            if call is None or call.name != name:
                raise GrammarCallError(f"grammar call {name} where the capture made {call.name if call else 'none'}")
            call.out.copy_(getattr(self._real, name)(*args))
            return call.out

        with self._grammar(replayed):
            return self.run()
