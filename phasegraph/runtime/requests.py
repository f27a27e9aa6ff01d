"""One request's life on the host: its tokens, text, stop checks and statistics."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from phasegraph.runtime.config import RequestOutput, RequestStats, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new or retracted)
    RUNNING = "running"  # holds a page-table row and a batch row
    FINISHED = "finished"


class Request:
    """Host-side record of a request. ``seq_len`` mirrors the device state: the number of
    committed tokens in the KV cache, always ``len(prompt) + len(output) - 1`` while running
    (the last output token is the bonus token, not yet in the cache)."""

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        stop_ids: Sequence[int],
        budget: int,
        seed: int,
        decode: Callable[[list[int]], str] | None,
    ):
        self.request_id = request_id
        self.prompt = list(prompt)
        self.params = params
        self.stop_ids = tuple(dict.fromkeys(stop_ids))  # ordered, unique
        self._stop_set = frozenset(self.stop_ids)
        self.budget = budget  # max new tokens, also capped by the context length
        self.seed = seed
        self._decode = decode
        self.output: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.row: int | None = None  # page-table row while running
        self.seq_len = 0
        self.text = ""
        self._reported_tokens = 0
        self._reported_text = ""
        self._stop_string_hit = False
        self.stats = RequestStats(prompt_tokens=len(self.prompt))

    # -- what prefill reads
    def tokens_to_prefill(self) -> list[int]:
        """The prompt plus everything emitted before a retraction."""
        return self.prompt + self.output

    @property
    def remaining(self) -> int:
        return self.budget - len(self.output)

    # -- appending
    def append(self, tokens: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Append newly emitted tokens in order, stopping at a stop token, the budget or a stop
        string; tokens after the stop are dropped."""
        for i, tok in enumerate(tokens):
            if self.finish_reason is not None:
                break
            self.output.append(int(tok))
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(float(logprobs[i]))
            if tok in self._stop_set:
                self.finish("stop")
            elif len(self.output) >= self.budget:
                self.finish("length")
        self._update_text()

    def _update_text(self) -> None:
        if self._decode is None:
            return
        text = self._decode(self.output)
        if self.params.stop and not self._stop_string_hit:
            cut = _first_stop(text, self.params.stop)
            if cut is not None:
                # keep the shortest token prefix whose text still reaches the stop string
                self._stop_string_hit = True
                while len(self.output) > 1 and _first_stop(self._decode(self.output[:-1]), self.params.stop) is not None:
                    self.output.pop()
                    if self.logprobs:
                        self.logprobs.pop()
                text = text[:cut]
                self.finish_reason = "stop"  # wins over a budget reached in the same step
        self.text = text

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    # -- reporting
    def take_delta(self) -> tuple[list[int], str]:
        """Tokens and text produced since the last call (text held back while it ends in a
        partial UTF-8 character)."""
        new_tokens = self.output[self._reported_tokens :]
        self._reported_tokens = len(self.output)
        text = self.text
        if self.finish_reason is None and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        new_text = text[len(self._reported_text) :] if text.startswith(self._reported_text) else text
        self._reported_text = text
        return new_tokens, new_text

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt),
            token_ids=list(self.output),
            text=self.text,
            finish_reason=self.finish_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            stats=self.stats,
        )


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None
