"""A phase: a named pure function from one schema to another."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from phasegraph.statemachine.errors import InvalidPhase, InvalidSchema
from phasegraph.statemachine.outline import first_sentence
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
    ``summary`` is the one line a drawing of the graph shows (default: the docstring's first
    sentence).
    """

    name: str
    input: type[Schema]
    output: type[Schema]
    fn: Callable[..., Any]
    doc: str = ""
    extra_inputs: Mapping[str, type[Schema]] = attrs.field(factory=dict)
    summary: str = attrs.field(default=attrs.Factory(lambda self: first_sentence(self.doc), takes_self=True))

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


def _annotated(fn: Callable[..., Any]) -> tuple[Any, Any, dict[str, Any]] | None:
    """(input, output, extra inputs) from ``fn``'s annotations: its first parameter, its return,
    and its keyword-only parameters annotated with a schema; None where they cannot be read."""
    try:
        hints = typing.get_type_hints(fn)
        params = list(inspect.signature(fn).parameters.values())
    except Exception:  # noqa: BLE001 - unresolvable names, builtins without a signature
        return None
    first = hints.get(params[0].name) if params else None
    extra = {p.name: hints[p.name] for p in params
             if p.kind is p.KEYWORD_ONLY and isinstance(hints.get(p.name), type)
             and issubclass(hints[p.name], Schema)}
    return first, hints.get("return"), extra


def phase(
    name: str,
    *,
    input: type[Schema] | None = None,  # noqa: A002 - mirrors the declaration's vocabulary
    output: type[Schema] | None = None,
    extra_inputs: Mapping[str, type[Schema]] | None = None,
) -> Callable[[Callable[..., Any]], PhaseSpec]:
    """Decorator declaring a phase function; its schemas come from the function's annotations::

        @phase("verify")
        def verify(state: TreeProposal, ctx: SpecContext) -> VerifyResult:
            '''Run the target over the tree and accept the longest matching path.'''

    The first parameter's annotation is the input, the return annotation the output, and
    keyword-only parameters annotated with a schema are the extra inputs. ``input=``,
    ``output=`` and ``extra_inputs=`` may be given instead (for a function without
    annotations); where both are, they must agree.
    """

    if input is not None and output is not None:  # a wrong declaration fails before any function
        _check_declaration(name, input, output, {} if extra_inputs is None else extra_inputs)

    def wrap(fn: Callable[..., Any]) -> PhaseSpec:
        declared = {"input": input, "output": output, "extra_inputs": extra_inputs}
        found = _annotated(fn) if callable(fn) else None
        if found is not None:
            annotated = dict(zip(("input", "output", "extra_inputs"), found, strict=True))
            for key, given in declared.items():
                have = annotated[key]
                if given is None or not have:
                    continue
                if (dict(given) != have) if key == "extra_inputs" else (given is not have):
                    raise InvalidPhase(name, [
                        f"{key}={_shown(given)} disagrees with the function's annotation {_shown(have)}"
                    ])
            declared = {k: v if v is not None else annotated[k] for k, v in declared.items()}
        for key in ("input", "output"):
            if declared[key] is None:
                raise InvalidPhase(name, [
                    f"no {key} schema: annotate the function ({'its first parameter' if key == 'input' else 'its return'}) "
                    f"or pass {key}="
                ])
        extra = dict(declared["extra_inputs"] or {})
        _check_declaration(name, declared["input"], declared["output"], extra)
        return PhaseSpec(
            name=name,
            input=declared["input"],
            output=declared["output"],
            fn=fn,
            doc=(inspect.getdoc(fn) or "") if callable(fn) else "",
            extra_inputs=extra,
        )

    return wrap


def _shown(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    return getattr(value, "__name__", repr(value))
