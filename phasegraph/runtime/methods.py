"""Drafting methods the engine knows by name beyond its built-in draft kinds.

A method is a phase graph (the EAGLE graph's phases, some replaced by the method's own, checked
against the graph's outline) and, where it needs no checkpoint, a function that builds its draft
object for a target. :func:`register_method` adds one; ``SpecConfig(method=name)`` then selects
it. phasegraph's own (``ngram``) live outside the runtime and are registered by the module that
defines them, imported the first time their name is looked up (as a plugin would be).
docs/custom-drafter.md walks through writing one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import attrs

from phasegraph.runtime.errors import InvalidConfig
from phasegraph.statemachine import PhaseGraph

# the built-in draft kinds, whose graph is the EAGLE graph and whose draft is a checkpoint
BUILT_IN = ("none", "eagle", "eagle3", "mtp", "standalone")
# methods defined outside the runtime: name -> the module that registers it when imported
PLUGINS = {"ngram": "phasegraph.drafters.ngram"}


@attrs.frozen
class DraftMethod:
    """A drafting method: ``graph``, the phase graph the engine runs (the EAGLE outline's
    phases and edges); ``make_draft(target, spec)``, the draft object (the ``DraftModel``
    protocol: its KV spec, its forward for draft-extend) where the method needs no checkpoint;
    ``feature_mode``, what the target hands the draft (``"none"``, ``"last"``, ``"eagle3"``);
    ``max_topk``: the widest tree its draft phase builds (None: any)."""

    name: str
    graph: PhaseGraph
    make_draft: Callable[[Any, Any], Any] | None = None
    feature_mode: str = "none"
    max_topk: int | None = None


_REGISTRY: dict[str, DraftMethod] = {}


def register_method(method: DraftMethod) -> None:
    """Make ``method`` selectable as ``SpecConfig(method=method.name)``."""
    if not isinstance(method, DraftMethod):
        raise InvalidConfig(f"register_method takes a DraftMethod; got {type(method).__name__}")
    if method.name in BUILT_IN:
        raise InvalidConfig(f"{method.name!r} is a built-in method and cannot be registered again")
    if not isinstance(method.graph, PhaseGraph):
        raise InvalidConfig(f"DraftMethod {method.name!r}: graph must be a PhaseGraph; got {type(method.graph).__name__}")
    _REGISTRY[method.name] = method


def method_names() -> tuple[str, ...]:
    """Every name ``SpecConfig.method`` accepts."""
    return (*BUILT_IN, *dict.fromkeys([*PLUGINS, *_REGISTRY]))


def registered(name: str) -> DraftMethod | None:
    """The registered method ``name`` (importing its plugin module on first use); None for a
    built-in kind."""
    if name not in _REGISTRY and name in PLUGINS:
        importlib.import_module(PLUGINS[name])  # registers it
    return _REGISTRY.get(name)
