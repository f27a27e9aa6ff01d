"""Continuous batching over the phase graph: admit, iterate, finish, retract, abort.

One :meth:`Scheduler.step` does, in order:

1. abort: requests marked aborted leave the batch (``filter``) or the queue;
2. admit: waiting requests that fit the KV pool are prefilled together on their own machine
   (``prefill-extend`` -> ``draft-extend``) and merged into the running batch (``merge``);
3. reserve: every running request gets the KV pages its next iteration writes; when the pool
   runs short the most recently admitted requests are retracted (``retract``) and requeued;
4. issue: one speculative iteration (``draft`` -> ``verify`` -> ``finalize-tree-path`` ->
   ``draft-extend``) or one ``decode`` step for the baseline, plus an asynchronous copy of its
   emitted tokens to the host;
5. collect: **the one host synchronisation of an iteration** reads the emitted tokens and
   accept lengths (:meth:`Scheduler._collect`);
6. finish: finished requests leave the batch (``filter``), freeing their KV.

With ``overlap=True`` (the default on a GPU) step 5 collects the iteration issued by the
*previous* step, after this step's iteration is already queued behind it: the GPU never waits
for the host's bookkeeping (SGLang's overlap scheduler does the same). The device then runs one
iteration ahead of the host, which costs three things, all handled here:

- pages: an iteration is issued before the host knows how many tokens the previous one
  committed, so each request's pages are reserved for the worst case (``commit_per_iteration``
  more tokens);
- finished requests run one iteration too many (their extra tokens are dropped on collection;
  the phases clamp ``remaining`` at 0, so the device state stays valid), except at the end of
  a batch: when every running request may reach its budget in the iteration in flight, the step
  collects it before issuing another (a stop token cannot be foreseen);
- host and device bookkeeping agree only after a drain (:meth:`Scheduler.drain`): ``check()``,
  retraction and a short pool drain first.

With adaptive speculation (``adaptive``, :mod:`phasegraph.runtime.adaptive`) step 4 first asks
the policy for the iteration's shape: no drafts (``decode``), a chain or a tree. Where the plan
holds some requests to a cheaper shape, the batch runs as two groups (``split`` keeps each
group's rows, a second machine runs the held group) merged back after the iteration; the
running batch's order is then the first group's requests, then the held ones.

The running batch's rows are always in the order of ``self.running``.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable

import attrs
import torch

from phasegraph.kernels.argmax import NONFINITE_LOGITS
from phasegraph.kernels.commit_path import DRAFT_NONFINITE
from phasegraph.phases import BatchParams, DraftState, PrefillInput, RowSelection, SpecContext
from phasegraph.phases.schemas import NO_DRAFT_CAP
from phasegraph.runtime.adaptive import (
    AdaptiveSpeculation,
    Plan,
    SpecShape,
    max_tokens_per_iteration,
)
from phasegraph.runtime.errors import (
    KVAccountingError,
    NonFiniteDraftWarning,
    OutOfKVPages,
    SchedulerInvariantError,
)
from phasegraph.runtime.grammar import BatchGrammar
from phasegraph.runtime.kv_pool import KVCacheManager, to_device
from phasegraph.runtime.prefix_cache import PrefixMatch
from phasegraph.runtime.requests import Request, Status
from phasegraph.statemachine import Machine, PhaseGraph, Trace

# A request whose KV must grow takes the pages of this many more positions while the pool has
# them free: at batch 1 the page table is then written once every ~64 tokens instead of every
# iteration (a host-to-device copy and an indexed write, ~0.15 ms of host time on a slow host).
# Under pressure the spare pages go back first (Scheduler._trim_spare), so admission and
# retraction see the same free pages as with exact growth; while requests wait, growth is exact.
KV_SPARE_TOKENS = 64

# A waiting request that shares this many tokens past its cached prefix with a request admitted
# in the same step waits one step and reads them from the prefix cache instead of prefilling
# them again beside it (SGLang's in-batch prefix caching does the same).
BATCH_SHARE_TOKENS = 32


@attrs.define(eq=False)
class InFlight:
    """An iteration issued to the device whose emitted tokens the host has not read yet."""

    batch: list[Request]  # the running batch it was issued for, in row order
    # speculative: [B, W] emitted tokens, -1 past each accept length (so the host counts the
    # length: no kernel packs it in); decode: [B]; in host memory. NONFINITE_LOGITS marks the
    # first token whose target logits were not finite (the request fails there)
    tokens: torch.Tensor
    logprobs: torch.Tensor | None  # [B, W] or [B]
    ready: torch.cuda.Event | None  # recorded after the copy to the host (None on the CPU)
    speculative: bool
    top_logprobs: torch.Tensor | None = None  # [B, W, L] or [B, L]: the batch's top logprobs
    top_ids: torch.Tensor | None = None  # their token ids
    routed_experts: torch.Tensor | None = None  # [B, W, M, Ke] or [B, M, Ke]: where a request asks
    shapes: list[SpecShape] | None = None  # adaptive speculation: the shape each row ran


class Scheduler:
    def __init__(
        self,
        *,
        graph: PhaseGraph,
        ctx: SpecContext,
        kv: KVCacheManager,
        max_batch_size: int,
        device: torch.device,
        trace: Trace | None = None,
        validate: str | None = None,
        check_every_step: bool = False,
        overlap: bool = False,
        spare_tokens: int = KV_SPARE_TOKENS,
        adaptive: AdaptiveSpeculation | None = None,
    ):
        self.graph = graph
        self.ctx = ctx
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.device = device
        self.trace = trace
        self.validate = validate
        self.check_every_step = check_every_step
        self.speculative = ctx.tree is not None
        self.base_tree = ctx.tree  # the configured shape (prefill and decode run with it set)
        self.adaptive = adaptive
        self.last_plan: Plan | None = None  # adaptive speculation's latest (tp_check compares it)
        self.tokens_per_iteration = ctx.tokens_per_iteration
        self.commit_per_iteration = ctx.commit_per_iteration
        if adaptive is not None:  # pages for the largest shape
            self.tokens_per_iteration = max_tokens_per_iteration(adaptive.shapes, ctx.kv_lead)
            self.commit_per_iteration = max(s.accept_width for s in adaptive.shapes)
        self.issuing: list[Request] = []  # the requests whose rows the phases now run (in row order)
        self.overlap = overlap
        self.spare_tokens = spare_tokens
        self.in_flight: InFlight | None = None
        self.host_buffers = PinnedBuffers()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.machine = Machine(graph, name="running", trace=trace, validate=validate)
        self.machine.reset("filter", self._empty_state())
        self.num_retractions = 0
        self._prefill_batches = 0
        self._warned_nonfinite_draft = False
        # called after every phase with its name, host wall time and batch (serving metrics)
        self.on_phase: Callable[[str, float, list[Request]], None] | None = None
        # seconds the host waited for the device at collection: the slack in which other host
        # work (a server's event loop) runs for free; none where the host is the bottleneck
        self.device_wait_s = 0.0

    # ------------------------------------------------------------------ requests in and out
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish("abort")
                req.status = Status.FINISHED
                return True
        for req in self.running:
            if req.request_id == request_id:
                req.finish("abort")
                self._filter_finished()
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight is not None)

    # ------------------------------------------------------------------ one step
    def step(self) -> set[Request]:
        """Run one scheduling step; returns the requests whose output changed."""
        touched: set[Request] = set()
        touched |= self._admit()
        self._filter_finished()
        issued = None
        if self.running:
            if self.in_flight is not None and (self._pages_short() or self._all_may_finish()
                                               or self._grammar_running()):
                # exact lengths before reserving (or retracting); or the iteration in flight may
                # finish every request by its budget: one un-overlapped step instead of a wasted
                # iteration (a whole decode step or speculative iteration at the end of a batch);
                # or a request has structured output: its masks need the matcher at its tokens,
                # and each mask waits for the tokens before it, so overlap would hide nothing
                touched |= self.drain()
            if self.running:
                self._reserve_pages()
            if self.running:
                issued = self._issue()
        previous, self.in_flight = self.in_flight, issued
        if previous is not None:  # overlap: it finished on the GPU while `issued` was queued
            touched |= self._collect(previous)
        if not self.overlap:
            touched |= self.drain()
        self._filter_finished()
        if self.check_every_step:
            self.check()
        return touched

    def drain(self) -> set[Request]:
        """Collect the iteration in flight, if any, and drop the requests it finished: after
        this the host's bookkeeping equals the device state again."""
        previous, self.in_flight = self.in_flight, None
        if previous is None:
            return set()
        touched = self._collect(previous)
        self._filter_finished()
        return touched

    def _all_may_finish(self) -> bool:
        """Every running request may reach its token budget in the iteration in flight (which
        commits at least one and at most ``commit_per_iteration`` tokens to each)."""
        return all(r.remaining <= self.commit_per_iteration for r in self.running)

    def _grammar_running(self) -> bool:
        return any(r.matcher is not None for r in self.running)

    def _grammar(self, reqs: list[Request], prefill: bool = False) -> BatchGrammar | None:
        """The grammar masks of a batch whose rows are ``reqs``; None where none has a grammar."""
        if all(r.matcher is None for r in reqs):
            return None
        resumed = [r.resuming for r in reqs] if prefill else None
        return BatchGrammar([r.matcher for r in reqs], self.ctx.target.vocab_size, self.device, resumed)

    def _lookahead(self) -> int:
        """Tokens past its host-side ``seq_len`` a running request may write in the next
        iteration: its own writes, plus the tokens the iteration in flight may commit."""
        ahead = self.commit_per_iteration if self.in_flight is not None else 0
        return ahead + self.tokens_per_iteration

    # ------------------------------------------------------------------ admission
    def _admit(self) -> set[Request]:
        admitted: list[Request] = []
        ahead = self._lookahead()
        reserve = sum(self.kv.pages_needed(r.seq_len + ahead, r.row) for r in self.running)
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            req = self.waiting[0]
            tokens = req.tokens_to_prefill()
            prefix = self._cached_prefix(req, tokens)
            if prefix is not None and self._shares_with_batch(tokens, prefix.length, admitted):
                break  # next step it reads the prefix the batch writes into the cache now
            need_tokens = len(tokens) + self.tokens_per_iteration
            if self.kv.pages_needed(need_tokens, prefix=prefix) + reserve > self.kv.num_free_pages:
                self._trim_spare()  # spare pages go back before a request is turned away
                if self.kv.pages_needed(need_tokens, prefix=prefix) + reserve > self.kv.num_free_pages:
                    break
            try:
                req.row = self.kv.admit(need_tokens, prefix)
            except OutOfKVPages:
                break
            req.cached_len = 0 if prefix is None else prefix.length
            self.waiting.popleft()
            admitted.append(req)
        if not admitted:
            return set()
        self._prefill(admitted)
        return set(admitted)

    def _cached_prefix(self, req: Request, tokens: list[int]) -> PrefixMatch | None:
        """The cached prefix ``req`` reuses; None without a cache, and for a request whose
        prefill must see every prompt token: prompt logprobs score each one, and penalties
        count them."""
        if self.kv.prefix_cache is None or req.needs_prompt_logprobs or req.params.uses_penalties:
            return None
        return self.kv.match_prefix(tokens)

    def _shares_with_batch(self, tokens: list[int], cached: int, batch: list[Request]) -> bool:
        """A request admitted in this step prefills at least ``BATCH_SHARE_TOKENS`` of
        ``tokens`` past their cached prefix: waiting one step reads them from the cache."""
        want = cached + BATCH_SHARE_TOKENS
        if want >= len(tokens):  # the last token is prefilled anyway
            return False
        return any(other.tokens_to_prefill()[:want] == tokens[:want] for other in batch)

    def _cache_rows(self, reqs: list[Request]) -> None:
        """Hand the prefix cache the committed KV of requests about to release their rows
        (finished, aborted or retracted); not that of a request whose logits were not finite."""
        if self.kv.prefix_cache is None:
            return
        for req in reqs:
            if req.row is not None and req.finish_reason != "error":
                tokens = req.prompt + req.output
                self.kv.cache_row(req.row, tokens, min(req.seq_len, len(tokens) - 1))

    def _params(self, reqs: list[Request]) -> BatchParams:
        dev = self.device
        z = max(1, max(len(r.stop_ids) for r in reqs))
        stop = torch.full((len(reqs), z), -1, dtype=torch.int64)
        for i, r in enumerate(reqs):
            if r.stop_ids:
                stop[i, : len(r.stop_ids)] = torch.tensor(r.stop_ids, dtype=torch.int64)

        def floats(name: str) -> torch.Tensor:
            return torch.tensor([getattr(r.params, name) for r in reqs], dtype=torch.float32, device=dev)

        return BatchParams(
            req_pool_idx=torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev),
            temperature=floats("temperature"),
            top_p=floats("top_p"),
            top_k=torch.tensor([r.params.top_k for r in reqs], dtype=torch.int64, device=dev),
            stop_ids=stop.to(dev),
            seed=torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=dev),
            min_p=floats("min_p"),
            repetition_penalty=floats("repetition_penalty"),
            frequency_penalty=floats("frequency_penalty"),
            presence_penalty=floats("presence_penalty"),
            logit_bias=self._logit_bias(reqs),
            draft_cap=self._draft_caps(reqs),
        )

    def _draft_caps(self, reqs: list[Request]) -> torch.Tensor | None:
        """The batch's per-request draft caps [B], None where no request has one (or nothing
        speculates)."""
        caps = [r.params.draft_cap for r in reqs]
        if not self.speculative or all(c is None for c in caps):
            return None
        return torch.tensor([NO_DRAFT_CAP if c is None else c for c in caps], dtype=torch.int64, device=self.device)

    def _logit_bias(self, reqs: list[Request]) -> torch.Tensor | None:
        """The batch's logit biases as a dense [B, V] table, None where no request has one."""
        if all(r.params.logit_bias is None for r in reqs):
            return None
        table = torch.zeros(len(reqs), self.ctx.target.vocab_size, dtype=torch.float32)
        for i, r in enumerate(reqs):
            for token, bias in r.params.logit_bias or ():
                table[i, token] = bias
        return table.to(self.device)

    def _prefill(self, reqs: list[Request]) -> None:
        """Prefill new and resumed requests together and merge them into the running batch.

        A resumed (retracted) request prefills its prompt and committed tokens only; its last
        emitted token stays its bonus token instead of being drawn again. Drawing it again would
        be harmless for greedy requests but would change a sampled request's output: the
        unretracted run chooses the next tokens by tree verification (acceptance and bonus
        coins, depending on the drafts), prefill by plain sampling (other coins).
        """
        dev = self.device
        self.ctx.tree = self.base_tree
        self.issuing = reqs
        self.ctx.grammar = self._grammar(reqs, prefill=True)
        prompts = [r.tokens_to_prefill() for r in reqs]
        cached = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64)  # read from the prefix cache
        resumed = [r.resuming for r in reqs]
        prompt_rows = [r.needs_prompt_logprobs for r in reqs]
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64) - cached  # tokens prefilled
        token_req = torch.repeat_interleave(torch.arange(len(reqs)), lens)
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(int(lens.sum())) - starts[token_req] + cached[token_req]
        inp = PrefillInput(
            params=self._params(reqs),
            input_ids=torch.tensor([t for r, p in zip(reqs, prompts, strict=True) for t in p[r.cached_len :]],
                                   dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            token_req=token_req.to(dev),
            select_index=(torch.cumsum(lens, 0) - 1).to(dev),
            seq_lens=(lens + cached).to(dev),
            prompt_lens=torch.tensor([len(r.prompt) for r in reqs], dtype=torch.int64, device=dev),
            # the bonus token counts against the budget once: a resumed request's is emitted
            remaining=torch.tensor(
                [r.remaining + int(res) for r, res in zip(reqs, resumed, strict=True)],
                dtype=torch.int64, device=dev,
            ),
            forced_tokens=torch.tensor(
                [r.output[-1] if res else -1 for r, res in zip(reqs, resumed, strict=True)],
                dtype=torch.int64, device=dev,
            ),
            # the first token's mask, from each matcher at its emitted tokens (none yet when new)
            token_bitmask=None if self.ctx.grammar is None else self.ctx.grammar.next_token_bitmask(),
        )
        self._set_flags(reqs, prompt_logprobs=[r for r, want in zip(reqs, prompt_rows, strict=True) if want])
        self._prefill_batches += 1
        m = Machine(self.graph, name=f"prefill-{self._prefill_batches}", trace=self.trace, validate=self.validate)
        result = self._run(m, "prefill-extend", reqs, state=inp)
        new_state = self._run(m, "draft-extend", reqs)
        # host sync: the first token of every new request
        first = result.bonus_tokens.tolist()
        finite = result.logits_finite.tolist()
        first_lp = result.first_logprobs.tolist() if result.first_logprobs is not None else None
        first_top = _top_pairs(result.first_top_logprobs, result.first_top_ids)
        first_experts = None if result.first_routed_experts is None else result.first_routed_experts.tolist()
        if any(prompt_rows):
            self._record_prompt_logprobs(reqs, prompts, prompt_rows, result)
        for i, (req, prompt) in enumerate(zip(reqs, prompts, strict=True)):
            req.status = Status.RUNNING
            req.seq_len = len(prompt)
            req.stats.cached_tokens += req.cached_len
            self.kv.cache_stats.prompt_tokens += len(prompt)
            self.kv.cache_stats.cached_tokens += req.cached_len
            req.cached_len = 0
            if not finite[i]:
                req.fail_nonfinite()  # leaves the batch with the finished ones (step)
                continue
            if not resumed[i]:
                req.append([first[i]], None if first_lp is None else [first_lp[i]],
                           None if first_top is None else [first_top[i]],
                           None if first_experts is None else [first_experts[i]])
            # the prompt's KV is shared while the request runs (its first token: what the lead-0
            # draft row of its last position was computed with)
            self.kv.cache_row(req.row, prompt + [first[i]], len(prompt))
        self._run(self.machine, "merge", self.running + reqs, other=new_state)
        self.running.extend(reqs)

    def _record_prompt_logprobs(self, reqs: list[Request], prompts: list[list[int]], wanted: list[bool],
                                result) -> None:
        """Hand each request that asked its prompt logprobs: row p of its prefilled rows holds
        the logprob of its token p + 1 (a lead-1 layout has one more row per request before
        it). Resumed requests had theirs at their first prefill and are not asked again."""
        lps = result.prompt_logprobs.tolist()
        top = _top_pairs(result.prompt_top_logprobs, result.prompt_top_ids)
        start = 0
        for i, (req, prompt) in enumerate(zip(reqs, prompts, strict=True)):
            first_row = start + (i if result.lead else 0)
            start += len(prompt) - req.cached_len  # the rows it prefilled
            if not wanted[i]:
                continue
            rows = slice(first_row, first_row + len(req.prompt) - 1)  # predicting tokens 1..P-1
            req.set_prompt_logprobs(lps[rows], None if top is None else top[rows])

    # ------------------------------------------------------------------ memory
    def _pages_short(self) -> bool:
        ahead = self._lookahead()
        need = sum(self.kv.pages_needed(r.seq_len + ahead, r.row) for r in self.running)
        return need > self.kv.num_free_pages

    def _reserve_pages(self) -> None:
        """Give every running request the pages of its next iteration, retracting the most
        recently admitted requests while the pool is short."""
        if self._pages_short():
            self._trim_spare()
        while self._pages_short() and len(self.running) > 1:
            self.retract([self.running[-1]])
        ahead = self._lookahead()
        # no spare pages while requests wait for room: they would be trimmed again next step
        spare = 0 if self.waiting else self.spare_tokens
        self.kv.ensure_capacity_many([r.row for r in self.running], [r.seq_len + ahead for r in self.running], spare)

    def _trim_spare(self) -> None:
        """Give back every running request's spare pages (those past the positions its next
        iteration and the one in flight may write)."""
        ahead = self._lookahead()
        for r in self.running:
            self.kv.trim(r.row, r.seq_len + ahead)

    def retract(self, victims: list[Request]) -> None:
        """Give back everything ``victims`` hold and requeue them (front of the queue) to
        resume from their prompt plus the tokens they already emitted (the last of which stays
        their bonus token, see :meth:`_prefill`)."""
        if not victims:
            return
        if self.in_flight is not None:
            self.drain()  # a victim resumes from exactly the tokens the host has
            victims = [v for v in victims if v.finish_reason is None]
            if not victims:
                return
        ids = {id(v) for v in victims}
        rows = [i for i, r in enumerate(self.running) if id(r) in ids]
        self._cache_rows(victims)  # a resumed request reads its own committed KV back
        self._run(self.machine, "retract", self.running, rows=self._selection(rows))
        self.running = [r for r in self.running if id(r) not in ids]
        for req in reversed(victims):
            req.status = Status.WAITING
            req.row = None
            req.seq_len = 0
            req.stats.retractions += 1
            self.num_retractions += 1
            self.waiting.appendleft(req)

    # ------------------------------------------------------------------ iteration
    def _set_flags(self, reqs: list[Request], prompt_logprobs: list[Request] = ()) -> None:
        """The context flags of a batch: what its requests use, so that the phases skip what
        none does (each is part of the CUDA-graph key). ``prompt_logprobs``: the requests of a
        prefill batch whose prompt logprobs are due."""
        ctx = self.ctx
        ctx.greedy_only = all(r.params.greedy for r in reqs)
        ctx.return_logprobs = any(r.params.wants_logprobs for r in reqs)
        ctx.top_logprobs = max((r.params.top_logprobs for r in reqs), default=0)
        ctx.prompt_logprobs = max((r.params.prompt_logprobs for r in prompt_logprobs), default=None)
        ctx.penalties = any(r.params.uses_penalties for r in reqs)
        ctx.min_p = any(r.params.min_p > 0 for r in reqs)
        ctx.return_routed_experts = any(r.params.return_routed_experts for r in reqs)

    def _issue(self) -> InFlight:
        """Queue one iteration of the running batch and an asynchronous copy of what it emits
        to the host; nothing here waits for the device."""
        batch = list(self.running)
        self._set_flags(batch)
        shapes = None
        if self.adaptive is None:
            shape = SpecShape.of(self.base_tree) if self.speculative else None
            out = self._iteration(self.machine, batch, shape, note="" if shape is None else shape.name)
        else:
            plan = self.last_plan = self.adaptive.plan(batch)
            shape = self.adaptive.shapes[plan.shape]
            if not plan.held:
                out = self._iteration(self.machine, batch, shape, note=shape.name)
                if shape.off:
                    self.adaptive.batch_ran_without_drafts()
                shapes = None if shape.off else [shape] * len(batch)
            else:
                batch, out, shapes = self._issue_split(batch, plan)
        tokens, lps, top, top_ids, experts = out
        ready = None
        if tokens.device.type == "cuda":
            tokens = self.host_buffers.copy(tokens)
            lps, top, top_ids, experts = (None if x is None else self.host_buffers.copy(x)
                                          for x in (lps, top, top_ids, experts))
            ready = torch.cuda.Event()
            ready.record()
        return InFlight(batch, tokens, lps, ready, tokens.dim() == 2, top, top_ids, experts, shapes)

    def _iteration(self, m: Machine, batch: list[Request], shape: SpecShape | None,
                   note: str = "") -> tuple[torch.Tensor, ...]:
        """Run one iteration of ``shape`` (None or off: decode) on machine ``m``, whose rows are
        ``batch``; returns the device tensors the host reads: tokens [B] or [B, W] (-1 past
        each accept length), logprobs, top logprobs and their ids, routed experts (or None)."""
        self.issuing = batch
        self.ctx.grammar = self._grammar(batch)  # these rows' masks (a split runs two groups)
        if shape is None or shape.off:
            self.ctx.tree = self.base_tree  # decode ignores it; the graph key stays one
            state = self._run(m, "decode", batch, note=note)
            if self.adaptive is not None:
                for r in batch:
                    self.adaptive.ran_without_drafts(r)
            # [B]: one token each, NONFINITE_LOGITS where it is garbage; [B] / [B, L] / [B, M, Ke] or None
            return (state.emitted, state.bonus_logprobs, state.bonus_top_logprobs, state.bonus_top_ids,
                    state.bonus_routed_experts)
        self.ctx.tree = shape.tree
        self._run(m, "draft", batch, note=note)
        self._run(m, "verify", batch)
        path = self._run(m, "finalize-tree-path", batch)
        self._run(m, "draft-extend", batch)
        # [B, W], -1 (DRAFT_NONFINITE: the draft was not finite) past accept_lens, NONFINITE_LOGITS
        tokens = path.emitted
        B, W = tokens.shape
        lps = None if path.accepted_logprobs is None else path.accepted_logprobs.view(B, W)
        top, top_ids = path.accepted_top_logprobs, path.accepted_top_logprob_ids  # [B*W, L] or None
        if top is not None:
            top, top_ids = top.view(B, W, -1), top_ids.view(B, W, -1)
        experts = path.accepted_routed_experts  # [B*W, M, Ke] or None: compacted along the path
        if experts is not None:
            experts = experts.view(B, W, *experts.shape[1:])
        return tokens, lps, top, top_ids, experts

    def _issue_split(self, batch: list[Request], plan) -> tuple[list[Request], tuple, list[SpecShape]]:
        """Run the plan's two groups apart: the kept rows on the running machine, the held ones
        on a machine of their own, each in its shape; then merge them back (kept rows first).
        Returns the new row order, the emitted tensors (W-wide, the groups' rows stacked) and
        each row's shape."""
        shapes = self.adaptive.shapes
        held = set(plan.held)
        kept_rows = [i for i in range(len(batch)) if i not in held]
        held_rows = list(plan.held)
        kept, holding = [batch[i] for i in kept_rows], [batch[i] for i in held_rows]
        shape, held_shape = shapes[plan.shape], shapes[plan.held_shape]
        side = Machine(self.graph, name="held", trace=self.trace, validate=self.validate)
        side.reset(self.machine.phase, self.machine.state)
        self._run(self.machine, "split", kept, note=plan.describe(shapes), keep=self._selection(kept_rows))
        self._run(side, "split", holding, note=plan.describe(shapes), keep=self._selection(held_rows))
        first = self._iteration(self.machine, kept, shape, note=shape.name)
        second = self._iteration(side, holding, held_shape, note=held_shape.name)
        order = kept + holding
        self._run(self.machine, "merge", order, other=side.state)
        self.running = order
        W = max(shape.accept_width, held_shape.accept_width)
        out = tuple(None if a is None else torch.cat([_widen(a, shape.off, W, fill), _widen(b, held_shape.off, W, fill)])
                    for a, b, fill in zip(first, second, (-1, 0.0, 0.0, 0, 0), strict=True))
        return order, out, [shape] * len(kept) + [held_shape] * len(holding)

    def _collect(self, done: InFlight) -> set[Request]:
        """**The one host synchronisation of an iteration**: wait for its copy to the host and
        append the emitted tokens. Requests that finished, were aborted or retracted since it
        was issued ran it for nothing; their tokens are dropped."""
        if done.ready is not None:
            start = time.perf_counter()
            done.ready.synchronize()
            self.device_wait_s += time.perf_counter() - start
        packed = done.tokens.tolist()
        lps = None if done.logprobs is None else done.logprobs.tolist()
        top = None if done.top_logprobs is None else (done.top_logprobs.tolist(), done.top_ids.tolist())
        experts = None if done.routed_experts is None else done.routed_experts.tolist()
        if done.ready is not None:  # read: its pinned buffers may take the next copies
            self.host_buffers.give_back(done.tokens, done.logprobs, done.top_logprobs, done.top_ids,
                                        done.routed_experts)
        touched = set()
        for i, req in enumerate(done.batch):
            if req.status is not Status.RUNNING or req.finish_reason is not None:
                continue
            row = packed[i] if done.speculative else packed[i : i + 1]
            row_lps = None if lps is None else (lps[i] if done.speculative else lps[i : i + 1])
            row_top = None
            if top is not None and req.top_logprobs is not None:  # (id, logprob) pairs per token
                values, ids = (x[i] if done.speculative else x[i : i + 1] for x in top)
                row_top = [list(zip(t_ids, t_values, strict=True)) for t_ids, t_values in zip(ids, values, strict=True)]
            row_experts = None if experts is None else (experts[i] if done.speculative else experts[i : i + 1])
            n = sum(1 for t in row if t >= 0)  # accept_lens[i]: -1 pads the rest
            failed = NONFINITE_LOGITS in row
            shape = None if done.shapes is None else done.shapes[i]
            if done.speculative and not failed and (shape is None or not shape.off):
                req.stats.accept_lengths.append(n)
                if DRAFT_NONFINITE in row:
                    self._note_nonfinite_draft(req)
                elif shape is not None and req.remaining >= shape.accept_width:
                    # (an iteration the budget cut short says nothing about the draft)
                    self.adaptive.observe(req, shape, n)
            req.append(row[:n], None if row_lps is None else row_lps[:n], None if row_top is None else row_top[:n],
                       None if row_experts is None else row_experts[:n])
            req.seq_len += n
            if failed:
                req.fail_nonfinite()  # the tokens before the bad one stay
            touched.add(req)
        return touched

    def _note_nonfinite_draft(self, req: Request) -> None:
        """Count a verify step whose tree came from non-finite draft logits; warn once."""
        req.stats.nonfinite_drafts += 1
        if self._warned_nonfinite_draft:
            return
        self._warned_nonfinite_draft = True
        warnings.warn(
            f"request {req.request_id}: the draft's logits were not finite (NaN or infinity), so "
            "verify rejected its drafts: the outputs stay exact but speculation gains nothing "
            "(tau 1). Check the draft's weights and dtype; RequestStats.nonfinite_drafts counts "
            "such verify steps per request (this warning is given once per engine)",
            NonFiniteDraftWarning,
            stacklevel=2,
        )

    def _filter_finished(self) -> None:
        done = [r for r in self.running if r.finish_reason is not None]
        if not done:
            return
        keep = [i for i, r in enumerate(self.running) if r.finish_reason is None]
        self._cache_rows(done)
        self._run(self.machine, "filter", self.running, keep=self._selection(keep))
        self.running = [self.running[i] for i in keep]
        for req in done:
            req.status = Status.FINISHED
            req.row = None

    # ------------------------------------------------------------------ helpers
    def _selection(self, rows: list[int]) -> RowSelection:
        return RowSelection(rows=to_device(torch.tensor(rows, dtype=torch.int64), self.device))

    def _run(self, machine: Machine, phase: str, reqs: list[Request], note: str = "", **kw):
        start = time.perf_counter()
        out = machine.advance(phase, self.ctx, note=note, **kw)
        seconds = time.perf_counter() - start
        for r in reqs:
            r.stats.phase_time_s[phase] = r.stats.phase_time_s.get(phase, 0.0) + seconds
        if self.on_phase is not None:
            self.on_phase(phase, seconds, reqs)
        return out

    def _empty_state(self) -> DraftState:
        dev = self.device
        K = (self.ctx.draft_topk or self.ctx.tree.topk) if self.speculative and self.ctx.draft is not None else 0
        z = torch.zeros(0, dtype=torch.int64, device=dev)
        f = torch.zeros(0, device=dev)
        return DraftState(
            params=BatchParams(
                req_pool_idx=z, temperature=f, top_p=torch.ones(0, device=dev),
                top_k=z, stop_ids=torch.zeros(0, 1, dtype=torch.int64, device=dev), seed=z,
                min_p=f, repetition_penalty=torch.ones(0, device=dev), frequency_penalty=f, presence_penalty=f,
            ),
            seq_lens=z, bonus_tokens=z, remaining=z,
            topk_p=torch.zeros(0, K, device=dev), topk_index=torch.zeros(0, K, dtype=torch.int64, device=dev),
            hidden=None,
        )

    def check(self) -> None:
        """Invariants after a step, all checked (no ``assert``: they survive ``python -O``):
        KV accounting; one place per request (waiting xor running, never twice); the running
        batch's device state == host bookkeeping (rows, ``seq_len == prompt + committed
        tokens``, bonus token, remaining budget); page-table rows held by running requests only,
        each owning the KV of its committed tokens. Raises :class:`SchedulerInvariantError`
        listing every problem found."""
        self.drain()
        problems: list[str] = []
        try:
            self.kv.check()
        except KVAccountingError as exc:
            problems += [f"KV: {p}" for p in exc.problems]
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        dups = sorted({i for i in ids if ids.count(i) > 1})
        if dups:
            problems.append(f"requests queued more than once: {dups}")
        state = self.machine.state
        if state.batch_size != len(self.running):
            problems.append(f"device batch has {state.batch_size} rows, host runs {len(self.running)} requests")
        elif self.running:
            seq = state.seq_lens.tolist()
            rows = state.params.req_pool_idx.tolist()
            bonus = state.bonus_tokens.tolist()
            remaining = state.remaining.tolist()
            for i, r in enumerate(self.running):
                problems += self._check_running(r, rows[i], seq[i], bonus[i], remaining[i])
            problems += self._check_penalty_state(state)
        held = sorted(r.row for r in self.running if r.row is not None)
        in_use = self.kv.table.rows_in_use()
        if held != in_use:
            problems.append(f"page-table rows in use {in_use} != rows of running requests {held}")
        for r in self.waiting:
            if r.status is not Status.WAITING or r.row is not None or r.finish_reason is not None:
                problems.append(
                    f"{r.request_id}: waiting with status {r.status.value}, row {r.row}, "
                    f"finish_reason {r.finish_reason!r}"
                )
        if problems:
            raise SchedulerInvariantError(problems)

    def _check_penalty_state(self, state: DraftState) -> list[str]:
        """The device's penalty state of every running request that uses penalties: its output
        counts are its output's (bonus token included), its prompt mask its prompt's."""
        users = [(i, r) for i, r in enumerate(self.running) if r.params.uses_penalties]
        if not users:
            return []
        if state.output_counts is None or state.prompt_mask is None:
            return [f"{users[0][1].request_id} uses penalties but the batch carries no output counts"]
        p = []
        vocab = state.output_counts.shape[1]
        for i, r in users:
            want = torch.bincount(torch.tensor(r.output, dtype=torch.int64), minlength=vocab)
            got = state.output_counts[i].cpu().to(torch.int64)
            if not torch.equal(got, want):
                diff = (got != want).nonzero()[:, 0].tolist()[:8]
                p.append(f"{r.request_id}: device output counts differ from its output at tokens {diff}")
            prompt = torch.zeros(vocab, dtype=torch.bool)
            prompt[torch.tensor(r.prompt, dtype=torch.int64)] = True
            if not torch.equal(state.prompt_mask[i].cpu(), prompt):
                p.append(f"{r.request_id}: device prompt mask differs from its prompt")
        return p

    def _check_running(self, r: Request, row: int, seq: int, bonus: int, remaining: int) -> list[str]:
        p = []
        if r.status is not Status.RUNNING or r.finish_reason is not None:
            p.append(f"{r.request_id}: in the batch with status {r.status.value}, finish_reason {r.finish_reason!r}")
        if r.row != row:
            p.append(f"{r.request_id}: host row {r.row}, device row {row}")
        committed = len(r.prompt) + len(r.output) - 1
        if not seq == r.seq_len == committed:
            p.append(
                f"{r.request_id}: device seq_len {seq}, host {r.seq_len}, prompt {len(r.prompt)} "
                f"+ output {len(r.output)} - 1 = {committed}"
            )
        if r.output and bonus != r.output[-1]:
            p.append(f"{r.request_id}: device bonus token {bonus} != last emitted token {r.output[-1]}")
        if remaining != r.remaining:
            p.append(f"{r.request_id}: device remaining {remaining} != host {r.remaining}")
        if r.row is not None and self.kv.table.is_in_use(r.row):
            owned = len(self.kv.table.owned[r.row]) * self.kv.page_size
            if owned < r.seq_len:
                p.append(f"{r.request_id}: row {r.row} owns {owned} KV slots < seq_len {r.seq_len}")
        return p


def _widen(x: torch.Tensor, decoded: bool, width: int, fill) -> torch.Tensor:
    """One group's output, ``[B, ...]`` of a decode or ``[B, W, ...]`` of an iteration, as
    ``[B, width, ...]`` with ``fill`` in the added columns (-1 for tokens: none)."""
    if decoded:
        x = x.unsqueeze(1)
    if x.shape[1] == width:
        return x
    pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), fill)
    return torch.cat([x, pad], dim=1)


def _top_pairs(values: torch.Tensor | None, ids: torch.Tensor | None) -> list[list[tuple[int, float]]] | None:
    """Rows of top logprobs [R, L] and their ids as (token id, logprob) pairs per row."""
    if values is None:
        return None
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


class PinnedBuffers:
    """Pinned host buffers for the one copy of an iteration's emitted tokens to the host, kept
    by shape and dtype and reused once the host has read them (:meth:`Scheduler._collect`).
    Allocating pinned memory on every iteration went through the caching host allocator each
    time (~0.04 ms of host time per iteration with the copy, benchmarks/profile_pair_host.py
    --generate). A buffer is given back only after its contents were read, so a reused one is
    never overwritten while an iteration in flight still owns it."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[torch.Tensor]] = {}
        self.allocated = 0

    def copy(self, x: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy of device tensor ``x`` into a free pinned buffer (valid once the
        stream reaches the copy)."""
        pool = self.free.get((x.shape, x.dtype))
        if pool:
            host = pool.pop()
        else:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.allocated += 1
        host.copy_(x, non_blocking=True)
        return host

    def give_back(self, *buffers: torch.Tensor | None) -> None:
        for host in buffers:
            if host is not None:
                self.free.setdefault((host.shape, host.dtype), []).append(host)
