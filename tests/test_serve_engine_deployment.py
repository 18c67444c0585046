"""The engine deployment (no Ray): delta conversion, chunking, cancellation, errors, health, shutdown."""
import asyncio

import pytest

from engine.entrypoints.async_llm import EngineDeadError
from engine.errors import PromptTooLongError, WorkerDiedError
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from serve_app.args import StreamingConfig
from serve_app.replica.engine_deployment import SHUTDOWN_MESSAGE, EngineDeployment, to_stream_item
from serve_app.http.messages import EngineRequest
from serve_app.metrics import EngineMetrics
from tests.fake_metrics import Recorder


def test_to_stream_item_is_compact():
    out = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(
        1, "ab", [5, 6], logprobs=[{5: Logprob(-0.1, 1, "a")}, {6: Logprob(-0.2, 2, "b"), 7: Logprob(-0.05, 1, "c")}],
        finish_reason="stop", stop_reason=2)], finished=True, num_cached_tokens=2)
    item = to_stream_item(out)
    assert item.num_prompt_tokens == 3 and item.num_cached_tokens == 2 and item.finished
    (d,) = item.deltas
    assert (d.index, d.text, d.token_ids, d.finish_reason, d.stop_reason) == (1, "ab", [5, 6], "stop", 2)
    assert d.logprobs == [[(5, -0.1, 1, "a")], [(6, -0.2, 2, "b"), (7, -0.05, 1, "c")]]
    assert item.prompt_logprobs is None
    out.prompt_logprobs = [None, {2: Logprob(-1.5, 4, "x"), 9: Logprob(-0.5, 1, "y")}, {3: Logprob(-0.2, 1, "z")}]
    # The first prompt token has no entry: the Ingress supplies its text.
    assert to_stream_item(out).prompt_logprobs == [[(2, -1.5, 4, "x"), (9, -0.5, 1, "y")], [(3, -0.2, 1, "z")]]


# -- the deployment class itself, around a fake engine (no Ray, no model) ----------------------

class FakeLLM:
    def __init__(self, outputs=(), error=None, dead=False):
        self.outputs, self.error, self.dead = list(outputs), error, dead
        self.shutdowns = 0
        self.stream_intervals = []
        self.priorities = []

    async def generate(self, prompt, params, request_id, *, stream_interval_s=0.0, lora_request=None, priority=0):
        self.priorities.append(priority)
        if self.error:
            raise self.error
        for out in self.outputs:
            yield out
            # as AsyncLLM: the interval is asked for after an item was taken, before the wait
            self.stream_intervals.append(stream_interval_s() if callable(stream_interval_s) else stream_interval_s)

    def get_stats(self):
        return {"num_requests_running": 2, "prefix_cache_queries": 7}

    def pop_iteration_stats(self):
        return []

    async def check_health(self):
        if self.dead:
            raise EngineDeadError("the engine loop died: boom")

    def shutdown(self):
        self.shutdowns += 1


def _deployment(llm, device="cpu") -> EngineDeployment:
    dep = object.__new__(EngineDeployment.func_or_class)
    dep.llm, dep._shutting_down, dep._replica, dep._cpu_threads = llm, False, "test", None
    dep._device, dep._num_streaming = device, 0
    dep.streaming = StreamingConfig()
    dep.recorder = Recorder()  # in place of Ray's metrics
    dep.metrics, dep._metrics_task = EngineMetrics("rayllm", "m", 64, factory=dep.recorder), None
    dep._request_ids, dep._refusing, dep._graceful_shutdown_timeout_s = set(), False, 20.0
    dep._drain_watched, dep._drain_task = False, None  # outside Serve: no stop to watch for
    return dep


def _run(dep, request=None):
    request = request or EngineRequest("r", [1, 2], SamplingParams(max_tokens=2))

    async def run():
        return [item async for item in dep.generate(request)]
    return asyncio.run(run())


def _output(text, finish=None, finished=False):
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [3], finish_reason=finish)], finished=finished)


def test_generate_streams_and_ends_with_a_finished_item():
    items = _run(_deployment(FakeLLM([_output("a"), _output("b", "length", True)])))
    assert "".join(d.text for i in items for d in i.deltas) == "ab"
    assert items[-1].finished and items[-1].error is None


def test_the_request_priority_reaches_the_engine():
    llm = FakeLLM([_output("b", "length", True)])
    _run(_deployment(llm), EngineRequest("r", [1, 2], SamplingParams(max_tokens=2), priority=-3))
    assert llm.priorities == [-3]


def test_replica_records_the_engine_stats_while_serving():
    dep = _deployment(FakeLLM([_output("a"), _output("b", "length", True)]))
    _run(dep)
    assert dep.recorder.value("rayllm_num_requests_running", model_name="m") == 2
    assert dep.recorder.value("rayllm_prefix_cache_queries") == 7


def test_invalid_request_becomes_an_error_item():
    (item,) = _run(_deployment(FakeLLM(error=ValueError("token id 9999 is out of vocabulary (vocab_size=10)"))))
    assert item.finished and item.error.kind == "invalid_request" and "9999" in item.error.message


def test_engine_errors_become_error_items_by_type():
    refusal = PromptTooLongError("prompt (60 tokens) + max_tokens (5) = 65 tokens exceeds max_model_len=64")
    (item,) = _run(_deployment(FakeLLM(error=refusal)))
    assert (item.error.kind, item.error.param, item.error.code) == ("invalid_request", "prompt",
                                                                    "context_length_exceeded")
    (item,) = _run(_deployment(FakeLLM(error=WorkerDiedError("TP worker rank 1 exited with code -9"))))
    assert item.error.kind == "unavailable" and "rank 1" in item.error.message


def test_engine_side_abort_says_shutting_down():
    items = _run(_deployment(FakeLLM([_output("a"), _output("", "abort", True)])))
    assert items[-1].error.kind == "unavailable" and items[-1].error.message == SHUTDOWN_MESSAGE


class AbortableLLM(FakeLLM):
    """One token, then nothing until the request is aborted; then the engine's final 'abort' output."""

    def __init__(self):
        super().__init__()
        self.aborted_ids: list[str] = []
        self._aborted = asyncio.Event()

    async def generate(self, prompt, params, request_id, *, stream_interval_s=0.0, lora_request=None, priority=0):
        yield _output("a")
        await self._aborted.wait()
        yield _output("", "abort", True)

    async def abort(self, request_id):
        self.aborted_ids.append(request_id)
        self._aborted.set()


def test_abort_all_ends_running_requests_and_refuses_new_ones():
    """What a replica that Serve stops does when its grace is over (serve_app/replica/draining.py)."""
    async def run(dep):
        items = []

        async def read():
            async for item in dep.generate(EngineRequest("r", [1, 2], SamplingParams(max_tokens=2))):
                items.append(item)
        task = asyncio.create_task(read())
        while not items:
            await asyncio.sleep(0)
        await dep.abort_all()
        await asyncio.wait_for(task, 5)
        late = [item async for item in dep.generate(EngineRequest("late", [1, 2], SamplingParams(max_tokens=2)))]
        return items, late

    dep = _deployment(AbortableLLM())
    items, late = asyncio.run(run(dep))
    assert dep.llm.aborted_ids == ["r"] and dep.llm.shutdowns == 0  # the engine itself stops in __del__
    assert [i.deltas[0].text for i in items] == ["a", ""] and items[-1].finished
    assert items[-1].error.kind == "unavailable" and items[-1].error.message == SHUTDOWN_MESSAGE
    assert len(late) == 1 and late[0].finished and late[0].error.message == SHUTDOWN_MESSAGE
    assert not dep._request_ids


def test_a_request_that_slips_past_abort_all_is_aborted_at_its_first_item():
    dep = _deployment(AbortableLLM())
    generate = dep.llm.generate

    async def late_generate(*args, **kwargs):
        dep._refusing = True  # abort_all() went by while this request was on its way into the engine
        async for out in generate(*args, **kwargs):
            yield out
    dep.llm.generate = late_generate
    items = _run(dep)
    assert dep.llm.aborted_ids == ["r"]
    assert items[-1].finished and items[-1].error.message == SHUTDOWN_MESSAGE


def test_check_health_fails_when_the_loop_died():
    asyncio.run(_deployment(FakeLLM()).check_health())
    with pytest.raises(EngineDeadError):
        asyncio.run(_deployment(FakeLLM(dead=True)).check_health())


def test_shutdown_aborts_once():
    llm = FakeLLM()
    dep = _deployment(llm)
    dep.__del__()
    dep.__del__()
    assert llm.shutdowns == 1


def test_reconfigure_sets_the_stream_interval_live():
    llm = FakeLLM([_output("a", "length", True)])
    dep = _deployment(llm)
    _run(dep)
    dep.reconfigure({"stream_interval_ms": 50})
    _run(dep)
    dep.reconfigure({"stream_interval_ms": 0, "max_stream_messages_per_s": 0})
    _run(dep)
    assert llm.stream_intervals == [StreamingConfig().stream_interval_ms / 1000, 0.05, 0.0]
    with pytest.raises(ValueError, match="stream_interval_ms"):
        dep.reconfigure({"stream_interval_ms": -1})
    with pytest.raises(ValueError, match="stream_interval"):
        dep.reconfigure({"stream_intervals_ms": 5})  # a typo is not ignored
    with pytest.raises(ValueError, match="max_stream_messages_per_s"):
        dep.reconfigure({"max_stream_messages_per_s": -5})


def test_the_interval_stretches_with_the_streams_on_the_replica():
    """Each stream counts from its first item to its end; the interval is the budget shared by them."""
    async def main():
        dep = _deployment(FakeLLM([_output("a"), _output("b"), _output("c", "length", True)]))
        dep.reconfigure({"stream_interval_ms": 20, "max_stream_messages_per_s": 100})
        streams = [dep.generate(EngineRequest(f"r{i}", [1, 2], SamplingParams(max_tokens=3))) for i in range(50)]
        for s in streams:  # every stream has sent its first item
            await s.__anext__()
        assert dep._num_streaming == 50
        assert dep._interval_s() == pytest.approx(0.5)  # 50 streams / 100 per s
        for s in streams[:45]:
            await s.aclose()  # a stream that ends (or is cancelled) no longer counts
        assert dep._num_streaming == 5 and dep._interval_s() == pytest.approx(0.05)
        for s in streams[45:]:
            assert [i async for i in s][-1].finished
        assert dep._num_streaming == 0 and dep._interval_s() == pytest.approx(0.02)  # the floor
    asyncio.run(main())
