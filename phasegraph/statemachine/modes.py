"""Validation modes, switchable globally and per machine. Imports nothing heavy (no torch).

- ``strict``: full schema checks (dtype, shape, symbolic dims, device) on every phase input and
  output, value invariants (these read tensor values and may synchronise with the GPU), and a
  check that the phase did not mutate its input. The default under the pytest plugin.
- ``boundary``: schema metadata checks only (dtype, shape, dims, device): no value reads, so no
  host synchronisation.
- ``off``: only the transition-legality check (a table lookup). The production hot path.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator


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
            raise ValueError(f"unknown validation mode {value!r}; choose one of {choices}") from None


_ENV = "PHASEGRAPH_VALIDATE"
_global_mode = ValidationMode.parse(os.environ.get(_ENV, "boundary"))


def get_validation_mode() -> ValidationMode:
    """The process-wide default mode (machines without their own setting use it)."""
    return _global_mode


def set_validation_mode(mode: ValidationMode | str) -> ValidationMode:
    """Set the process-wide default; returns the previous one."""
    global _global_mode
    previous = _global_mode
    _global_mode = ValidationMode.parse(mode)
    return previous


@contextlib.contextmanager
def validation_mode(mode: ValidationMode | str) -> Iterator[ValidationMode]:
    """Temporarily switch the process-wide default."""
    previous = set_validation_mode(mode)
    try:
        yield get_validation_mode()
    finally:
        set_validation_mode(previous)
