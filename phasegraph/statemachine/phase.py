"""A phase: a named pure function from one schema to another."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from phasegraph.statemachine.errors import InvalidSchema
from phasegraph.statemachine.schema import Schema


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
    for label, cls in (("input", input), ("output", output), *((extra_inputs or {}).items())):
        if not (isinstance(cls, type) and issubclass(cls, Schema)):
            raise InvalidSchema(str(cls), [f"phase {name!r}: {label} must be a Schema subclass"])

    def wrap(fn: Callable[..., Any]) -> PhaseSpec:
        return PhaseSpec(
            name=name,
            input=input,
            output=output,
            fn=fn,
            doc=inspect.getdoc(fn) or "",
            extra_inputs=dict(extra_inputs or {}),
        )

    return wrap
