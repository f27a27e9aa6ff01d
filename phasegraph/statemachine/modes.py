"""Validation modes, switchable globally and per machine. Imports nothing heavy (no torch).

- ``strict``: full schema checks (dtype, shape, symbolic dims, device) on every phase input and
  output, value invariants (these read tensor values and may synchronise with the GPU), and a
  check that the phase did not mutate its input. The default under the pytest plugin.
- ``boundary``: schema metadata checks only (dtype, shape, dims, device): no value reads, so no
  host synchronisation.
- ``off``: only the transition-legality check (a table lookup). The production hot path.

The process-wide default is ``PHASEGRAPH_VALIDATE`` (``boundary`` when it is unset or empty) until
:func:`set_validation_mode` changes it. A value there that names no mode makes the first
:func:`get_validation_mode` (e.g. a machine's first phase) raise :class:`InvalidValidationMode`;
importing phasegraph, or :func:`set_validation_mode` (the pytest plugin's option), still works.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator

from phasegraph.statemachine.errors import InvalidValidationMode


class ValidationMode(enum.Enum):
    STRICT = "strict"
    BOUNDARY = "boundary"
    OFF = "off"

    @classmethod
    def parse(cls, value: ValidationMode | str) -> ValidationMode:
        if isinstance(value, ValidationMode):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise InvalidValidationMode(
                f"unknown validation mode {value!r}; choose one of {choices}"
            ) from None


_ENV = "PHASEGRAPH_VALIDATE"


def _mode_from_env() -> tuple[ValidationMode | None, str]:
    """The mode ``PHASEGRAPH_VALIDATE`` names (unset or empty: boundary), or None and why not."""
    raw = os.environ.get(_ENV, "")
    try:
        return ValidationMode.parse(raw.strip() or "boundary"), ""
    except InvalidValidationMode as exc:
        return None, f"environment variable {_ENV}={raw!r}: {exc}"


# None while PHASEGRAPH_VALIDATE names no mode and nothing has set one: reading it then raises
_global_mode, _env_problem = _mode_from_env()


def get_validation_mode() -> ValidationMode:
    """The process-wide default mode (machines without their own setting use it)."""
    mode = _global_mode
    if mode is None:
        raise InvalidValidationMode(_env_problem)
    return mode


def set_validation_mode(mode: ValidationMode | str) -> ValidationMode | None:
    """Set the process-wide default; returns the previous one (None when the previous one came
    from a ``PHASEGRAPH_VALIDATE`` that named no mode)."""
    global _global_mode
    previous = _global_mode
    _global_mode = ValidationMode.parse(mode)
    return previous


@contextlib.contextmanager
def validation_mode(mode: ValidationMode | str) -> Iterator[ValidationMode]:
    """Temporarily switch the process-wide default."""
    global _global_mode
    previous = set_validation_mode(mode)
    try:
        yield get_validation_mode()
    finally:
        _global_mode = previous
