"""``phasegraph serve``: an OpenAI-compatible HTTP server over a model pair.

::

    phasegraph serve --target DIR [--draft DIR --method eagle3] [--topk K --num-steps S ...]
        [--host 127.0.0.1] [--port 8000] [--max-queue N] [--on-full 429|wait]
        [--model-name NAME] [--chat-template FILE] [--max-batch-size N] [--[no-]engine-process]
        [--api-key KEY]

Serves ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health`` and
``/metrics`` (docs/serving.md) until interrupted; needs the ``serve`` extra (FastAPI, uvicorn,
prometheus-client). The library part is :func:`phasegraph.serving.create_app`; this module only
checks the options, loads the engine, prints where it listens and runs uvicorn.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from phasegraph.cli.common import (
    CliError,
    add_command,
    load_engine,
    model_spec,
    read_text_file,
    require_at_least,
    require_name,
)
from phasegraph.serving import DEFAULT_MAX_QUEUE

SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")
API_KEY_ENV = "PHASEGRAPH_API_KEY"
GRACEFUL_SHUTDOWN_S = 5  # then streams still open are cut and their requests aborted


def add_parser(sub) -> None:
    p = add_command(sub, "serve", "serve a model pair over an OpenAI-compatible HTTP API",
                    "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics; "
                    "speculative when a draft is given.", model_options=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this "
                   "machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"requests waiting or running at once (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--on-full", choices=("429", "wait"), default="429",
                   help="a request past --max-queue gets 429 (default) or waits for room")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the target directory's name)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions instead of the tokenizer's")
    p.add_argument("--max-batch-size", type=int, default=32, metavar="N", help="requests run together (default 32)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill every prompt whole: no KV shared between requests with a common prefix "
                        "(the cache is on by default for serve; docs/serving.md)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own, apart from the HTTP server, so that the "
                        "server's Python never delays the engine's kernel launches (default: on where the "
                        "device is CUDA, off otherwise)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV),
                   help="every /v1 request must send 'Authorization: Bearer KEY' (/health and /metrics stay "
                        f"open); the environment variable {API_KEY_ENV} sets it without showing it in the "
                        "process list (default: none, any client is served)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info: one line per request)")
    p.set_defaults(func=run_serve)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a taken port is one clear
    error instead of a log line after a long load."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise CliError(f"--host {host}: not an address this machine can listen on ({exc.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run_serve(args: argparse.Namespace) -> int:
    missing = [name for name in SERVE_PACKAGES if not _importable(name)]
    if missing:
        raise CliError(f"phasegraph serve needs {', '.join(missing)}: install the serve extra "
                       "(pip install 'phasegraph[serve]', or scripts/install.sh serve)")
    import uvicorn

    from phasegraph.serving import AsyncEngine, ProcessEngine, create_app

    spec = model_spec(args)
    require_name("--chat-template", args.chat_template, "file")
    require_name("--model-name", args.model_name, "model")
    if args.api_key is not None and (not args.api_key.strip() or args.api_key != args.api_key.strip()):
        raise CliError(f"--api-key (or {API_KEY_ENV}) must be non-empty, without surrounding spaces")
    require_at_least("--max-queue", args.max_queue, 1)
    require_at_least("--max-batch-size", args.max_batch_size, 1)
    if not 1 <= args.port <= 65535:
        raise CliError(f"--port must be in [1, 65535], got {args.port}")
    template = None if args.chat_template is None else read_text_file(args.chat_template, "--chat-template")
    model_name = args.model_name or Path(args.target).resolve().name
    sock = _listen(args.host, args.port)
    if args.tp != 1 and "WORLD_SIZE" in os.environ:  # every rank would serve HTTP, each its own requests
        raise CliError("serve --tp starts the other ranks itself: run it without torchrun")
    from phasegraph.runtime.engine import resolve_device

    on_cuda = resolve_device(args.device).type == "cuda"  # a bad --device: the engine's own error, now
    in_process = not (on_cuda if args.engine_process is None else args.engine_process)
    try:
        # no trace: a server runs for days, and a trace keeps every phase transition
        load = functools.partial(load_engine, args, spec, trace=False, max_batch_size=args.max_batch_size,
                                 prefix_cache=args.prefix_cache)
        if in_process:
            engine = load()
            engine.warm_up()  # every graph captured before the first request, none mid-stream
            aengine = AsyncEngine(engine, max_queue=args.max_queue)
        else:  # loads and warms up in the engine process
            aengine = ProcessEngine(load, max_queue=args.max_queue)
        with_draft = f" with {spec.method} drafts" if spec.speculative else ""
        try:
            app = create_app(aengine, model_name=model_name, on_full=args.on_full, chat_template=template,
                             api_key=args.api_key)
            host = f"[{args.host}]" if ":" in args.host else args.host
            where = "in this process" if in_process else f"in engine process {aengine.pid}"
            print(f"phasegraph: serving {model_name!r}{with_draft} on http://{host}:{args.port}/v1 "
                  f"(OpenAI-compatible{'; API key required' if args.api_key else ''}; /health, /metrics; the engine "
                  f"{where}); Ctrl-C stops", file=sys.stderr)
            config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
            with _stop_signals():
                uvicorn.Server(config).run(sockets=[sock])
        except _Stopped:
            pass
        finally:
            aengine.close()
    finally:
        sock.close()
    print("phasegraph: the server stopped", file=sys.stderr)
    return 0


class _Stopped(Exception):
    """Ctrl-C or SIGTERM, after uvicorn's graceful shutdown: the way a server is meant to end."""


@contextlib.contextmanager
def _stop_signals():
    """uvicorn shuts down gracefully on SIGINT or SIGTERM, then raises the signal again for the
    handler it found: make that handler end the command normally (exit status 0, no
    "interrupted"), and the engine close, instead of a KeyboardInterrupt or a killed process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stopped(signum, frame):
        raise _Stopped

    previous = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
