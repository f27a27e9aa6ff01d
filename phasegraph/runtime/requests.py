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
        # structured output: the request's xgrammar matcher, at its emitted tokens (set by the engine)
        self.matcher = None
        self.logprobs: list[float] | None = [] if params.wants_logprobs else None
        # per output token, the top_logprobs most likely (token id, logprob)
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if params.top_logprobs else None
        # per output token, the expert ids each MoE layer chose ([num_moe_layers][k])
        self.routed_experts: list[list[list[int]]] | None = [] if params.return_routed_experts else None
        # set once, by the request's first prefill (a resumed request's prefill reports none)
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None  # set with finish_reason "error"
        self.row: int | None = None  # page-table row while running
        self.seq_len = 0
        self.cached_len = 0  # between admission and prefill: tokens read from the prefix cache
        self._text = ""  # decoded from output[:_text_tokens] (cut at a stop string once one is hit)
        self._text_tokens = 0
        self._reported_tokens = 0
        self._reported_text = ""
        self._reported_accepts = 0
        self._reported_experts = 0
        self._stop_string_hit = False
        self.stats = RequestStats(prompt_tokens=len(self.prompt))

    # -- what prefill reads
    def tokens_to_prefill(self) -> list[int]:
        """The tokens whose KV prefill writes: the prompt, plus after a retraction every
        committed token (everything emitted but the last token, which is the bonus token: it
        is not drawn again on resumption, see ``Scheduler._prefill``)."""
        return self.prompt + self.output[:-1]

    @property
    def resuming(self) -> bool:
        """Waiting after a retraction (it has emitted tokens already)."""
        return bool(self.output)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.output)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asks for prompt logprobs and has none yet (a resumed request had them already)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    def set_prompt_logprobs(self, logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]] | None) -> None:
        """Record the logprobs of prompt tokens 1.. (given the tokens before each) and, where
        asked, the top ones at their positions; entry 0 (the first token) is None."""
        self.prompt_logprobs = [None, *(float(x) for x in logprobs)]
        k = self.params.prompt_logprobs or 0
        self.prompt_top_logprobs = [None, *([[] for _ in logprobs] if top is None else [list(t[:k]) for t in top])]

    # -- appending
    def append(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[float] | None = None,
        top: Sequence[Sequence[tuple[int, float]]] | None = None,
        experts: Sequence[list[list[int]]] | None = None,
    ) -> None:
        """Append newly emitted tokens in order, stopping at a stop token, the budget or a stop
        string; tokens after the stop are dropped. ``logprobs``, ``top`` (the batch's top
        logprobs per token, cut here to the request's own number) and ``experts`` (the routed
        experts per token) go along with them."""
        k = self.params.top_logprobs
        for i, tok in enumerate(tokens):
            if self.finish_reason is not None:
                break
            self.output.append(int(tok))
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(float(logprobs[i]))
            if self.top_logprobs is not None and top is not None:
                self.top_logprobs.append(list(top[i][:k]))
            if self.routed_experts is not None and experts is not None:
                self.routed_experts.append(experts[i])
            if self.matcher is not None and not self._advance_grammar(int(tok)):
                break
            if tok in self._stop_set:
                self.finish("stop")
            elif len(self.output) >= self.budget:
                self.finish("length")
        self._update_text()

    @property
    def text(self) -> str:
        """The output's text, decoded when read (a full decode of a long output costs ~0.1 ms
        of host time, too much for every iteration of a batch nobody streams)."""
        if self._decode is not None and not self._stop_string_hit and self._text_tokens != len(self.output):
            self._text, self._text_tokens = self._decode(self.output), len(self.output)
        return self._text

    def _update_text(self) -> None:
        """Stop strings: look for one in the text after every append (only then is the text
        decoded eagerly); on a hit, cut the output and the text there for good."""
        if self._decode is None or not self.params.stop or self._stop_string_hit:
            return
        text = self.text
        cut = _first_stop(text, self.params.stop)
        if cut is None:
            return
        # keep the shortest token prefix whose text still reaches the stop string
        self._stop_string_hit = True
        while len(self.output) > 1 and _first_stop(self._decode(self.output[:-1]), self.params.stop) is not None:
            self.output.pop()
            if self.logprobs:
                self.logprobs.pop()
            if self.top_logprobs:
                self.top_logprobs.pop()
            if self.routed_experts:
                self.routed_experts.pop()
        self._text, self._text_tokens = text[:cut], len(self.output)
        self.finish_reason = "stop"  # wins over a budget reached in the same step

    def _advance_grammar(self, token: int) -> bool:
        """Advance the matcher over an emitted token; a finished grammar finishes the request
        ("stop"). False (the request failed) where the grammar refuses the token: the masks of
        prefill, decode and verify allow only what it accepts, so this is a bug, never hidden."""
        if not self.matcher.accept_token(token):
            self.finish_reason = "error"
            self.error = f"structured output: the grammar refused emitted token {token} (output token {len(self.output) - 1})"
            return False
        if self.matcher.is_terminated():
            self.finish("stop")
        return True

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def fail_nonfinite(self) -> None:
        """Finish with ``"error"``: the target's logits for output token ``len(output)`` held NaN
        or +inf (or only -inf), so that token and every later one would be garbage (greedy
        argmax picks the first NaN's id, 0 for an all-NaN row)."""
        if self.finish_reason is not None:
            return
        self.finish_reason = "error"
        self.error = (
            f"the target's logits for output token {len(self.output)} were not finite (NaN or "
            "infinity): its activations overflowed or its weights are broken. A float16 model "
            "often overflows; load it in bfloat16 or float32"
        )

    # -- reporting
    def take_delta(self) -> tuple[list[int], str, list[float] | None, list[list[tuple[int, float]]] | None]:
        """Tokens, text, and the tokens' logprobs and top logprobs (None where not asked for)
        produced since the last call.

        While the request runs, the text is held back where it may still change: a trailing
        partial UTF-8 character (decoded as U+FFFD) and a tail that could be the start of a
        stop string (the final text is cut before the stop string, so text streamed earlier
        must never include a piece of it). The streamed pieces add up to the final text."""
        start = self._reported_tokens
        new_tokens = self.output[start:]
        self._reported_tokens = len(self.output)
        new_logprobs = None if self.logprobs is None else self.logprobs[start:]
        new_top = None if self.top_logprobs is None else self.top_logprobs[start:]
        text = self.text
        if self.finish_reason is None:
            text = text.rstrip("\ufffd")
            if self.params.stop:
                text = text[: len(text) - _stop_prefix_len(text, self.params.stop)]
        done = self._reported_text
        if not text.startswith(done):  # cannot happen outside the held-back tail; be safe
            common = 0
            while common < min(len(text), len(done)) and text[common] == done[common]:
                common += 1
            done = done[:common]
        self._reported_text = text
        return new_tokens, text[len(done) :], new_logprobs, new_top

    def take_routed_experts(self) -> list[list[list[int]]] | None:
        """The routed experts of the tokens since the last call (None where not asked for);
        called beside :meth:`take_delta`, so they belong to the tokens it returned."""
        if self.routed_experts is None:
            return None
        new = self.routed_experts[self._reported_experts :]
        self._reported_experts += len(new)
        return new

    def take_accept_lengths(self) -> list[int]:
        """Accept lengths of the verify steps since the last call."""
        new = self.stats.accept_lengths[self._reported_accepts :]
        self._reported_accepts += len(new)
        return new

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt),
            token_ids=list(self.output),
            text=self.text,
            finish_reason=self.finish_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            stats=self.stats,
            error=self.error,
            top_logprobs=None if self.top_logprobs is None else [list(t) for t in self.top_logprobs],
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            prompt_top_logprobs=None if self.prompt_top_logprobs is None else list(self.prompt_top_logprobs),
            routed_experts=None if self.routed_experts is None else [[list(layer) for layer in t] for t in self.routed_experts],
        )


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
