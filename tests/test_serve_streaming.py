"""SSE framing and the status-then-stream logic of Generation (no Ray)."""
import asyncio
import json

import pytest

from serve_app.http.errors import OpenAIError
from serve_app.http.messages import Delta, StreamError, StreamItem
from serve_app.metrics import IngressMetrics
from serve_app.http.responses import ChatBuilder, CompletionBuilder
from serve_app.http.streaming import SSE_DONE, Generation, sse, sse_error
from tests.fake_metrics import Recorder


async def _items(*items):
    for i, item in enumerate(items):
        await asyncio.sleep(0)
        yield 0, item


def _gen(items, builder=None):
    builder = builder or CompletionBuilder("c", "m", n=1, num_prompts=1, logprobs=None)
    return Generation(_items(*items), builder, IngressMetrics("t", "m", factory=Recorder()).request(), retry_after_s=2)


def _collect(agen):
    async def run():
        return [e async for e in agen]
    return asyncio.run(run())


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"
    assert json.loads(sse_error(OpenAIError(400, "bad", param="x"))[6:])["error"]["param"] == "x"


def test_error_in_first_item_is_a_status():
    gen = _gen([StreamItem(finished=True, error=StreamError("invalid_request", "max_tokens=9 is too large"))])
    with pytest.raises(OpenAIError) as info:
        asyncio.run(gen.first())
    assert info.value.status_code == 400 and info.value.param == "max_tokens"
    gen = _gen([StreamItem(finished=True, error=StreamError("unavailable", "engine gone"))])
    with pytest.raises(OpenAIError) as info:
        asyncio.run(gen.first())
    assert info.value.status_code == 503 and info.value.headers["Retry-After"] == "2"


def test_mid_stream_error_is_an_event_then_done():
    gen = _gen([StreamItem(deltas=[Delta(0, "a", [1])]),
                StreamItem(finished=True, error=StreamError("unavailable", "shutting down"))])

    async def run():
        await gen.first()
        return [e async for e in gen.sse()]
    events = asyncio.run(run())
    assert json.loads(events[0][6:])["choices"][0]["text"] == "a"
    assert json.loads(events[1][6:])["error"]["message"] == "shutting down"
    assert events[-1] == SSE_DONE and len(events) == 3


def test_stream_with_usage_ends_with_usage_then_done():
    builder = ChatBuilder("x", "m", n=1, num_prompts=1, logprobs=None, include_usage=True)
    gen = _gen([StreamItem(deltas=[Delta(0, "a", [1], finish_reason="length")], num_prompt_tokens=3,
                           finished=True)], builder)

    async def run():
        await gen.first()
        return [e async for e in gen.sse()]
    events = asyncio.run(run())
    assert events[-1] == SSE_DONE
    assert json.loads(events[-2][6:])["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_body_collects_everything():
    gen = _gen([StreamItem(deltas=[Delta(0, "a", [1])]),
                StreamItem(deltas=[Delta(0, "b", [2], finish_reason="stop")], finished=True)])

    async def run():
        await gen.first()
        return await gen.body()
    assert asyncio.run(run())["choices"][0]["text"] == "ab"


def test_guardrail_violation_is_a_422_and_its_outcomes_are_counted():
    rec = Recorder()
    metrics = IngressMetrics("t", "m", factory=rec)
    err = StreamError("guardrail_violation", "The output violated ...", param="response_format", code="max_depth")
    outcomes = [("retried", "max_depth"), ("rejected", "max_depth")]
    item = StreamItem(finished=True, error=err, guardrail_outcomes=outcomes)
    gen = Generation(_items(item), CompletionBuilder("c", "m", n=1, num_prompts=1, logprobs=None), metrics.request(),
                     retry_after_s=2)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(gen.first())
    assert info.value.status_code == 422
    assert info.value.body()["error"] == {"message": "The output violated ...", "type": "guardrail_violation",
                                          "param": "response_format", "code": "max_depth"}
    assert rec.value("t_guardrail_outcomes", model_name="m", outcome="retried", reason="max_depth") == 1
    assert rec.value("t_guardrail_outcomes", model_name="m", outcome="rejected", reason="max_depth") == 1


def test_invalid_request_keeps_the_param_the_stream_error_names():
    gen = _gen([StreamItem(finished=True, error=StreamError("invalid_request", "'contains' (at #) is not supported",
                                                            param="response_format"))])
    with pytest.raises(OpenAIError) as info:
        asyncio.run(gen.first())
    assert info.value.status_code == 400 and info.value.param == "response_format"


@pytest.mark.parametrize("engine_param,source,named", [
    ("response_format", "guided_regex", "guided_regex"),  # the engine's structured_outputs, as stream_error names it
    ("structured_outputs.regex", "guided_regex", "guided_regex"),
    ("response_format", "tools.0.function.parameters", "tools.0.function.parameters"),  # a named tool's schema
    ("structured_outputs.regex", "structured_outputs", "structured_outputs.regex"),  # sent as such: kept
    ("max_tokens", "guided_regex", "max_tokens"),  # about another field: kept
])
def test_an_engine_error_about_the_constraint_names_the_field_it_came_in(engine_param, source, named):
    item = StreamItem(finished=True, error=StreamError("invalid_request", "cannot compile", param=engine_param))
    gen = Generation(_items(item), CompletionBuilder("c", "m", n=1, num_prompts=1, logprobs=None),
                     IngressMetrics("t", "m", factory=Recorder()).request(), retry_after_s=2, param_source=source)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(gen.first())
    assert info.value.status_code == 400 and info.value.param == named
