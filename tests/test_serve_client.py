"""Calling engine streams (no Ray): merge order, sibling cancellation, cancel-on-close, backpressure."""
import asyncio

import pytest
from ray.serve.exceptions import BackPressureError

from engine.sampling_params import SamplingParams
from serve_app.replica.client import merge_streams, stream_from
from serve_app.http.messages import EngineRequest, StreamItem


def test_interleaves_in_arrival_order():
    """Items come out in the order they were produced, whichever stream made them. The order is
    forced by events (each item is produced only after the merged output took the one before), so
    a loaded box cannot reorder it as sleep delays could."""
    plan = ["a", "b", "b", "a"]
    turn = [asyncio.Event() for _ in plan]

    async def s(name):
        for i, who in enumerate(plan):
            if who == name:
                await turn[i].wait()
                yield name

    async def run():
        out = []
        turn[0].set()
        async for pair in merge_streams([s("a"), s("b")]):
            out.append(pair)
            if len(out) < len(plan):
                turn[len(out)].set()
        return out
    # A merge that drained one stream before the other would wait forever for its turn.
    out = asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert out == [(0, "a"), (1, "b"), (1, "b"), (0, "a")]


def test_failure_cancels_siblings():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(10)
            yield "never"
        finally:
            cancelled.append(True)

    async def bad():
        await asyncio.sleep(0.01)
        raise RuntimeError("boom")
        yield  # noqa: unreachable - makes this an async generator

    async def run():
        return [pair async for pair in merge_streams([slow(), bad()])]
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run())
    assert cancelled == [True]


# -- stream_from, against a fake DeploymentHandle ---------------------------------------------

class FakeStream:
    def __init__(self, items, error=None):
        self.items, self.error, self.cancelled = list(items), error, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.items:
            return self.items.pop(0)
        if self.error:
            raise self.error
        await asyncio.sleep(10)  # an endless generation
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    """handle.options(...).generate.options(stream=True).remote(request) -> FakeStream"""

    def __init__(self, stream):
        self.stream, self.session_ids = stream, []
        self.generate = self

    def options(self, session_id=None, stream=None):
        if session_id is not None:
            self.session_ids.append(session_id)
        return self

    def remote(self, request):
        return self.stream


REQUEST = EngineRequest("r", [1], SamplingParams(), batch_id="b1")


def _drain(handle, limit=None):
    async def run():
        out = []
        agen = stream_from(handle, REQUEST)
        async for item in agen:
            out.append(item)
            if limit and len(out) >= limit:
                await agen.aclose()  # the reader goes away mid-stream
                break
        return out
    return asyncio.run(run())


def test_stream_from_passes_items_and_the_batch_affinity_key():
    handle = FakeHandle(FakeStream([StreamItem(), StreamItem(finished=True)]))
    assert [i.finished for i in _drain(handle)] == [False, True]
    assert handle.session_ids == ["b1"] and not handle.stream.cancelled


def test_stream_from_cancels_the_call_when_the_reader_leaves():
    handle = FakeHandle(FakeStream([StreamItem(), StreamItem()]))
    _drain(handle, limit=1)
    assert handle.stream.cancelled  # -> Serve cancels the engine's generator -> the engine aborts


def test_backpressure_becomes_an_overloaded_item():
    (item,) = _drain(FakeHandle(FakeStream([], error=BackPressureError(num_queued_requests=3,
                                                                        max_queued_requests=2))))
    assert item.finished and item.error.kind == "overloaded"
