"""The OpenAI API's request bodies, their mapping to :class:`SamplingParams`, chat prompts, and
the response and stream-chunk bodies (``/v1/completions``, ``/v1/chat/completions``).

Request bodies are checked strictly (a string is no number, an unknown field is refused by
name) so that a request the server cannot honour fails with 400 instead of being half-served.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from phasegraph.runtime.config import RequestOutput, SamplingParams
from phasegraph.runtime.grammar import InvalidGrammar
from phasegraph.serving.errors import APIError

# OpenAI's default max_tokens of /v1/completions; chat completions default to the whole context
COMPLETION_MAX_TOKENS = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """The fields both endpoints share; phasegraph's own extensions (as in vLLM): ``top_k``,
    ``ignore_eos``, ``stop_token_ids``; ``speculate``, ``max_draft_tokens``; and structured
    output by ``regex`` or ``grammar``."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: off
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as it only labels the caller
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    speculate: bool = True
    max_draft_tokens: int | None = Field(default=None, ge=0)
    regex: str | None = None  # structured output: the text matches it
    grammar: str | None = None  # structured output: EBNF, root rule `root`


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | bool | None = None  # 0 (or true): each sampled token's; no alternatives yet
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class JSONSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted: the output always follows the schema


class ResponseFormat(_Body):
    type: str
    json_schema: JSONSchemaFormat | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None


# ---------------------------------------------------------------------------------------------
# requests


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def _check_shared(req: _SamplingFields) -> None:
    """The OpenAI fields phasegraph does not do (yet): refused by name, never ignored."""
    if req.n not in (None, 1):
        raise _refuse("n", f"only n=1 is supported (one choice per request); got {req.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise _refuse(name, "penalties are not supported; leave it out or 0")
    if req.logit_bias:
        raise _refuse("logit_bias", "logit_bias is not supported")


def sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: bool,
                    json_schema: dict | bool | None = None) -> SamplingParams:
    """``req``'s sampling fields as SamplingParams (OpenAI's defaults: temperature 1, top_p 1);
    an impossible value raises InvalidRequest naming it, a grammar that does not compile a 400
    naming the field that gave it."""
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    given = [name for name, v in (("response_format", json_schema), ("regex", req.regex), ("grammar", req.grammar))
             if v is not None]
    if len(given) > 1:
        raise APIError(400, f"at most one of response_format (JSON), regex and grammar; got {', '.join(given)}",
                       param=given[1])
    try:
        return _sampling_params(req, max_tokens, logprobs, top_k, json_schema)
    except InvalidGrammar as exc:
        raise APIError(400, f"{given[0]}: {exc}", param=given[0], code="invalid_grammar") from None


def _sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: bool, top_k: int,
                     json_schema: dict | bool | None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        stop=() if req.stop is None else req.stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        seed=req.seed,
        speculate=req.speculate,
        max_draft_tokens=req.max_draft_tokens,
        json_schema=json_schema,
        regex=req.regex,
        grammar=req.grammar,
    )


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: a string or a list of token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise _refuse("prompt", f"one prompt per request is supported; got a batch of {len(prompt)}")
        prompt = prompt[0]
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, "prompt: the prompt is empty", param="prompt")
    return prompt


def completion_params(req: CompletionRequest) -> SamplingParams:
    _check_shared(req)
    if req.echo:
        raise _refuse("echo", "echo is not supported")
    if req.suffix is not None:
        raise _refuse("suffix", "suffix (insertion) is not supported")
    if req.best_of not in (None, 1):
        raise _refuse("best_of", f"only best_of=1 is supported; got {req.best_of}")
    lp = req.logprobs
    if lp is not None and lp is not False and lp is not True and lp != 0:
        raise _refuse("logprobs", "only logprobs=0 (the sampled tokens' log-probabilities, no "
                      f"alternatives) is supported; got {lp}")
    wants = lp is True or (lp is not None and lp is not False)  # true, or 0
    max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    return sampling_params(req, max_tokens, wants)


def chat_params(req: ChatRequest, max_context: int) -> SamplingParams:
    _check_shared(req)
    if req.top_logprobs not in (None, 0):
        raise _refuse("top_logprobs", f"alternatives are not supported (top_logprobs 0 only); got {req.top_logprobs}")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # no limit given: up to the context (the engine caps a request's budget by its prompt)
    return sampling_params(req, max_context if max_tokens is None else max_tokens, bool(req.logprobs),
                           response_json_schema(req.response_format))


def response_json_schema(fmt: ResponseFormat | None) -> dict | bool | None:
    """The JSON schema a ``response_format`` asks for: ``json_schema``'s own, any JSON object for
    ``json_object``, None for ``text``."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format: type 'json_schema' needs json_schema.schema",
                           param="response_format")
        return fmt.json_schema.json_schema
    raise _refuse("response_format", f"type must be 'text', 'json_object' or 'json_schema'; got {fmt.type!r}")


def chat_prompt(tokenizer, messages: list[ChatMessage], template: str | None) -> str:
    """The messages through the chat template (``template``, else the tokenizer's), ending
    with the assistant's turn opened. No template: a 400 naming the problem (a made-up format
    would give a model trained on another one text it never saw)."""
    if tokenizer is None:
        raise APIError(400, "this model ships no tokenizer, so it has no chat template: use "
                       "/v1/completions with token ids", param="messages", code="no_chat_template")
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(400, "this model's tokenizer has no chat template: start the server with "
                       "--chat-template FILE, or use /v1/completions", param="messages", code="no_chat_template")
    conversation = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        item: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            item["name"] = m.name
        conversation.append(item)
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template raises what its author chose (jinja's raise_exception)
        raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from None
    if not isinstance(text, str):
        raise APIError(500, "the chat template did not render to text", type="server_error")
    return text


# ---------------------------------------------------------------------------------------------
# responses

FINISH_REASONS = {"stop": "stop", "length": "length"}


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    # prompt tokens read from the prefix cache (a resumed request's second prefill may read more)
    cached = min(out.stats.cached_tokens, prompt)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def extension(out: RequestOutput) -> dict:
    """The ``phasegraph`` field of a whole response."""
    return {
        "accept_lengths": list(out.stats.accept_lengths),
        "mean_accept_length": out.stats.mean_accept_length,
        "token_ids": list(out.token_ids),
    }


def token_texts(tokenizer, token_ids) -> list[str]:
    if tokenizer is None:
        return [str(t) for t in token_ids]
    return [tokenizer.decode([t]) for t in token_ids]


def completion_logprobs(tokens: list[str], logprobs, offset: int = 0) -> dict | None:
    if logprobs is None:
        return None
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs) -> dict | None:
    if logprobs is None:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs, strict=True)]}
