"""AsyncLLM: streaming, abort, cancellation and failure delivery."""
import asyncio

import pytest

from engine import AsyncLLM, EngineConfig, RequestOutputKind, SamplingParams
from engine.entrypoints.async_llm import EngineDeadError
from engine.errors import InvalidRequestError, PromptTooLongError
from tests.faults import drain_all, fail_next_step


@pytest.fixture
def make_llm(tiny_llama):
    engines = []

    def make(**kw):
        llm = AsyncLLM(EngineConfig(model=tiny_llama, device="cpu", dtype="float32", **kw))
        engines.append(llm)
        return llm
    yield make
    for llm in engines:
        llm.shutdown()
        if llm._error is None:
            llm.engine.block_manager.check_no_leak()


async def _collect(llm, prompt, params, request_id):
    return [out async for out in llm.generate(prompt, params, request_id)]


def _token_ids(outs) -> list[int]:
    """Every token id a stream of DELTA outputs carried, in order."""
    return sum((o.outputs[0].token_ids for o in outs), [])


async def _wait_idle(llm, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while llm.get_stats()["num_requests_running"] or llm.get_stats()["kv_cache_usage"]:
        assert asyncio.get_running_loop().time() < deadline, llm.get_stats()
        await asyncio.sleep(0.02)


def test_streamed_deltas_concatenate_to_final_text(make_llm):
    llm = make_llm()

    async def main():
        base = dict(temperature=0, max_tokens=24, ignore_eos=True)
        deltas = await _collect(llm, "Once upon", SamplingParams(**base, output_kind=RequestOutputKind.DELTA), "d")
        final = await _collect(llm, "Once upon", SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY), "f")
        assert len(deltas) > 1 and len(final) == 1
        assert "".join(o.outputs[0].text for o in deltas) == final[0].outputs[0].text
        assert sum((o.outputs[0].token_ids for o in deltas), []) == final[0].outputs[0].token_ids
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
    asyncio.run(main())


def test_concurrent_requests_equal_sequential(make_llm):
    llm = make_llm()
    prompts = [f"prompt number {i}" for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def main():
        seq = [(await _collect(llm, p, params, f"s{i}"))[-1].outputs[0].token_ids for i, p in enumerate(prompts)]
        conc = await asyncio.gather(*[_collect(llm, p, params, f"c{i}") for i, p in enumerate(prompts)])
        assert [c[-1].outputs[0].token_ids for c in conc] == seq
    asyncio.run(main())


def test_cancelled_consumer_aborts_and_frees_blocks(make_llm):
    llm = make_llm()

    async def main():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        gen = llm.generate("a long one", params, "gone")
        await gen.__anext__()
        assert llm.get_stats()["num_requests_running"] == 1 or llm.get_stats()["kv_cache_usage"] > 0
        await gen.aclose()  # what a client disconnect does to the consumer
        await _wait_idle(llm)

        task = asyncio.ensure_future(_collect(llm, "another", params, "cancelled"))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(llm)
    asyncio.run(main())


def test_explicit_abort_ends_stream_with_abort(make_llm):
    llm = make_llm()

    async def main():
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        gen = llm.generate("to be aborted", params, "ab")
        await gen.__anext__()
        await llm.abort("ab")
        outs = [o async for o in gen]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await _wait_idle(llm)
    asyncio.run(main())


def test_bad_request_raises_value_error(make_llm):
    llm = make_llm(max_model_len=64)

    async def main():
        with pytest.raises(PromptTooLongError, match="max_model_len"):
            await _collect(llm, {"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=10), "long")
        with pytest.raises(InvalidRequestError, match="vocab") as info:
            await _collect(llm, {"prompt_token_ids": [10**7]}, SamplingParams(), "oov")
        assert info.value.param == "prompt"
        ok = await _collect(llm, "still alive", SamplingParams(max_tokens=3), "ok")
        assert ok[-1].finished
    asyncio.run(main())


def test_step_failure_reaches_every_waiter(make_llm):
    llm = make_llm()

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    async def main():
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        llm.engine.executor.forward = boom
        results = await asyncio.gather(*[_collect(llm, f"p{i}", params, f"r{i}") for i in range(3)],
                                       return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) and "injected" in str(r) for r in results), results
        with pytest.raises(EngineDeadError):
            await llm.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(llm, "after death", params, "late")
    asyncio.run(main())


@pytest.mark.parametrize("ending", ["death", "shutdown"])
def test_request_registered_as_the_loop_ends_is_not_left_waiting(make_llm, ending):
    """The window between generate()'s liveness check and its registration: the loop may end
    right there (CI once hung 600 s on this). The request must fail, never wait forever."""
    llm = make_llm()
    real_make_request = llm.engine.make_request

    def make_request_then_end_loop(request_id, *args, **kwargs):
        state = real_make_request(request_id, *args, **kwargs)
        if ending == "death":
            llm.engine.executor.forward = _boom
            llm._client.add_request(real_make_request("killer", "x", SamplingParams(max_tokens=2)))
        else:
            llm.shutdown()  # from another thread, in real use
        llm._client._thread.join(10)
        assert not llm._client._thread.is_alive()
        return state

    async def main():
        llm.engine.make_request = make_request_then_end_loop
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(llm, "late", SamplingParams(max_tokens=4), "late"), 10)
    asyncio.run(main())


def _boom(*a, **k):
    raise RuntimeError("injected failure")


def test_shutdown_aborts_in_flight(make_llm):
    llm = make_llm()

    async def main():
        params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        gen = llm.generate("long running", params, "inflight")
        await gen.__anext__()
        await asyncio.to_thread(llm.shutdown)
        outs = [o async for o in gen]
        assert outs[-1].outputs[0].finish_reason == "abort"
    asyncio.run(main())


def test_stream_interval_sends_fewer_larger_outputs_and_loses_nothing(make_llm):
    llm = make_llm()
    params = lambda: SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,  # noqa: E731
                                    output_kind=RequestOutputKind.DELTA)

    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()
        every = await _collect(llm, "Once upon", params(), "every")
        per_token_s = (loop.time() - start) / 32
        start = loop.time()
        chunked = [out async for out in llm.generate("Once upon", params(), "chunked", stream_interval_s=0.2)]
        return every, chunked, loop.time() - start, per_token_s
    every, chunked, elapsed, per_token_s = asyncio.run(main())
    assert _token_ids(chunked) == _token_ids(every) and len(_token_ids(chunked)) == 32
    assert "".join(o.outputs[0].text for o in chunked) == "".join(o.outputs[0].text for o in every)
    # The first output is not held back for an interval, which would gather the tokens of 0.2 s (at
    # this box's measured pace): it carries the first token, or the few steps that finished before
    # the reader woke.
    held = 0.2 / per_token_s
    assert len(chunked[0].outputs[0].token_ids) <= max(2, held / 2), (per_token_s, chunked[0])
    assert len(chunked) < len(every) and chunked[-1].finished
    # Held at most one interval per output: the end is not delayed by a whole interval after it.
    assert elapsed < 0.2 * len(chunked) + 1.0


def test_stream_interval_holds_nothing_before_the_first_text(make_llm):
    """Outputs with tokens but no text yet (here: text held back as a possible stop string; in
    real use a first token that is half a UTF-8 character) are not held, so the first visible
    text comes when the engine makes it, not an interval later. Told apart by what the stream
    holds, not by how many tokens a reader sees (a reader that wakes late sees merged deltas):
    with an interval longer than the whole generation, a hold before the first text would bring
    that text only with the final output; after it, the next output is the final one."""
    llm = make_llm()
    never = "\x00" * 8  # never generated: keeps the last 7 characters of text back until the end
    params = lambda: SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, stop=[never],  # noqa: E731
                                    output_kind=RequestOutputKind.DELTA)

    async def main():
        every = await _collect(llm, "Once upon", params(), "every")
        held = [out async for out in llm.generate("Once upon", params(), "held", stream_interval_s=1000.0)]
        return every, held
    every, held = asyncio.run(main())

    def first_text(outs) -> int:
        return next(i for i, out in enumerate(outs) if out.outputs[0].text)
    # The case under test: the first token's text (up to 7 characters) is held back, so the first
    # output a prompt reader sees carries a token and no text.
    assert len(llm.tokenizer.decode(_token_ids(every)[:1])) <= len(never) - 1
    assert _token_ids(held) == _token_ids(every)
    i = first_text(held)
    assert not held[i].finished  # not held until the end, though the interval outlasts the request
    assert len(held) == i + 2 and held[-1].finished  # then held: the next output is the final one


def test_negative_stream_interval_is_rejected(make_llm):
    llm = make_llm()

    async def main():
        with pytest.raises(ValueError, match="stream_interval_s"):
            await _collect_interval(llm, -0.1)
    asyncio.run(main())


async def _collect_interval(llm, interval):
    return [out async for out in llm.generate("hi", SamplingParams(max_tokens=2), "neg", stream_interval_s=interval)]


def test_tp_worker_death_fails_every_waiter_within_5s_and_health(tiny_llama):
    """A TP worker killed mid-generation: noticed by the executor's watcher, not a collective timeout."""
    import os
    import signal
    import time

    from test_multiproc_executor import resources, wait_until_released
    before = resources()
    llm = AsyncLLM(EngineConfig(model=tiny_llama, device="cpu", dtype="float32", tensor_parallel_size=2,
                                num_kv_blocks=64))

    async def main():
        params = SamplingParams(temperature=0, max_tokens=10_000 // 64, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        streams = [llm.generate(f"prompt {i}", params, f"r{i}") for i in range(3)]
        for s in streams:
            await s.__anext__()  # every request is running
        os.kill(llm.engine.executor.worker_pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        results = await drain_all(streams, timeout_s=10)
        assert time.monotonic() - t0 < 5
        assert all(isinstance(r, EngineDeadError) and "rank 1" in str(r) for r in results), results
        with pytest.raises(EngineDeadError):
            await llm.check_health()
    asyncio.run(main())
    llm.shutdown()
    wait_until_released(before)


@pytest.mark.parametrize("how", ["with", "async with", "gc"])
def test_lifecycle_leaves_nothing_behind(tiny_llama, how):
    import gc

    from test_multiproc_executor import resources, wait_until_released
    before = resources()
    config = EngineConfig(model=tiny_llama, device="cpu", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main():
        if how == "with":
            with AsyncLLM(config) as llm:
                await _collect(llm, "hi", params, "a")
        elif how == "async with":
            async with AsyncLLM(config) as llm:
                await _collect(llm, "hi", params, "a")
        else:
            llm = AsyncLLM(config)
            await _collect(llm, "hi", params, "a")
            del llm
            gc.collect()
    asyncio.run(main())
    wait_until_released(before)


def test_injected_step_error_reaches_every_waiter(make_llm):
    """The fault the serving fault tests inject (tests/faults.py): the step loop raises, everyone hears."""
    llm = make_llm()

    async def main():
        params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        streams = [llm.generate(f"p{i}", params, f"r{i}") for i in range(2)]
        for s in streams:
            await s.__anext__()
        await fail_next_step(llm, RuntimeError("injected in the step loop"))
        for s in streams:
            with pytest.raises(EngineDeadError, match="injected in the step loop"):
                async for _ in s:
                    pass
        with pytest.raises(EngineDeadError):
            await llm.check_health()
    asyncio.run(main())
