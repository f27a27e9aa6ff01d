"""Named errors raised by the runtime (KV pool, model loading, attention backend)."""

from __future__ import annotations

from collections.abc import Sequence


class PhasegraphRuntimeError(Exception):
    """Base class of every error the runtime raises on purpose."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says memory ran out: Python's ``MemoryError``, torch's allocator
    (``torch.OutOfMemoryError``), a CUDA call that ran out and raised a plain ``RuntimeError``
    ("out of memory": a graph's instantiation, say), or torch's CPU allocator ("can't allocate
    memory")."""
    if isinstance(exc, MemoryError):
        return True
    import torch  # here: this module is imported where torch is not

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


# ---------------------------------------------------------------------------------------------
# KV pool


class OutOfKVPages(PhasegraphRuntimeError):
    """The allocator has fewer free pages than requested; nothing was allocated."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"requested {requested} KV pages but only {available} are free")
        self.requested = requested
        self.available = available


class OutOfRequestRows(PhasegraphRuntimeError):
    """Every row of the request table (row 0 excluded) is in use."""

    def __init__(self, max_reqs: int) -> None:
        super().__init__(f"all {max_reqs - 1} request rows are in use (row 0 is reserved)")
        self.max_reqs = max_reqs


class RequestTooLong(PhasegraphRuntimeError):
    """A request needs more pages than one page-table row holds."""

    def __init__(self, num_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"{num_tokens} tokens do not fit one page-table row (at most {max_tokens} tokens)"
        )
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


class InvalidPageFree(PhasegraphRuntimeError, ValueError):
    """free() got the reserved page 0, an out-of-range page, or a page that is already free."""


class InvalidRow(PhasegraphRuntimeError, ValueError):
    """A request-table row that is reserved, out of range, or not in use."""


class KVAccountingError(PhasegraphRuntimeError):
    """The page accounting is inconsistent; ``problems`` lists every violation found."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(
            "KV accounting is inconsistent:\n" + "\n".join(f"  - {p}" for p in self.problems)
        )


# ---------------------------------------------------------------------------------------------
# Models and checkpoints


class UnsupportedModel(PhasegraphRuntimeError, ValueError):
    """The checkpoint's ``model_type`` is not one the runtime runs."""


class CheckpointFileError(PhasegraphRuntimeError, OSError):
    """A checkpoint file is missing, truncated or corrupt, or its index is inconsistent."""


class CheckpointMismatch(PhasegraphRuntimeError, ValueError):
    """The checkpoint's tensors do not match the model: missing, unexpected or mis-shaped keys."""

    def __init__(
        self,
        where: str,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
    ) -> None:
        self.where = where
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        lines = [f"checkpoint {where} does not match the model:"]
        if self.missing:
            lines.append(f"  missing keys ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(
                f"  unexpected keys ({len(self.unexpected)}): {', '.join(self.unexpected)}"
            )
        for key, found, expected in self.mismatched:
            lines.append(
                f"  shape mismatch for {key}: checkpoint {list(found)}, model {list(expected)}"
            )
        super().__init__("\n".join(lines))


class GGUFConversionError(PhasegraphRuntimeError, RuntimeError):
    """A ``.gguf`` file could not be converted to a Hugging Face directory: the optional
    dependencies are missing (``pip install phasegraph[gguf]``), the file is not GGUF, or
    transformers' GGUF reader does not know its architecture or quantization."""


class DraftMismatch(PhasegraphRuntimeError, ValueError):
    """A draft head whose hidden size, feature width or vocabulary does not fit the target."""


class UnsupportedDraftLayout(DraftMismatch):
    """A draft checkpoint in a public layout, or with a value of one of its switches, that the
    runtime does not implement; the message names the key and its value. Raised before any
    weight is read, so that no head loads and computes something else than its reference."""


class NoForwardContext(PhasegraphRuntimeError, RuntimeError):
    """The phasegraph attention function ran outside ``forward_context(...)``."""


# ---------------------------------------------------------------------------------------------
# Engine and requests


class InvalidConfig(PhasegraphRuntimeError, ValueError):
    """An engine or speculation setting is out of range or inconsistent."""


class InvalidRequest(PhasegraphRuntimeError, ValueError):
    """A request cannot be served as given (empty or too long prompt, token ids outside the
    vocabulary, bad sampling parameters, ...). Nothing was queued; no other request is affected."""


class EngineInUse(PhasegraphRuntimeError, RuntimeError):
    """An Engine was called from a second thread while another thread was inside it. An Engine
    is not thread-safe: one thread drives it (an AsyncEngine owns the engine it wraps)."""


class RequestFailed(PhasegraphRuntimeError):
    """``Engine.generate`` ran every request to its end, and some ended with finish reason
    ``"error"`` (e.g. the target's logits were not finite). ``outputs`` holds every request's
    output, in the prompts' order, the failed ones with their ``error``; nothing is lost."""

    def __init__(self, outputs: Sequence) -> None:
        self.outputs = list(outputs)
        self.failed = [o for o in self.outputs if o.finish_reason == "error"]
        first = self.failed[0]
        more = f" (and {len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
        super().__init__(
            f"request {first.request_id} failed after {len(first.token_ids)} tokens{more}: {first.error}"
        )


class NonFiniteDraftWarning(RuntimeWarning):
    """The draft's logits were not finite (NaN or infinity) for a request: verify rejects every
    draft of such a tree, so the outputs stay exact but speculation gains nothing (tau 1).
    Issued once per engine; ``RequestStats.nonfinite_drafts`` counts the verify steps of each
    request. ``validate="strict"`` raises ``InvariantViolation`` instead."""


class SchedulerInvariantError(PhasegraphRuntimeError):
    """The scheduler's bookkeeping is inconsistent (a request in two queues, host and device
    state disagreeing, KV accounting broken, ...); ``problems`` lists every violation found.
    Raised by ``Scheduler.check()`` / ``Engine.check()`` (never an ``assert``: it survives
    ``python -O``)."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(
            "scheduler invariants violated:\n" + "\n".join(f"  - {p}" for p in self.problems)
        )


# ---------------------------------------------------------------------------------------------
# Tensor parallelism


class TensorParallelError(PhasegraphRuntimeError, RuntimeError):
    """A tensor-parallel engine's ranks cannot go on together."""


class WorkerDied(TensorParallelError):
    """A rank of a tensor-parallel engine exited, failed, or stopped answering a collective
    within ``tp_timeout_s``; ``rank`` is the rank that died where it is known, ``detail`` what
    it reported (its traceback) or what the collective raised."""

    def __init__(self, message: str, rank: int | None = None, detail: str | None = None) -> None:
        super().__init__(message if not detail else f"{message}\n{detail}")
        self.rank = rank
        self.detail = detail


class RankDivergence(TensorParallelError):
    """``tp_check=True``: the ranks' emitted tokens differ after a step (their checksums
    disagree), which the same seeded counters and identical logits should make impossible."""
