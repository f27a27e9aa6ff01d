"""The OpenAI API's request bodies, their mapping to :class:`SamplingParams`, chat prompts, and
the response and stream-chunk bodies (``/v1/completions``, ``/v1/chat/completions``).

Request bodies are checked strictly (a string is no number, an unknown field is refused by
name) so that a request the server cannot honour fails with 400 instead of being half-served.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import attrs
from pydantic import BaseModel, ConfigDict, Field

from phasegraph.runtime.config import INT64_MIN, MAX_LOGPROBS, RequestOutput, SamplingParams
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
    ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``; ``speculate``,
    ``max_draft_tokens``; and structured output by ``regex`` or ``grammar``."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: off
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as it only labels the caller
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {token id as a string: bias}
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    speculate: bool = True
    max_draft_tokens: int | None = Field(default=None, ge=0)
    regex: str | None = None  # structured output: the text matches it
    grammar: str | None = None  # structured output: EBNF, root rule `root`


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the prompt scored, nothing generated
    logprobs: int | bool | None = None  # k: each sampled token's logprob and the k most likely
    echo: bool = False  # the prompt before the completion, with its tokens' logprobs where asked
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer names the call it answers


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None  # accepted: a forced call always follows the schema


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


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
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted: a forced call is one call per choice


# ---------------------------------------------------------------------------------------------
# requests


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, whose keys are token ids written as strings, keyed by the ids."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias: keys are token ids (integers as strings); got {key!r}",
                           param="logit_bias") from None
        if token in out:
            raise APIError(400, f"logit_bias: token id {token} is named twice", param="logit_bias")
        out[token] = value
    return out


def sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: bool | int,
                    json_schema: dict | bool | None = None, schema_field: str = "response_format") -> SamplingParams:
    """``req``'s sampling fields as SamplingParams (OpenAI's defaults: temperature 1, top_p 1);
    ``logprobs``: False, True (the sampled tokens') or k (and the k most likely). An impossible
    value raises InvalidRequest naming it, a grammar that does not compile a 400 naming the
    field that gave it (``schema_field`` for ``json_schema``)."""
    given = [name for name, v in ((schema_field, json_schema), ("regex", req.regex), ("grammar", req.grammar))
             if v is not None]
    if len(given) > 1:
        raise APIError(400, f"at most one of response_format (JSON), regex and grammar; got {', '.join(given)}",
                       param=given[1])
    try:
        return _sampling_params(req, max_tokens, logprobs, json_schema)
    except InvalidGrammar as exc:
        raise APIError(400, f"{given[0]}: {exc}", param=given[0], code="invalid_grammar") from None


def _sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: bool | int,
                     json_schema: dict | bool | None) -> SamplingParams:
    def given(value, default):
        return default if value is None else value

    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=given(req.temperature, 1.0),
        top_p=given(req.top_p, 1.0),
        top_k=req.top_k if req.top_k is not None and req.top_k > 0 else 0,
        min_p=given(req.min_p, 0.0),
        repetition_penalty=given(req.repetition_penalty, 1.0),
        frequency_penalty=given(req.frequency_penalty, 0.0),
        presence_penalty=given(req.presence_penalty, 0.0),
        logit_bias=_logit_bias(req.logit_bias),
        stop=given(req.stop, ()),
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


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of each of ``n`` choices of one prompt: with a seed, choice j samples with
    seed + j (wrapped into 64 bits), so that the choices differ and each is reproducible."""
    if params.seed is None or n == 1:
        return [params] * n
    return [attrs.evolve(params, seed=(params.seed + j - INT64_MIN) % 2**64 + INT64_MIN) for j in range(n)]


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """A completion request's prompts (one, or a batch): each a string or a list of token ids."""
    prompt = req.prompt
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    for i, one in enumerate(batch):
        if isinstance(one, list) and not one:
            where = "" if len(batch) == 1 else f" {i}"
            raise APIError(400, f"prompt: the prompt{where} is empty", param="prompt")
    return batch


def completion_params(req: CompletionRequest) -> SamplingParams:
    if req.echo and req.stream:
        raise _refuse("echo", "echo is supported without streaming only")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens: 0 is allowed with echo only (the prompt scored, nothing generated)",
                       param="max_tokens")
    if req.suffix is not None:
        raise _refuse("suffix", "suffix (insertion) is not supported")
    if req.best_of not in (None, 1):
        raise _refuse("best_of", f"only best_of=1 is supported; got {req.best_of}")
    lp = req.logprobs
    if lp is not None and not isinstance(lp, bool) and not 0 <= lp <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs: must be in [0, {MAX_LOGPROBS}] (alternatives per token); got {lp}",
                       param="logprobs")
    # true or 0: the sampled tokens' logprobs; k: and the k most likely tokens at each position
    wants = False if lp is None or lp is False else True if lp is True or lp == 0 else lp
    # max_tokens 0: one token made, and dropped from the response (see without_generated)
    max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else max(req.max_tokens, 1)
    params = sampling_params(req, max_tokens, wants)
    if req.echo and wants is not False:
        params = attrs.evolve(params, prompt_logprobs=0 if wants is True else wants)
    return params


def without_generated(out: RequestOutput) -> RequestOutput:
    """``out`` as a request of max_tokens 0 answers: its prompt, nothing generated."""
    def none_or_empty(x):
        return None if x is None else []

    return attrs.evolve(out, token_ids=[], text="", finish_reason="length", logprobs=none_or_empty(out.logprobs),
                        top_logprobs=none_or_empty(out.top_logprobs))


@attrs.frozen
class ForcedCall:
    """A chat request whose output must be a tool call (``tool_choice`` ``"required"`` or a named
    function): the JSON schema its output follows, and the function's name where one is named
    (the output is then its arguments; with ``"required"`` it is ``{"name", "arguments"}``)."""

    schema: dict
    name: str | None


def forced_call(req: ChatRequest) -> ForcedCall | None:
    """The tool call ``req`` forces, if any. ``"auto"`` (the default with tools) is refused by
    name: it needs the model's own tool-call format parsed, model by model."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: no tools were given", param="tool_choice")
        return None
    tools = {t.function.name: t.function for t in req.tools}
    if len(tools) != len(req.tools):
        raise APIError(400, "tools: two tools have one name", param="tools")
    if choice is None or choice == "auto":
        raise _refuse("tool_choice", "'auto' (the default with tools) needs the model's own tool-call format "
                      "parsed, which phasegraph does not do: send 'required' or a named function (the output "
                      "is then constrained to a call), or 'none'")
    if choice == "none":
        return None

    def arguments(f: FunctionDef) -> dict:
        return f.parameters if f.parameters is not None else {"type": "object"}

    if isinstance(choice, NamedToolChoice):
        f = tools.get(choice.function.name)
        if f is None:
            raise APIError(400, f"tool_choice: no tool is named {choice.function.name!r} (tools: "
                           f"{', '.join(map(repr, tools))})", param="tool_choice")
        return ForcedCall(arguments(f), f.name)
    calls = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": arguments(f)},
              "required": ["name", "arguments"], "additionalProperties": False} for f in tools.values()]
    return ForcedCall(calls[0] if len(calls) == 1 else {"anyOf": calls}, None)


def tool_calls(text: str, call: ForcedCall, finish_reason: str) -> list[dict] | None:
    """The ``tool_calls`` of a forced call's whole output, or None where it was cut short (by
    max_tokens: its finish reason is not ``stop``, or its JSON not whole)."""
    if finish_reason != "stop":
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if call.name is not None:
        name, args = call.name, text
    else:
        name, args = value["name"], json.dumps(value["arguments"], ensure_ascii=False)
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}]


def chat_params(req: ChatRequest, max_context: int, call: ForcedCall | None = None) -> SamplingParams:
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs: must be in [0, {MAX_LOGPROBS}]; got {top}", param="top_logprobs")
    if top and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # no limit given: the context, until the route has encoded the prompt and counts it
    schema = response_json_schema(req.response_format)
    if call is not None:
        if schema is not None:
            raise APIError(400, "response_format: a forced tool call constrains the output already",
                           param="response_format")
        schema = call.schema
    return sampling_params(req, max_context if max_tokens is None else max_tokens,
                           top if top else bool(req.logprobs), schema, "tools" if call is not None else "response_format")


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


def chat_prompt(tokenizer, messages: list[ChatMessage], template: str | None,
                tools: list[Tool] | None = None) -> str:
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
        if m.tool_calls:  # (templates take the arguments as an object, where they are JSON)
            item["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                                  for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        conversation.append(item)
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=True,
            tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None)
    except Exception as exc:  # noqa: BLE001 - a template raises what its author chose (jinja's raise_exception)
        raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from None
    if not isinstance(text, str):
        raise APIError(500, "the chat template did not render to text", type="server_error")
    return text


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---------------------------------------------------------------------------------------------
# responses

FINISH_REASONS = {"stop": "stop", "length": "length"}


def usage(outs: Sequence[RequestOutput], n: int = 1) -> dict:
    """OpenAI's usage of a response whose choices are ``outs`` (in index order, ``n`` per
    prompt): each prompt counted once, as OpenAI counts it whatever ``n``."""
    firsts = outs[::n]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.token_ids) for o in outs)
    # prompt tokens read from the prefix cache (a resumed request's second prefill may read more)
    cached = sum(min(o.stats.cached_tokens, len(o.prompt_token_ids)) for o in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def extension(out: RequestOutput) -> dict:
    """The ``phasegraph`` field of one whole choice."""
    return {
        "accept_lengths": list(out.stats.accept_lengths),
        "mean_accept_length": out.stats.mean_accept_length,
        "token_ids": list(out.token_ids),
    }


def _text(tokenizer, token_id: int) -> str:
    return str(token_id) if tokenizer is None else tokenizer.decode([token_id])


def completion_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                        top: Sequence[Sequence[tuple[int, float]]] | None, offset: int = 0) -> dict | None:
    """A completion choice's ``logprobs`` (None where not asked for): each token's text, logprob
    and offset in the choice's text; with ``top``, at each position a {text: logprob} of the most
    likely tokens and the sampled one (OpenAI's form: two ids of one text keep the likelier)."""
    if logprobs is None:
        return None
    tokens = [_text(tokenizer, t) for t in token_ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    alternatives = None
    if top is not None:
        alternatives = []
        for text, lp, alts in zip(tokens, logprobs, top, strict=True):
            if alts is None:  # an echoed prompt's first token: nothing before it
                alternatives.append(None)
                continue
            entry: dict[str, float] = {}
            for token, alt in alts:
                entry.setdefault(_text(tokenizer, token), alt)
            entry.setdefault(text, lp)
            alternatives.append(entry)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": alternatives, "text_offset": offsets}


def echoed_completion(tokenizer, prompt: str | list[int], out: RequestOutput) -> tuple[str, dict | None]:
    """A completion choice with ``echo``: its prompt before its text, and the logprobs of every
    prompt token (None for the first) before those of the generated ones, where asked."""
    prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt) if tokenizer else ""
    if out.logprobs is None:
        return prompt_text + out.text, None
    tokens = [*out.prompt_token_ids, *out.token_ids]
    logprobs = [*out.prompt_logprobs, *out.logprobs]
    top = None
    if out.top_logprobs is not None:
        top = [*out.prompt_top_logprobs, *out.top_logprobs]
    return prompt_text + out.text, completion_logprobs(tokenizer, tokens, logprobs, top)


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                  top: Sequence[Sequence[tuple[int, float]]] | None) -> dict | None:
    """A chat choice's ``logprobs`` (None where not asked for): each token with its logprob,
    bytes and, with ``top``, the most likely tokens at its position."""
    if logprobs is None:
        return None

    def item(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    tops = top if top is not None else [()] * len(token_ids)
    return {"content": [{**item(_text(tokenizer, t), lp),
                         "top_logprobs": [item(_text(tokenizer, a), alp) for a, alp in alts]}
                        for t, lp, alts in zip(token_ids, logprobs, tops, strict=True)]}
