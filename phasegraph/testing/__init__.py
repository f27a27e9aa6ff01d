"""Test helpers for phasegraph users: the pytest plugin (registered as ``phasegraph`` through the
``pytest11`` entry point) and trace assertions. Importing this package does not import torch."""

from phasegraph.testing.recorder import PhaseTraceRecorder

__all__ = ["PhaseTraceRecorder"]
