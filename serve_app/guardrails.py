"""Guardrails: the deployment in the path of JSON (`response_format`) requests.

    Ingress --EngineRequest--> Guardrails.generate --> guard.run(request, engine) --> EngineDeployment

For now the policy passes the engine's stream through unchanged (the engine's
grammar-constrained decoding already makes the output valid JSON). The seam for the
real checks (validate the finished text against the request's schema and the
server's policy, retry, or fail with a clear error) is the guard's `run`: it gets
the request and the engine handle, calls the engine, and streams items back.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.client import stream_from
from serve_app.messages import EngineRequest, StreamItem

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs


class PassThroughGuard:
    """Pass-through: every item of the engine's stream, as is. A real guard has the same `run`."""

    async def run(self, request: EngineRequest, engine: DeploymentHandle) -> AsyncIterator[StreamItem]:
        async with contextlib.aclosing(stream_from(engine, request)) as items:
            async for item in items:
                yield item


@serve.deployment(name="Guardrails")
class Guardrails:
    def __init__(self, engine: DeploymentHandle, policy: dict[str, Any] | None = None):
        self.engine = engine
        self.policy = dict(policy or {})  # the `guardrails` app arg, for the real guard
        self.guard = PassThroughGuard()

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamItem]:
        # Same interface as EngineDeployment.generate, so the Ingress treats both alike.
        # Cancellation: Serve cancels this generator, `stream_from` cancels the engine call.
        logger.debug("guardrails %s", request.request_id)
        async with contextlib.aclosing(self.guard.run(request, self.engine)) as items:
            async for item in items:
                yield item
