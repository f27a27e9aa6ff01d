"""AsyncEngine: an :class:`~phasegraph.runtime.engine.Engine` driven by one background thread,
for asyncio programs (the HTTP server of :mod:`phasegraph.serving.app` among them).

::

    async with AsyncEngine(engine, max_queue=64) as aengine:
        async for delta in aengine.stream("def fib(n):", SamplingParams(max_new_tokens=32)):
            print(delta.new_text, end="")
        out = await aengine.generate("def fib(n):")  # a RequestOutput

The Engine is not thread-safe, so every call to it happens on the AsyncEngine's thread: its step
loop, the requests added and aborted, and the functions given to :meth:`AsyncEngine.call`. The
event loop only puts commands on a queue and reads deltas from per-request queues, so it never
waits for a model step. A consumer that stops reading (a cancelled task, a closed stream, a
client gone) aborts its request, and the engine thread frees its KV before its next step.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import attrs

from phasegraph.runtime.config import RequestDelta, RequestOutput, SamplingParams, is_int
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import InvalidConfig, InvalidRequest, RequestFailed
from phasegraph.serving import DEFAULT_MAX_QUEUE
from phasegraph.serving.errors import EngineClosed, QueueFull


@attrs.frozen
class ServingStats:
    """A snapshot of an :class:`AsyncEngine` (:meth:`AsyncEngine.stats`); the counts are totals
    since it started, the rest as of the engine's last step."""

    queued: int  # requests the bounded queue holds: added and not yet finished
    max_queue: int
    waiting: int  # requests in the engine's scheduler waiting for admission
    running: int  # requests in the engine's running batch
    kv_free_pages: int
    kv_total_pages: int  # pages the KV allocator can hand out
    steps: int  # engine steps run
    generated_tokens: int  # tokens emitted, also those of requests whose consumer left
    prompt_tokens: int  # of the finished requests
    rejected: int  # requests refused with QueueFull
    finished: dict[str, int]  # finished requests by finish reason
    accept_lengths: dict[int, int]  # verify steps by accept length (speculative methods)
    phase_seconds: dict[str, float]  # host wall time per phase (Scheduler.on_phase)
    phase_runs: dict[str, int]  # runs per phase
    prefill_tokens: int = 0  # tokens of every prefill (a resumed request's committed ones too)
    cached_tokens: int = 0  # of them, read from the prefix cache
    kv_cached_pages: int = 0  # pages the prefix cache holds (evictable ones count as free too)
    # the engine thread's host time: in engine.step(), and on the serving layer's own work around
    # it (deltas handed to their event loops, waking them, counters): that share is what this
    # layer adds to every iteration on the engine's critical path
    step_seconds: float = 0.0
    serving_seconds: float = 0.0
    deliveries: int = 0  # hand-overs to an event loop: one per step and loop, whatever the tokens


def engine_state(engine: Engine) -> dict:
    """The engine's side of :class:`ServingStats` that is read off the engine itself (call it
    on the thread that steps the engine)."""
    cache = engine.kv.cache_stats
    return {"waiting": len(engine.scheduler.waiting), "running": len(engine.scheduler.running),
            "kv_free_pages": engine.kv.num_free_pages, "kv_total_pages": engine.kv.allocator.total,
            "prefill_tokens": cache.prompt_tokens, "cached_tokens": cache.cached_tokens,
            "kv_cached_pages": engine.kv.cached_pages}


class StepCounters:
    """The totals :class:`ServingStats` reports, kept by whichever thread steps the engine (the
    AsyncEngine's, or the engine process's step loop)."""

    def __init__(self) -> None:
        self.steps = self.tokens = self.prompt_tokens = 0
        self.finished: dict[str, int] = defaultdict(int)
        self.accepts: dict[int, int] = defaultdict(int)
        self.phase_seconds: dict[str, float] = defaultdict(float)
        self.phase_runs: dict[str, int] = defaultdict(int)
        self.step_seconds = self.serving_seconds = 0.0

    def count_step(self, deltas: Sequence[RequestDelta], finished: Sequence[RequestDelta]) -> None:
        """One engine step: every delta's tokens and accept lengths, and the ``finished`` ones."""
        self.steps += 1
        for delta in deltas:
            self.tokens += len(delta.new_token_ids)
            for n in delta.accept_lengths:
                self.accepts[n] += 1
        for delta in finished:
            self.finished[delta.finish_reason] += 1
            self.prompt_tokens += len(delta.output.prompt_token_ids)

    def count_phase(self, phase: str, seconds: float) -> None:
        self.phase_seconds[phase] += seconds
        self.phase_runs[phase] += 1

    def totals(self) -> dict:
        """The totals as :class:`ServingStats` fields (copies)."""
        return {"steps": self.steps, "generated_tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
                "finished": dict(self.finished), "accept_lengths": dict(self.accepts),
                "phase_seconds": dict(self.phase_seconds), "phase_runs": dict(self.phase_runs),
                "step_seconds": self.step_seconds, "serving_seconds": self.serving_seconds}


@attrs.define
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    add_special_tokens: bool
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue
    done: concurrent.futures.Future


@attrs.define
class _Abort:
    request_id: str


@attrs.define
class _Call:
    fn: Callable[[Engine], Any]
    done: concurrent.futures.Future


_CLOSE = object()


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    """On a consumer's event loop: hand one step's deltas to their requests' queues."""
    for deltas, item in items:
        deltas.put_nowait(item)


class RequestStream:
    """One request's deltas, as an async iterator (``async for delta in stream``), from
    :meth:`AsyncEngine.add_request`. The last delta has the finish reason and the whole output,
    also kept as :attr:`output`. Dropping the stream unfinished aborts the request."""

    def __init__(self, aengine: AsyncEngineBase, request_id: str, deltas: asyncio.Queue) -> None:
        self.request_id = request_id
        self.output: RequestOutput | None = None  # set by the last delta
        self._deltas = deltas
        self._done = False
        # a stream garbage-collected unread still holds KV on the engine: abort it then
        self._finalizer = weakref.finalize(self, aengine._abort_soon, request_id)
        self._abort_soon = aengine._abort_soon

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self._done:
            raise StopAsyncIteration
        item = await self._deltas.get()
        if isinstance(item, BaseException):  # the engine's step loop stopped
            self._end()
            raise item
        if item.output is not None:
            self.output = item.output
            self._end()
        return item

    def _end(self) -> None:
        self._done = True
        self._finalizer.detach()

    def cancel(self) -> None:
        """Abort the request unless it has finished; returns at once (the engine thread frees
        its KV before its next step; the stream then ends with finish reason ``"abort"``)."""
        if not self._done:
            self._abort_soon(self.request_id)

    async def aclose(self) -> None:
        """Abort the request unless it has finished, and wait until the engine has let it go
        (its KV is free when this returns)."""
        self.cancel()
        try:
            while not self._done:
                await self.__anext__()
        except EngineClosed:
            pass


class AsyncEngineBase(abc.ABC):
    """What :class:`AsyncEngine` and :class:`~phasegraph.serving.engine_process.ProcessEngine`
    share: the bounded queue of requests and the calls built on :meth:`add_request`. The rest
    (where the engine runs, how commands reach it) is each one's own."""

    def __init__(self, max_queue: int) -> None:
        if not is_int(max_queue) or max_queue < 1:
            raise InvalidConfig(f"max_queue must be an integer >= 1; got {max_queue!r}")
        self.max_queue = max_queue
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the fields below it, shared by the loop(s) and the engine's side
        self._closed = False
        self._failure: BaseException | None = None
        self._queued = 0
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._rejected = 0

    @property
    def failure(self) -> BaseException | None:
        """The unexpected error that stopped the step loop, if one did."""
        return self._failure

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        wait: bool = False,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[RequestDelta]:
        """``async for delta in aengine.stream(prompt, params)``: the request's deltas (their
        ``new_text`` add up to its text), the last with its finish reason and whole ``output``.
        Leaving the loop early, or the consuming task's cancellation, aborts the request.
        Errors as :meth:`add_request`; a request that fails while it runs ends with finish
        reason ``"error"`` (and ``delta.error``)."""
        stream = await self.add_request(prompt, params, request_id=request_id, wait=wait,
                                        add_special_tokens=add_special_tokens)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.cancel()

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        wait: bool = False,
        add_special_tokens: bool = True,
    ) -> RequestOutput:
        """The request's whole :class:`RequestOutput`. Errors as :meth:`add_request`; a request
        that fails while it runs raises :class:`RequestFailed` (its output in ``.outputs``), one
        that :meth:`close` aborted raises :class:`EngineClosed`."""
        stream = await self.add_request(prompt, params, request_id=request_id, wait=wait,
                                        add_special_tokens=add_special_tokens)
        try:
            async for _ in stream:
                pass
        finally:
            stream.cancel()
        out = stream.output
        if out.finish_reason == "error":
            raise RequestFailed([out])
        if out.finish_reason == "abort" and self._closed:
            raise EngineClosed(f"the engine was closed while request {out.request_id} ran")
        return out

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> AsyncEngineBase:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        wait: bool = False,
        add_special_tokens: bool = True,
    ) -> RequestStream:
        """Queue a request and return its :class:`RequestStream` once the engine has taken it.

        Bad input raises :class:`~phasegraph.runtime.errors.InvalidRequest` here, and nothing
        of it runs or touches another request. A full queue raises :class:`QueueFull`, or with
        ``wait=True`` waits for room. ``add_special_tokens=False`` encodes a text prompt without
        the tokenizer's special tokens (for a prompt a chat template already framed)."""
        self._check_request(request_id, add_special_tokens)
        params = SamplingParams() if params is None else params
        loop = asyncio.get_running_loop()
        await self._acquire(loop, wait)
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        deltas: asyncio.Queue = asyncio.Queue()
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(rid, prompt, params, add_special_tokens, loop, deltas, done)
        except (EngineClosed, InvalidRequest):
            self._release()
            raise
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self._abort_soon(rid)  # the engine may take it after all: let it go again at once
            raise
        return RequestStream(self, rid, deltas)

    @abc.abstractmethod
    def _submit(self, request_id: str, prompt, params: SamplingParams, add_special_tokens: bool,
                loop: asyncio.AbstractEventLoop, deltas: asyncio.Queue, done: concurrent.futures.Future) -> None:
        """Send the request to the engine; ``done`` gets its answer, ``deltas`` its deltas."""

    @abc.abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Abort every pending request and stop the engine's thread or process."""

    @abc.abstractmethod
    def _abort_soon(self, request_id: str) -> None:
        """Ask the engine to abort ``request_id`` (a stream dropped unfinished)."""

    @staticmethod
    def _check_request(request_id, add_special_tokens) -> None:
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequest(f"a request id is a string; got {type(request_id).__name__} {request_id!r}")
        if not isinstance(add_special_tokens, bool):
            raise InvalidRequest(f"add_special_tokens must be True or False; got {add_special_tokens!r}")

    # ------------------------------------------------------------------ the bounded queue
    async def _acquire(self, loop: asyncio.AbstractEventLoop, wait: bool) -> None:
        with self._lock:
            self._check_open()
            if self._queued < self.max_queue and not self._waiters:
                self._queued += 1
                return
            if not wait:
                self._rejected += 1
                raise QueueFull(self.max_queue)
            fut = loop.create_future()
            entry = (loop, fut)
            self._waiters.append(entry)
        try:
            await fut  # _release hands its slot over
        except asyncio.CancelledError:
            with self._lock:
                if entry in self._waiters:  # no slot was handed over
                    self._waiters.remove(entry)
                    raise
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release()  # handed over just as the wait was cancelled
            raise

    def _release(self) -> None:
        """A request left the queue: its slot goes to the first caller waiting, if any."""
        with self._lock:
            while self._waiters:
                loop, fut = self._waiters.popleft()
                if _call_soon(loop, self._hand_over, fut):
                    return
            self._queued -= 1

    def _hand_over(self, fut: asyncio.Future) -> None:
        if fut.done():  # its caller stopped waiting: the slot goes on
            self._release()
        else:
            fut.set_result(None)

    def _check_open(self) -> None:
        if self._failure is not None:
            raise EngineClosed(f"the engine's step loop stopped: {self._failure!r}") from self._failure
        if self._closed:
            raise EngineClosed("the engine was closed")


class AsyncEngine(AsyncEngineBase):
    """An :class:`~phasegraph.runtime.engine.Engine` behind one background thread (see the
    module's docstring). It owns the engine from now on: touch the engine only through
    :meth:`call`. Build a long-running engine with ``trace=False``: a trace keeps every phase
    transition it ever ran.

    ``max_queue`` bounds the requests added and not finished (waiting or running): past it,
    :meth:`add_request` raises :class:`~phasegraph.serving.errors.QueueFull`, or with
    ``wait=True`` waits for room. Close it with :meth:`close` / :meth:`aclose` or ``async with``:
    requests still pending are aborted and the thread is joined.
    """

    def __init__(self, engine: Engine, *, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        if not isinstance(engine, Engine):
            raise InvalidConfig(f"AsyncEngine wraps an Engine; got {type(engine).__name__}")
        super().__init__(max_queue)
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stats_lock = threading.Lock()  # the counters the engine thread keeps
        self._counters = StepCounters()
        # the engine's state as of its last step (stats() runs on other threads: it never reads the engine)
        self._engine_state = {"waiting": 0, "running": 0, "kv_free_pages": engine.kv.num_free_pages,
                              "kv_total_pages": engine.kv.allocator.total, "prefill_tokens": 0,
                              "cached_tokens": 0, "kv_cached_pages": 0}
        self._deliveries = 0
        # engine-thread state: each request's (loop, delta queue), and whether to step once more
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._flush = False
        self._previous_on_phase = engine.scheduler.on_phase  # given back when the thread ends
        engine.scheduler.on_phase = self._on_phase
        self._thread = threading.Thread(target=self._main, name="phasegraph-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what the engine serves
    @property
    def tokenizer(self):
        """The target's tokenizer (None where it ships none); safe to read from any thread for
        decoding and chat templates."""
        return self.engine.tokenizer

    @property
    def max_context(self) -> int:
        """The most tokens one request may hold (``Engine.longest_request``)."""
        return self.engine.longest_request

    @property
    def is_running(self) -> bool:
        """Takes requests: not closed, and its step loop has not stopped on an error."""
        return not self._closed and self._thread.is_alive()

    @property
    def accept_width(self) -> int:
        """Tokens one verify step can accept at most (1 without speculation)."""
        tree = self.engine.spec.tree()
        return tree.accept_width if tree is not None else 1

    # ------------------------------------------------------------------ requests
    def _submit(self, request_id, prompt, params, add_special_tokens, loop, deltas, done) -> None:
        self._send(_Add(request_id, prompt, params, add_special_tokens, loop, deltas, done))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps (after every command sent
        before it), its result or exception returned here: the one safe way to read or change
        the engine while the AsyncEngine runs (``engine.check()``, its KV pool, ...)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def stats(self) -> ServingStats:
        with self._lock:
            queued, rejected = self._queued, self._rejected
        with self._stats_lock:
            return ServingStats(queued=queued, max_queue=self.max_queue, rejected=rejected,
                                deliveries=self._deliveries, **self._engine_state, **self._counters.totals())

    # ------------------------------------------------------------------ shutting down
    def close(self, timeout: float | None = None) -> None:
        """Abort every pending request (their streams end with finish reason ``"abort"``;
        callers waiting for room get :class:`EngineClosed`) and join the thread. Blocks while
        the engine finishes its step and reports the aborts; idempotent."""
        if threading.current_thread() is self._thread:
            raise InvalidConfig("AsyncEngine.close() cannot be called from its own engine thread")
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.put(_CLOSE)
            waiters, self._waiters = list(self._waiters), deque()
        for loop, fut in waiters:
            _call_soon(loop, _fail_waiter, fut, EngineClosed("the engine was closed"))
        self._thread.join(timeout)

    def _send(self, command) -> None:
        with self._lock:  # nothing is sent after _CLOSE, so every command gets an answer
            self._check_open()
            self._commands.put(command)

    def _abort_soon(self, request_id: str) -> None:
        with self._lock:
            if not self._closed and self._failure is None:
                self._commands.put(_Abort(request_id))

    # ------------------------------------------------------------------ the engine thread
    def _main(self) -> None:
        engine = self.engine
        try:
            if engine.device.type == "cuda":  # CUDA's current device is per thread
                import torch

                torch.cuda.set_device(engine.device)
            run_step_loop(self)
        except BaseException as exc:  # noqa: BLE001 - every consumer must hear of it
            self._fail(exc)
        finally:
            engine.scheduler.on_phase = self._previous_on_phase

    # the step loop's hooks (run_step_loop)
    def _take(self, block: bool) -> list:
        return drain(self._commands, block)

    @staticmethod
    def _is_close(command) -> bool:
        return command is _CLOSE

    def _running_ids(self) -> list[str]:
        return list(self._sinks)

    def _idle(self) -> None:
        """Nothing waits to be sent: replies were set on their futures as the commands ran."""

    def _apply(self, command) -> None:
        engine = self.engine
        if isinstance(command, _Abort):
            if command.request_id in self._sinks:
                engine.abort(command.request_id)
                self._flush = True  # the step that reports the abort, even with nothing else to run
        elif isinstance(command, _Call):
            if command.done.set_running_or_notify_cancel():
                try:
                    command.done.set_result(command.fn(engine))
                except Exception as exc:  # noqa: BLE001 - the caller's function: its error is its caller's
                    command.done.set_exception(exc)
        else:
            if not command.done.set_running_or_notify_cancel():  # its caller stopped waiting
                self._release()
                return
            try:
                engine.add_request(command.request_id, encoded_prompt(engine, command.prompt, command.add_special_tokens),
                                   command.params)
            except Exception as exc:  # noqa: BLE001 - InvalidRequest, or whatever the tokenizer raised
                self._release()
                command.done.set_exception(exc)
                return
            self._sinks[command.request_id] = (command.loop, command.deltas)
            command.done.set_result(None)

    def _step(self) -> None:
        engine = self.engine
        start = time.perf_counter()
        deltas = engine.step()
        stepped = time.perf_counter()
        by_loop, finished = route_deltas(self._sinks, deltas)
        with self._stats_lock:
            self._counters.count_step(deltas, finished)
            self._deliveries += len(by_loop)
            self._engine_state = engine_state(engine)
        for _ in finished:
            self._release()
        hand_over(by_loop, self._abort_unread)
        with self._stats_lock:  # after the hand-over: its wake-ups are the layer's cost too
            self._counters.step_seconds += stepped - start
            self._counters.serving_seconds += time.perf_counter() - stepped

    def _abort_unread(self, request_id: str) -> None:
        """Its consumer's event loop is closed: nobody reads it, so it stops (reported next step)."""
        self.engine.abort(request_id)
        self._flush = True

    def _on_phase(self, phase: str, seconds: float, reqs) -> None:
        with self._stats_lock:
            self._counters.count_phase(phase, seconds)

    def _fail(self, exc: BaseException) -> None:
        """The step loop stopped on an unexpected error: every consumer, waiting caller and
        pending command gets :class:`EngineClosed` caused by it."""
        with self._lock:
            self._failure = exc
            self._closed = True
            waiters, self._waiters = list(self._waiters), deque()
            pending = self._take(block=False)
        error = EngineClosed(f"the engine's step loop stopped: {exc!r}")
        error.__cause__ = exc
        for loop, fut in waiters:
            _call_soon(loop, _fail_waiter, fut, error)
        for command in pending:
            done = getattr(command, "done", None)
            if done is not None and done.set_running_or_notify_cancel():
                done.set_exception(error)
        for loop, deltas in self._sinks.values():
            _call_soon(loop, _deliver, [(deltas, error)])
        self._sinks.clear()


def encoded_prompt(engine: Engine, prompt, add_special_tokens: bool):
    """``prompt`` as the engine takes it: a text prompt without special tokens is encoded here
    (one a chat template already framed), anything else passes as it is."""
    if isinstance(prompt, str) and not add_special_tokens and engine.tokenizer is not None:
        return list(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return prompt


def route_deltas(sinks: dict, deltas) -> tuple[dict[asyncio.AbstractEventLoop, list], list]:
    """``deltas`` grouped by their consumers' event loops as ``(queue, delta)`` items (``sinks``:
    request id -> (loop, queue); a request's last delta removes its sink), and the last deltas."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    finished = []
    for delta in deltas:
        sink = sinks.get(delta.request_id)
        if sink is not None:
            by_loop[sink[0]].append((sink[1], delta))
            if delta.output is not None:
                finished.append(delta)
                del sinks[delta.request_id]
    return by_loop, finished


def hand_over(by_loop: dict[asyncio.AbstractEventLoop, list], abort_unread: Callable[[str], None]) -> None:
    """Each loop's items put on their queues on that loop's thread; where the loop is closed,
    nobody reads them: ``abort_unread`` each request not finished."""
    for loop, items in by_loop.items():
        if not _call_soon(loop, _deliver, items):
            for _, delta in items:
                if delta.output is None:
                    abort_unread(delta.request_id)


def drain(items: queue.SimpleQueue, block: bool = True) -> list:
    """The next of ``items`` (waited for with ``block``) and every one queued behind it."""
    out = [items.get()] if block else []
    while True:
        try:
            out.append(items.get_nowait())
        except queue.Empty:
            return out


def run_step_loop(loop) -> None:
    """The engine's step loop, the engine thread's and the engine process's: take the commands
    (waiting for one only when nothing runs), apply them, step while anything runs or an abort
    waits to be reported (``loop._flush``); on the close command, abort what runs and step until
    it has ended. ``loop`` gives ``engine``, ``_flush`` and the hooks ``_take(block)``,
    ``_apply(command)``, ``_step()``, ``_is_close(command)``, ``_running_ids()`` and ``_idle()``."""
    engine = loop.engine
    while True:
        closing = False
        for command in loop._take(block=not (engine.has_unfinished() or loop._flush)):
            if loop._is_close(command):  # always the last command: none is sent after it
                closing = True
            else:
                loop._apply(command)
        if closing:
            abort_all_and_finish(engine, loop._running_ids(), loop._step)
            return
        if loop._flush or engine.has_unfinished():
            loop._flush = False
            loop._step()
        else:
            loop._idle()


def abort_all_and_finish(engine: Engine, request_ids: Sequence[str], step: Callable[[], None]) -> None:
    """On close: abort ``request_ids`` and ``step`` until the engine has nothing left, so that
    every stream hears its end (finish reason ``"abort"``) and every page is freed."""
    for rid in request_ids:
        engine.abort(rid)
    step()  # reports the aborts
    while engine.has_unfinished():
        step()


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """``fn(*args)`` on ``loop``'s thread; False when that loop is closed (nobody to tell)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _fail_waiter(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
