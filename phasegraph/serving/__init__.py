"""Serving: :class:`AsyncEngine` (an Engine for asyncio programs: streaming, cancellation, a
bounded queue) and :func:`create_app`, the OpenAI-compatible HTTP server ``phasegraph serve``
runs (FastAPI; the ``serve`` extra). See docs/serving.md.

Names are imported lazily, so that ``AsyncEngine`` needs no HTTP package installed.
"""

from __future__ import annotations

# requests an AsyncEngine holds at once (waiting or running): far past a batch, short of a flood
DEFAULT_MAX_QUEUE = 256

_LAZY = {
    "AsyncEngine": "phasegraph.serving.async_engine",
    "RequestStream": "phasegraph.serving.async_engine",
    "ServingStats": "phasegraph.serving.async_engine",
    "QueueFull": "phasegraph.serving.errors",
    "EngineClosed": "phasegraph.serving.errors",
    "create_app": "phasegraph.serving.app",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phasegraph.serving' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
