"""Serving: :class:`AsyncEngine` (an Engine for asyncio programs: streaming, cancellation, a
bounded queue), :class:`ProcessEngine` (the same with the Engine in a process of its own) and :func:`create_app`, the OpenAI-compatible HTTP server ``phasegraph serve``
runs (FastAPI; the ``serve`` extra). See docs/serving.md.

Names are imported lazily, so that ``AsyncEngine`` needs no HTTP package installed.
"""

from __future__ import annotations

from phasegraph import lazy_getattr

# requests an AsyncEngine holds at once (waiting or running): far past a batch, short of a flood
DEFAULT_MAX_QUEUE = 256

_LAZY = {
    "AsyncEngine": "phasegraph.serving.async_engine",
    "ProcessEngine": "phasegraph.serving.engine_process",
    "RequestStream": "phasegraph.serving.async_engine",
    "ServingStats": "phasegraph.serving.async_engine",
    "QueueFull": "phasegraph.serving.errors",
    "EngineClosed": "phasegraph.serving.errors",
    "EngineDied": "phasegraph.serving.errors",
    "create_app": "phasegraph.serving.app",
}

__all__ = list(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
