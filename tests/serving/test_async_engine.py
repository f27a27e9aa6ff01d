"""AsyncEngine over the demo pair: streams equal the offline Engine's outputs; a cancelled
consumer frees its KV at once; the bounded queue refuses (QueueFull) or waits; close() aborts
what is pending and joins the thread; bad input and a failing request harm no other request; a
crashed step loop reaches every consumer. ProcessEngine, the same over an engine process: its
streams equal the offline Engine's, a cancelled consumer frees its KV there, the bounded queue
works here, close() leaves no process; a checkpoint that fails to load raises its own error."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing

import pytest

import phasegraph
from phasegraph.runtime.engine import Engine
from phasegraph.runtime.errors import (
    CheckpointFileError,
    InvalidConfig,
    InvalidRequest,
    PhasegraphRuntimeError,
    RequestFailed,
)
from phasegraph.serving import AsyncEngine, EngineClosed, ProcessEngine, QueueFull
from phasegraph.serving.errors import EngineDied
from tests.serving.support import (
    PROMPTS,
    assert_all_free,
    demo_engine,
    greedy,
    kv_state,
    poison_target,
)

LONG = greedy(400, ignore_eos=True)  # runs for many steps: a request still running when looked at


def _free(engine) -> tuple[int, int, bool]:
    engine.check()
    return engine.kv.num_free_pages, engine.kv.allocator.total, engine.has_unfinished()


async def _consuming_mid_stream(aengine, prompt) -> asyncio.Task:
    """A task consuming ``prompt``'s stream (LONG), returned once its first token has arrived."""
    started = asyncio.Event()

    async def consume():
        async for delta in aengine.stream(prompt, LONG):
            if delta.new_token_ids:
                started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    return task


async def _first_delta(stream):
    async for delta in stream:
        if delta.new_token_ids:
            return delta
    raise AssertionError("the stream ended before its first token")


def test_streams_and_generate_equal_the_offline_engine(idle_engine):
    engine = idle_engine
    prompts = PROMPTS[:3]
    want = engine.generate(prompts, greedy(12))

    async def consume(aengine, prompt):
        text, tokens, deltas = "", [], []
        async for delta in aengine.stream(prompt, greedy(12)):
            text += delta.new_text
            tokens += delta.new_token_ids
            deltas.append(delta)
        return text, tokens, deltas

    async def main():
        async with AsyncEngine(engine) as aengine:
            streamed = await asyncio.gather(*(consume(aengine, p) for p in prompts))
            whole = await aengine.generate(prompts[0], greedy(12))
            return streamed, whole, aengine.stats()

    streamed, whole, stats = asyncio.run(main())
    for (text, tokens, deltas), ref in zip(streamed, want, strict=True):
        assert text == ref.text and tokens == ref.token_ids
        last = deltas[-1]
        assert last.finish_reason == ref.finish_reason and last.output.token_ids == ref.token_ids
        assert [n for d in deltas for n in d.accept_lengths] == ref.stats.accept_lengths
    assert whole.token_ids == want[0].token_ids and whole.text == want[0].text
    assert phasegraph.AsyncEngine is AsyncEngine  # the lazy top-level name
    assert stats.queued == 0 and stats.kv_free_pages == stats.kv_total_pages
    assert stats.generated_tokens == sum(len(r.token_ids) for r in want) + len(want[0].token_ids)
    assert stats.finished == {r.finish_reason: 4 for r in want[:1]}
    assert sum(stats.accept_lengths.values()) == sum(len(r.stats.accept_lengths) for r in want) + len(
        want[0].stats.accept_lengths)
    assert {"prefill-extend", "draft", "verify", "draft-extend"} <= set(stats.phase_seconds)


def test_one_hand_over_per_iteration_not_per_token(idle_engine, monkeypatch):
    """The engine thread wakes a consumer's loop once a step with every token of that step's
    iteration (several under speculation): the layers' cost is per iteration, never per token."""
    from phasegraph.serving import async_engine

    engine = idle_engine
    want = engine.generate([PROMPTS[0]], greedy(24, ignore_eos=True))[0]
    handed = []
    real = async_engine._deliver
    monkeypatch.setattr(async_engine, "_deliver", lambda items: (handed.append(len(items)), real(items)))

    async def main():
        async with AsyncEngine(engine) as aengine:
            deltas = [d async for d in aengine.stream(PROMPTS[0], greedy(24, ignore_eos=True))]
        return deltas, aengine.stats()  # closed: the thread's last step is counted

    deltas, stats = asyncio.run(main())
    tokens = [t for d in deltas for t in d.new_token_ids]
    assert tokens == want.token_ids
    with_tokens = [d for d in deltas if d.new_token_ids]
    # one delta per step, each with one iteration's accepted tokens (the first also the prefill's)
    assert [d.accept_lengths for d in with_tokens] == [(n,) for n in want.stats.accept_lengths]
    assert [len(d.new_token_ids) for d in with_tokens[1:]] == want.stats.accept_lengths[1:]
    assert len(with_tokens) < len(tokens)
    assert handed == [1] * len(deltas) and stats.deliveries == len(deltas) <= stats.steps
    assert stats.step_seconds > 0 and stats.serving_seconds > 0


def test_a_cancelled_consumer_frees_its_kv_at_once(idle_engine):
    engine = idle_engine

    async def main():
        async with AsyncEngine(engine) as aengine:
            # a consuming task cancelled mid-stream
            task = await _consuming_mid_stream(aengine, PROMPTS[0])
            used = await aengine.call(lambda e: e.kv.allocator.total - e.kv.num_free_pages)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # the abort was sent before this call: the engine thread ran it first
            after_cancel = await aengine.call(_free)
            # a consumer that leaves its loop early and closes the stream
            async with contextlib.aclosing(aengine.stream(PROMPTS[1], LONG)) as stream:
                async for _ in stream:
                    break
            after_break = await aengine.call(_free)
            # RequestStream.aclose() returns once the engine has let the request go
            handle = await aengine.add_request(PROMPTS[2], LONG)
            await _first_delta(handle)
            await handle.aclose()
            after_aclose = await aengine.call(_free)
            return used, after_cancel, after_break, after_aclose, handle, aengine.stats()

    used, after_cancel, after_break, after_aclose, handle, stats = asyncio.run(main())
    assert used > 0
    for free, total, unfinished in (after_cancel, after_break, after_aclose):
        assert free == total and not unfinished
    assert handle.output.finish_reason == "abort" and 0 < len(handle.output.token_ids) < 400
    assert stats.finished == {"abort": 3} and stats.queued == 0
    assert stats.generated_tokens < 3 * 400


def test_the_bounded_queue_refuses_or_waits(idle_engine):
    engine = idle_engine
    want = engine.generate([PROMPTS[3]], greedy(8))[0]

    async def main():
        async with AsyncEngine(engine, max_queue=2) as aengine:
            a = await aengine.add_request(PROMPTS[0], LONG)
            b = await aengine.add_request(PROMPTS[1], LONG)
            with pytest.raises(QueueFull) as full:
                await aengine.add_request(PROMPTS[3], greedy(8))
            assert isinstance(full.value, PhasegraphRuntimeError) and full.value.max_queue == 2
            # a caller that waits for room, and one that gives up waiting (no slot may leak)
            waiting = asyncio.create_task(aengine.generate(PROMPTS[3], greedy(8), wait=True))
            quitter = asyncio.create_task(aengine.generate(PROMPTS[4], greedy(8), wait=True))
            await asyncio.sleep(0.2)
            assert not waiting.done() and aengine.stats().queued == 2
            quitter.cancel()
            await a.aclose()  # its slot goes to the first caller still waiting
            out = await waiting
            await b.aclose()
            with pytest.raises(asyncio.CancelledError):
                await quitter
            return out, aengine.stats()

    out, stats = asyncio.run(main())
    assert out.token_ids == want.token_ids
    assert stats.rejected == 1 and stats.queued == 0
    assert stats.finished == {"abort": 2, "length": 1}


def test_close_aborts_what_is_pending_and_joins_the_thread(idle_engine):
    engine = idle_engine

    async def main():
        aengine = AsyncEngine(engine, max_queue=3)
        streams = [await aengine.add_request(p, LONG) for p in PROMPTS[:2]]
        whole = asyncio.create_task(aengine.generate(PROMPTS[2], LONG))
        waiter = asyncio.create_task(aengine.generate(PROMPTS[3], LONG, wait=True))
        await _first_delta(streams[0])
        await asyncio.sleep(0.05)
        await aengine.aclose()
        ends = []
        for stream in streams:
            async for delta in stream:
                ends.append(delta.finish_reason)
        with pytest.raises(EngineClosed):
            await whole
        with pytest.raises(EngineClosed):
            await waiter
        with pytest.raises(EngineClosed):
            await aengine.add_request(PROMPTS[0])
        aengine.close()  # idempotent
        return aengine, [s.output.finish_reason for s in streams], ends

    aengine, reasons, ends = asyncio.run(main())
    assert reasons == ["abort", "abort"] and ends[-1] == "abort"
    assert not aengine.is_running and not aengine._thread.is_alive()
    assert aengine.stats().finished == {"abort": 3}
    assert_all_free(engine)


def test_bad_input_is_raised_to_its_caller_and_harms_no_other_request(idle_engine):
    engine = idle_engine
    want = engine.generate([PROMPTS[5]], greedy(16))[0]
    vocab = engine.target.vocab_size
    bad = [
        ("", None, "empty"),
        ([], None, "empty"),
        ([1, vocab + 5], None, "outside the vocabulary"),
        (PROMPTS[0], "not params", "SamplingParams"),
        (3.5, None, "a string or a list of token ids"),
        ([1] * (engine.max_context + 1), None, "context"),
    ]

    async def main():
        async with AsyncEngine(engine, max_queue=2) as aengine:
            stream = await aengine.add_request(PROMPTS[5], greedy(16), request_id="good")
            with pytest.raises(InvalidRequest, match="already in use"):
                await aengine.generate(PROMPTS[0], request_id="good")
            errors = []
            for prompt, params, _ in bad:
                with pytest.raises(InvalidRequest) as err:
                    async for _ in aengine.stream(prompt, params):
                        pass
                errors.append(str(err.value))
            with pytest.raises(InvalidRequest, match="request id"):
                await aengine.generate(PROMPTS[0], request_id=7)
            tokens = [t async for d in stream for t in d.new_token_ids]
            return errors, tokens, aengine.stats()

    errors, tokens, stats = asyncio.run(main())
    for message, (_, _, words) in zip(errors, bad, strict=True):
        assert words in message
    assert tokens == want.token_ids
    assert stats.queued == 0 and stats.finished == {"length": 1}  # refused requests held no slot
    with pytest.raises(InvalidConfig):
        AsyncEngine(engine, max_queue=0)
    with pytest.raises(InvalidConfig):
        AsyncEngine("no engine")


def test_a_request_failing_mid_run_reaches_its_consumer_and_no_other(idle_engine, monkeypatch):
    engine = idle_engine
    short = engine.tokenizer(PROMPTS[0])["input_ids"]
    long = engine.tokenizer(PROMPTS[4] * 6)["input_ids"]
    clean, clean_long = engine.generate([short, long], greedy(8))
    poison_target(monkeypatch, engine, at=len(long) + 3)  # only the long prompt's request gets there

    async def main():
        async with AsyncEngine(engine) as aengine:
            good = asyncio.create_task(aengine.generate(short, greedy(8)))
            deltas = [d async for d in aengine.stream(long, greedy(8))]
            with pytest.raises(RequestFailed) as failed:
                await aengine.generate(long, greedy(8))
            return deltas, await good, failed.value

    deltas, good, failed = asyncio.run(main())
    last = deltas[-1]
    assert last.finish_reason == "error" and "not finite" in last.error
    # the logits at positions len(long) .. len(long) + 2 were clean: they chose 4 tokens
    assert last.output.error == last.error and last.output.token_ids == clean_long.token_ids[:4]
    assert failed.outputs[0].finish_reason == "error"
    assert good.token_ids == clean.token_ids


def test_a_crashed_step_loop_reaches_every_consumer(idle_engine, monkeypatch):
    engine = idle_engine

    def broken_step():
        raise RuntimeError("injected step failure")

    async def main():
        aengine = AsyncEngine(engine)
        monkeypatch.setattr(engine, "step", broken_step)
        with pytest.raises(EngineClosed) as err:
            await aengine.generate(PROMPTS[0], greedy(4), request_id="crash")
        with pytest.raises(EngineClosed):
            await aengine.add_request(PROMPTS[0])
        return aengine, err.value

    aengine, error = asyncio.run(main())
    assert isinstance(error.__cause__, RuntimeError) and "injected" in str(error)
    assert not aengine.is_running and isinstance(aengine.failure, RuntimeError)
    aengine.close()  # after a crash too
    monkeypatch.undo()
    engine.abort("crash")  # the request the crashed loop left in the engine
    engine.step()


def test_the_process_engine_streams_like_the_offline_engine_and_frees_what_is_cancelled(idle_engine):
    prompts = PROMPTS[:3]
    want = idle_engine.generate(prompts, greedy(12))

    async def consume(aengine, prompt):
        deltas = [delta async for delta in aengine.stream(prompt, greedy(12))]
        return "".join(d.new_text for d in deltas), [t for d in deltas for t in d.new_token_ids], deltas

    async def main(aengine):
        streamed = await asyncio.gather(*(consume(aengine, p) for p in prompts))
        whole = await aengine.generate(prompts[0], greedy(12))
        # a cancelled consumer: the abort reaches the engine process before the next call
        task = await _consuming_mid_stream(aengine, PROMPTS[3])
        running = await aengine.call(kv_state)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after_cancel = await aengine.call(kv_state)
        # the bounded queue is this process's: full at 3, then a waiting caller gets the room
        held = [await aengine.add_request(p, LONG) for p in PROMPTS[4:7]]
        with pytest.raises(QueueFull):
            await aengine.add_request(PROMPTS[7], greedy(4))
        waiting = asyncio.create_task(aengine.generate(PROMPTS[7], greedy(4), wait=True))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await held[0].aclose()
        waited = await waiting
        for stream in held[1:]:
            await stream.aclose()
        with pytest.raises(InvalidRequest, match="pickle"):
            await aengine.call(lambda engine: None)
        return streamed, whole, running, after_cancel, waited, await aengine.call(kv_state), aengine.stats()

    aengine = ProcessEngine(functools.partial(demo_engine), max_queue=3)
    try:
        streamed, whole, running, after_cancel, waited, idle, stats = asyncio.run(main(aengine))
    finally:
        aengine.close()
    for (text, tokens, deltas), ref in zip(streamed, want, strict=True):
        assert text == ref.text and tokens == ref.token_ids
        assert deltas[-1].finish_reason == ref.finish_reason and deltas[-1].output.token_ids == ref.token_ids
        assert [n for d in deltas for n in d.accept_lengths] == ref.stats.accept_lengths
    assert whole.token_ids == want[0].token_ids
    assert waited.token_ids == idle_engine.generate([PROMPTS[7]], greedy(4))[0].token_ids
    free, total, _ = running
    assert free < total
    assert after_cancel == (total, total, False) and idle == (total, total, False)
    assert stats.finished == {"length": 5, "abort": 4} and stats.rejected == 1 and stats.queued == 0
    assert stats.kv_total_pages == total and stats.steps > 0 and stats.deliveries > 0
    assert not aengine.is_running
    assert aengine.pid not in [p.pid for p in multiprocessing.active_children()]


def test_the_process_engine_raises_the_load_error_of_its_engine(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(CheckpointFileError, match="config.json not found"):
        ProcessEngine(functools.partial(Engine.from_pretrained, missing, device="cpu"))
    with pytest.raises(InvalidConfig, match="pickle"):
        ProcessEngine(lambda: None)
    assert multiprocessing.active_children() == []


def _engine_whose_third_step_fails():
    """A demo engine whose scheduler raises on its third step (module-level: it runs in the
    engine process)."""
    engine = demo_engine()
    step, calls = engine.scheduler.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return step()

    engine.scheduler.step = failing_step
    return engine


def test_a_step_that_fails_in_the_engine_process_reaches_every_caller():
    """The failure travels after the deltas sent before it (one sender, in order): the stream
    got its first tokens, then ends with EngineDied naming the error; later calls fail alike."""

    async def main(aengine):
        stream = await aengine.add_request(PROMPTS[0], greedy(16, ignore_eos=True))
        tokens = []

        async def read_all():
            async for delta in stream:
                tokens.extend(delta.new_token_ids)

        with pytest.raises(EngineDied, match="injected step failure"):
            await read_all()
        with pytest.raises(EngineDied):
            await aengine.add_request(PROMPTS[1])
        return tokens

    aengine = ProcessEngine(_engine_whose_third_step_fails)  # warm_up steps too: raise on a later one
    try:
        tokens = asyncio.run(main(aengine))
    finally:
        aengine.close()
    assert tokens  # the steps before the failure were delivered
    assert multiprocessing.active_children() == []


def test_the_engine_process_messages_round_trip_packed():
    """A write holds every message queued since the last one, deltas as tuples: unpacked,
    each delta equals the one sent, every field included, and a failure keeps its place."""
    from phasegraph.runtime.config import RequestDelta, RequestOutput, RequestStats
    from phasegraph.serving.engine_process import _Failed, pack_messages, unpack_messages

    output = RequestOutput("b", [1, 2], [7, 8, 9], "xyz", "length", logprobs=[-0.5, -0.25, -1.0],
                           stats=RequestStats(accept_lengths=[2, 1], prompt_tokens=2),
                           top_logprobs=[[(7, -0.5), (3, -2.0)]] * 3)
    deltas = [
        RequestDelta("a", (5,), "f", None, accept_lengths=(1,), logprobs=(-0.125,),
                     top_logprobs=(((5, -0.125), (6, -3.0)),), routed_experts=(((1, 2), (0, 3)),)),
        RequestDelta("b", (8, 9), "yz", "length", accept_lengths=(2,), output=output),
    ]
    failed = _Failed(RuntimeError("boom"))
    messages = [(deltas, [(1, True, {"x": 1})]), ([], [(2, False, ValueError("no"))]), failed]
    back = unpack_messages(pack_messages(messages))
    assert back[0] == (deltas, [(1, True, {"x": 1})])
    assert back[1][0] == [] and back[1][1][0][:2] == (2, False) and str(back[1][1][0][2]) == "no"
    assert isinstance(back[2], _Failed) and str(back[2].error) == "boom"


def test_a_message_that_does_not_pickle_reaches_the_parent_as_a_failure():
    """The engine process's sender cannot pickle a message: the parent reads a failure naming
    it (not silence), the sender stops, and the step loop's next send or receive ends it."""
    from phasegraph.serving.engine_process import _Channel, _Failed, unpack_messages

    parent, child = multiprocessing.Pipe()
    channel = _Channel(child)
    channel.send(([], [(1, True, lambda: None)]))
    assert parent.poll(10.0)
    (message,) = unpack_messages(parent.recv_bytes())
    assert isinstance(message, _Failed) and "pickle" in repr(message.error).lower()
    channel._sender.join(10.0)
    assert not channel._sender.is_alive()
    with pytest.raises(EOFError):
        channel.send(([], []))
    with pytest.raises(EOFError):
        channel.receive(block=False)
    parent.close()
