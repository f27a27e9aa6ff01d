"""Test helpers for phasegraph users: the pytest plugin (registered as ``phasegraph`` through the
``pytest11`` entry point), trace assertions, and tiny random checkpoints in every format the
runtime loads (:mod:`phasegraph.testing.checkpoints`, which needs torch and transformers).
Importing this package does not import torch."""

from phasegraph.testing.recorder import PhaseTraceRecorder

__all__ = ["PhaseTraceRecorder"]
