"""The OpenAI-compatible HTTP server over an :class:`AsyncEngine`: :func:`create_app` builds the
FastAPI application that ``phasegraph serve`` runs with uvicorn.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream over
server-sent events with ``"stream": true``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus). Every error is OpenAI's error body
(``{"error": {"message", "type", "param", "code"}}``): 400 for a bad request (a body that does
not validate included), 401 for a missing or wrong API key (where one is set), 404 for an
unknown model or path, 429 when the queue is full (with
``on_full="429"``), 503 once the engine is closed, 500 (no traceback) for a request that failed
while it ran or for a bug. See docs/serving.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import attrs
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from phasegraph.runtime.config import RequestOutput, SamplingParams
from phasegraph.runtime.errors import InvalidConfig, InvalidRequest
from phasegraph.serving import openai_api as api
from phasegraph.serving.async_engine import AsyncEngineBase, RequestStream
from phasegraph.serving.errors import APIError, EngineClosed, QueueFull, ServerDidNotStart
from phasegraph.serving.metrics import ServerMetrics

ON_FULL = ("429", "wait")


def create_app(
    aengine: AsyncEngineBase,
    *,
    model_name: str = "phasegraph",
    on_full: str = "429",
    chat_template: str | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The server's FastAPI application over ``aengine``, an :class:`AsyncEngine` or a
    :class:`~phasegraph.serving.engine_process.ProcessEngine` (which the caller closes).

    ``model_name``: the model id requests name and ``/v1/models`` lists. ``on_full``: what a
    request meets when ``aengine``'s queue is full: ``"429"`` (an error, retry later) or
    ``"wait"`` (it waits for room, unless its client leaves). ``chat_template``: a Jinja chat
    template used instead of the tokenizer's (without either, chat requests get a 400).
    ``api_key``: every ``/v1`` route then asks for ``Authorization: Bearer <api_key>`` (a 401
    without it); ``/health`` and ``/metrics`` stay open."""
    if not isinstance(aengine, AsyncEngineBase):
        raise InvalidConfig(f"create_app serves an AsyncEngine or a ProcessEngine; got {type(aengine).__name__}")
    if on_full not in ON_FULL:
        raise InvalidConfig(f"on_full must be one of {', '.join(ON_FULL)}; got {on_full!r}")
    if not isinstance(model_name, str) or not model_name:
        raise InvalidConfig(f"model_name must be a non-empty string; got {model_name!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key or api_key != api_key.strip()):
        raise InvalidConfig("api_key must be a non-empty string without surrounding spaces, or None")
    server = _Server(aengine, model_name, on_full == "wait", chat_template)
    app = FastAPI(title="phasegraph", docs_url=None, redoc_url=None, openapi_url=None)
    v1 = [Depends(_bearer(api_key))] if api_key is not None else []
    app.state.phasegraph = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
        # SamplingParams' own checks (a stop string "", a seed past 64 bits, ...)
        return await api_error(request, APIError(400, str(exc)))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await api_error(request, APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # a bug: the client gets its name, never a traceback (the server's log has that)
        error = APIError(500, f"internal error ({type(exc).__name__})", type="server_error")
        return await api_error(request, error)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not aengine.is_running:
            failure = aengine.failure
            why = f"the engine's step loop stopped: {failure!r}" if failure else "the engine is closed"
            return await api_error(None, APIError(503, why, type="server_error", code="engine_closed"))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", dependencies=v1)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": server.created, "owned_by": "phasegraph",
            "max_model_len": aengine.max_context,
        }]})

    @app.get("/metrics")
    async def metrics() -> Response:
        # on a thread: a ProcessEngine's stats wait for its engine's step, which the loop must not
        text = await asyncio.to_thread(generate_latest, server.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        params = api.completion_params(body)
        prompts = api.completion_prompts(body)
        server.check_choices(body.n, len(prompts))
        return await server.respond(request, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: api.ChatRequest, request: Request) -> Response:
        server.check_model(body.model)
        call = api.forced_call(body)
        params = api.chat_params(body, aengine.max_context, call)
        server.check_choices(body.n, 1)
        prompt = api.chat_prompt(aengine.tokenizer, body.messages, server.chat_template, body.tools)
        if body.max_completion_tokens is None and body.max_tokens is None:
            # no limit given: up to the most one request may hold, counting its prompt (encoded
            # here once, and sent as ids; a chat template places the special tokens itself)
            prompt = list(aengine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            params = attrs.evolve(params, max_new_tokens=max(aengine.max_context - len(prompt), 1))
        return await server.respond(request, body, [prompt], params, chat=True, call=call)

    return app


def _bearer(api_key: str) -> Callable[[Request], None]:
    """A route dependency that lets a request through only with ``Authorization: Bearer api_key``."""
    expected = f"Bearer {api_key}".encode()

    def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # in constant time: no key guessed byte by byte
            raise APIError(401, "a missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    return check


def _validation_error(exc: RequestValidationError) -> APIError:
    """A body that does not validate, as one 400 naming the first field at fault."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif first.get("type") == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('msg')}"
        param = None
    elif first.get("type") == "missing":
        message = f"{param}: a required field is missing"
    else:
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}"
    more = len(errors) - 1
    if more > 0 and first.get("type") != "extra_forbidden":
        message += f" (and {more} more problem{'s' if more > 1 else ''} with the body)"
    return APIError(400, message, param=param)


class _Server:
    """What the routes share: the engine, the settings and the metrics."""

    def __init__(self, aengine: AsyncEngineBase, model_name: str, wait: bool, chat_template: str | None):
        self.aengine = aengine
        self.model_name = model_name
        self.wait = wait
        self.chat_template = chat_template
        self.created = int(time.time())
        self.metrics = ServerMetrics(aengine)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model {model!r} does not exist: this server serves {self.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    def check_choices(self, n: int | None, prompts: int) -> None:
        """A request whose choices (``n`` for each prompt) the queue could never hold at once is
        refused before anything runs."""
        choices = (n or 1) * prompts
        if choices > self.aengine.max_queue:
            param = "n" if prompts == 1 else "prompt"
            raise APIError(400, f"{param}: {choices} choices ({prompts} prompt(s) × n={n or 1}) are more "
                           f"than the server's queue holds ({self.aengine.max_queue})", param=param)

    async def respond(self, request: Request, body, prompts: list, params: SamplingParams, *, chat: bool,
                      call: api.ForcedCall | None = None) -> Response:
        """The response to ``body``: ``n`` choices of each of ``prompts``, choice ``p * n + j``
        the j-th of prompt p, each an engine request of its own; ``call``: the tool call
        every chat choice must be."""
        arrived = time.perf_counter()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        n = body.n or 1
        choices = [(prompt, p) for prompt in prompts for p in api.choice_params(params, n)]
        streams = await _unless_disconnected(request, self._add_all(rid, choices, chat))
        if streams is None:  # the client left while the request waited for room
            return Response(status_code=499)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._events(streams, rid, arrived, chat, include_usage, n, call)
            return _EventStream(events, on_close=lambda: _cancel(streams))
        outs = await _unless_disconnected(request, self._collect_all(streams, arrived))
        if outs is None:
            return Response(status_code=499)
        echo = getattr(body, "echo", False)
        if echo and body.max_tokens == 0:
            outs = [api.without_generated(o) for o in outs]
        return JSONResponse(self._whole(outs, rid, chat, n, [p for p, _ in choices] if echo else None, call))

    async def _add_all(self, rid: str, choices: list, chat: bool) -> list[RequestStream]:
        """Every choice queued, or none: a choice refused (or the client leaving) aborts those
        added before it."""
        streams: list[RequestStream] = []
        try:
            for i, (prompt, params) in enumerate(choices):
                streams.append(await self._add(rid if len(choices) == 1 else f"{rid}-{i}", prompt, params, chat))
        except BaseException:
            _cancel(streams)
            raise
        return streams

    async def _add(self, rid: str, prompt, params: SamplingParams, chat: bool) -> RequestStream:
        try:
            # a chat prompt is framed by its template already: no special tokens added again
            return await self.aengine.add_request(prompt, params, request_id=rid, wait=self.wait,
                                                  add_special_tokens=not chat)
        except InvalidRequest as exc:
            raise APIError(400, str(exc)) from None
        except QueueFull as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from None
        except EngineClosed as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_closed") from None

    async def _collect_all(self, streams: list[RequestStream], arrived: float) -> list[RequestOutput]:
        """Every choice's whole output; one that fails ends the others."""
        tasks = [asyncio.ensure_future(self._collect(s, arrived)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, stream: RequestStream, arrived: float) -> RequestOutput:
        first = None
        try:
            async for delta in stream:
                if first is None and delta.new_token_ids:
                    first = time.perf_counter()
                    self.metrics.time_to_first_token.observe(first - arrived)
        except EngineClosed as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_closed") from None
        finally:
            stream.cancel()
        out = stream.output
        _raise_unfinished(out)
        self.metrics.request_latency.observe(time.perf_counter() - arrived)
        return out

    def _whole(self, outs: list[RequestOutput], rid: str, chat: bool, n: int, echoed: list | None,
               call: api.ForcedCall | None) -> dict:
        """The whole response; ``echoed``: with ``echo``, each choice's prompt as the request gave
        it; ``call``: the tool call each chat choice is."""
        tokenizer = self.aengine.tokenizer
        choices = []
        for index, out in enumerate(outs):
            choice: dict = {"index": index, "finish_reason": api.FINISH_REASONS[out.finish_reason]}
            if chat:
                calls = None if call is None else api.tool_calls(out.text, call, out.finish_reason)
                choice["message"] = {"role": "assistant", "content": out.text}
                if calls:
                    choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                    choice["finish_reason"] = "tool_calls"
                choice["logprobs"] = api.chat_logprobs(tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
            elif echoed is not None:
                choice["text"], choice["logprobs"] = api.echoed_completion(tokenizer, echoed[index], out)
            else:
                choice["text"] = out.text
                choice["logprobs"] = api.completion_logprobs(tokenizer, out.token_ids, out.logprobs,
                                                             out.top_logprobs)
            choice["phasegraph"] = api.extension(out)
            choices.append(choice)
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model_name, "choices": choices,
            "usage": api.usage(outs, n),
        }

    async def _events(self, streams: list[RequestStream], rid: str, arrived: float, chat: bool,
                      include_usage: bool, n: int, call: api.ForcedCall | None) -> AsyncIterator[str]:
        """The server-sent events of a streamed response: each choice's chunks (one per delta,
        as they come), then the usage chunk if asked for, and ``[DONE]``. A choice that fails
        ends the response with the error event."""
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        sources = [self._choice_chunks(s, i, arrived, chat, call) for i, s in enumerate(streams)]
        chunks = sources[0] if len(sources) == 1 else _merged(sources)
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield _event({**head, **chunk})
            if include_usage:
                outs = [s.output for s in streams]
                yield _event({**head, "choices": [], "usage": api.usage(outs, n),
                              "phasegraph": {"choices": [api.extension(o) for o in outs]}})
        except (APIError, EngineClosed) as exc:
            error = exc if isinstance(exc, APIError) else APIError(503, str(exc), type="server_error",
                                                                   code="engine_closed")
            yield _event(error.body())
        finally:
            _cancel(streams)
        yield "data: [DONE]\n\n"

    async def _choice_chunks(self, stream: RequestStream, index: int, arrived: float, chat: bool,
                             call: api.ForcedCall | None) -> AsyncIterator[dict]:
        """One choice's chunks (without the head): one per delta (every token of one engine
        step), whose ``phasegraph`` field has that step's token ids and accept lengths. A
        request that fails (or that a closing engine aborts) sends the tokens it made, then
        raises the error. A forced tool call comes whole, on the last chunk (its name may be
        the output's, known at its end)."""
        tokenizer = self.aengine.tokenizer
        last = None
        made = ""
        if chat:  # OpenAI's first chat chunk of a choice opens the assistant's message
            yield {"choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]}
        async for delta in stream:
            if delta.new_token_ids:
                now = time.perf_counter()
                metric = self.metrics.time_to_first_token if last is None else self.metrics.inter_token
                metric.observe(now - (arrived if last is None else last))
                last = now
            ended = delta.finish_reason in ("error", "abort")
            if ended and not delta.new_token_ids and not delta.new_text:
                _raise_unfinished(stream.output)
            reason = None if ended or delta.finish_reason is None else api.FINISH_REASONS[delta.finish_reason]
            choice: dict = {"index": index, "finish_reason": reason}
            if chat and call is not None:  # the call comes whole, on the choice's last chunk
                calls = None if reason is None else api.tool_calls(made + delta.new_text, call, reason)
                choice["delta"] = {} if reason is None else {"content": made + delta.new_text}
                if calls:
                    choice["delta"] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
                    choice["finish_reason"] = "tool_calls"
            elif chat:
                choice["delta"] = {"content": delta.new_text} if delta.new_text or reason is None else {}
            else:
                choice["text"] = delta.new_text
                choice["logprobs"] = api.completion_logprobs(tokenizer, delta.new_token_ids, delta.logprobs,
                                                             delta.top_logprobs, len(made))
            if chat:
                choice["logprobs"] = api.chat_logprobs(tokenizer, delta.new_token_ids, delta.logprobs,
                                                       delta.top_logprobs)
            made += delta.new_text
            yield {"choices": [choice], "phasegraph": {"token_ids": list(delta.new_token_ids),
                                                       "accept_lengths": list(delta.accept_lengths)}}
            if ended:
                _raise_unfinished(stream.output)
        self.metrics.request_latency.observe(time.perf_counter() - arrived)


def _cancel(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.cancel()


async def _merged(sources: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The items of every source as they come; the first error of any source is raised (and
    every source stopped)."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(source: AsyncIterator[dict]) -> None:
        try:
            async for item in source:
                queue.put_nowait((item, None))
            queue.put_nowait((end, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((None, exc))

    tasks = [asyncio.ensure_future(pump(s)) for s in sources]
    try:
        running = len(tasks)
        while running:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _raise_unfinished(out: RequestOutput) -> None:
    """A request that ended without finishing: an error while it ran, or the engine closing."""
    if out.finish_reason == "error":
        raise APIError(500, f"the request failed while it ran: {out.error}", type="server_error",
                       code="request_failed")
    if out.finish_reason == "abort":
        raise APIError(503, "the server is shutting down: the request was aborted", type="server_error",
                       code="engine_closed")


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _until_disconnected(receive: Callable) -> None:
    """Returns when the client has gone (the request's body is read by then, so the next ASGI
    message can only be the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work):
    """``work``'s result, or None if the client leaves first (``work`` is then cancelled, which
    aborts the request it runs)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


class _EventStream(StreamingResponse):
    """Server-sent events that end their request as soon as the client leaves: the disconnect
    is watched while the stream waits for tokens (not only noticed at the next write), and the
    request is aborted however the response ends."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        sending = asyncio.ensure_future(self._send_all(send))
        watch = asyncio.ensure_future(_until_disconnected(receive))
        try:
            await asyncio.wait({sending, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._on_close()
            for task in (sending, watch):
                task.cancel()
            await asyncio.gather(sending, watch, return_exceptions=True)
            await self.body_iterator.aclose()
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            raise sending.exception()

    async def _send_all(self, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # the client left mid-write (uvicorn's ClientDisconnected)
            return


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, timeout_s: float = 60.0) -> Iterator[str]:
    """``app`` served by uvicorn in a daemon thread on a free port of 127.0.0.1 (benchmarks and
    tests); yields its base URL and stops the server on exit. :class:`ServerDidNotStart` if it
    has not started within ``timeout_s``."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound here, so no other process can take the port meanwhile
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise ServerDidNotStart(f"the server on 127.0.0.1:{port} did not start within {timeout_s:g} s")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()
