"""From a request's engine streams to an HTTP answer: one JSON body, or Server-Sent Events.

    data: {chunk}\\n\\n ... data: {usage chunk}\\n\\n (stream_options.include_usage) ... data: [DONE]\\n\\n

The status code is decided by the first stream item: an error there is a plain 4xx/5xx
JSON answer. After the first chunk has gone out the status is 200 for good, so a later
failure is sent as an `data: {"error": ...}` event, followed by `data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

from serve_app.http.errors import OpenAIError, from_stream_error, internal_error, name_source
from serve_app.http.messages import StreamItem
from serve_app.metrics import RequestRecorder
from serve_app.http.responses import ResponseBuilder

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def sse_error(err: OpenAIError) -> str:
    return sse(err.body())


class Generation:
    """One HTTP request in flight: its merged engine streams, its response builder and its metrics."""

    def __init__(self, items: AsyncIterator[tuple[int, StreamItem]], builder: ResponseBuilder,
                 metrics: RequestRecorder, retry_after_s: int, param_source: str | None = None):
        self.items = items
        self.builder = builder
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.param_source = param_source  # the field the structured-output form came in (errors name it)
        self.start = time.monotonic()
        self._first: tuple[int, StreamItem] | None = None
        self._first_token_seen = False

    async def first(self) -> None:
        """Wait for the first item; raise its error as an OpenAIError (the status code is still free)."""
        try:
            self._first = await self.items.__anext__()
        except StopAsyncIteration:
            raise internal_error("The engine returned no output.") from None
        if self._first[1].error is not None:
            self._observe(self._first[1])  # its guardrail outcomes count too
        self._raise_if_error(self._first[1])

    def _raise_if_error(self, item: StreamItem) -> None:
        if item.error is not None:
            raise self._error(item)

    def _error(self, item: StreamItem) -> OpenAIError:
        return name_source(from_stream_error(item.error, self.retry_after_s), self.param_source)

    def _observe(self, item: StreamItem) -> int:
        """Record what an item says for the metrics; returns its number of new tokens."""
        num_tokens = sum(len(d.token_ids) for d in item.deltas)
        self.metrics.chunk("engine", num_tokens)
        if item.guardrail_outcomes:
            self.metrics.guardrail_outcomes(item.guardrail_outcomes)
        if not self._first_token_seen and any(d.token_ids for d in item.deltas):
            self._first_token_seen = True
            self.metrics.ttft(time.monotonic() - self.start)
        return num_tokens

    async def _all(self) -> AsyncIterator[tuple[int, StreamItem]]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for pair in self.items:
            yield pair

    async def body(self) -> dict:
        """Non-streaming: every item, then the whole response."""
        try:
            async for i, item in self._all():
                self._observe(item)
                self._raise_if_error(item)
                self.builder.add(i, item)
        except asyncio.CancelledError:
            self.metrics.finished(499, time.monotonic() - self.start)  # the client went away
            raise
        body = self.builder.final()
        self.metrics.finished(200, time.monotonic() - self.start)
        return body

    async def sse(self) -> AsyncIterator[str]:
        """Streaming: chunks as they come; a mid-stream failure becomes an error event; always [DONE]."""
        status = 200
        try:
            async for i, item in self._all():
                num_tokens = self._observe(item)
                chunks = self.builder.add(i, item, stream=True)
                if chunks:  # one write per item, however many chunks (choices, role) it makes
                    self.metrics.chunk("client", num_tokens)
                    yield "".join(sse(chunk) for chunk in chunks)
                if item.error is not None:
                    err = self._error(item)
                    status = err.status_code
                    yield sse_error(err)
                    break
            else:
                if self.builder.include_usage:
                    yield sse(self.builder.usage_chunk())
        except (asyncio.CancelledError, GeneratorExit):
            status = 499  # the client went away (nginx's code for it); the engine request is cancelled
            raise
        except Exception as e:  # noqa: BLE001 - the status line is gone; tell the client in-band
            logger.exception("stream failed")
            status = 500
            yield sse_error(internal_error(f"The stream failed: {type(e).__name__}"))
        finally:
            # Also on cancellation (client gone): `items` is closed by the caller's aclose.
            self.metrics.finished(status, time.monotonic() - self.start)
        yield SSE_DONE
