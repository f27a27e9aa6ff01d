"""The public Engine: load a target (and a draft), then generate, in one call or step by step.

::

    engine = Engine.from_pretrained(target_dir, draft_dir, spec=SpecConfig(method="eagle3", ...))
    outs = engine.generate(["def fib(n):"], SamplingParams(max_new_tokens=64))
    engine.add_request("r1", prompt_ids, params); deltas = engine.step(); engine.abort("r1")
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from phasegraph.kernels import KernelSettingError, check_kernel_settings
from phasegraph.phases import EAGLE_GRAPH, SpecContext
from phasegraph.phases.context import tokens_per_iteration
from phasegraph.runtime import tensor_parallel
from phasegraph.runtime.adaptive import (
    AdaptiveSpeculation,
    CostTable,
    SpecShape,
    default_shapes,
    max_tokens_per_iteration,
)
from phasegraph.runtime.config import (
    DEFAULT_TP_TIMEOUT_S,
    MAX_KV_TOKENS,
    EngineConfig,
    RequestDelta,
    RequestOutput,
    SamplingParams,
    SpecConfig,
    as_spec,
    is_int,
)
from phasegraph.runtime.cuda_graphs import DEFAULT_BUCKETS
from phasegraph.runtime.errors import (
    CheckpointFileError,
    DraftMismatch,
    EngineInUse,
    InvalidConfig,
    InvalidRequest,
    RequestFailed,
    SchedulerInvariantError,
    is_out_of_memory,
)
from phasegraph.runtime.grammar import GrammarCompiler
from phasegraph.runtime.graph_runner import GraphRunner
from phasegraph.runtime.kv_pool import KVCacheManager, PrefixCacheStats
from phasegraph.runtime.memory import PhaseMemory
from phasegraph.runtime.methods import registered
from phasegraph.runtime.models.drafts import draft_kind, load_draft
from phasegraph.runtime.models.gguf import convert_gguf, is_gguf
from phasegraph.runtime.models.loading import load_tokenizer, read_json_object
from phasegraph.runtime.models.target import HFTarget
from phasegraph.runtime.prefill_graph import token_buckets_for
from phasegraph.runtime.requests import Request, Status
from phasegraph.runtime.scheduler import Scheduler
from phasegraph.statemachine import PhaseGraph, Trace
from phasegraph.statemachine.errors import one_line

# the prompt length at which measure_spec_costs times each shape a second time: the policy reads
# costs at a batch's own context, linear between the two
LONG_COST_CONTEXT = 512
# the batch sizes measure_spec_costs times by default (those the bench sweeps), up to max_batch_size
MEASURE_BATCHES = (1, 8, 32, 64)

FEATURE_MODE = {"none": "none", "eagle": "last", "eagle3": "eagle3", "mtp": "last", "standalone": "none"}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidConfig(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'; got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise InvalidConfig(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'; got {device!r} (phasegraph runs "
                            "on CPUs and NVIDIA GPUs)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidConfig(f"device={str(device)!r} was asked for but no CUDA GPU is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidConfig(f"device={str(device)!r} was asked for but this machine has "
                            f"{torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, name: str = "dtype") -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise InvalidConfig(f"{name} must be a floating-point torch dtype (float32, bfloat16, float16, float64); "
                                f"got {dtype}")
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise InvalidConfig(f"{name} must be one of {', '.join(names)}; got {dtype!r}")
    return names[dtype]


def _token_ids_field(value, where: str) -> list[int]:
    """An ``eos_token_id`` field (absent, one id or a list of ids) as a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(is_int(v) for v in values):
        raise CheckpointFileError(f"{where}: eos_token_id must be a token id or a list of them; got {value!r}")
    return [int(v) for v in values]


def _eos_ids(target: HFTarget, directory: Path | None, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids from the target's config, ``generation_config.json`` and tokenizer."""
    ids = _token_ids_field(getattr(target.config, "eos_token_id", None), "the target's config")
    generation_config = directory / "generation_config.json" if directory is not None else None
    if generation_config is not None and generation_config.exists():
        fields = read_json_object(generation_config)
        ids += _token_ids_field(fields.get("eos_token_id"), str(generation_config))
    if tokenizer is not None:
        ids += _token_ids_field(getattr(tokenizer, "eos_token_id", None), "the tokenizer")
    return tuple(dict.fromkeys(i for i in ids if 0 <= i < target.vocab_size))


def _one_thread_at_a_time(method):
    """Refuse a call that comes while another thread is inside the engine, with
    :class:`EngineInUse`, where two threads would otherwise corrupt the scheduler silently (a
    test stepping an engine that its AsyncEngine's thread also steps). Reentrant: ``generate``
    calls ``step`` on its own thread."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        if not self._one_thread.acquire(blocking=False):
            raise EngineInUse(
                f"Engine.{method.__name__}() was called while another thread is inside the engine: an "
                "Engine is not thread-safe; drive it from one thread (an AsyncEngine owns the engine it "
                "wraps: reach it through AsyncEngine.call)")
        try:
            return method(self, *args, **kwargs)
        finally:
            self._one_thread.release()

    return guarded


class Engine:
    """Speculative (or plain) generation over a Hugging Face target of the Llama family."""

    def __init__(
        self,
        target: HFTarget,
        draft=None,
        config: EngineConfig | None = None,
        *,
        tokenizer=None,
        **options,
    ):
        """``options`` are :class:`EngineConfig`'s fields (``spec=``, ``page_size=``, ...), or
        change those of ``config``."""
        config = _engine_config(config, options)
        self._one_thread = threading.RLock()  # held by the thread inside a public call
        self.method = registered(config.spec.method)  # a registered method (ngram, ...), else None
        if draft is None and self.method is not None and self.method.make_draft is not None:
            draft = self.method.make_draft(target, config.spec)  # a method without a checkpoint
        _check_models(config, target, draft)
        self.config = config
        self.tp = getattr(target, "tp", None)  # a TensorParallelGroup: this rank's place
        tp_size = 1 if self.tp is None else self.tp.world_size
        if tp_size != config.tensor_parallel_size:
            raise InvalidConfig(
                f"tensor_parallel_size={config.tensor_parallel_size}, but the target is split over {tp_size} "
                "rank(s): Engine.from_pretrained(..., tensor_parallel_size=N) loads and splits it"
            )
        draft_tp = getattr(draft, "tp", None)
        draft_tp_size = 1 if draft_tp is None else draft_tp.world_size
        if draft_tp is not None and draft_tp is not self.tp:
            raise InvalidConfig("the draft is split over another tensor-parallel group than the target")
        if draft_tp_size != config.draft_tensor_parallel_size:
            raise InvalidConfig(
                f"draft_tensor_parallel_size={config.draft_tensor_parallel_size}, but the draft is split over "
                f"{draft_tp_size} rank(s): Engine.from_pretrained(..., draft_tensor_parallel_size=N) loads and "
                "splits it"
            )
        if self.tp is not None:  # the draft, when split, shares the group and so its dtype
            half = config.tp_reduce_dtype == "float32" and target.dtype != torch.float32
            self.tp.reduce_dtype = torch.float32 if half else None
        if config.tp_all_reduce == "symm_mem":
            if self.tp is None:
                raise InvalidConfig("tp_all_reduce='symm_mem' applies to a target split over several ranks")
            self.tp.enable_symmetric_memory(8 << 20, self.tp.reduce_dtype or target.dtype)
        spec = config.spec
        self.target = target
        self.draft = draft if spec.speculative else None
        self.spec = spec
        self.tokenizer = tokenizer
        self.device = target.device
        if self.device.type == "cpu" and config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.eos_token_ids = config.eos_token_ids
        self.max_context = int(config.max_context or getattr(target.config, "max_position_embeddings", 4096))
        tree = spec.tree()
        self.spec_shapes = self._spec_shapes(tree)  # the shapes adaptive speculation picks from
        lead = self.draft.kv_lead if self.draft is not None else 0
        self.tokens_per_iteration = tokens_per_iteration(tree, lead)
        if self.spec_shapes:
            self.tokens_per_iteration = max_tokens_per_iteration(self.spec_shapes, lead)
        # overlap scheduling (default on a GPU): the device runs one iteration ahead of the
        # host, so a request may hold the tokens of one more iteration (see scheduler.py)
        self.overlap = self.device.type == "cuda" if config.overlap is None else config.overlap
        widest = max((sh.accept_width for sh in self.spec_shapes), default=tree.accept_width if tree else 1)
        self.kv_lookahead = self.tokens_per_iteration + (widest if self.overlap else 0)
        self.page_size = config.page_size
        self._allocate_kv(tree)
        self._attach_pools()
        self.ctx = SpecContext(target=target, memory=PhaseMemory(self.kv), tree=tree, draft=self.draft)
        if self.spec_shapes:  # draft-extend keeps the candidates of the widest shape
            self.ctx.draft_topk = max(sh.topk for sh in self.spec_shapes)
        if config.simulate_accept_length is not None:
            # Benchmark mode: every verify accepts simulate_accept_length - 1 drafts whatever
            # they are, so outputs are not the target's; never compare them with a baseline.
            self.ctx.simulate_accept_drafts = config.simulate_accept_length - 1
        self.simulated = config.simulate_accept_length is not None
        self.trace = Trace() if config.trace else None
        if self.trace is not None and self.tp is not None and self.device.type == "cpu":
            # on a GPU the all-reduces run asynchronously, inside the graphs: host time would
            # be their launch, so the trace records none there (docs/parallel.md)
            self.tp.timed = True
            self.trace.collective_clock = self.tp.collective_seconds
        self.graph_runner = self._graph_runner()
        graph = self._phase_graph() if self.graph_runner is None else self.graph_runner.graph
        self.scheduler = Scheduler(
            graph=graph, ctx=self.ctx, kv=self.kv, max_batch_size=config.max_batch_size,
            device=self.device, trace=self.trace, validate=config.validate,
            check_every_step=config.check_every_step, overlap=self.overlap,
        )
        self.check_every_step = config.check_every_step
        self._seed = config.seed
        self._counter = itertools.count()
        self._requests: dict[str, Request] = {}
        self._grammars: GrammarCompiler | None = None  # made at the first structured-output request
        if self.spec_shapes:
            costs = config.spec_costs
            if costs is None:
                costs = self.measure_spec_costs()
            if self.tp is not None and config.tp_check:
                tensor_parallel.check_same_record(self.tp, costs.to_dict(), "adaptive speculation's cost-table")
            self.scheduler.adaptive = AdaptiveSpeculation(costs)

    def _spec_shapes(self, tree) -> tuple[SpecShape, ...]:
        """The shapes of adaptive speculation (none where it is off): those of the given cost
        table, else off, short chains and the configured shape."""
        spec, config = self.spec, self.config
        adaptive = spec.adaptive
        if adaptive is None:  # auto: where costs are given, or measured on the GPU that runs;
            # not yet under tensor parallelism (SpecConfig(adaptive=True) asks for it there)
            adaptive = spec.speculative and self.tp is None and (
                self.device.type == "cuda" or config.spec_costs is not None)
        if not adaptive:
            if config.spec_costs is not None:
                raise InvalidConfig("spec_costs was given but speculation is not adaptive: "
                                    "pass SpecConfig(adaptive=True) or leave spec_costs out")
            return ()
        if not spec.speculative:
            raise InvalidConfig("SpecConfig(adaptive=True) needs a speculative method (a draft)")
        shapes = config.spec_costs.shapes if config.spec_costs is not None else default_shapes(tree)
        for shape in shapes:
            if not shape.off:
                _check_tree_fits(shape.tree, self.target, self.draft, self.method)
        return tuple(shapes)

    def warm_up(self, sampled: bool = True) -> int:
        """Capture the CUDA graphs that every batch bucket and speculation shape replays, on
        requests of random prompts, so that no request waits for a capture later (a server calls
        this once before taking traffic; under adaptive speculation a shape first chosen at a
        bucket would otherwise capture mid-stream; the groups of a split batch, which run per-phase
        graphs, may still capture at first use). Nothing without graphs. The engine is left
        idle and clean, no acceptance estimate having seen the requests. ``sampled=False`` leaves
        out the graphs of batches that sample (a greedy-only workload: half the time). Returns the
        graphs captured. Under tensor parallelism every rank warms up in step (the leader tells the
        workers it started; under torchrun each rank calls this), capturing the same graphs."""
        runner = self.graph_runner
        if runner is None:
            return 0
        if self.has_unfinished():
            raise InvalidConfig("warm_up runs on an idle engine: let its requests finish first")
        self._tp_send("warm_up", sampled)
        before = runner.graph_count()
        sched, saved = self.scheduler, self.scheduler.adaptive
        # a throwaway policy steps the random prompts: their acceptance teaches the engine's nothing
        policy = None if saved is None else AdaptiveSpeculation(saved.costs, split=False)
        gen = torch.Generator().manual_seed(0)
        # every shape after itself and after a step without drafts (whose state the draft
        # phase then reads: another graph key)
        off = [sh for sh in self.spec_shapes if sh.off]
        order = off + [x for sh in self.spec_shapes if not sh.off for x in (sh, sh, *off)] if policy else [None] * 3
        budget = max(1, min(len(order) * 2 * max((sh.accept_width for sh in self.spec_shapes), default=1) + 8,
                            self.max_context - 17))  # past a 16-token prompt
        sched.adaptive = policy
        try:
            for b in runner.buckets:
                if b > self.config.max_batch_size:
                    continue
                # a graph is captured the second time its key runs; a batch that samples is
                # another key than a greedy one (greedy_only)
                for temperature in (0.0, 0.0, 1.0, 1.0) if sampled else (0.0, 0.0):
                    with self._throwaway_requests(b, 16, budget, gen, "warm-up", temperature):
                        for shape in order:
                            if policy is not None:
                                policy.force = shape
                            sched.step()
        finally:
            sched.adaptive = saved
        return runner.graph_count() - before

    @contextlib.contextmanager
    def _throwaway_requests(self, batch: int, prompt_len: int, budget: int, gen: torch.Generator, tag: str,
                            temperature: float = 0.0):
        """``batch`` requests of random prompts, prefilled, for the body to step; aborted and
        drained after it, and nothing of them left in the trace or the prefix cache (start-up
        measurement and warm-up)."""
        sched = self.scheduler
        marks = len(self.trace) if self.trace is not None else 0
        reqs = [Request(f"{tag}-{batch}-{i}", torch.randint(0, self.target.vocab_size, (prompt_len,),
                                                            generator=gen).tolist(),
                        SamplingParams(max_new_tokens=budget, ignore_eos=True, temperature=temperature),
                        stop_ids=(), budget=budget, seed=i, decode=None) for i in range(batch)]
        for r in reqs:
            sched.add(r)
        while sched.waiting:  # prefill
            sched.step()
        try:
            yield reqs
        finally:
            for r in reqs:
                sched.abort(r.request_id)
            sched.drain()
            if self.trace is not None:
                del self.trace.transitions[marks:]
            if self.kv.prefix_cache is not None:
                self.kv.clear_prefix_cache()

    def measure_spec_costs(self, shapes: Sequence[SpecShape] | None = None, batches: Sequence[int] | None = None,
                           *, warmup: int = 3, steps: int = 6, long_context: int | None = None) -> CostTable:
        """Seconds per iteration of each shape (default: the engine's) at a few batch sizes
        (default: 1, 8, 32, 64 up to ``max_batch_size``, and it), timed on requests of random
        prompts with every shape forced in turn, and what running a batch as two groups adds
        (``split_s``). Each is timed on 16-token prompts and again on prompts of
        ``long_context`` tokens (default: :data:`LONG_COST_CONTEXT`, or the most the KV pool
        holds at the largest batch; 0: not at all), so that the policy prices a batch at its own
        context. The engine is left as it was: the requests are gone, the trace and the prefix
        cache hold nothing of them, and no request's acceptance estimate saw them."""
        shapes = tuple(shapes or self.spec_shapes)
        if not shapes:
            raise InvalidConfig("measure_spec_costs needs shapes: this engine does not speculate adaptively")
        if self.has_unfinished():
            raise InvalidConfig("measure_spec_costs runs on an idle engine: let its requests finish first")
        if self.draft is None:
            raise InvalidConfig("measure_spec_costs needs a speculative engine (a draft)")
        lead = self.draft.kv_lead
        wide = [sh.name for sh in shapes if sh.topk > self.kv.topk or sh.num_steps > self.kv.num_steps
                or max_tokens_per_iteration([sh], lead) > self.scheduler.tokens_per_iteration]
        if wide:  # the draft's branch regions and the KV lookahead were sized for the engine's shapes
            raise InvalidConfig(f"shapes {wide} need more draft branches, steps or tree nodes than this engine "
                                f"allocates (topk {self.kv.topk}, num_steps {self.kv.num_steps}, "
                                f"{self.scheduler.tokens_per_iteration} positions per iteration)")
        largest = self.config.max_batch_size
        batches = tuple(sorted({b for b in (batches or MEASURE_BATCHES) if b <= largest} | ({largest} if batches is None else set())))
        sched = self.scheduler
        saved = sched.adaptive
        sched.adaptive = AdaptiveSpeculation(CostTable(shapes, [1], [[1.0]] * len(shapes)), split=False)
        prompt_len = 16
        # each shape times fresh requests, so none finishes (or shrinks the batch) while timed
        budget = min((warmup + 2 * steps) * max(s.accept_width for s in shapes) + 8, self.max_context - prompt_len - 1)
        long_len = self._long_cost_context(batches[-1], budget, long_context, prompt_len)
        contexts = (prompt_len, long_len) if long_len else (prompt_len,)
        seconds = {c: [[0.0] * len(batches) for _ in shapes] for c in contexts}
        split_s = 0.0
        gen = torch.Generator().manual_seed(0)
        self._attach_pools()
        saved_topk, self.ctx.draft_topk = self.ctx.draft_topk, self.kv.topk

        def timed(b: int, length: int, tag: str, time_it) -> float:
            with self._throwaway_requests(b, length, budget, gen, f"measure-{tag}"):
                return time_it()

        try:
            for j, b in enumerate(batches):
                for c in contexts:
                    for i, shape in enumerate(shapes):
                        sched.adaptive.force = shape
                        # the faster of two timings: a capture or a stall in one would misprice the shape
                        seconds[c][i][j] = timed(b, c, shape.name, lambda: min(self._time_steps(warmup, steps),
                                                                               self._time_steps(0, steps)))
                sched.adaptive.force = None
                if b == batches[-1] and b >= 2 and len(shapes) > 1:
                    self._agree_on_costs(seconds, 0.0)  # the split's shapes are chosen from them
                    split_s = timed(b, prompt_len, "split", lambda j=j, b=b: self._time_split(
                        shapes, seconds[prompt_len], j, b, warmup, steps))
        finally:
            sched.adaptive = saved
            self.ctx.draft_topk = saved_topk
        split_s = self._agree_on_costs(seconds, split_s)
        return CostTable(shapes, batches, seconds[prompt_len], split_s, prompt_len, long_len or None,
                         seconds[long_len] if long_len else None)

    def _agree_on_costs(self, seconds: dict[int, list[list[float]]], split_s: float) -> float:
        """Under tensor parallelism, rank 0's timings (``seconds`` in place, and ``split_s``
        returned) on every rank: each rank plans its own iterations from them, and ranks that
        planned differently would run different collectives."""
        if self.tp is None:
            return split_s
        flat = [x for c in sorted(seconds) for row in seconds[c] for x in row] + [split_s]
        agreed = iter(self.tp.same_floats(flat))
        for c in sorted(seconds):
            for row in seconds[c]:
                row[:] = [next(agreed) for _ in row]
        return next(agreed)

    def _long_cost_context(self, batch: int, budget: int, wanted: int | None, short: int) -> int:
        """The prompt length of the long-context timings: ``wanted`` (default
        :data:`LONG_COST_CONTEXT`), cut to what the context length and the KV pool hold for
        ``batch`` requests; 0 where that is not at least twice the short prompts'."""
        if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 0):
            raise InvalidConfig(f"long_context must be a token count >= 0; got {wanted!r}")
        length = LONG_COST_CONTEXT if wanted is None else wanted
        length = min(length, self.max_context - budget - 1)
        page = self.kv.page_size
        # each request's pages: its prompt and budget, plus the draft's region and a page of slack
        spare_pages = self.kv.allocator.total // batch - self.kv.region_len - 1
        length = min(length, spare_pages * page - budget - self.scheduler.tokens_per_iteration)
        return length if length >= 2 * short else 0

    def _time_steps(self, warmup: int, steps: int) -> float:
        """Seconds per scheduling step, after ``warmup`` steps (graph capture among them)."""
        sched = self.scheduler
        for _ in range(warmup):
            sched.step()
        sched.drain()
        _synchronize(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            sched.step()
        sched.drain()
        _synchronize(self.device)
        return (time.perf_counter() - start) / steps

    def _time_split(self, shapes, seconds, j: int, b: int, warmup: int, steps: int) -> float:
        """What running a batch of ``b`` as two halves adds to the halves' own iterations (the
        costliest shape kept, the cheapest held), from the costs just measured at ``b``."""
        cheap = min(range(len(shapes)), key=lambda i: seconds[i][j])
        dear = max(range(len(shapes)), key=lambda i: seconds[i][j])
        half = b // 2
        policy = self.scheduler.adaptive
        policy.force = None
        policy.fixed_split = (dear, cheap)
        try:
            together = self._time_steps(warmup, steps)
        finally:
            policy.fixed_split = None
        alone = seconds[dear][j] * (b - half) / b + seconds[cheap][j] * half / b  # linear in the batch
        return max(0.0, together - alone)

    def _allocate_kv(self, tree) -> None:
        """``self.kv``: the paged KV pools of the target and the draft, with room for the
        smallest request; :class:`InvalidConfig` where they do not fit in memory."""
        config, page_size = self.config, self.config.page_size
        kv_tokens = config.kv_pool_tokens or self._default_pool_tokens()
        if self.tp is not None:  # each rank sizes its own pool: every scheduler must see the same
            kv_tokens = self.tp.min_int(kv_tokens)
        num_pages = math.ceil(kv_tokens / page_size) + 1  # + the reserved page 0
        max_pages = math.ceil((self.max_context + self.kv_lookahead) / page_size) + 1
        try:
            self.kv = KVCacheManager(
                num_pages=num_pages,
                page_size=page_size,
                max_reqs=config.max_batch_size + 1,
                max_pages_per_req=max_pages,
                target=self.target.kv_spec,
                draft=self.draft.kv_spec if self.draft is not None else None,
                topk=max([tree.topk if tree else 1, *(sh.topk for sh in self.spec_shapes)]),
                num_steps=max([tree.num_steps if tree else 1, *(sh.num_steps for sh in self.spec_shapes)]),
                device=self.device,
                prefix_cache=config.prefix_cache,
                draft_lead=self.draft.kv_lead if self.draft is not None else 0,
            )
        except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            if not is_out_of_memory(exc) and "alloc" not in str(exc):  # or another allocator refusal
                raise
            raise InvalidConfig(
                f"the KV cache (kv_pool_tokens={kv_tokens}, max_context={self.max_context}, "
                f"max_batch_size={config.max_batch_size}) does not fit in {self.device.type} memory: lower "
                f"them ({type(exc).__name__}: {one_line(str(exc))})"
            ) from None
        least = 2 + self.kv_lookahead  # one prompt token and one new token, plus the lookahead
        capacity = self._kv_capacity()
        if capacity < least:
            raise InvalidConfig(
                f"kv_pool_tokens={kv_tokens} with page_size={page_size} leaves room for "
                f"{max(capacity, 0)} tokens of one request, fewer than the {least} the "
                "smallest request needs: raise kv_pool_tokens or lower page_size"
            )

    def _graph_runner(self) -> GraphRunner | None:
        """CUDA graphs of every phase of an iteration (``graph_scope="iteration"``: one graph
        for draft -> verify -> finalize -> draft-extend; ``"phase"``: one per phase) and of
        decode: on by default on a GPU; ``"emulate"`` runs the same padding and slicing on the
        CPU (for tests). ``prefill_graphs=True`` adds graphs of prefill-extend per request and
        token bucket (phasegraph/runtime/prefill_graph.py); off by default."""
        config = self.config
        cuda_graphs = self.device.type == "cuda" if config.cuda_graphs is None else config.cuda_graphs
        # MoE layers whose experts synchronise with the host cannot be captured (a standalone
        # draft wraps its model as a target)
        reasons = [(name, why) for name, model in (("target", self.target), ("draft", getattr(self.draft, "model", None)))
                   if (why := getattr(model, "capture_reason", None)) is not None]
        if reasons and cuda_graphs is True:
            if config.cuda_graphs is True:
                name, why = reasons[0]
                raise InvalidConfig(f"cuda_graphs=True cannot capture the {name}'s layers: {why}")
            cuda_graphs = False
        if not cuda_graphs:
            if config.prefill_graphs:
                raise InvalidConfig("prefill_graphs=True needs CUDA graphs (cuda_graphs=True on a GPU, 'emulate' on the CPU)")
            return None
        emulate = cuda_graphs == "emulate"
        if not emulate and self.device.type != "cuda":
            raise InvalidConfig("cuda_graphs=True needs a CUDA device (use cuda_graphs='emulate' on the CPU)")
        # every batch the engine can form has a bucket: the largest one is max_batch_size
        largest = config.max_batch_size
        buckets = tuple(b for b in (config.graph_buckets or DEFAULT_BUCKETS) if b < largest) + (largest,)
        prefill = token_buckets_for(self.max_context) if config.prefill_graphs else ()
        return GraphRunner(buckets, emulate=emulate, scope=config.graph_scope, prefill_token_buckets=prefill,
                           phases=tuple(self._phase_graph()))

    def _phase_graph(self) -> PhaseGraph:
        """The phase graph of the engine's method: a registered method's own, else EAGLE's."""
        return EAGLE_GRAPH if self.method is None else self.method.graph

    def _attach_pools(self) -> None:
        """Point the models at this engine's KV pools. Done before every step, not only at
        construction: two engines may share one model object (``Engine(target, ...)`` with the
        same target), and each must run over its own pools."""
        self.target.attach_kv(self.kv.target_pool)
        if self.draft is not None:
            self.draft.attach_kv(self.kv.draft_pool)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        target_dir: str | os.PathLike,
        draft_dir: str | os.PathLike | None = None,
        *,
        spec: SpecConfig | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        draft_dtype: str | torch.dtype | None = None,
        page_size: int = 1,
        kv_pool_tokens: int | None = None,
        progress: bool = False,
        **kwargs,
    ) -> Engine:
        """Load a target directory (config.json + safetensors, sharded or not, plus its
        tokenizer if present), or a ``.gguf`` file (converted once, :func:`convert_gguf`) and, for speculative methods, a draft directory in that method's
        public checkpoint layout. Without ``spec``, a draft directory selects the method it
        holds (:func:`~phasegraph.runtime.models.drafts.draft_kind`) with its default shape; a
        ``spec`` whose method is another kind than the directory's raises :class:`DraftMismatch`.

        ``draft_dtype`` (default: ``dtype``) runs the draft in another precision than the target,
        e.g. a bfloat16 head beside a float32 target: the draft only proposes tokens, so its
        precision moves the acceptance length, never the output (which is always the target's).
        ``progress``: a bar while the target's weights load (its tensors; split, rank 0's layers).
        """
        for name, path in (("target_dir", target_dir), ("draft_dir", draft_dir)):
            if path is not None and not isinstance(path, (str, os.PathLike)):
                raise InvalidConfig(f"{name} must be a directory path; got {type(path).__name__} {path!r}")
        if target_dir is None:
            raise InvalidConfig("target_dir must be a directory path; got None")
        if spec is None and draft_dir is not None:  # the method the draft's checkpoint names
            kind = draft_kind(draft_dir)
            if kind is None:
                raise InvalidConfig(
                    f"cannot tell which kind of draft {str(draft_dir)!r} holds (its config and tensor "
                    "names fit none of eagle, eagle3, mtp, standalone): pass spec=SpecConfig(method=...)"
                )
            spec = SpecConfig(method=kind)
        spec = as_spec(spec)
        method = registered(spec.method)
        if draft_dir is not None and method is not None and method.make_draft is not None:
            raise InvalidConfig(f"SpecConfig(method={spec.method!r}) needs no draft_dir; got {str(draft_dir)!r}")
        if draft_dir is not None and not spec.speculative:
            raise InvalidConfig(
                f"draft_dir {str(draft_dir)!r} was given but spec is method 'none' (the target alone), "
                "which would ignore it: pass spec=SpecConfig(method=...) to speculate with it"
            )
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        draft_dt = dt if draft_dtype is None else resolve_dtype(draft_dtype, dev, "draft_dtype")
        group = None
        tp_size = kwargs.get("tensor_parallel_size", 1)
        if tp_size != 1 or kwargs.get("draft_tensor_parallel_size", 1) != 1:
            # a bad option raises here, before any rank starts (or any weight is read)
            _engine_config(None, dict(kwargs, spec=spec, page_size=page_size, kv_pool_tokens=kv_pool_tokens))
        if tp_size != 1 and kwargs.get("tp_all_reduce") == "symm_mem":
            tensor_parallel.check_symmetric_memory_fresh()
        if tp_size != 1:
            load = (target_dir, draft_dir, dict(spec=spec, device=device, dtype=dtype, draft_dtype=draft_dtype,
                                                page_size=page_size, kv_pool_tokens=kv_pool_tokens, **kwargs))
            group = _tp_group(tp_size, dev, kwargs.get("tp_timeout_s", DEFAULT_TP_TIMEOUT_S), load)
        try:
            return cls._load(target_dir, draft_dir, spec, dev if group is None else group.device, dt, draft_dt,
                             group, progress and (group is None or group.rank == 0), page_size=page_size,
                             kv_pool_tokens=kv_pool_tokens, **kwargs)
        except BaseException:
            if group is not None and group.sends:
                group.close()
            raise

    @classmethod
    def _load(cls, target_dir, draft_dir, spec: SpecConfig, dev: torch.device, dt: torch.dtype,
              draft_dt: torch.dtype, group, progress: bool, **kwargs) -> Engine:
        target_path = Path(target_dir)
        if is_gguf(target_path):  # converted once into the user cache dir (models/gguf.py)
            target_path = convert_gguf(target_path)
        method = registered(spec.method)
        feature_mode = FEATURE_MODE[spec.method] if method is None else method.feature_mode
        if group is None:
            target = HFTarget.from_pretrained(target_path, dtype=dt, device=dev, feature_mode=feature_mode,
                                              progress=progress)
        else:  # each rank reads one decoder layer at a time and keeps its slice on its device
            target = HFTarget.from_pretrained_split(target_path, dt, group, feature_mode=feature_mode,
                                                    progress=progress)
        draft = None
        if spec.speculative and (method is None or method.make_draft is None):  # else the engine builds it
            if draft_dir is None:
                raise InvalidConfig(f"SpecConfig(method={spec.method!r}) needs draft_dir")
            split = group is not None and kwargs.get("draft_tensor_parallel_size", 1) != 1
            # a standalone draft to split is read whole on the CPU too (an EAGLE-3 head is one layer)
            draft_dev = "cpu" if split and spec.method == "standalone" else dev
            draft = load_draft(Path(draft_dir), target, spec.method, dtype=draft_dt, device=draft_dev)
            if split:
                draft.split(group)  # StandaloneDraft and Eagle3Draft (config: DRAFT_TP_METHODS)
        tokenizer = load_tokenizer(target_path)
        if spec.method == "standalone":
            _check_draft_tokenizer(Path(draft_dir), tokenizer)
        kwargs.setdefault("eos_token_ids", _eos_ids(target, target_path, tokenizer))
        return cls(target, draft, spec=spec, tokenizer=tokenizer, **kwargs)

    @property
    def longest_request(self) -> int:
        """The most tokens one request may hold, prompt and output: the context, or fewer where
        the KV pool holds fewer (a server's limit to offer, and its default budget)."""
        return min(self.max_context, self._kv_capacity() - self.kv_lookahead)

    def _kv_capacity(self) -> int:
        """KV tokens one request may hold: the pool less the tree-branch pages it also takes."""
        return (self.kv.num_pages - 1 - self.kv.pages_per_admission) * self.page_size

    def _default_pool_tokens(self) -> int:
        if self.device.type != "cuda":
            return 32768
        per_token = _kv_bytes_per_token(self.target.kv_spec)
        if self.draft is not None:
            per_token += _kv_bytes_per_token(self.draft.kv_spec)
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(4096, int(free * 0.5) // per_token)

    # ------------------------------------------------------------------ requests
    @_one_thread_at_a_time
    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Bad input raises :class:`InvalidRequest` and changes nothing."""
        self._admit(self._make_request(request_id, prompt, params or SamplingParams()))

    def _admit(self, req: Request) -> None:
        if self.tp is not None and self.tp.sends:  # the workers build the same request
            self.tp.send("add", req.request_id, req.prompt, req.params, req.seed)
        self._requests[req.request_id] = req
        self.scheduler.add(req)

    def _make_request(self, request_id: str, prompt, params: SamplingParams, seed: int | None = None) -> Request:
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be a SamplingParams; got {type(params).__name__}")
        _check_request_id(request_id)
        if request_id in self._requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        ids = self._encode(prompt)
        if len(ids) + 1 > self.max_context:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_context}, "
                "so there is no room to generate"
            )
        budget = min(params.max_new_tokens, self.max_context - len(ids))
        need = len(ids) + budget + self.kv_lookahead
        capacity = self._kv_capacity()
        if need > capacity:
            raise InvalidRequest(
                f"request {request_id!r} may need {need} tokens of KV cache, but the pool holds "
                f"{capacity}; raise kv_pool_tokens or lower max_new_tokens"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequest(
                f"stop strings {list(params.stop)!r} need a tokenizer to be matched, and this target "
                "has none: pass stop_token_ids instead"
            )
        outside = [t for t in params.stop_token_ids if t >= self.target.vocab_size]
        if outside:
            raise InvalidRequest(
                f"stop_token_ids {outside} are outside the vocabulary [0, {self.target.vocab_size}): "
                "they can never be generated"
            )
        outside = [t for t, _ in params.logit_bias or () if t >= self.target.vocab_size]
        if outside:
            raise InvalidRequest(
                f"logit_bias names token ids {outside[:8]} outside the vocabulary [0, {self.target.vocab_size})"
            )
        if params.return_routed_experts and not getattr(self.target, "num_moe_layers", 0):
            raise InvalidRequest(
                f"return_routed_experts=True needs a mixture-of-experts target; this "
                f"{getattr(self.target.config, 'model_type', 'dense')} target routes no token to experts"
            )
        matcher = None
        if params.structured_output is not None:  # compiled once per spec, before anything is queued
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.target.vocab_size, self.eos_token_ids)
            matcher = self._grammars.matcher(*params.structured_output)
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += list(self.eos_token_ids)
        if seed is None:
            seed = params.seed if params.seed is not None else hash((self._seed, next(self._counter))) & 0x7FFFFFFF
        decode = None
        if self.tokenizer is not None:
            tok = self.tokenizer

            def decode(tokens: list[int]) -> str:
                return tok.decode(tokens, skip_special_tokens=True)

        req = Request(request_id, ids, params, stop_ids=stop_ids, budget=budget, seed=seed, decode=decode)
        req.matcher = matcher
        return req

    def _encode(self, prompt) -> list[int]:
        vocab = self.target.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this target has no tokenizer: pass prompts as lists of token ids")
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1:
                raise InvalidRequest(
                    f"a prompt tensor must be 1-D (one prompt's token ids); got shape {list(prompt.shape)} "
                    "(pass a batch as a list of 1-D tensors)"
                )
            ids = prompt.tolist()
        elif isinstance(prompt, Sequence):
            ids = list(prompt)
        else:
            raise InvalidRequest(f"a prompt is a string or a list of token ids; got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequest("the prompt is empty: give at least one token")
        ints = [_as_token_id(t) for t in ids]
        not_ints = [t for t, i in zip(ids, ints, strict=True) if i is None]
        if not_ints:
            raise InvalidRequest(f"token ids must be integers; got {not_ints[:8]!r}")
        bad = [t for t in ints if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(
                f"{len(bad)} token id(s) outside the vocabulary [0, {vocab}) of this target: {bad[:8]}"
            )
        return ints

    @_one_thread_at_a_time
    def abort(self, request_id: str) -> bool:
        """Stop a request; its KV is freed at once. Returns False for an unknown or finished id."""
        _check_request_id(request_id)
        req = self._requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return False
        self._tp_send("abort", request_id)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @_one_thread_at_a_time
    def step(self) -> list[RequestDelta]:
        """Run one scheduling step; returns what each affected request produced. A request's
        last delta has its finish reason and its whole :class:`RequestOutput` (``output``)."""
        self._step_scheduler()
        deltas = []
        for rid, req in list(self._requests.items()):
            tokens, text, logprobs, top = req.take_delta()
            experts = req.take_routed_experts()
            if tokens or text or req.finish_reason is not None:
                output = req.to_output() if req.status is Status.FINISHED else None
                deltas.append(RequestDelta(
                    rid, tuple(tokens), text, req.finish_reason, req.error, tuple(req.take_accept_lengths()),
                    logprobs=None if logprobs is None else tuple(logprobs),
                    top_logprobs=None if top is None else tuple(tuple(t) for t in top),
                    routed_experts=None if experts is None else tuple(
                        tuple(tuple(layer) for layer in t) for t in experts),
                    output=output,
                ))
            if req.status is Status.FINISHED:
                del self._requests[rid]
        return deltas

    def _step_scheduler(self) -> None:
        self._tp_send("step")
        self._attach_pools()
        self.scheduler.step()
        if self.check_every_step:
            self._check_requests()
        if self.tp is not None and self.config.tp_check:
            plan = self.scheduler.last_plan
            ids = () if plan is None else (plan.shape, -1 if plan.held_shape is None else plan.held_shape, *plan.held)
            tensor_parallel.check_divergence(self.tp, [r.output for r in (*self.scheduler.running, *self.scheduler.waiting)],
                                             ids)

    @_one_thread_at_a_time
    def retract(self, request_id: str) -> bool:
        """Force a running request out of the batch (it is requeued and resumes with the same
        output). Returns False when the request is not running."""
        _check_request_id(request_id)
        self._tp_send("retract", request_id)
        self.scheduler.drain()  # it may have finished in the iteration in flight
        for req in self.scheduler.running:
            if req.request_id == request_id:
                self.scheduler.retract([req])
                return True
        return False

    # ------------------------------------------------------------------ batch generation
    @_one_thread_at_a_time
    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        ``should_stop`` is asked between scheduling steps (e.g. whether Ctrl-C was pressed);
        once it answers True, the iteration in flight is collected and every request still
        running ends with finish reason ``"abort"``, keeping every token it has: the outputs
        come back as usual.

        Every prompt and parameter set is checked before any work starts, so one bad prompt
        raises :class:`InvalidRequest` without running (or harming) the others. A request that
        fails while it runs (finish reason ``"error"``: its target's logits were not finite)
        does not stop the others; once all have ended, :class:`RequestFailed` is raised with
        every output (``.outputs``), the failed ones carrying their ``error``.
        """
        if isinstance(prompts, (str, torch.Tensor)) or (
            isinstance(prompts, Sequence) and prompts and _as_token_id(prompts[0]) is not None
        ):
            prompts = [prompts]  # one prompt
        if not isinstance(prompts, Sequence):
            raise InvalidRequest(
                "prompts must be a list of prompts (strings or lists of token ids) or one prompt; "
                f"got {type(prompts).__name__}"
            )
        n = len(prompts)
        plist = [params or SamplingParams()] * n if not isinstance(params, (list, tuple)) else list(params)
        if len(plist) != n:
            raise InvalidRequest(f"got {n} prompts but {len(plist)} SamplingParams")
        base = next(self._counter)
        while any(f"gen-{base}-{i}" in self._requests for i in range(n)):  # ids a caller chose
            base = next(self._counter)
        reqs = [self._make_request(f"gen-{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))]
        for req in reqs:
            self._admit(req)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=sum(r.budget for r in reqs), unit="tok", desc="generating")
        try:
            # scheduler steps without the streaming deltas of step(): nobody reads this batch's
            # text before it ends; requests added through add_request keep theirs for step()
            while any(r.status is not Status.FINISHED for r in reqs):
                if should_stop is not None and should_stop():
                    self._stop(reqs)
                    break
                before = sum(len(r.output) for r in reqs)
                self._step_scheduler()
                if bar is not None:
                    bar.update(sum(len(r.output) for r in reqs) - before)
        finally:
            if bar is not None:
                bar.close()
            for req in reqs:
                if req.status is Status.FINISHED:
                    self._requests.pop(req.request_id, None)
        outputs = [r.to_output() for r in reqs]
        if any(o.finish_reason == "error" for o in outputs):
            raise RequestFailed(outputs)
        return outputs

    def _stop(self, reqs: Sequence[Request]) -> None:
        """End ``reqs`` now: collect the iteration in flight (its tokens were computed), then
        abort every request it did not finish."""
        self._tp_send("drain")
        self.scheduler.drain()
        for req in reqs:
            if req.status is not Status.FINISHED:
                self.abort(req.request_id)

    # ------------------------------------------------------------------ tensor parallelism
    def _tp_send(self, *command) -> None:
        """Hand one scheduling call to the workers this engine started (no-op otherwise)."""
        if self.tp is not None and self.tp.sends:
            self.tp.send(*command)

    def shutdown(self) -> None:
        """Stop the ranks this engine started, or leave torchrun's group (bounded; idempotent).
        An engine without tensor parallelism has nothing to stop."""
        if self.tp is not None and self.tp.mode != "worker":
            self._release_graphs()
            self.tp.close()

    def _release_graphs(self) -> None:
        """Destroy this rank's CUDA graphs before it leaves its group: NCCL's abort and destroy
        wait until no live graph holds a collective of the communicator (vLLM #39846 traced
        this), so leaving with the graphs alive outlasted its bound on 2×H200."""
        if self.graph_runner is not None:
            self.graph_runner.release()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _serve_leader(self, commands) -> None:
        """A started worker: run the leader's scheduling calls in order until it shuts down."""
        while (command := tensor_parallel.next_command(commands)) is not None:
            op, args = command[0], command[1:]
            if op == "shutdown":
                self._release_graphs()
                self.tp.close()  # meets the leader's close, then leaves the group
                return
            if op == "add":
                request_id, prompt, params, seed = args
                req = self._make_request(request_id, prompt, params, seed)
                self._requests[request_id] = req
                self.scheduler.add(req)
            elif op == "step":
                self._step_scheduler()
                for rid in [rid for rid, r in self._requests.items() if r.status is Status.FINISHED]:
                    del self._requests[rid]
            elif op == "abort":
                self.abort(*args)
            elif op == "retract":
                self.retract(*args)
            elif op == "drain":
                self.scheduler.drain()
            elif op == "warm_up":
                self.warm_up(*args)

    # ------------------------------------------------------------------ introspection
    @property
    def num_retractions(self) -> int:
        return self.scheduler.num_retractions

    def check(self) -> None:
        """Check every invariant: the scheduler's (KV accounting, one place per request, device
        state == host bookkeeping, ``seq_len == prompt + committed tokens``) and the engine's
        own request table. Raises :class:`SchedulerInvariantError` listing every problem."""
        self.scheduler.check()
        self._check_requests()

    def _check_requests(self) -> None:
        problems = []
        queued = {r.request_id: r for r in (*self.scheduler.running, *self.scheduler.waiting)}
        for rid, req in queued.items():
            if self._requests.get(rid) is not req:
                problems.append(f"{rid}: queued in the scheduler but unknown to the engine")
        for rid, req in self._requests.items():
            if req.status is Status.FINISHED:
                if rid in queued or req.row is not None or req.finish_reason is None:
                    problems.append(
                        f"{rid}: finished ({req.finish_reason!r}) but still queued or holding row {req.row}"
                    )
            elif rid not in queued:
                problems.append(f"{rid}: {req.status.value} but in neither queue")
        if problems:
            raise SchedulerInvariantError(problems)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens prefilled and read from the prefix cache so far, and pages evicted."""
        return self.kv.cache_stats

    @property
    def cached_pages(self) -> int:
        """KV pages the prefix cache holds now (all free again after :meth:`clear_prefix_cache`
        once no request runs)."""
        return self.kv.cached_pages

    def clear_prefix_cache(self) -> int:
        """Free the cached pages no running request borrows; returns how many."""
        self.scheduler.drain()
        return self.kv.clear_prefix_cache()

    def save_trace(self, path: str | os.PathLike) -> Path:
        if self.trace is None:
            raise InvalidConfig("this engine records no trace (trace=False)")
        return self.trace.save_chrome(path)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_token_id(t) -> int | None:
    """``t`` as a Python int if it is an integer (int, numpy or 0-d torch integer), else None."""
    if isinstance(t, bool):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None


def _kv_bytes_per_token(spec) -> int:
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.tensor([], dtype=spec.dtype).element_size()


# What the engine and the phases use of each model object (phases/protocols.py, plus the KV
# attachment the runtime needs)
MODEL_ATTRIBUTES = {
    "target": ("forward", "vocab_size", "feature_size", "config", "device", "kv_spec", "attach_kv"),
    "draft": ("forward", "hidden_size", "uses_features", "kv_lead", "to_target_ids", "kv_spec", "attach_kv"),
}


def _check_model_object(name: str, model) -> None:
    """``Engine(target, draft)`` takes phasegraph's model wrappers; anything else (a bare
    transformers model, None) would fail deep inside the first step."""
    missing = [a for a in MODEL_ATTRIBUTES[name] if not hasattr(model, a)]
    if not missing:
        return
    wrapper = ("HFTarget(model, feature_mode=...)" if name == "target"
               else "a draft class of phasegraph.runtime.models (e.g. Eagle3Draft)")
    raise InvalidConfig(
        f"Engine({name}=...) takes a phasegraph {name} model ({wrapper}); got {type(model).__name__}, "
        f"which lacks {', '.join(missing)}. Engine.from_pretrained(target_dir, draft_dir, spec=...) "
        "loads checkpoint directories"
    )


def _check_request_id(request_id) -> None:
    if not isinstance(request_id, str):
        raise InvalidRequest(f"a request id is a string; got {type(request_id).__name__} {request_id!r}")


def _engine_config(config: EngineConfig | None, options: dict) -> EngineConfig:
    """``config`` with ``options`` (EngineConfig fields) changed; an unknown option is refused
    by name."""
    if config is not None and not isinstance(config, EngineConfig):
        raise InvalidConfig(f"config must be an EngineConfig; got {type(config).__name__}")
    unknown = sorted(set(options) - set(attrs.fields_dict(EngineConfig)))
    if unknown:
        raise InvalidConfig(f"Engine got unknown option(s) {', '.join(unknown)}; its options are the fields "
                            f"of EngineConfig: {', '.join(attrs.fields_dict(EngineConfig))}")
    return attrs.evolve(config, **options) if config is not None else EngineConfig(**options)


def _check_models(config: EngineConfig, target, draft) -> None:
    """The models given to an Engine, and the options that depend on them: :class:`InvalidConfig`
    naming what is wrong."""
    spec = config.spec
    for name, model in (("target", target), ("draft", draft)):
        if isinstance(model, (str, os.PathLike)):
            raise InvalidConfig(
                f"Engine({name}=...) takes a loaded model, not the path {str(model)!r}: load "
                "checkpoint directories with Engine.from_pretrained(target_dir, draft_dir, spec=...)"
            )
        if model is not None or name == "target":
            _check_model_object(name, model)
    if spec.speculative and draft is None:
        raise InvalidConfig(f"SpecConfig(method={spec.method!r}) needs a draft model")
    if draft is not None and not spec.speculative:
        raise InvalidConfig(
            "a draft was given but spec is method 'none' (the target alone), which would ignore "
            "it: pass spec=SpecConfig(method=...) to speculate with it, or no draft"
        )
    _check_config_fits(config, target, draft)
    try:  # a kernel setting the first launch would refuse, refused before any request
        check_kernel_settings(getattr(target, "device", torch.device("cpu")))
    except KernelSettingError as exc:
        raise InvalidConfig(str(exc)) from None


def _check_config_fits(config: EngineConfig, target, draft) -> None:
    """The options that depend on the models: :class:`InvalidConfig` naming one."""
    if config.max_context is None and getattr(target.config, "max_position_embeddings", 0) > MAX_KV_TOKENS:
        raise InvalidConfig(f"the target's max_position_embeddings ({target.config.max_position_embeddings}) "
                            f"exceeds {MAX_KV_TOKENS} tokens: pass max_context")
    eos = config.eos_token_ids
    if not isinstance(eos, tuple) or any(not is_int(t) or not 0 <= t < target.vocab_size for t in eos):
        raise InvalidConfig(f"eos_token_ids must be a list of token ids in [0, {target.vocab_size}); "
                            f"got {list(eos) if isinstance(eos, tuple) else eos!r}")
    tree = config.spec.tree()
    if tree is not None:
        _check_tree_fits(tree, target, draft, registered(config.spec.method))


def _check_tree_fits(tree, target, draft, method=None) -> None:
    """A tree shape the models (and a registered method's draft phase) can run:
    :class:`InvalidConfig` naming why not."""
    if method is not None and method.max_topk is not None and tree.topk > method.max_topk:
        raise InvalidConfig(f"method {method.name!r} builds trees of topk <= {method.max_topk}; a shape asks "
                            f"topk={tree.topk}")
    # The tree block is not windowed (AttentionMetadata.window_lo): a node at depth d reads
    # ancestors up to d positions back, which must lie inside every window.
    for name, model in (("target", target), ("draft", getattr(draft, "model", draft))):
        window = getattr(model, "sliding_window", None)
        if isinstance(window, int) and tree.num_steps >= window:
            raise InvalidConfig(
                f"SpecConfig.num_steps={tree.num_steps} reaches past the {name}'s sliding window "
                f"of {window} tokens: use num_steps < {window}"
            )
    draft_vocab = getattr(draft, "vocab_size", None)
    if isinstance(draft_vocab, int) and tree.topk > draft_vocab:
        raise InvalidConfig(
            f"SpecConfig.topk={tree.topk} exceeds the draft's vocabulary of {draft_vocab} tokens "
            "(each draft step keeps the top-k of it)"
        )


def _check_draft_tokenizer(draft_dir: Path, tokenizer) -> None:
    """A standalone draft that ships a tokenizer must map token ids to the same tokens as the
    target's: with the same vocabulary size but another tokenizer, every draft would be
    rejected (the output stays the target's, the speed-up silently vanishes)."""
    if tokenizer is None:
        return
    draft_tokenizer = load_tokenizer(draft_dir)
    if draft_tokenizer is None:
        return
    target_tokens = {i: t for t, i in tokenizer.get_vocab().items()}
    draft_tokens = {i: t for t, i in draft_tokenizer.get_vocab().items()}
    differ = sorted(i for i, t in draft_tokens.items() if i in target_tokens and target_tokens[i] != t)
    if differ:
        i = differ[0]
        raise DraftMismatch(
            f"{draft_dir}: the standalone draft's tokenizer differs from the target's: "
            f"{len(differ)} token id(s) name other tokens (id {i} is {draft_tokens[i]!r} for the draft, "
            f"{target_tokens[i]!r} for the target); a standalone draft must share the target's tokenizer"
        )


def _tp_group(world_size: int, dev: torch.device, timeout_s: float, load: tuple):
    """This process's tensor-parallel group: the one it already is in (a started worker, or
    torchrun's), else a new one whose other ranks it starts now."""
    group = tensor_parallel.current_group(world_size, dev, timeout_s)
    if group is not None:
        return group
    return tensor_parallel.launch(world_size, dev, timeout_s, _tp_worker, load)


def _tp_worker(rank: int, world_size: int, init_method: str, device_type: str, timeout_s: float, load: tuple,
               commands, errors) -> None:
    """A started rank's process: join the group, load the same engine (validation off), run the
    leader's calls; report a failure's traceback to the leader and exit."""
    try:
        tensor_parallel.start_worker(rank, world_size, init_method, device_type, timeout_s)
        target_dir, draft_dir, options = load
        options = dict(options, validate="off", trace=False)
        engine = Engine.from_pretrained(target_dir, draft_dir, **options)
        engine._serve_leader(commands)
    except BaseException:  # noqa: BLE001 - everything goes back to the leader
        errors.put(f"rank {rank}: " + traceback.format_exc())
        errors.close()
        errors.join_thread()
        os._exit(1)
    os._exit(0)
