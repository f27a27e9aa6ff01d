"""Shared pieces of the serving tests: the demo engine, a real uvicorn server on a free port of
127.0.0.1, offline references, and a target whose logits turn NaN past a position."""

from __future__ import annotations

import asyncio

from phasegraph.demo import DEMO_CHAIN, demo_pair_dir
from phasegraph.phases.protocols import TargetOutput
from phasegraph.runtime.config import SamplingParams, SpecConfig
from phasegraph.runtime.engine import Engine
from phasegraph.serving.app import serve_in_thread

# short code prompts the demo pair (trained on the Python standard library) continues sensibly
PROMPTS = [
    "def fib(n):", "class Stack:", "import os\n", "for i in range(10):", "def __init__(self, name):",
    "    return self.", "with open(path) as f:", "if __name__ == '__main__':", "try:\n    import",
    "def read(self, size=-1):", "class Error(Exception):", "    def close(self):", "x = [",
    "def _check(value):", "    raise ValueError(", "from collections import",
]
# a small chat template (the demo tokenizer ships none), used as the tokenizer's or the server's
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}def answer():\n{% endif %}"
)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_tokens, temperature=0.0, **kw)


def demo_engine(**options) -> Engine:
    pair = demo_pair_dir()
    options.setdefault("kv_pool_tokens", 8192)
    return Engine.from_pretrained(pair / "target", pair / "eagle3", spec=SpecConfig(**DEMO_CHAIN), device="cpu",
                                  dtype="float32", trace=False, **options)


def offline(aengine, prompts, params) -> list:
    """``engine.generate(prompts, params)`` on the AsyncEngine's own thread: the engine is not
    thread-safe, and that thread may still be in its loop after the last response went out, where
    it would step the requests a generate on the test's thread had just added."""
    return asyncio.run(aengine.call(lambda engine: engine.generate(prompts, params)))


def assert_all_free(engine: Engine) -> None:
    """No request left and every KV page and page-table row back (call with the engine idle:
    its AsyncEngine closed, or through ``AsyncEngine.call``)."""
    engine.check()
    assert not engine.has_unfinished()
    assert engine.kv.num_free_pages == engine.kv.allocator.total, "KV pages leaked"
    assert engine.kv.table.rows_in_use() == [], "page-table rows leaked"


def kv_state(engine: Engine) -> tuple[int, int, bool]:
    """Free KV pages, all pages, and whether a request is left (a module-level function, so
    that ``ProcessEngine.call`` can send it to the engine process)."""
    engine.check()
    return engine.kv.num_free_pages, engine.kv.allocator.total, engine.has_unfinished()


def chat_ids(engine: Engine, messages: list[dict], template: str = CHAT_TEMPLATE) -> list[int]:
    """The prompt a chat request becomes: the template's text, encoded without special tokens."""
    text = engine.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                add_generation_prompt=True)
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def running_server(app, timeout_s: float = 30.0):
    """``app`` served on a free port of 127.0.0.1; yields its base URL."""
    return serve_in_thread(app, timeout_s)


def poison_target(monkeypatch, engine: Engine, at: int) -> None:
    """The target's logits are NaN at every position >= ``at`` (an overflowing model), so a
    request that gets there fails with finish reason "error"."""
    real = engine.target.forward

    def forward(input_ids, positions, attn, logits_index=None) -> TargetOutput:
        out = real(input_ids, positions, attn, logits_index)
        rows = positions if logits_index is None else positions[logits_index]
        return TargetOutput(logits=out.logits.masked_fill((rows >= at)[:, None], float("nan")),
                            features=out.features)

    monkeypatch.setattr(engine.target, "forward", forward)
