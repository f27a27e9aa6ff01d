"""A phase: a named pure function from one schema to another."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from phasegraph.statemachine.errors import InvalidPhase, InvalidSchema
from phasegraph.statemachine.schema import Schema


def _schema_problem(cls: Any) -> str | None:
    """Why ``cls`` cannot be a phase's input or output schema (None: it can)."""
    if not (isinstance(cls, type) and issubclass(cls, Schema)):
        return "must be a Schema subclass"
    if "__schema__" not in vars(cls):
        return f"{cls.__name__} must be decorated with @schema"
    return None


def _check_declaration(name: Any, input: Any, output: Any, extra_inputs: Any) -> None:  # noqa: A002
    """A phase's name and schemas, as :func:`phase` and :class:`PhaseSpec` both check them."""
    if not isinstance(name, str) or not name:
        raise InvalidPhase(name, ["a phase's name must be a non-empty string"])
    if not isinstance(extra_inputs, Mapping):
        raise InvalidPhase(name, [
            f"extra_inputs must map argument names to Schema subclasses, got {type(extra_inputs).__name__}"
        ])
    extra = ((f"extra input {key!r}", cls) for key, cls in extra_inputs.items())
    for label, cls in (("input", input), ("output", output), *extra):
        problem = _schema_problem(cls)
        if problem is not None:
            shown = cls.__name__ if isinstance(cls, type) else str(cls)
            raise InvalidSchema(shown, [f"phase {name!r}: {label} {problem}"])


@attrs.frozen(eq=False)
class PhaseSpec:
    """Declaration of one phase.

    ``fn(state, ctx, **extra)`` must return a new ``output`` instance and never mutate ``state``
    (strict mode checks this). ``extra_inputs`` names further schema-typed arguments the phase
    takes (e.g. merge's second ``DraftState``); they are validated like the main input.
    """

    name: str
    input: type[Schema]
    output: type[Schema]
    fn: Callable[..., Any]
    doc: str = ""
    extra_inputs: Mapping[str, type[Schema]] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        _check_declaration(self.name, self.input, self.output, self.extra_inputs)
        if not callable(self.fn):
            raise InvalidPhase(self.name, [f"its function must be callable, got {type(self.fn).__name__}"])
        try:
            signature = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a callable without a signature (some builtins)
            return
        try:
            signature.bind(None, None, **dict.fromkeys(self.extra_inputs))
        except TypeError as exc:
            extra = "".join(f", {k}=..." for k in self.extra_inputs)
            raise InvalidPhase(self.name, [
                f"its function {getattr(self.fn, '__qualname__', repr(self.fn))}{signature} cannot be "
                f"called as fn(state, ctx{extra}): {exc}"
            ]) from None

    def __call__(self, state: Any, ctx: Any = None, **extra: Any) -> Any:
        return self.fn(state, ctx, **extra)

    @property
    def summary(self) -> str:
        """First line of the docstring."""
        return self.doc.strip().splitlines()[0] if self.doc.strip() else ""


def phase(
    name: str,
    *,
    input: type[Schema],  # noqa: A002 - mirrors the declaration's vocabulary
    output: type[Schema],
    extra_inputs: Mapping[str, type[Schema]] | None = None,
) -> Callable[[Callable[..., Any]], PhaseSpec]:
    """Decorator declaring a phase function::

        @phase("verify", input=TreeProposal, output=VerifyResult)
        def verify(state: TreeProposal, ctx: SpecContext) -> VerifyResult:
            '''Run the target over the tree and accept the longest matching path.'''
    """
    extra_inputs = {} if extra_inputs is None else extra_inputs
    _check_declaration(name, input, output, extra_inputs)

    def wrap(fn: Callable[..., Any]) -> PhaseSpec:
        return PhaseSpec(
            name=name,
            input=input,
            output=output,
            fn=fn,
            doc=(inspect.getdoc(fn) or "") if callable(fn) else "",
            extra_inputs=dict(extra_inputs),
        )

    return wrap
