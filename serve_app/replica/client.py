"""Where the Ingress and Guardrails get an engine request's token stream from.

    RemoteEngine        a deployment behind a handle (the engine replicas, or Guardrails in front
                        of them): one streaming handle call per engine request (`stream_from`)
    LocalEngine         an engine replica's object in this very process (`colocate_ingress`): its
                        `generate()` iterated directly, no call, no hop
    LocalEngineFactory  what build_app hands a colocated Ingress in place of handles: called once
                        in the Ingress's replica, it starts the engine there (LocalEngine) and puts
                        the JSON guard in front of it (GuardedEngine)

Both clients have one interface, so the Ingress never asks where its engine is: besides the
streams, `check_lora` says why the engine cannot run an adapter (a runtime load's check),
`reconfigure` takes the engine's knobs out of the caller's user_config,
`check_replica_health` is what the engine adds to the caller replica's health, and `get_stats`
and `shutdown` reach an engine in this process.

A handle call is cancelled in `finally`, so whoever stops reading (a disconnected client,
a cancelled task, an error in a sibling stream) stops the engine request too; Serve's own
propagation of cancellation to child requests is the first line, this is the second. A local
stream is the replica's own generator, which aborts the engine request when it is closed.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from engine.lora.request import LoRARequest
from serve_app.args import AppArgs, StreamingConfig
from serve_app.http.messages import EngineRequest, StreamError, StreamItem

if TYPE_CHECKING:  # guardrails imports this module
    from serve_app.guard.guardrails import GuardedEngine

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs


class RemoteEngine:
    """Token streams, model info and health of a deployment, through its handle. `adapter_routing`:
    the deployment is the engine's, whose replicas report the LoRA adapters they hold (Serve's model
    multiplexing); not Guardrails, which holds none."""

    def __init__(self, handle: DeploymentHandle, adapter_routing: bool = True):
        self.handle = handle
        self.adapter_routing = adapter_routing

    def stream(self, request: EngineRequest) -> AsyncIterator[StreamItem]:
        return stream_from(self.handle, request, self.adapter_routing)

    async def model_info(self) -> dict[str, Any]:
        return await self.handle.model_info.remote()

    async def check_health(self) -> None:
        await self.handle.check_health.remote()

    async def check_lora(self, lora: LoRARequest) -> str | None:
        return await self.handle.check_lora.remote(lora)

    def reconfigure(self, user_config: dict[str, Any]) -> dict[str, Any]:
        """None of the caller's user_config is the engine's (its replicas have a user_config of
        their own): all of it comes back."""
        return user_config

    async def check_replica_health(self) -> None:
        """Nothing: Serve checks the engine replicas' health itself."""

    async def get_stats(self) -> dict[str, Any]:
        raise ValueError("the engine is not in this replica (colocate_ingress is off): call the EngineDeployment")

    def shutdown(self) -> None:
        """Nothing: the engine replicas are not the caller's to stop."""


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

    async def check_lora(self, lora: LoRARequest) -> str | None:
        return await self.replica.check_lora(lora)

    def reconfigure(self, user_config: dict[str, Any]) -> dict[str, Any]:
        """Apply the engine replica's knobs (StreamingConfig's keys) of the caller's user_config,
        a bad value raising ValueError naming it; the other keys, the caller's own, come back."""
        self.replica.reconfigure({k: v for k, v in user_config.items() if k in StreamingConfig.model_fields})
        return {k: v for k, v in user_config.items() if k not in StreamingConfig.model_fields}

    async def check_replica_health(self) -> None:
        """The engine runs in the caller's replica: its health is the replica's."""
        await self.replica.check_health()

    async def get_stats(self) -> dict[str, Any]:
        return await self.replica.get_stats()

    def shutdown(self) -> None:
        self.replica.shutdown()


@dataclasses.dataclass(frozen=True)
class LocalEngineFactory:
    """The engine of a colocated Ingress (`colocate_ingress`), as build_app decides it: plain values,
    pickled into the Ingress's replica and called there once, so the engine starts in that process."""

    args: AppArgs
    device: str  # resolved by build_app ("cpu" or "cuda")

    def __call__(self) -> tuple[LocalEngine, GuardedEngine]:
        """The engine (a LocalEngine), and the same behind a JSON guard (a GuardedEngine)."""
        # Imported here: a separate Ingress imports this module and must never load the engine (torch).
        from serve_app.guard.guardrails import GuardedEngine, JsonGuard
        from serve_app.guard.policy import GuardrailPolicy
        from serve_app.replica.engine_deployment import EngineReplica

        engine = LocalEngine(EngineReplica(self.args, self.device))
        return engine, GuardedEngine(JsonGuard(GuardrailPolicy.from_args(self.args.guardrails)), engine)


async def stream_from(handle: DeploymentHandle, request: EngineRequest,
                      adapter_routing: bool = True) -> AsyncIterator[StreamItem]:
    """The StreamItems of one engine request; Ray-level failures become a final error item."""
    if request.batch_id is not None:  # BatchAffinityRouter: the whole micro-batch to one replica
        handle = handle.options(session_id=request.batch_id)
    if adapter_routing and request.lora_request is not None:  # Serve's multiplexing: a replica holding it
        handle = handle.options(multiplexed_model_id=request.multiplexed_model_id)
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
