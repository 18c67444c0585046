"""AsyncLLM(engine_process=True): the step loop in its own process (engine/entrypoints/core_client.py)."""
import asyncio
import gc
import os
import signal
import time

import pytest

from engine import AsyncLLM, EngineConfig, RequestOutputKind, SamplingParams
from engine.core.engine_core import PromptCache
from engine.errors import EngineDeadError, InvalidRequestError
from engine.outputs import CompletionOutput, RequestOutput
from tests.faults import StepFaultEngineCore, drain_all, fail_next_step

DELTA = dict(temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def _config(model, **kw):
    return EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=64, **kw)


@pytest.fixture(scope="module")
def shared_proc_llm(tiny_llama):
    """One engine process for the tests that leave it running and idle (a spawn imports torch and
    builds the model: seconds of CPU each on the 2-core box)."""
    llm = AsyncLLM(_config(tiny_llama), engine_process=True)
    yield llm
    llm.shutdown()


@pytest.fixture
def proc_llm(shared_proc_llm):
    yield shared_proc_llm
    asyncio.run(_wait_idle(shared_proc_llm))  # the next test finds it at rest


@pytest.fixture
def own_proc_llm(tiny_llama):
    """An engine process of the test's own, for a test that ends it."""
    llm = AsyncLLM(_config(tiny_llama), engine_process=True)
    yield llm
    llm.shutdown()


@pytest.fixture
def faulty_proc_llm(tiny_llama):
    """An engine process whose step a test can make raise (tests/faults.py)."""
    llm = AsyncLLM(_config(tiny_llama), engine_process=True, engine_core_class=StepFaultEngineCore)
    yield llm
    llm.shutdown()


async def _tokens(llm, prompt, params, request_id):
    text, ids, outs = "", [], []
    async for out in llm.generate(prompt, params, request_id):
        text, ids = text + out.outputs[0].text, ids + out.outputs[0].token_ids
        outs.append(out)
    return text, ids, outs[-1].outputs[0].finish_reason


async def _wait_idle(llm, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.get_stats()
        if stats and not stats["num_requests_running"] and not stats["kv_cache_usage"]:
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def _wait_gone(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        assert time.monotonic() < deadline, f"engine process {pid} still running"
        time.sleep(0.1)


def test_engine_process_streams_what_the_thread_streams(tiny_llama, proc_llm):
    prompts = [f"prompt number {i}" for i in range(6)]
    params = SamplingParams(max_tokens=12, **DELTA)

    async def run(llm):
        return await asyncio.gather(*[_tokens(llm, p, params, f"r{i}") for i, p in enumerate(prompts)])
    in_process = AsyncLLM(_config(tiny_llama))
    try:
        expected = asyncio.run(run(in_process))
    finally:
        in_process.shutdown()
    generated_before = (proc_llm.get_stats() or {}).get("num_generated_tokens", 0)  # the module's engine
    proc_llm.pop_iteration_stats()
    assert asyncio.run(run(proc_llm)) == expected
    assert proc_llm.engine_pid != os.getpid() and proc_llm.engine is None
    assert proc_llm.engine_config.max_model_len == in_process.engine_config.max_model_len
    stats = asyncio.run(_wait_idle(proc_llm))
    assert stats["num_generated_tokens"] - generated_before == 6 * 12
    assert sum(s.num_generation_tokens for s in proc_llm.pop_iteration_stats()) == 6 * 12


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_every_output_carries_its_prompt(proc_llm, kind, monkeypatch):
    """The prompt crosses the pipe once per request; each output still has it, and the parent
    forgets it when the request ends, finished or aborted. What the caller sees may be fewer
    outputs than crossed the pipe (a slow reader's cumulative outputs merge), so the outputs that
    crossed are counted where the parent restores them."""
    ids = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, output_kind=kind)
    restored: dict[str, list] = {}
    restore = proc_llm._client._prompts.restore

    def recording_restore(pairs):
        pairs = restore(pairs)
        for request_id, out in pairs:
            if isinstance(out, RequestOutput):
                restored.setdefault(request_id, []).append((out.prompt, tuple(out.prompt_token_ids)))
        return pairs
    monkeypatch.setattr(proc_llm._client._prompts, "restore", recording_restore)

    async def main():
        outs = [out async for out in proc_llm.generate({"prompt_token_ids": ids, "prompt": "five ids"}, params, "a")]
        texts = [out async for out in proc_llm.generate("some text", params, "b")]
        long = proc_llm.generate("abort me", SamplingParams(max_tokens=400, **DELTA), "c")
        first = await long.__anext__()
        await long.aclose()
        await _wait_idle(proc_llm)
        return outs, texts, first
    outs, texts, first = asyncio.run(main())
    assert len(restored["a"]) > 1 and set(restored["a"]) == {("five ids", tuple(ids))}
    assert all(o.prompt_token_ids == ids and o.prompt == "five ids" for o in outs)
    b_ids = tuple(texts[0].prompt_token_ids)
    assert b_ids and len(restored["b"]) > 1 and set(restored["b"]) == {("some text", b_ids)}
    assert all(o.prompt == "some text" and tuple(o.prompt_token_ids) == b_ids for o in texts)
    assert first.prompt == "abort me"
    assert len(proc_llm._client._prompts) == 0


def test_outputs_that_cannot_be_delivered_fail_every_waiter(own_proc_llm, monkeypatch):
    """A bug in the parent's reader (here: restoring prompts raises) ends the engine, not the waits."""
    proc_llm = own_proc_llm
    async def main():
        stream = proc_llm.generate("p", SamplingParams(max_tokens=400, **DELTA), "r")
        await stream.__anext__()
        monkeypatch.setattr(proc_llm._client._prompts, "restore", lambda pairs: 1 / 0)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="could not be delivered"):
            async for _ in stream:
                pass
        assert time.monotonic() - t0 < 5
    asyncio.run(asyncio.wait_for(main(), 30))
    _wait_gone(proc_llm.engine_pid)


def _out(request_id: str, finished: bool, prompt_ids: list[int]) -> RequestOutput:
    return RequestOutput(request_id, "p", list(prompt_ids), [CompletionOutput(0, "t", [1])], finished)


def test_prompt_cache_sends_a_prompt_once_and_forgets_finished_requests():
    child, parent = PromptCache(), PromptCache()
    steps = [[("a", _out("a", False, [1, 2])), ("b", _out("b", True, [3]))],   # b: one output only
             [("a", _out("a", False, [1, 2])), ("c", ValueError("refused"))],
             [("a", _out("a", True, [1, 2]))]]
    for k, pairs in enumerate(steps):
        sent = child.strip(pairs)
        if k:  # only a's first output carries its prompt
            assert all(out.prompt_token_ids is None for _, out in sent if isinstance(out, RequestOutput))
        restored = parent.restore(sent)
        assert all(out.prompt_token_ids and out.prompt == "p" for _, out in restored
                   if isinstance(out, RequestOutput))
    assert len(child) == len(parent) == 0


def test_invalid_request_fails_alone(proc_llm):
    async def main():
        good = asyncio.create_task(_tokens(proc_llm, "hello", SamplingParams(max_tokens=8, **DELTA), "good"))
        with pytest.raises(InvalidRequestError, match="out of vocabulary"):
            await _tokens(proc_llm, {"prompt_token_ids": [10**7]}, SamplingParams(max_tokens=4, **DELTA), "bad")
        _, ids, reason = await good
        assert len(ids) == 8 and reason == "length"
        first = proc_llm.generate("x", SamplingParams(max_tokens=400, **DELTA), "same")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):  # the parent still refuses a live id
            await proc_llm.generate("x", SamplingParams(max_tokens=5, **DELTA), "same").__anext__()
        await first.aclose()
        await _wait_idle(proc_llm)
    asyncio.run(main())


def test_a_closed_stream_is_aborted_in_the_engine_process(proc_llm):
    async def main():
        stream = proc_llm.generate("tell me", SamplingParams(max_tokens=400, **DELTA), "long")
        await stream.__anext__()
        await stream.aclose()  # the caller went away
        await _wait_idle(proc_llm)  # the engine freed its sequence and KV blocks
    asyncio.run(main())


@pytest.mark.parametrize("fault, message", [("kill", "exited"), ("step_error", "injected in the step loop")])
def test_a_dead_engine_process_fails_every_waiter(faulty_proc_llm, fault, message):
    proc_llm = faulty_proc_llm

    async def main():
        params = SamplingParams(max_tokens=400, **DELTA)
        streams = [proc_llm.generate(f"p{i}", params, f"r{i}") for i in range(2)]
        for s in streams:
            await s.__anext__()  # both running
        if fault == "kill":
            os.kill(proc_llm.engine_pid, signal.SIGKILL)
        else:  # the fault the serving fault tests inject: the step loop raises
            await fail_next_step(proc_llm, RuntimeError("injected in the step loop"))
        t0 = time.monotonic()
        results = await drain_all(streams, timeout_s=10)
        assert time.monotonic() - t0 < 5
        assert all(isinstance(r, EngineDeadError) and message in str(r) for r in results), results
        with pytest.raises(EngineDeadError):
            await proc_llm.check_health()
        with pytest.raises(EngineDeadError):  # and nothing new is taken
            await _tokens(proc_llm, "again", SamplingParams(max_tokens=2, **DELTA), "late")
    asyncio.run(main())
    _wait_gone(proc_llm.engine_pid)  # a dead loop ends its process


@pytest.mark.parametrize("how", ["shutdown", "gc"])
def test_the_engine_process_ends_with_its_owner(tiny_llama, how):
    async def main():
        llm = AsyncLLM(_config(tiny_llama), engine_process=True)
        stream = llm.generate("hi", SamplingParams(max_tokens=400, **DELTA), "a")
        await stream.__anext__()
        pid = llm.engine_pid
        if how == "shutdown":
            llm.shutdown()  # the running request ends with finish_reason "abort"
            outs = [out async for out in stream]
            assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        else:
            await stream.aclose()
            del stream, llm
            gc.collect()
        return pid
    _wait_gone(asyncio.run(main()))


def test_a_model_that_cannot_load_raises_the_engines_error(tmp_path):
    config = EngineConfig(model=str(tmp_path), device="cpu")  # no checkpoint there
    with pytest.raises(Exception) as in_process:
        AsyncLLM(config)
    with pytest.raises(type(in_process.value)):
        AsyncLLM(config, engine_process=True)
