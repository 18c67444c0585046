"""Where the Ingress and Guardrails get an engine request's token stream from.

    RemoteEngine   a deployment behind a handle (the engine replicas, or Guardrails in front of
                   them): one streaming handle call per engine request (`stream_from`)
    LocalEngine    an engine replica's object in this very process (`colocate_ingress`): its
                   `generate()` iterated directly, no call, no hop

A handle call is cancelled in `finally`, so whoever stops reading (a disconnected client,
a cancelled task, an error in a sibling stream) stops the engine request too; Serve's own
propagation of cancellation to child requests is the first line, this is the second. A local
stream is the replica's own generator, which aborts the engine request when it is closed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from serve_app.http.messages import EngineRequest, StreamError, StreamItem

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs


class RemoteEngine:
    """Token streams, model info and health of a deployment, through its handle."""

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle

    def stream(self, request: EngineRequest) -> AsyncIterator[StreamItem]:
        return stream_from(self.handle, request)

    async def model_info(self) -> dict[str, Any]:
        return await self.handle.model_info.remote()

    async def check_health(self) -> None:
        await self.handle.check_health.remote()


class LocalEngine:
    """The same, from an engine replica object held in this process (`colocate_ingress`). Its
    `generate()` maps engine failures to error items itself, and closing it aborts the request."""

    def __init__(self, replica):
        self.replica = replica

    def stream(self, request: EngineRequest) -> AsyncIterator[StreamItem]:
        return self.replica.generate(request)

    async def model_info(self) -> dict[str, Any]:
        return await self.replica.model_info()

    async def check_health(self) -> None:
        await self.replica.check_health()


async def stream_from(handle: DeploymentHandle, request: EngineRequest) -> AsyncIterator[StreamItem]:
    """The StreamItems of one engine request; Ray-level failures become a final error item."""
    if request.batch_id is not None:  # BatchAffinityRouter: the whole micro-batch to one replica
        handle = handle.options(session_id=request.batch_id)
    stream = handle.generate.options(stream=True).remote(request)
    finished = False
    try:
        async for item in stream:
            finished = item.finished
            yield item
            if finished:
                return
        if not finished:
            yield StreamItem(finished=True, error=StreamError("unavailable", "The engine stream ended early."))
    except BackPressureError:
        yield StreamItem(finished=True, error=StreamError("overloaded", "The engine is at capacity; retry later."))
    except (DeploymentUnavailableError, RayActorError) as e:  # the replica died or cannot be reached
        logger.warning("engine unavailable: %s", type(e).__name__)
        yield StreamItem(finished=True, error=StreamError("unavailable", "The engine replica is unavailable."))
    except RequestCancelledError:
        if not finished:
            raise asyncio.CancelledError() from None
    finally:
        if not finished:
            stream.cancel()


async def merge_streams(streams: list[AsyncIterator[StreamItem]]) -> AsyncIterator[tuple[int, StreamItem]]:
    """Interleave several streams as (stream index, item), in arrival order; one failing ends all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, s: AsyncIterator[StreamItem]) -> None:
        try:
            async for item in s:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await queue.put((i, e))
            raise
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
