"""Load: 64 concurrent streaming clients × 4 requests each against the real server, some
hanging up mid-stream, bounded in count and time.

Every stream that completes equals an offline ``Engine.generate`` of the same request
(greedy): the same text and the same tokens, none lost or duplicated; a stream cut short is a
prefix of it. Afterwards every request has left the engine and its KV pool is whole. The
client-side p50/p99 time to first token and inter-token latency (between chunks; a chunk holds
every token of one engine step) are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import openai

from phasegraph.serving import AsyncEngine, create_app
from tests.serving.support import PROMPTS, greedy, running_server

CLIENTS, REQUESTS_EACH = 64, 4
MAX_TOKENS = (8, 12, 16)
HANG_UP = 0.2  # share of requests whose client leaves after its first chunk or two
DEADLINE_S = 240  # the whole run; CI's 2 cores take a fraction of it


def test_concurrent_streaming_clients_with_disconnects(engine):
    cases = [(p, n) for p in range(len(PROMPTS)) for n in MAX_TOKENS]
    outputs = engine.generate([PROMPTS[p] for p, _ in cases], [greedy(n) for _, n in cases])
    want = {case: out for case, out in zip(cases, outputs, strict=True)}
    rng = random.Random(62)
    plans = [[(rng.randrange(len(PROMPTS)), rng.choice(MAX_TOKENS),
               rng.choice((1, 2)) if rng.random() < HANG_UP else None)
              for _ in range(REQUESTS_EACH)] for _ in range(CLIENTS)]

    # room for every client twice over: a request whose client hung up holds its place until
    # the server has noticed, while that client may already send its next one
    aengine = AsyncEngine(engine, max_queue=2 * CLIENTS)
    try:
        with running_server(create_app(aengine, model_name="demo")) as url:
            results, wall, leftover = asyncio.run(_drive(url, plans, aengine))
    finally:
        aengine.close()

    completed = [r for r in results if r["hang_up"] is None]
    cut = [r for r in results if r["hang_up"] is not None]
    assert len(results) == CLIENTS * REQUESTS_EACH and completed and cut
    for r in completed:
        ref = want[r["case"]]
        assert r["tokens"] == ref.token_ids, f"tokens lost or duplicated in {r['case']}"
        assert r["text"] == ref.text
        assert r["finish_reason"] == ref.finish_reason
        assert r["usage"].completion_tokens == len(ref.token_ids)
        assert r["usage"].prompt_tokens == len(ref.prompt_token_ids)
    for r in cut:
        ref = want[r["case"]]
        assert r["tokens"] == ref.token_ids[: len(r["tokens"])]
    free, total, unfinished, rows = leftover
    assert free == total, "KV pages leaked"
    assert not unfinished and rows == []
    stats = aengine.stats()
    assert stats.queued == 0 and stats.rejected == 0
    assert sum(stats.finished.values()) == CLIENTS * REQUESTS_EACH
    assert stats.finished.get("length", 0) + stats.finished.get("stop", 0) >= len(completed)

    ttft = np.array([r["ttft"] for r in results if r["ttft"] is not None]) * 1e3
    itl = np.array([gap for r in completed for gap in r["gaps"]]) * 1e3
    tokens = sum(len(r["tokens"]) for r in results)
    busy = sum(stats.phase_seconds.values()) / wall  # the engine's share of the run: the rest is HTTP and clients
    print(f"\nserving load on the CPU (demo pair, eagle3 chain): {CLIENTS} clients x {REQUESTS_EACH} streaming "
          f"requests, {len(completed)} completed, {len(cut)} cut short by their client, {wall:.1f} s, "
          f"{tokens / wall:.0f} tokens/s received, engine busy {busy:.0%} of the time\n"
          f"  time to first token: p50 {np.percentile(ttft, 50):.0f} ms, p99 {np.percentile(ttft, 99):.0f} ms\n"
          f"  inter-token latency (between chunks): p50 {np.percentile(itl, 50):.0f} ms, "
          f"p99 {np.percentile(itl, 99):.0f} ms")


async def _drive(url: str, plans, aengine: AsyncEngine):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    start = time.perf_counter()
    runs = [_client(client, plan) for plan in plans]
    per_client = await asyncio.wait_for(asyncio.gather(*runs), DEADLINE_S)
    wall = time.perf_counter() - start
    await client.close()
    # the server aborts a request whose client left as soon as it notices: give it that moment
    deadline = time.monotonic() + 30
    while aengine.stats().queued and time.monotonic() < deadline:
        await asyncio.sleep(0.01)

    def leftover(engine):
        engine.check()
        return engine.kv.num_free_pages, engine.kv.allocator.total, engine.has_unfinished(), engine.kv.table.rows_in_use()

    return [r for results in per_client for r in results], wall, await aengine.call(leftover)


async def _client(client: openai.AsyncOpenAI, plan) -> list[dict]:
    """One client's requests, one after the other."""
    results = []
    for prompt, max_tokens, hang_up in plan:
        sent = time.perf_counter()
        stream = await client.completions.create(
            model="demo", prompt=PROMPTS[prompt], max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        r = {"case": (prompt, max_tokens), "hang_up": hang_up, "text": "", "tokens": [], "gaps": [],
             "ttft": None, "usage": None, "finish_reason": None}
        last, chunks = None, 0
        async for chunk in stream:
            if not chunk.choices:
                r["usage"] = chunk.usage
                continue
            now = time.perf_counter()
            new = chunk.model_extra["phasegraph"]["token_ids"]
            if new:
                if last is None:
                    r["ttft"] = now - sent
                else:
                    r["gaps"].append(now - last)
                last = now
            r["text"] += chunk.choices[0].text
            r["tokens"] += new
            r["finish_reason"] = chunk.choices[0].finish_reason or r["finish_reason"]
            chunks += 1
            if hang_up is not None and chunks >= hang_up:
                await stream.close()
                break
        results.append(r)
    return results
