"""The OpenAI-compatible server, started for real on 127.0.0.1 and driven by the official
``openai`` client (and httpx for what that client will not send): completions and chat
(the template applied), streaming and not, equal to the offline Engine; the sampling fields;
OpenAI-style errors with status 400 (never a 500 with a traceback); 429 or waiting when the
queue is full; a request failing mid-run; disconnects; /v1/models, /health and /metrics. The
same server over a ProcessEngine answers the client as the offline Engine does, and an engine
process killed mid-request fails what is pending and what comes later with EngineDied, /health
turning 503."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from phasegraph.runtime.config import SamplingParams
from phasegraph.runtime.errors import InvalidConfig
from phasegraph.serving import AsyncEngine, EngineDied, ProcessEngine, create_app
from tests.serving.support import (
    CHAT_TEMPLATE,
    PROMPTS,
    assert_all_free,
    chat_ids,
    demo_engine,
    greedy,
    kv_state,
    offline,
    poison_target,
    running_server,
)

MODEL = "demo"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]


@contextlib.contextmanager
def serving(engine, **options):
    """The engine behind an AsyncEngine and a real server; yields (base URL, AsyncEngine) and
    leaves the engine idle with every page free."""
    max_queue = options.pop("max_queue", 64)
    aengine = AsyncEngine(engine, max_queue=max_queue)
    try:
        with running_server(create_app(aengine, model_name=MODEL, **options)) as url:
            yield url, aengine
    finally:
        aengine.close()
    assert_all_free(engine)


def client(url: str) -> openai.OpenAI:
    # no retries: a 429 must reach the test, not be retried away
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def server(engine):
    with serving(engine) as (url, aengine):
        yield url, aengine


def test_completions_equal_the_offline_engine(engine, server):
    url, aengine = server
    want = offline(aengine, PROMPTS[:2], greedy(16))
    api = client(url)
    whole = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    choice = whole.choices[0]
    assert choice.text == want[0].text and choice.finish_reason == want[0].finish_reason
    assert whole.usage.prompt_tokens == len(want[0].prompt_token_ids)
    assert whole.usage.completion_tokens == len(want[0].token_ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    ext = choice.model_extra["phasegraph"]
    assert ext["token_ids"] == want[0].token_ids and ext["accept_lengths"] == want[0].stats.accept_lengths
    assert ext["mean_accept_length"] == pytest.approx(want[0].stats.mean_accept_length)
    # token ids as the prompt, streamed, with the usage chunk OpenAI sends last
    chunks = list(api.completions.create(model=MODEL, prompt=want[1].prompt_token_ids, max_tokens=16, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices for t in c.model_extra["phasegraph"]["token_ids"]]
    assert text == want[1].text and tokens == want[1].token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want[1].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want[1].token_ids)
    assert chunks[-1].model_extra["phasegraph"]["choices"][0]["token_ids"] == want[1].token_ids
    accepts = [n for c in chunks if c.choices for n in c.model_extra["phasegraph"]["accept_lengths"]]
    assert accepts == want[1].stats.accept_lengths


def test_chat_applies_the_tokenizers_template(engine, server, monkeypatch):
    url, aengine = server
    api = client(url)
    with pytest.raises(openai.BadRequestError) as err:  # the demo tokenizer ships no template
        api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert err.value.body["code"] == "no_chat_template" and "--chat-template" in err.value.body["message"]
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    ids = chat_ids(engine, MESSAGES)
    want = offline(aengine, [ids], greedy(12))[0]
    whole = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(want.token_ids)
    chunks = list(api.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=12,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    # content as a list of text parts renders the same
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    again = api.chat.completions.create(model=MODEL, messages=parts, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == want.text


def test_sampling_fields_map_to_sampling_params(engine, server):
    url, aengine = server
    api = client(url)
    prompt = PROMPTS[2]
    # seeded sampling with top_p and top_k is reproducible whatever the batch
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=40, seed=7)
    stop = greedy(24, stop=("\n",))
    with_lp = greedy(8, logprobs=True)
    want_sampled, want_stop, want_lp = (offline(aengine, [prompt], p)[0] for p in (sampled, stop, with_lp))
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                                 extra_body={"top_k": 40})
    assert out.choices[0].text == want_sampled.text
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop="\n")
    assert out.choices[0].text == want_stop.text and out.choices[0].finish_reason == want_stop.finish_reason
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=["\n", "zzz"])
    assert out.choices[0].text == want_stop.text
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want_lp.logprobs) and "".join(lp.tokens) == want_lp.text
    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                         stream=True))
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(want_lp.logprobs)


JSON_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
               "required": ["n", "ok"], "additionalProperties": False}


def test_structured_output_through_response_format_and_extensions(engine, server, monkeypatch):
    import json

    import jsonschema

    url, aengine = server
    api = client(url)
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    ids = chat_ids(engine, MESSAGES)
    want = offline(aengine, [ids], greedy(48, json_schema=JSON_SCHEMA))[0]
    out = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": JSON_SCHEMA, "strict": True}})
    assert out.choices[0].message.content == want.text and out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), JSON_SCHEMA)
    want = offline(aengine, [ids], greedy(48, json_schema={"type": "object"}))[0]
    out = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=48, temperature=0,
                                      response_format={"type": "json_object"})
    assert out.choices[0].message.content == want.text
    if want.finish_reason == "stop":  # any object: the demo model may run to the budget inside one
        assert isinstance(json.loads(want.text), dict)
    for field, spec in (("regex", "(yes|no) [0-9]{1,2}"), ("grammar", 'root ::= "x" | "y" [0-9]')):
        want = offline(aengine, [PROMPTS[0]], greedy(16, **{field: spec}))[0]
        out = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                     extra_body={field: spec})
        assert out.choices[0].text == want.text and out.choices[0].finish_reason == "stop"


def test_chat_logprobs(engine, server, monkeypatch):
    url, aengine = server
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    want = offline(aengine, [chat_ids(engine, MESSAGES)], greedy(6, logprobs=True))[0]
    out = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(want.logprobs)
    assert "".join(c.token for c in content) == want.text


TOOLS_TEMPLATE = (  # renders the tools and an assistant's earlier call
    "{% if tools %}# tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}"
    "{% if m.tool_calls %} -> {{ m.tool_calls[0]['function']['name'] }}"
    "({{ m.tool_calls[0]['function']['arguments']['city'] }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}def answer():\n{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
        "required": ["city"], "additionalProperties": False}
UNITS = {"type": "object", "properties": {"celsius": {"type": "boolean"}}, "required": ["celsius"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "set_units", "parameters": UNITS}}]


def _tool_prompt(engine, messages, tools=TOOLS) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, chat_template=TOOLS_TEMPLATE, tools=tools, tokenize=False,
                                                add_generation_prompt=True)
    assert all(t["function"]["name"] in text for t in tools)
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_forced_tool_calls_follow_their_schemas(engine):
    import json

    import jsonschema

    with serving(engine, chat_template=TOOLS_TEMPLATE) as (url, aengine):
        api = client(url)
        ids = _tool_prompt(engine, MESSAGES)
        # a named function: the output is its arguments
        want = offline(aengine, [ids], greedy(40, json_schema=CITY))[0]
        out = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, tools=TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert call.function.arguments == want.text
        jsonschema.validate(json.loads(call.function.arguments), CITY)
        # streamed: the call comes whole on the choice's last chunk
        chunks = list(api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, tools=TOOLS, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}))
        assert all(not c.choices[0].delta.content for c in chunks)
        (streamed,) = chunks[-1].choices[0].delta.tool_calls
        assert streamed.function.name == "get_weather" and streamed.function.arguments == want.text
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # "required": one call of any tool, its arguments that tool's
        either = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                              "arguments": t["function"]["parameters"]},
                             "required": ["name", "arguments"], "additionalProperties": False} for t in TOOLS]}
        want = json.loads(offline(aengine, [ids], greedy(60, json_schema=either))[0].text)
        out = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, tools=TOOLS,
                                          tool_choice="required")
        (call,) = out.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (want["name"], want["arguments"])
        jsonschema.validate(want["arguments"], {"get_weather": CITY, "set_units": UNITS}[want["name"]])
        # cut short by max_tokens: no call, the text as it stands
        out = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, tools=TOOLS,
                                          tool_choice="required")
        assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls is None
        assert out.choices[0].message.content.startswith("{")
        # tool_choice "none": the tools are in the prompt, the answer is free text
        want = offline(aengine, [ids], greedy(8))[0]
        out = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, tools=TOOLS,
                                          tool_choice="none")
        assert out.choices[0].message.content == want.text
        # a conversation holding an earlier call and its answer reaches the template whole
        history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        rendered = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [  # the arguments as an object
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                    history[-1]]
        ids = _tool_prompt(engine, rendered)
        assert "get_weather(Oslo)" in engine.tokenizer.decode(ids) and "tool: sunny" in engine.tokenizer.decode(ids)
        want = offline(aengine, [ids], greedy(8))[0]
        out = api.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, tools=TOOLS,
                                          tool_choice="none")
        assert out.choices[0].message.content == want.text


def _top_texts(tokenizer, out) -> list[dict[str, float]]:
    """The completions API's top_logprobs of an offline output: at each position the top
    tokens' texts (the likelier of two of one text) and the sampled token's."""
    tops = []
    for token, lp, alts in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        entry = {}
        for alt, alt_lp in alts:
            entry.setdefault(tokenizer.decode([alt]), alt_lp)
        entry.setdefault(tokenizer.decode([token]), lp)
        tops.append(entry)
    return tops


def test_top_logprobs_equal_the_offline_engine(engine, server, monkeypatch):
    url, aengine = server
    api = client(url)
    want = offline(aengine, [PROMPTS[5]], greedy(8, logprobs=5))[0]
    assert all(len(alts) == 5 for alts in want.top_logprobs)
    out = api.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=8, temperature=0, logprobs=5)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs)
    expected = _top_texts(engine.tokenizer, want)
    assert [sorted(t) for t in lp.top_logprobs] == [sorted(t) for t in expected]
    assert [t[k] for t in lp.top_logprobs for k in sorted(t)] == pytest.approx(
        [t[k] for t in expected for k in sorted(t)])
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=8, temperature=0, logprobs=5,
                                         stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.top_logprobs]
    assert [sorted(t) for t in streamed] == [sorted(t) for t in expected]
    for off in (False, None):  # (False == 0, yet it asks for none)
        body = httpx.post(f"{url}/v1/completions", json=_body("completions", {"logprobs": off})).json()
        assert body["choices"][0]["logprobs"] is None
    # chat: each token's most likely alternatives, most likely first
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    want = offline(aengine, [chat_ids(engine, MESSAGES)], greedy(6, logprobs=3))[0]
    out = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                      top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert [[a.token for a in c.top_logprobs] for c in content] == [
        [engine.tokenizer.decode([t]) for t, _ in alts] for alts in want.top_logprobs]
    assert [a.logprob for c in content for a in c.top_logprobs] == pytest.approx(
        [lp for alts in want.top_logprobs for _, lp in alts])
    assert content[0].top_logprobs[0].bytes == list(content[0].top_logprobs[0].token.encode())


def test_echo_scores_prompts_as_an_evaluation_harness_asks(engine, server):
    """lm-evaluation-harness scores a continuation with a batch of token-id prompts, echo,
    logprobs=1 and max_tokens 0 or 1: each prompt token's logprob, and whether it was the most
    likely one."""
    url, aengine = server
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS[8:10]]
    want = offline(aengine, prompts, greedy(1, logprobs=1, prompt_logprobs=1))
    for max_tokens in (0, 1):
        out = client(url).completions.create(model=MODEL, prompt=prompts, max_tokens=max_tokens, temperature=0,
                                             echo=True, logprobs=1)
        for choice, ids, w in zip(out.choices, prompts, want, strict=True):
            made = w.token_ids[:max_tokens]
            lp = choice.logprobs
            assert choice.text == engine.tokenizer.decode(ids) + engine.tokenizer.decode(made)
            assert lp.tokens == [engine.tokenizer.decode([t]) for t in ids + made]
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            # (within 1e-5: the server prefills each prompt in a batch of its own)
            assert lp.token_logprobs[1:] == pytest.approx(w.prompt_logprobs[1:] + w.logprobs[:max_tokens], abs=1e-5)
            for i, top in enumerate(lp.top_logprobs[1:len(ids)], start=1):
                (best, best_lp), actual = w.prompt_top_logprobs[i][0], lp.tokens[i]
                assert top[engine.tokenizer.decode([best])] == pytest.approx(best_lp, abs=1e-5)
                assert top[actual] == pytest.approx(w.prompt_logprobs[i], abs=1e-5)
            assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
        assert out.usage.completion_tokens == max_tokens * len(prompts)
    # echo without logprobs: the prompt's text before the completion's
    out = client(url).completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text == PROMPTS[8] + offline(aengine, [PROMPTS[8]], greedy(4))[0].text
    assert out.choices[0].logprobs is None


def test_penalties_min_p_and_logit_bias_equal_the_offline_engine(engine, server):
    url, aengine = server
    api = client(url)
    prompt = PROMPTS[3]
    plain = offline(aengine, [prompt], greedy(12))[0]
    # the greedy choice banned: the output must change, so the field cannot have been ignored
    banned = {plain.token_ids[0]: -100.0}
    want = offline(aengine, [prompt], greedy(12, logit_bias=banned))[0]
    assert want.token_ids[0] != plain.token_ids[0]
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                 logit_bias={str(t): b for t, b in banned.items()})
    assert out.choices[0].model_extra["phasegraph"]["token_ids"] == want.token_ids
    penalised = SamplingParams(max_new_tokens=24, temperature=0.7, seed=5, presence_penalty=0.6,
                               frequency_penalty=0.4, repetition_penalty=1.3, min_p=0.05)
    want = offline(aengine, [prompt], penalised)[0]
    out = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.7, seed=5,
                                 presence_penalty=0.6, frequency_penalty=0.4,
                                 extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    assert out.choices[0].model_extra["phasegraph"]["token_ids"] == want.token_ids
    unpenalised = offline(aengine, [prompt], SamplingParams(max_new_tokens=24, temperature=0.7, seed=5))[0]
    assert unpenalised.token_ids != want.token_ids


def test_n_choices_of_each_prompt_of_a_batch(engine, server, monkeypatch):
    url, aengine = server
    api = client(url)
    prompts = [PROMPTS[0], PROMPTS[1]]

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=10, temperature=0.9, seed=seed)

    # choice p * n + j: prompt p sampled with seed + j
    want = [offline(aengine, [p], sampled(11 + j))[0] for p in prompts for j in range(3)]
    assert len({w.text for w in want[:3]}) > 1  # the choices of one prompt differ
    out = api.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=10, temperature=0.9, seed=11)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [w.text for w in want]
    assert out.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want[::3])
    assert out.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    chunks = list(api.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=10, temperature=0.9, seed=11,
                                         stream=True, stream_options={"include_usage": True}))
    texts, reasons = [""] * 6, [None] * 6
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [w.text for w in want] and reasons == [w.finish_reason for w in want]
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert [e["token_ids"] for e in chunks[-1].model_extra["phasegraph"]["choices"]] == [w.token_ids for w in want]
    # chat: n choices of the one conversation
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    ids = chat_ids(engine, MESSAGES)
    want = [offline(aengine, [ids], sampled(4 + j))[0] for j in range(2)]
    out = api.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=10, temperature=0.9, seed=4)
    assert [c.message.content for c in out.choices] == [w.text for w in want]
    assert out.usage.prompt_tokens == len(ids)


BAD_BODIES = [
    # (path, body, param the error names, words in its message)
    ("completions", {"n": 0}, "n", "greater than or equal to 1"),
    ("completions", {"n": 65}, "n", "more than the server's queue holds (64)"),
    ("completions", {"prompt": ["a"] * 33, "n": 2}, "prompt", "66 choices"),
    ("completions", {"temperature": -1}, "temperature", "greater than or equal to 0"),
    ("completions", {"temperature": "hot"}, "temperature", "number"),
    ("completions", {"max_tokens": 0}, "max_tokens", "with echo only"),
    ("completions", {"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ("chat/completions", {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("completions", {"max_tokens": True}, "max_tokens", "integer"),
    ("completions", {"top_p": 0}, "top_p", "greater than 0"),
    ("completions", {"frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
    ("completions", {"prompt": []}, "prompt", "empty"),
    ("completions", {"prompt": [[5, 6], []]}, "prompt", "the prompt 1 is empty"),
    ("completions", {"prompt": [[5, 6], [1, 999999]]}, None, "outside the vocabulary"),
    ("completions", {"prompt": [1, 999999]}, None, "outside the vocabulary"),
    ("completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("completions", {"logprobs": -1}, "logprobs", "[0, 20]"),
    ("completions", {"echo": True, "stream": True}, "echo", "without streaming"),
    ("completions", {"stop": [""]}, None, "stop"),
    ("completions", {"presence_penalty": 2.5}, None, "presence_penalty must be in [-2, 2]"),
    ("completions", {"frequency_penalty": "high"}, "frequency_penalty", "number"),
    ("completions", {"repetition_penalty": 0}, None, "repetition_penalty must be > 0"),
    ("completions", {"min_p": 1.5}, None, "min_p must be in [0, 1]"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("completions", {"logit_bias": {"1": 1, "01": 2}}, "logit_bias", "named twice"),
    ("completions", {"logit_bias": {"999999": 1}}, None, "outside the vocabulary"),
    ("completions", {"logit_bias": {"5": 101}}, None, "[-100, 100]"),
    ("completions", {"seed": 2**70}, None, "seed"),
    ("completions", {"model": None}, "model", "string"),
    ("chat/completions", {"messages": []}, "messages", "at least 1"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}},
     "response_format", "does not compile"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format", "json_schema.schema"),
    ("completions", {"regex": "a(b"}, "regex", "does not compile"),
    ("completions", {"grammar": "root ::= foo"}, "grammar", "does not compile"),
    ("chat/completions", {"regex": "a", "response_format": {"type": "json_object"}}, "regex", "at most one"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("chat/completions", {"n": 65}, "n", "more than the server's queue holds"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "'auto'"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "no tool is named 'g'"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice", "no tools"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}] * 2, "tool_choice": "required"},
     "tools", "two tools have one name"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, "response_format", "forced tool call"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                          "tool_choice": "required"}, "tools", "does not compile"),
]


def _body(path: str, change: dict) -> dict:
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    base.update({"prompt": PROMPTS[0]} if path == "completions" else {"messages": MESSAGES})
    base.update(change)
    return base


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(("path", "change", "param", "words"), BAD_BODIES,
                         ids=[f"{p}-{next(iter(c))}" for p, c, _, _ in BAD_BODIES])
def test_a_bad_request_is_an_openai_error_400(server, path, change, param, words):
    url, _ = server
    error = _assert_openai_error(httpx.post(f"{url}/v1/{path}", json=_body(path, change)), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"]


def test_other_errors_are_openai_errors_too(server):
    url, aengine = server
    api = client(url)
    with pytest.raises(openai.BadRequestError) as err:  # through the official client
        api.completions.create(model=MODEL, prompt="x", max_tokens=4, n=0)
    assert err.value.status_code == 400 and err.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as err:
        api.completions.create(model="gpt-4", prompt="x", max_tokens=4)
    assert err.value.body["code"] == "model_not_found"
    error = _assert_openai_error(httpx.post(f"{url}/v1/completions", content=b"{not json",
                                            headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in error["message"]
    _assert_openai_error(httpx.post(f"{url}/v1/completions", json=[1, 2]), 400)
    _assert_openai_error(httpx.get(f"{url}/v1/nothing-here"), 404)
    _assert_openai_error(httpx.get(f"{url}/v1/completions"), 405)
    # none of it reached the engine, and the server still serves
    assert aengine.stats().queued == 0
    assert api.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens


def test_a_pool_smaller_than_the_context_bounds_the_default_budget(monkeypatch):
    """A chat request without max_tokens may run to the context; where the KV pool holds less,
    the server offers (and defaults to) what the pool holds, instead of refusing the request."""
    engine = demo_engine(kv_pool_tokens=256)
    assert engine.longest_request < engine.max_context == 1024
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    with serving(engine) as (url, _):
        api = client(url)
        assert api.models.list().data[0].model_extra["max_model_len"] == engine.longest_request
        out = api.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
        assert out.usage.total_tokens == engine.longest_request


def test_models_health_and_metrics(engine, server):
    url, _ = server
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    client(url).completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=6, temperature=0)
    list(client(url).completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=6, temperature=0, stream=True))
    text = httpx.get(f"{url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["phasegraph_generation_tokens_total"] >= 12
    assert values["phasegraph_prompt_tokens_total"] > 0
    assert values["phasegraph_accept_length_count"] > 0
    assert values['phasegraph_accept_length_bucket{le="+Inf"}'] == values["phasegraph_accept_length_count"]
    assert values['phasegraph_phase_seconds_total{phase="verify"}'] > 0
    assert values['phasegraph_phase_runs_total{phase="verify"}'] > 0
    assert values["phasegraph_engine_step_seconds_total"] > 0 and values["phasegraph_serving_seconds_total"] > 0
    assert values["phasegraph_kv_pages_total"] == engine.kv.allocator.total
    assert values["phasegraph_kv_pages_used"] == 0  # everything finished
    assert values['phasegraph_queue_depth{state="waiting"}'] == 0
    assert values["phasegraph_queue_capacity"] == 64
    assert values["phasegraph_time_to_first_token_seconds_count"] >= 2
    assert values["phasegraph_inter_token_latency_seconds_count"] >= 1
    assert values['phasegraph_requests_finished_total{finish_reason="length"}'] >= 2
    # this engine runs without a prefix cache: every prefill token was computed
    assert values["phasegraph_prefill_tokens_total"] >= values["phasegraph_prompt_tokens_total"]
    assert values["phasegraph_prefix_cache_hit_tokens_total"] == 0
    assert values["phasegraph_prefix_cache_hit_rate"] == 0 and values["phasegraph_kv_pages_cached"] == 0


def _metric_values(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics_report_the_prefix_cache_hit_rate():
    engine = demo_engine(prefix_cache=True)
    system = "".join(f"def helper_{i}(x):\n    return x + {i}\n\n" for i in range(8))
    with serving(engine) as (url, _):
        api = client(url)
        outs = [api.completions.create(model=MODEL, prompt=system + tail, max_tokens=4, temperature=0)
                for tail in ("def a(", "class B:", "import os")]
        values = _metric_values(url)
    prompt = sum(o.usage.prompt_tokens for o in outs)
    shared = len(engine.tokenizer(system)["input_ids"]) - 1  # the second and third read it
    assert values["phasegraph_prefill_tokens_total"] == prompt
    assert values["phasegraph_prefix_cache_hit_tokens_total"] >= 2 * shared - 2
    assert values["phasegraph_prefix_cache_hit_rate"] == pytest.approx(
        values["phasegraph_prefix_cache_hit_tokens_total"] / prompt)
    assert values["phasegraph_kv_pages_cached"] == engine.cached_pages > 0
    assert [o.usage.prompt_tokens_details.cached_tokens for o in outs][0] == 0
    assert sum(o.usage.prompt_tokens_details.cached_tokens for o in outs) == values["phasegraph_prefix_cache_hit_tokens_total"]
    assert_all_free(engine)


def test_over_capacity_is_429_or_waits(engine):
    want = engine.generate([PROMPTS[7]], greedy(6))[0]
    long = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}
    for on_full in ("429", "wait"):
        with serving(engine, max_queue=2, on_full=on_full) as (url, aengine):
            api = client(url)
            busy = [api.completions.create(model=MODEL, prompt=p, stream=True, **long) for p in PROMPTS[:2]]
            for stream in busy:
                next(iter(stream))  # both are in the engine now
            if on_full == "429":
                with pytest.raises(openai.RateLimitError) as err:
                    api.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=6, temperature=0)
                assert err.value.status_code == 429 and err.value.body["code"] == "queue_full"
                assert err.value.response.headers["retry-after"] == "1"
                assert aengine.stats().rejected == 1
                busy[0].close()
                _wait_until(lambda: aengine.stats().queued == 1)
            else:
                # a client that leaves while its request waits for room: the request is dropped
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(f"{url}/v1/completions", json=_body("completions", {}), timeout=0.5)
                result = {}

                def wait_for_room(api=api, result=result):
                    result["out"] = api.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=6,
                                                           temperature=0)

                waiter = threading.Thread(target=wait_for_room)
                waiter.start()
                time.sleep(0.3)
                assert "out" not in result and aengine.stats().queued == 2  # it waits for room
                busy[0].close()  # the client leaves: its slot goes to the waiting request
                waiter.join(60)
                assert aengine.stats().rejected == 0
            out = api.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=6, temperature=0)
            assert out.choices[0].text == want.text
            if on_full == "wait":
                assert result["out"].choices[0].text == want.text
            busy[1].close()
            _wait_until(lambda: aengine.stats().queued == 0)
            # the busy two aborted by their clients; the refused and the dropped requests never ran
            assert aengine.stats().finished == {"abort": 2, "length": 2 if on_full == "wait" else 1}


def test_a_request_failing_mid_run_is_a_500_with_the_reason(engine, monkeypatch):
    long = PROMPTS[4] * 6
    at = len(engine.tokenizer(long)["input_ids"]) + 3
    want = engine.generate([PROMPTS[0]], greedy(6))[0]
    poison_target(monkeypatch, engine, at)
    with serving(engine) as (url, _):
        response = httpx.post(f"{url}/v1/completions", json=_body("completions", {"prompt": long, "max_tokens": 8}))
        error = _assert_openai_error(response, 500)
        assert error["type"] == "server_error" and error["code"] == "request_failed"
        assert "not finite" in error["message"]
        api = client(url)
        with pytest.raises(openai.APIError, match="not finite"):
            list(api.completions.create(model=MODEL, prompt=long, max_tokens=8, temperature=0, stream=True))
        # one failing choice fails the whole response, and its sibling is aborted
        response = httpx.post(f"{url}/v1/completions", json=_body("completions", {"prompt": [PROMPTS[0], long],
                                                                                  "max_tokens": 8}))
        assert _assert_openai_error(response, 500)["code"] == "request_failed"
        with pytest.raises(openai.APIError, match="not finite"):
            list(api.completions.create(model=MODEL, prompt=[long, PROMPTS[0]], max_tokens=8, temperature=0,
                                        stream=True))
        # the other requests go on
        assert api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0).choices[0].text == want.text


def test_a_client_that_leaves_aborts_its_request(engine):
    with serving(engine) as (url, aengine):
        long = _body("completions", {"max_tokens": 400, "ignore_eos": True})
        # streaming: the client reads two chunks and hangs up
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        _wait_until(lambda: aengine.stats().queued == 0)
        # not streaming: the client gives up waiting for the whole response
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=long, timeout=0.5)
        _wait_until(lambda: aengine.stats().queued == 0)
        # several choices, streamed: every one of them ends when the client leaves
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True, "n": 3}) as response:
            assert next(response.iter_lines()).startswith("data: ")
        _wait_until(lambda: aengine.stats().queued == 0)
        stats = aengine.stats()
        assert stats.finished == {"abort": 5} and stats.generated_tokens < 5 * 400


def test_an_api_key_guards_every_v1_route_only(engine):
    want = engine.generate([PROMPTS[0]], greedy(4))[0]
    with serving(engine, api_key="s3cret") as (url, aengine):
        for key in ("unused", "s3cret-not", None):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            for method, path, body in (("GET", "models", None), ("POST", "completions", _body("completions", {})),
                                       ("POST", "chat/completions", _body("chat/completions", {})),
                                       ("POST", "completions", {"temperature": "hot"})):  # not even validated
                error = _assert_openai_error(httpx.request(method, f"{url}/v1/{path}", json=body, headers=headers),
                                             401)
                assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
        with pytest.raises(openai.AuthenticationError):
            client(url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert aengine.stats().finished == {}  # nothing reached the engine
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        out = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert out.choices[0].text == want.text


def test_create_app_refuses_bad_settings(engine):
    aengine = AsyncEngine(engine)
    try:
        with pytest.raises(InvalidConfig, match="on_full"):
            create_app(aengine, on_full="drop")
        with pytest.raises(InvalidConfig, match="model_name"):
            create_app(aengine, model_name="")
        with pytest.raises(InvalidConfig, match="AsyncEngine"):
            create_app(engine)
        for key in ("", " key", 7):
            with pytest.raises(InvalidConfig, match="api_key"):
                create_app(aengine, api_key=key)
    finally:
        aengine.close()


def test_health_is_503_once_the_engine_is_closed(engine):
    aengine = AsyncEngine(engine)
    with running_server(create_app(aengine, model_name=MODEL)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        aengine.close()
        error = _assert_openai_error(httpx.get(f"{url}/health"), 503)
        assert error["code"] == "engine_closed"
        error = _assert_openai_error(httpx.post(f"{url}/v1/completions", json=_body("completions", {})), 503)
        assert error["code"] == "engine_closed"


def test_a_process_engine_serves_the_client_and_its_death_fails_every_request(engine):
    want = engine.generate(PROMPTS[:2], greedy(16))
    aengine = ProcessEngine(functools.partial(demo_engine), max_queue=8)
    try:
        with running_server(create_app(aengine, model_name=MODEL)) as url:
            api = client(url)
            whole = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
            assert whole.choices[0].text == want[0].text
            assert whole.choices[0].model_extra["phasegraph"]["token_ids"] == want[0].token_ids
            chunks = list(api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                                 stream=True))
            assert [t for c in chunks for t in c.model_extra["phasegraph"]["token_ids"]] == want[1].token_ids
            assert "".join(c.choices[0].text for c in chunks) == want[1].text
            assert "phasegraph_accept_length_bucket" in httpx.get(f"{url}/metrics").text

            async def kill_mid_request() -> float:
                stream = await aengine.add_request(PROMPTS[2], greedy(400, ignore_eos=True))
                async for delta in stream:
                    if delta.new_token_ids:
                        break
                waiting = asyncio.create_task(aengine.generate(PROMPTS[3], greedy(400, ignore_eos=True)))
                assert (await aengine.call(kv_state))[2]  # both are in the engine
                os.kill(aengine.pid, signal.SIGKILL)
                killed = time.monotonic()
                with pytest.raises(EngineDied, match="SIGKILL"):
                    async for _ in stream:
                        pass
                with pytest.raises(EngineDied):
                    await waiting
                waited = time.monotonic() - killed
                with pytest.raises(EngineDied):
                    await aengine.add_request(PROMPTS[4], greedy(4))
                with pytest.raises(EngineDied):
                    await aengine.call(kv_state)
                return waited

            assert asyncio.run(asyncio.wait_for(kill_mid_request(), 30)) < 5
            error = _assert_openai_error(httpx.get(f"{url}/health"), 503)
            assert error["code"] == "engine_closed" and "EngineDied" in error["message"]
            error = _assert_openai_error(httpx.post(f"{url}/v1/completions", json=_body("completions", {})), 503)
            assert "ended unexpectedly" in error["message"]
    finally:
        aengine.close()
    assert aengine.pid not in [p.pid for p in multiprocessing.active_children()]


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
