"""The exceptions of the phase-graph core, one tree under :class:`PhaseGraphError`.

Definition errors (:class:`InvalidPhaseGraph`, :class:`InvalidPhase`, :class:`InvalidSchema`) are
raised when a graph, phase or schema is declared; :class:`InvalidValidationMode` for a mode that
is none; the others when a machine runs. Each carries its data as attributes and a message a user
can act on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


class PhaseGraphError(Exception):
    """Root of every error phasegraph's state machine raises."""


def one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line (whitespace runs collapsed), cut at ``limit`` characters with "...":
    for messages that quote another library's error, which may hold a whole input."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _declared_wrongly(what: str, problems: Sequence[str]) -> str:
    """The message of a declaration error: ``what`` and one line per problem."""
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"{what} is declared wrongly:\n{lines}"


class InvalidSchema(PhaseGraphError):
    """A schema class is declared wrongly (bad annotation, role and shape disagree, ...)."""

    def __init__(self, schema: str, problems: Sequence[str]):
        self.schema = schema
        self.problems = tuple(problems)
        super().__init__(_declared_wrongly(f"schema {schema}", self.problems))


class InvalidPhase(PhaseGraphError):
    """A phase is declared wrongly (its name, function or extra inputs); raised by :func:`phase`
    and when a :class:`PhaseSpec` is made."""

    def __init__(self, phase: object, problems: Sequence[str]):
        self.phase = phase
        self.problems = tuple(problems)
        super().__init__(_declared_wrongly(f"phase {phase!r}", self.problems))


class InvalidPhaseGraph(PhaseGraphError):
    """A phase graph broke one or more build-time rules; ``problems`` maps rule -> findings."""

    def __init__(self, graph: str, problems: Mapping[str, Sequence[str]]):
        self.graph = graph
        self.problems = {rule: tuple(found) for rule, found in problems.items()}
        parts = []
        for rule, found in self.problems.items():
            parts.append(f"  rule {rule!r}:")
            parts.extend(f"    - {f}" for f in found)
        super().__init__(f"phase graph {graph!r} is invalid:\n" + "\n".join(parts))


class InvalidValidationMode(PhaseGraphError, ValueError):
    """A validation mode that is not ``strict``, ``boundary`` or ``off`` (given as an argument,
    or in the ``PHASEGRAPH_VALIDATE`` environment variable)."""


class IllegalTransition(PhaseGraphError):
    """A machine was asked to run a phase that no declared edge leads to from where it is."""

    def __init__(self, current: str | None, requested: str, allowed: Iterable[str]):
        self.current = current
        self.requested = requested
        self.allowed = tuple(allowed)
        where = f"when in {current!r}" if current is not None else "before the first phase"
        allowed_text = ", ".join(repr(a) for a in self.allowed) or "none (terminal phase)"
        super().__init__(f"Can't run {requested!r} {where}; allowed: {allowed_text}")


class UnknownPhase(IllegalTransition):
    """The requested phase is not declared in the graph at all."""


class SchemaViolation(PhaseGraphError):
    """A value does not match its schema: wrong type, dtype, shape, device or dimension."""

    def __init__(
        self,
        schema: str,
        field: str | None,
        expected: str,
        actual: str,
        *,
        phase: str | None = None,
        side: str | None = None,
    ):
        self.schema = schema
        self.field = field
        self.expected = expected
        self.actual = actual
        self.phase = phase
        self.side = side
        where = f"{schema}.{field}" if field else schema
        ctx = ""
        if phase is not None:
            ctx = f" ({side} of phase {phase!r})" if side else f" (phase {phase!r})"
        super().__init__(f"{where}{ctx}: expected {expected}, got {actual}")

    def at(self, phase: str, side: str) -> SchemaViolation:
        """The same violation, annotated with the phase boundary where it was caught."""
        err = type(self).__new__(type(self))
        SchemaViolation.__init__(
            err, self.schema, self.field, self.expected, self.actual, phase=phase, side=side
        )
        for key, value in vars(self).items():
            if key not in vars(err):
                setattr(err, key, value)
        return err


class InvariantViolation(SchemaViolation):
    """A value-level invariant of a schema failed (checked in strict mode only)."""

    def __init__(self, schema: str, invariant: str, detail: str, **kw):
        self.invariant = invariant
        super().__init__(schema, None, f"invariant {invariant!r}", detail, **kw)


class PaddingViolation(SchemaViolation):
    """A padded request's row of a batch padded up to a fixed size (a CUDA graph's bucket)
    addresses a live request's rows (vLLM #43682's class): checked when a graph's padding is
    planned and after its capture."""

    def __init__(self, schema: str, field: str, where: str, detail: str):
        self.where = where
        super().__init__(schema, field, "padded rows that address only padded requests",
                         f"{detail}{f' ({where})' if where else ''}")


class PhaseContractViolation(PhaseGraphError):
    """A phase broke its contract: it mutated its input or returned the wrong type."""

    def __init__(self, phase: str, detail: str):
        self.phase = phase
        self.detail = detail
        super().__init__(f"phase {phase!r} broke its contract: {detail}")


class RendererUnavailable(PhaseGraphError):
    """A diagram format needs a tool that is not installed; the message names it."""
