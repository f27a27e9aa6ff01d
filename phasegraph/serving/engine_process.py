"""ProcessEngine: :class:`~phasegraph.serving.async_engine.AsyncEngine`'s interface over an
Engine that runs in a process of its own.

::

    factory = functools.partial(Engine.from_pretrained, target, draft, spec=spec, device="cuda")
    async with ProcessEngine(factory) as aengine:  # loads and warms up in the engine process
        out = await aengine.generate("def fib(n):")

A step of a small batch is host-bound: in one process, every Python line the HTTP server runs
per streamed chunk holds the interpreter lock that the engine's kernel launches wait for. Here
the engine process builds the engine itself (``factory()``, then ``engine.warm_up()``) and runs
the step loop; per step it hands one message with every request's deltas to a sender thread
(which writes every message queued since its last write as one, its deltas as plain tuples,
off the loop's path; a receiver thread takes the commands). This
process keeps the bounded queue and the requests' asyncio queues: one reader thread receives the
steps' messages (blocked in the pipe without the lock) and hands the deltas to their event
loops, and one writer thread sends the commands (add, abort, call, stats, close), so that
neither the event loop nor the reader ever waits on a full pipe.

The engine process is started with multiprocessing's ``spawn`` (CUDA cannot be forked), so
``factory`` and every function given to :meth:`ProcessEngine.call` must pickle: module-level
functions, or :func:`functools.partial` of them. An engine process that ends unasked (killed,
crashed, its step loop stopped) fails every pending request and later call with
:class:`~phasegraph.serving.errors.EngineDied`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import multiprocessing
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import attrs

from phasegraph.runtime.config import RequestDelta, SamplingParams
from phasegraph.runtime.errors import InvalidConfig, InvalidRequest
from phasegraph.serving import DEFAULT_MAX_QUEUE
from phasegraph.serving.async_engine import (
    AsyncEngineBase,
    ServingStats,
    StepCounters,
    _call_soon,
    _deliver,
    _fail_waiter,
    drain,
    encoded_prompt,
    engine_state,
    hand_over,
    route_deltas,
    run_step_loop,
)
from phasegraph.serving.errors import EngineClosed, EngineDied, EngineProcessError

START_TIMEOUT_S = 1800.0  # loading a large checkpoint and capturing every graph
CLOSE_TIMEOUT_S = 60.0  # the engine process finishes its step and reports the aborts
STATS_TIMEOUT_S = 10.0  # a scrape waits at most this long for the engine's step to end


# ---------------------------------------------------------------------- messages
# parent -> engine process: a list of commands per message


@attrs.frozen
class _Add:
    reply: int
    request_id: str
    prompt: Any
    params: SamplingParams
    add_special_tokens: bool


@attrs.frozen
class _Abort:
    request_id: str


@attrs.frozen
class _Call:
    reply: int
    fn: Callable


@attrs.frozen
class _Stats:
    reply: int


@attrs.frozen
class _Close:
    """The last command: abort what runs, report it, and end the engine process."""


# engine process -> parent: _Ready or _LoadFailed first, then per iteration a tuple
# (deltas, replies), replies as (reply id, ok, value), and _Failed if the step loop breaks


@attrs.frozen
class _Ready:
    tokenizer: Any
    max_context: int
    accept_width: int


@attrs.frozen
class _LoadFailed:
    error: BaseException


@attrs.frozen
class _Failed:
    error: BaseException


# what stats() reports before the engine's side has answered once
_NO_ENGINE_STATS = {"waiting": 0, "running": 0, "kv_free_pages": 0, "kv_total_pages": 0, **StepCounters().totals()}

_STOP_WRITER = None  # put on the command queue once the engine process is gone


class ProcessEngine(AsyncEngineBase):
    """An Engine in a process of its own, behind :class:`AsyncEngine`'s interface (see the
    module's docstring). ``factory()`` builds the engine there (build a long-running one with
    ``trace=False``); the constructor returns once it has warmed up, raises the error that
    loading raised (the same type where it pickles, else
    :class:`~phasegraph.serving.errors.EngineProcessError`), or
    :class:`~phasegraph.serving.errors.EngineDied` if the process ends or has not started
    within ``start_timeout_s``.

    ``max_queue`` as :class:`AsyncEngine`'s. Close it with :meth:`close` / :meth:`aclose` or
    ``async with``: pending requests are aborted and the engine process is joined (terminated
    if it has not ended within ``close_timeout_s``); at the latest at interpreter exit."""

    def __init__(self, factory: Callable[[], Any], *, max_queue: int = DEFAULT_MAX_QUEUE,
                 start_timeout_s: float = START_TIMEOUT_S, close_timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        if not callable(factory):
            raise InvalidConfig(f"ProcessEngine builds its engine with a callable; got {type(factory).__name__}")
        super().__init__(max_queue)
        self.close_timeout_s = close_timeout_s
        context = multiprocessing.get_context("spawn")  # CUDA cannot be initialised in a fork
        self._conn, child_conn = context.Pipe()
        # not a daemon: a tensor-parallel engine starts processes of its own; the engine
        # process ends when this one closes it, or when the pipe breaks
        self._process = context.Process(target=_engine_process_main, args=(factory, child_conn),
                                        name="phasegraph-engine", daemon=False)
        try:
            self._process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            self._conn.close()
            raise InvalidConfig(f"the engine factory must pickle (a module-level function or a "
                                f"functools.partial of one): {exc}") from None
        finally:
            child_conn.close()  # so that this end reads EOF once the engine process is gone
        ready = self._wait_until_ready(start_timeout_s)
        self._tokenizer = ready.tokenizer
        self._max_context = ready.max_context
        self._accept_width = ready.accept_width
        self._reply_ids = iter(range(1, 1 << 62))
        self._replies: dict[int, tuple[concurrent.futures.Future, str | None]] = {}
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closing = False
        self._last_stats: dict | None = None
        self._deliveries = 0  # hand-overs to an event loop (the reader thread's count)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe in finalizers too
        self._reader = threading.Thread(target=self._read, name="phasegraph-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="phasegraph-engine-writer", daemon=True)
        self._reader.start()
        self._writer.start()
        atexit.register(self._close_at_exit)

    def _wait_until_ready(self, timeout_s: float) -> _Ready:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):  # an ended process reads as ready: EOF
            if time.monotonic() > deadline:
                self._stop_process(0.0)
                self._conn.close()
                raise EngineDied(f"the engine process did not load its engine within {timeout_s:g} s")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._conn.close()
            self._process.join(5.0)
            raise EngineDied(f"the engine process ended while it loaded the engine "
                             f"({_exit_status(self._process)})") from None
        if isinstance(message, _LoadFailed):
            self._conn.close()
            self._stop_process(5.0)
            raise message.error
        return message

    # ------------------------------------------------------------------ what the engine serves
    @property
    def tokenizer(self):
        """The target's tokenizer (None where it ships none), a copy sent by the engine process."""
        return self._tokenizer

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def accept_width(self) -> int:
        """Tokens one verify step can accept at most (1 without speculation)."""
        return self._accept_width

    @property
    def is_running(self) -> bool:
        """Takes requests: not closed, and the engine process has not ended."""
        return not self._closed

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    # ------------------------------------------------------------------ requests
    def _submit(self, request_id, prompt, params, add_special_tokens, loop, deltas, done) -> None:
        with self._lock:
            if request_id in self._sinks:
                raise InvalidRequest(f"request id {request_id!r} is already in use")
            self._sinks[request_id] = (loop, deltas)  # before it is sent: its first deltas may come with the reply
        try:
            self._send(lambda reply: _Add(reply, request_id, prompt, params, add_special_tokens), done, request_id)
        except EngineClosed:
            with self._lock:
                self._sinks.pop(request_id, None)
            raise

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` run in the engine process between two steps (after every command sent
        before it), its result or exception returned here. ``fn`` and its result must pickle:
        a module-level function (or a :func:`functools.partial` of one), not a lambda."""
        try:
            pickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - whatever pickling raised, named as the caller's mistake
            raise InvalidRequest(f"call() sends its function to the engine process, so it must pickle "
                                 f"(a module-level function, or functools.partial of one): {exc}") from None
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(lambda reply: _Call(reply, fn), done)
        return await asyncio.wrap_future(done)

    def stats(self) -> ServingStats:
        """A snapshot, as :meth:`AsyncEngine.stats`; the engine's side is asked for (waiting at
        most for its step to end), or as last seen once it has ended."""
        child = self._last_stats
        if not self._closed:
            done: concurrent.futures.Future = concurrent.futures.Future()
            with contextlib.suppress(EngineClosed, concurrent.futures.TimeoutError):  # the last snapshot then
                self._send(_Stats, done)
                child = done.result(STATS_TIMEOUT_S)
        self._last_stats = child
        with self._lock:
            queued, rejected = self._queued, self._rejected
        return ServingStats(queued=queued, max_queue=self.max_queue, rejected=rejected,
                            deliveries=self._deliveries, **(child or _NO_ENGINE_STATS))

    # ------------------------------------------------------------------ shutting down
    def close(self, timeout: float | None = None) -> None:
        """Abort every pending request (their streams end with finish reason ``"abort"``;
        callers waiting for room get :class:`EngineClosed`) and join the engine process,
        terminated if it has not ended within ``timeout`` (default ``close_timeout_s``);
        idempotent."""
        timeout = self.close_timeout_s if timeout is None else timeout
        with self._lock:
            if not self._closing:
                self._closing = True
                if not self._closed:
                    self._closed = True
                    self._commands.put(_Close())  # the last command: nothing is sent after it
            waiters, self._waiters = list(self._waiters), type(self._waiters)()
        for loop, fut in waiters:
            _call_soon(loop, _fail_waiter, fut, EngineClosed("the engine was closed"))
        self._stop_process(timeout)
        self._reader.join(timeout)
        self._commands.put(_STOP_WRITER)
        self._writer.join(timeout)
        self._conn.close()
        atexit.unregister(self._close_at_exit)

    def _close_at_exit(self) -> None:
        # multiprocessing joins its non-daemon processes at exit: this one must end first
        self.close(timeout=5.0)

    def _stop_process(self, timeout: float) -> None:
        process = self._process
        process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)

    # ------------------------------------------------------------------ commands
    def _check_open(self) -> None:
        if isinstance(self._failure, EngineDied):
            raise EngineDied(str(self._failure)) from self._failure.__cause__
        super()._check_open()

    def _send(self, command, done: concurrent.futures.Future, request_id: str | None = None) -> None:
        """Queue ``command(reply id)`` for the writer; ``done`` gets the reply (or the error
        that ended the engine process)."""
        with self._lock:  # nothing is queued after _Close, and every reply is awaited or failed
            self._check_open()
            reply = next(self._reply_ids)
            self._replies[reply] = (done, request_id)
            self._commands.put(command(reply))

    def _abort_soon(self, request_id: str) -> None:
        if not self._closed:
            self._commands.put(_Abort(request_id))

    def _write(self) -> None:
        """The writer thread: every command queued since its last send, in one message."""
        while True:
            batch = drain(self._commands)
            stop = _STOP_WRITER in batch
            batch = [c for c in batch if c is not _STOP_WRITER]
            try:
                if batch:
                    self._conn.send(batch)
            except (OSError, ValueError):
                return  # the engine process is gone: the reader reports it
            if stop or any(isinstance(c, _Close) for c in batch):
                return

    # ------------------------------------------------------------------ the engine's messages
    def _read(self) -> None:
        """The reader thread: each step's message, its replies and deltas handed on, until the
        engine process ends."""
        error: EngineClosed | None = None
        try:
            while error is None:
                for message in unpack_messages(self._conn.recv_bytes()):
                    if isinstance(message, _Failed):
                        error = EngineDied(f"the engine process's step loop stopped: {message.error!r}")
                        error.__cause__ = message.error
                        break
                    self._dispatch(*message)
        except (EOFError, OSError):  # the pipe's end: the engine process has ended
            pass
        except Exception as exc:  # noqa: BLE001 - a message that does not unpickle: nothing more can be read
            error = EngineDied(f"a message from the engine process could not be read: {exc!r}")
            error.__cause__ = exc
        self._process.join(5.0)
        if error is None and not self._closing:
            error = EngineDied(f"the engine process ended unexpectedly ({_exit_status(self._process)})")
        self._engine_gone(error)

    def _dispatch(self, deltas: list, replies: list) -> None:
        with self._lock:
            answered = [(self._replies.pop(reply), ok, value) for reply, ok, value in replies]
        for (done, rid), ok, value in answered:
            if ok:
                done.set_result(value)
                continue
            if rid is not None:  # an add the engine refused: its slot and sink go
                with self._lock:
                    self._sinks.pop(rid, None)
                self._release()
            done.set_exception(value)
        with self._lock:
            by_loop, finished = route_deltas(self._sinks, deltas)
        for _ in finished:
            self._release()
        self._deliveries += len(by_loop)
        hand_over(by_loop, self._abort_soon)

    def _engine_gone(self, error: EngineClosed | None) -> None:
        """The engine process has ended: every waiting caller, pending reply and unfinished
        stream gets ``error`` (EngineClosed after :meth:`close`)."""
        with self._lock:
            if error is not None:
                self._failure = error
            self._closed = True
            waiters, self._waiters = list(self._waiters), type(self._waiters)()
            replies, self._replies = list(self._replies.values()), {}
            sinks, self._sinks = list(self._sinks.values()), {}
        self._commands.put(_STOP_WRITER)
        error = error if error is not None else EngineClosed("the engine was closed")
        for loop, fut in waiters:
            _call_soon(loop, _fail_waiter, fut, error)
        for done, _ in replies:
            done.set_exception(error)
        for loop, deltas in sinks:
            _call_soon(loop, _deliver, [(deltas, error)])


def _exit_status(process) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


# ---------------------------------------------------------------------- the engine process


def _engine_process_main(factory: Callable[[], Any], conn) -> None:
    """The engine process: build and warm up the engine, then step it until closed."""
    # Ctrl-C reaches the whole process group: the parent decides when this process ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = factory()
        engine.warm_up()
        tree = engine.spec.tree()
        ready = _Ready(engine.tokenizer, engine.longest_request, tree.accept_width if tree is not None else 1)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(_LoadFailed(_sendable(exc)))
        return
    conn.send(ready)
    channel = _Channel(conn)
    try:
        _StepLoop(engine, channel).run()
    except EOFError:  # the parent is gone: nobody left to serve
        return
    except BaseException as exc:  # noqa: BLE001 - every consumer must hear of it
        with contextlib.suppress(EOFError):
            channel.send(_Failed(_sendable(exc)))
    channel.close()  # every message sent before this process ends


_GONE = object()  # the server's process closed its end of the pipe
_STOP_SENDING = object()


# engine process -> parent: the messages of one write, each a step's (deltas, replies) or a
# _Failed. A delta travels as a tuple of its fields: pickling an attrs instance costs several
# times more, and the engine process pays it on the interpreter lock its step loop needs.
_DELTA_FIELDS = tuple(f.name for f in attrs.fields(RequestDelta))


def pack_messages(messages: list) -> bytes:
    """``messages`` as one pickle, every :class:`RequestDelta` as the tuple of its fields."""
    packed = [m if isinstance(m, _Failed) else ([tuple(getattr(d, f) for f in _DELTA_FIELDS) for d in m[0]], m[1])
              for m in messages]
    return pickle.dumps(packed, pickle.HIGHEST_PROTOCOL)


def unpack_messages(data: bytes) -> list:
    """What :func:`pack_messages` packed, its deltas :class:`RequestDelta` again."""
    return [m if isinstance(m, _Failed) else ([RequestDelta(*d) for d in m[0]], m[1])
            for m in pickle.loads(data)]


class _Channel:
    """The engine process's end of the pipe, with a thread that sends and one that receives, so
    that the step loop hands a message over and goes on: waking the server's sleeping reader
    (the write's cost) and polling for commands stay off the engine's critical path."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # lists of commands, or _GONE
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages, then _STOP_SENDING
        self.gone = False
        self._sender = threading.Thread(target=self._send_all, name="phasegraph-engine-sender", daemon=True)
        self._receiver = threading.Thread(target=self._receive_all, name="phasegraph-engine-receiver", daemon=True)
        self._sender.start()
        self._receiver.start()

    def send(self, message) -> None:
        if self.gone:
            raise EOFError("the server's process closed the pipe")
        self.outbox.put(message)

    def receive(self, block: bool) -> list:
        """Every command received so far (waiting for the first with ``block``)."""
        batches = drain(self.inbox, block)
        if any(batch is _GONE for batch in batches):
            raise EOFError("the server's process closed the pipe")
        return [command for batch in batches for command in batch]

    def close(self) -> None:
        """Send what is queued, then stop the sender."""
        self.outbox.put(_STOP_SENDING)
        self._sender.join(CLOSE_TIMEOUT_S)

    def _send_all(self) -> None:
        """Every message queued since the last write, packed (:func:`pack_messages`) in one."""
        stop = False
        while not stop:
            messages = drain(self.outbox)
            if _STOP_SENDING in messages:
                stop, messages = True, messages[: messages.index(_STOP_SENDING)]
            if not messages:
                continue
            failed = False
            try:
                data = pack_messages(messages)
            except Exception as exc:  # noqa: BLE001 - a value that does not pickle: the parent must hear of it
                data, failed = pack_messages([_Failed(_sendable(exc))]), True
            try:
                self.conn.send_bytes(data)
            except (EOFError, OSError, ValueError):
                self._lost()
                return
            if failed:  # nothing after it could arrive in order: the step loop ends, then the process
                self._lost()
                return

    def _receive_all(self) -> None:
        while True:
            try:
                batch = self.conn.recv()
            except (EOFError, OSError, ValueError):
                self._lost()
                return
            self.inbox.put(batch)

    def _lost(self) -> None:
        self.gone = True
        self.inbox.put(_GONE)


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles whole, else an :class:`EngineProcessError` with its type, message
    and traceback (the traceback goes along as a note either way)."""
    trace = "".join(traceback.format_exception(exc))
    try:
        exc.add_note(f"in the engine process:\n{trace}")
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - whatever pickling raised: the wrapper carries the message
        error = EngineProcessError(f"{type(exc).__name__}: {exc}")
        error.add_note(f"in the engine process:\n{trace}")
        return error


class _StepLoop:
    """The engine process's step loop: :class:`AsyncEngine`'s, with the pipe in place of the
    event loops; one message per iteration carries the step's deltas and the replies."""

    def __init__(self, engine, channel: _Channel) -> None:
        self.engine = engine
        self.channel = channel
        self.requests: set[str] = set()  # added and not reported finished
        self.replies: list[tuple[int, bool, Any]] = []
        self._flush = False  # step once more, to report an abort
        self.counters = StepCounters()
        engine.scheduler.on_phase = self._on_phase

    def run(self) -> None:
        run_step_loop(self)

    # the step loop's hooks (run_step_loop)
    def _take(self, block: bool) -> list:
        return self.channel.receive(block)

    @staticmethod
    def _is_close(command) -> bool:
        return isinstance(command, _Close)

    def _running_ids(self) -> list[str]:
        return list(self.requests)

    def _idle(self) -> None:
        """Nothing to step: the replies of the commands just applied go on their own."""
        if self.replies:
            self.channel.send(([], self._take_replies()))

    def _take_replies(self) -> list:
        replies, self.replies = self.replies, []
        return replies

    def _apply(self, command) -> None:
        engine = self.engine
        if isinstance(command, _Abort):
            if command.request_id in self.requests:
                engine.abort(command.request_id)
                self._flush = True  # the step that reports the abort, even with nothing else to run
        elif isinstance(command, _Add):
            try:
                engine.add_request(command.request_id, encoded_prompt(engine, command.prompt, command.add_special_tokens),
                                   command.params)
            except Exception as exc:  # noqa: BLE001 - InvalidRequest, or whatever the tokenizer raised
                self.replies.append((command.reply, False, _sendable(exc)))
                return
            self.requests.add(command.request_id)
            self.replies.append((command.reply, True, None))
        elif isinstance(command, _Call):
            try:
                result = command.fn(engine)
                pickle.dumps(result)  # checked here: an unpicklable one would break the message
                self.replies.append((command.reply, True, result))
            except Exception as exc:  # noqa: BLE001 - the caller's function: its error is its caller's
                self.replies.append((command.reply, False, _sendable(exc)))
        elif isinstance(command, _Stats):
            self.replies.append((command.reply, True, self._stats()))

    def _step(self) -> None:
        engine = self.engine
        start = time.perf_counter()
        deltas = engine.step()
        stepped = time.perf_counter()
        finished = [delta for delta in deltas if delta.output is not None]
        self.requests.difference_update(delta.request_id for delta in finished)
        self.counters.count_step(deltas, finished)
        self.channel.send((deltas, self._take_replies()))
        self.counters.step_seconds += stepped - start
        self.counters.serving_seconds += time.perf_counter() - stepped

    def _stats(self) -> dict:
        """The engine's side of :class:`ServingStats`."""
        return {**engine_state(self.engine), **self.counters.totals()}

    def _on_phase(self, phase: str, seconds: float, reqs) -> None:
        self.counters.count_phase(phase, seconds)

