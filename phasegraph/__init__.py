"""phasegraph: EAGLE-style speculative decoding as an explicit, typed state graph of phases.

The public API (``Engine``, ``AsyncEngine``, ``EngineConfig``, ``SpecConfig``, ``SamplingParams``,
``RequestOutput``, ``RequestDelta``, ``RequestFailed``, ``NonFiniteDraftWarning``, ``WorkerDied``,
``RankDivergence``) is imported
lazily, so that ``import phasegraph`` (and the pytest plugin) does not pull in torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Engine": "phasegraph.runtime.engine",
    "AsyncEngine": "phasegraph.serving.async_engine",  # an Engine for asyncio: stream, cancel, bounded queue
    "SpecConfig": "phasegraph.runtime.config",
    "EngineConfig": "phasegraph.runtime.config",  # every Engine option, checked when made
    "SamplingParams": "phasegraph.runtime.config",
    "RequestOutput": "phasegraph.runtime.config",
    "RequestDelta": "phasegraph.runtime.config",  # what Engine.step() returns, one per request
    "RequestFailed": "phasegraph.runtime.errors",  # Engine.generate: a request ended with an error
    "NonFiniteDraftWarning": "phasegraph.runtime.errors",  # the draft's logits were NaN or infinite
    "WorkerDied": "phasegraph.runtime.errors",  # a tensor-parallel rank exited or stopped answering
    "RankDivergence": "phasegraph.runtime.errors",  # tp_check: the ranks' tokens differ
    "EngineInUse": "phasegraph.runtime.errors",  # a second thread called into a busy Engine
}

__all__ = ["__version__", *_LAZY]


def lazy_getattr(package: str, lazy: dict[str, str]):
    """A module ``__getattr__`` for ``package`` that imports each name of ``lazy`` from the
    module it maps to on first use."""

    def __getattr__(name: str):
        module = lazy.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        return getattr(importlib.import_module(module), name)

    return __getattr__


__getattr__ = lazy_getattr(__name__, _LAZY)
