"""Named errors of the serving layer (subclasses of the runtime's error base, so that whatever
catches :class:`~phasegraph.runtime.errors.PhasegraphRuntimeError` catches these too)."""

from __future__ import annotations

from phasegraph.runtime.errors import PhasegraphRuntimeError


class QueueFull(PhasegraphRuntimeError):
    """The :class:`~phasegraph.serving.AsyncEngine` already holds ``max_queue`` requests (waiting
    or running); nothing was queued. Retry later, or pass ``wait=True`` to wait for room."""

    def __init__(self, max_queue: int) -> None:
        super().__init__(
            f"the request queue is full: {max_queue} requests are waiting or running (max_queue="
            f"{max_queue}); retry later"
        )
        self.max_queue = max_queue


class EngineClosed(PhasegraphRuntimeError):
    """The :class:`~phasegraph.serving.AsyncEngine` was closed, or its step loop stopped on an
    unexpected error (then ``__cause__`` holds that error): it takes no more requests."""


class EngineDied(EngineClosed):
    """The engine process of a :class:`~phasegraph.serving.engine_process.ProcessEngine` ended
    without being closed (killed, crashed, or its step loop stopped on an error, then
    ``__cause__`` holds that error): every pending request and later call gets this."""


class EngineProcessError(PhasegraphRuntimeError):
    """An error raised in the engine process that cannot travel to this one as itself (it does
    not pickle): its type's name and message, and the engine process's traceback."""


class APIError(PhasegraphRuntimeError):
    """A request the HTTP server answers with an error: its status, and the fields of OpenAI's
    error body (``{"error": {"message", "type", "param", "code"}}``)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ServerDidNotStart(PhasegraphRuntimeError):
    """:func:`~phasegraph.serving.app.serve_in_thread`'s server did not start in time."""
