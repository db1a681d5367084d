"""The ``asyncio`` face: the same engine's calls as awaitables, turns streamed with ``async
for``, several conversations at once."""

import asyncio

import pytest

import pensieve


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture(scope="module")
def aengine():
    engine = pensieve.AsyncEngine()
    yield engine
    run(engine.shutdown())


def test_async_turns_stream_and_reuse_the_history(aengine):
    async def chat():
        conv = await aengine.open(system="Be brief.")
        first = await conv.ask("What is the capital of France?", max_tokens=24)
        stream = await conv.send("And of Spain?", max_tokens=24)
        pieces = [piece async for piece in stream]
        return first, stream, pieces, await conv.messages()

    first, stream, pieces, messages = run(chat())
    assert "".join(pieces) == stream.text and stream.finish_reason in ("stop", "length")
    assert stream.stats.reused_tokens >= first.stats.prompt_tokens + first.stats.output_tokens - 1
    assert messages[-1] == {"role": "assistant", "content": stream.text}


def test_conversations_run_at_once_and_answer_as_they_would_alone(aengine):
    questions = ["What is 2 + 2?", "Name a fruit.", "What color is the sky?", "Say hello."]

    async def ask(question):
        conv = await aengine.open()
        return (await conv.ask(question, max_tokens=16)).tokens

    async def together():
        return await asyncio.gather(*(ask(q) for q in questions))

    at_once = run(together())
    alone = [run(ask(q)) for q in questions]
    assert at_once == alone


def test_a_coroutine_is_awaited_in_a_loop_started_after_it_was_made(aengine):
    opened = aengine.open()
    assert isinstance(run(opened), pensieve.AsyncConversation)


def test_async_cancel_and_errors(aengine):
    async def go():
        conv = await aengine.open()
        stream = await conv.send("Write a long story.", max_tokens=200, ignore_eos=True)
        await stream.__anext__()
        await stream.acancel()
        with pytest.raises(pensieve.NotFoundError):
            await aengine.resume("no such conversation")
        return stream, await conv.messages()

    stream, messages = run(go())
    assert stream.finish_reason == "cancelled" and messages == []


def test_the_async_engine_is_an_async_context_manager():
    async def go():
        async with pensieve.AsyncEngine(mode="stateless") as engine:
            conv = await engine.open()
            return await conv.ask("Hi!", max_tokens=4)

    assert run(go()).stats.output_tokens > 0
