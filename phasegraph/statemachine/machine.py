"""A machine: the cursor that runs phases along a :class:`PhaseGraph`'s declared edges.

``advance(name, ctx)`` runs phase ``name`` on the current state only if an edge leads there from
the current phase, validates what crosses the boundary (per the validation mode), and only then
commits the new phase and state. After any rejection the machine's phase and state are unchanged.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

from phasegraph.statemachine import trace as _trace
from phasegraph.statemachine.errors import (
    IllegalTransition,
    PhaseContractViolation,
    PhaseGraphError,
    SchemaViolation,
    UnknownPhase,
)
from phasegraph.statemachine.graph import PhaseGraph
from phasegraph.statemachine.modes import ValidationMode, get_validation_mode
from phasegraph.statemachine.schema import (
    Schema,
    as_device,
    check_fields,
    check_invariants,
    check_nested_fields,
    nested_schemas,
)

_ids = itertools.count(1)
_STRICT = ValidationMode.STRICT
_OFF = ValidationMode.OFF


class Machine:
    """Holds the current phase and state of one batch and runs phases along declared edges."""

    def __init__(
        self,
        graph: PhaseGraph,
        *,
        name: str | None = None,
        validate: ValidationMode | str | None = None,
        device: Any = None,
        trace: _trace.Trace | None = None,
    ):
        if not isinstance(graph, PhaseGraph):
            raise PhaseGraphError(f"a Machine runs a PhaseGraph, got {type(graph).__name__}")
        if trace is not None and not callable(getattr(trace, "record", None)):
            raise PhaseGraphError(f"trace must be a phasegraph Trace or None, got {type(trace).__name__}")
        self.graph = graph
        self.name = name or f"{graph.name}-{next(_ids)}"
        self._mode = None if validate is None else ValidationMode.parse(validate)
        as_device(device)  # a device torch does not take fails here, not at the first phase
        self.device = device
        self.trace = trace
        self._phase: str | None = None
        self._state: Any = None

    # -- state
    @property
    def phase(self) -> str | None:
        """The phase that produced the current state (None before the first phase)."""
        return self._phase

    @property
    def state(self) -> Any:
        return self._state

    @property
    def validation(self) -> ValidationMode:
        return self._mode if self._mode is not None else get_validation_mode()

    @validation.setter
    def validation(self, mode: ValidationMode | str | None) -> None:
        self._mode = None if mode is None else ValidationMode.parse(mode)

    def allowed(self) -> tuple[str, ...]:
        return self.graph.allowed(self._phase)

    def may_advance(self, name: str) -> bool:
        return self.graph.is_allowed(self._phase, name)

    # -- running
    def advance(self, name: str, ctx: Any = None, *, state: Any = None, note: str = "", **extra: Any) -> Any:
        """Run phase ``name`` and return its output, which becomes the machine's state.

        Before the first phase, pass the entry phase's input as ``state``. ``extra`` carries the
        phase's declared extra inputs (e.g. ``other=`` for merge). ``note`` is recorded with the
        transition in the trace (what ran, e.g. a speculation shape); the phase never sees it.
        """
        graph = self.graph
        current = self._phase
        try:
            allowed = graph.is_allowed(current, name)
        except TypeError:  # an unhashable name (a list, a dict): no phase has it
            raise UnknownPhase(current, name, graph.allowed(current)) from None
        if not allowed:
            if name not in graph.phases:
                raise UnknownPhase(current, name, graph.allowed(current))
            raise IllegalTransition(current, name, graph.allowed(current))
        spec = graph.phases[name]
        if current is None:
            if state is None:
                raise PhaseGraphError(
                    f"machine {self.name!r} has no state yet: pass the input of {name!r} as state="
                )
            inp = state
        else:
            if state is not None:
                raise PhaseGraphError(
                    f"machine {self.name!r} already holds a {type(self._state).__name__}; "
                    f"state= is only for the first phase"
                )
            inp = self._state
        mode = self.validation
        if not isinstance(inp, spec.input):
            raise SchemaViolation(
                spec.input.__name__, None, f"an instance of {spec.input.__name__}",
                type(inp).__name__, phase=name, side="input",
            )
        if extra or spec.extra_inputs:
            self._check_extra(spec, extra, mode)
        versions = None
        if mode is not _OFF:
            # The current state was validated when it was produced, unless it came from outside.
            if current is None:
                self._validate(inp, mode, name, "input")
            if mode is _STRICT:
                versions = _tensor_versions(inp)
        clock = getattr(self.trace, "collective_clock", None)
        clock_before = clock() if clock is not None else 0.0
        start = time.perf_counter_ns()
        out = spec.fn(inp, ctx, **extra)
        end = time.perf_counter_ns()
        collective = clock() - clock_before if clock is not None else None
        if not isinstance(out, spec.output):
            raise PhaseContractViolation(
                name, f"returned {type(out).__name__}, declared output is {spec.output.__name__}"
            )
        if versions is not None and _tensor_versions(inp) != versions:
            after = _tensor_versions(inp)
            names = _tensor_names(inp)
            changed = [n for n, a, b in zip(names, versions, after, strict=True) if a != b]
            if changed:
                raise PhaseContractViolation(
                    name, f"mutated its input {type(inp).__name__} in place (fields {changed})"
                )
        if mode is not _OFF:
            # nested schemas the input carried were checked with it; new ones are checked here
            # (boundary mode checks only the output's own fields; strict also the new nested ones)
            known = frozenset(map(id, (inp, *nested_schemas(inp)))) if mode is _STRICT else frozenset()
            self._validate(out, mode, name, "output", known, nested=mode is _STRICT)
        self._phase = name
        self._state = out
        if self.trace is not None or _trace.has_listeners():
            t = _trace.Transition(
                self.name, current, name, start, end, out.batch_size, type(out).__name__, note, collective,
                self.graph.name,
            )
            if self.trace is not None:
                self.trace.record(t)
            _trace._notify(t)
        return out

    def reset(self, phase: str | None = None, state: Any = None) -> None:
        """Place the machine at ``phase`` holding ``state`` (validated), or back at the start."""
        if phase is None:
            self._phase, self._state = None, None
            return
        if phase not in self.graph.phases:
            raise UnknownPhase(self._phase, phase, self.graph.phases)
        spec = self.graph.phases[phase]
        if not isinstance(state, spec.output):
            raise SchemaViolation(
                spec.output.__name__, None, f"an instance of {spec.output.__name__}",
                type(state).__name__, phase=phase, side="output",
            )
        if self.validation is not _OFF:
            self._validate(state, self.validation, phase, "output")
        self._phase, self._state = phase, state

    # -- helpers
    def _validate(self, obj: Schema, mode: ValidationMode, phase: str, side: str,
                  known: frozenset[int] = frozenset(), nested: bool = True) -> None:
        """Check ``obj`` per ``mode``; with ``nested`` also the fields of the schemas nested in it
        that are not in ``known`` (a state from outside the machine: all of them)."""
        spec = type(obj).__schema__
        try:
            check_fields(obj, spec, self.device)
            if nested:
                check_nested_fields(obj, self.device, known)
            if mode is _STRICT:
                check_invariants(obj, spec, nested=True, known=known)
        except SchemaViolation as err:
            raise err.at(phase, side) from None

    def _check_extra(self, spec, extra: Mapping[str, Any], mode: ValidationMode) -> None:
        declared = spec.extra_inputs
        if set(extra) != set(declared):
            missing = sorted(set(declared) - set(extra))
            unknown = sorted(set(extra) - set(declared))
            raise PhaseGraphError(
                f"phase {spec.name!r} takes extra inputs {sorted(declared)}; "
                f"missing {missing}, unexpected {unknown}"
            )
        for key, cls in declared.items():
            value = extra[key]
            if not isinstance(value, cls):
                raise SchemaViolation(
                    cls.__name__, None, f"an instance of {cls.__name__}", type(value).__name__,
                    phase=spec.name, side=f"extra input {key!r}",
                )
            if mode is not _OFF:
                self._validate(value, mode, spec.name, f"extra input {key!r}")

    def __repr__(self) -> str:
        state = type(self._state).__name__ if self._state is not None else None
        return f"Machine({self.name!r}, phase={self._phase!r}, state={state})"


def _schemas_deep(obj: Schema, prefix: str = ""):
    """(path, schema) for ``obj`` and every schema nested in it, depth first (``params.``)."""
    yield prefix, obj
    for vs in type(obj).__schema__.values:
        if vs.nested:
            inner = getattr(obj, vs.name)
            if inner is not None:
                yield from _schemas_deep(inner, f"{prefix}{vs.name}.")


def _tensor_names(obj: Schema) -> list[str]:
    """Every tensor field of ``obj`` and its nested schemas (``params.seed``), in the order of
    :func:`_tensor_versions`."""
    return [path + name for path, inner in _schemas_deep(obj) for name, _ in inner.tensors()]


def _tensor_versions(obj: Schema) -> tuple[int, ...]:
    """In-place modification counters of every tensor field, nested schemas' included (they rise
    on any in-place op)."""
    return tuple(x._version for _, inner in _schemas_deep(obj) for _, x in inner.tensors())
