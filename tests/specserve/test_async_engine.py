"""The asynchronous engine: requests arrive at any time, stream their deltas, can be aborted
(or abandoned by their consumer) and free their blocks; bad input fails in the caller."""

from __future__ import annotations

import asyncio

import pytest

from specserve.async_engine import AsyncEngine, EngineDeadError
from specserve.config import EngineConfig
from specserve.engine import LLMEngine
from specserve.sampling import SamplingParams


@pytest.fixture
def engine(tiny_chat_model):
    async_engine = AsyncEngine(LLMEngine(tiny_chat_model, "float32", EngineConfig(kv_cache_memory="8MiB")))
    yield async_engine
    async_engine.shutdown()


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, request_id=None):
    deltas, tokens, last = "", [], None
    async for out in engine.generate(prompt, params, request_id):
        deltas += out.outputs[0].delta_text
        tokens += out.outputs[0].delta_token_ids
        last = out
    return deltas, tokens, last


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(200):
        if not engine.engine.has_unfinished() and not engine.num_unfinished:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not become idle")


def test_concurrent_streams_match_the_synchronous_engine(engine, tiny_chat_model):
    prompts = [[5 + i, 17, 300 + i, 42] * (i + 1) for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, p, params) for p in prompts))

    results = asyncio.run(main())
    reference = LLMEngine(tiny_chat_model, "float32", EngineConfig(kv_cache_memory="8MiB"))
    for i, (deltas, tokens, last) in enumerate(results):
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert tokens == last.outputs[0].token_ids and deltas == last.outputs[0].text
        reference.add_request("r", prompts[i], params)
        while reference.has_unfinished():
            final = next((o for o in reference.step() if o.finished), None)
        assert final.outputs[0].token_ids == tokens


def test_requests_join_while_others_run(engine):
    async def main():
        long = asyncio.create_task(collect(engine, [7, 8, 9], SamplingParams(max_tokens=60, ignore_eos=True)))
        await asyncio.sleep(0.05)
        short = await collect(engine, [10, 11], SamplingParams(max_tokens=3, ignore_eos=True))
        assert not long.done()  # the short request finished while the long one was still running
        return short, await long

    short, long = asyncio.run(main())
    assert len(short[1]) == 3 and len(long[1]) == 60


def test_abort_and_abandoned_streams_free_their_blocks(engine):
    async def main():
        stream = engine.generate([3, 4, 5], SamplingParams(max_tokens=500, ignore_eos=True), "abandoned")
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await stream.aclose()  # the consumer goes away (a client disconnect)

        async def aborted():
            return await collect(engine, [6, 7, 8], SamplingParams(max_tokens=500, ignore_eos=True), "aborted")

        task = asyncio.create_task(aborted())
        await asyncio.sleep(0.1)
        engine.abort("aborted")
        _, tokens, last = await task
        assert last.outputs[0].finish_reason == "abort" and 0 < len(tokens) < 500
        await wait_idle(engine)

    asyncio.run(main())
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bad_input_fails_in_the_caller_and_the_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="the prompt is empty"):
            await collect(engine, [], SamplingParams())
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await collect(engine, [5] * 100, SamplingParams(max_tokens=10**6))
        return await collect(engine, "Hello", SamplingParams(max_tokens=2, ignore_eos=True))

    _, tokens, _ = asyncio.run(main())
    assert len(tokens) == 2


def test_a_failing_engine_loop_fails_every_waiting_stream(engine):
    def broken_step():
        raise RuntimeError("boom")

    engine.engine.step = broken_step

    async def main():
        with pytest.raises(EngineDeadError, match="boom"):
            await collect(engine, [5, 6], SamplingParams(max_tokens=4))
        with pytest.raises(EngineDeadError):
            await collect(engine, [5, 6], SamplingParams(max_tokens=4))

    asyncio.run(main())
