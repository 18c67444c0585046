"""Guardrails: the deployment in the path of requests whose output has a contract: JSON (`response_format`,
`structured_outputs.json`, `guided_json`) or tool calls (`tools` with a tool_choice other than "none").

    Ingress --EngineRequest--> Guardrails.generate --> JsonGuard.run --attempt 0, 1, ...--> EngineDeployment
            <--StreamItems (validated; the last one may be a 422 error)--

With `colocate_ingress` the engine runs in the Ingress's process, which no deployment can hold
a handle to; there the Ingress runs JsonGuard itself, in front of its own engine (GuardedEngine).

The engine's grammar-constrained decoding makes valid JSON the normal case; the guard makes
it a guarantee: every finished completion is parsed and validated against the request's whole
schema, or each of its tool calls against its tool's (serve_app.guard.contract), and the server's
policy (serve_app.guard.policy); failing completions are generated again, and what still fails
ends the request with a 422 `guardrail_violation`. The decisions
(retry what, pass on what, when) live in serve_app.guard.session, without Ray; here is only
the engine I/O. Contract, knobs and metrics: docs/guardrails.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.replica.client import LocalEngine, RemoteEngine
from serve_app.guard.contract import make_contract
from serve_app.guard.policy import GuardrailPolicy
from serve_app.guard.session import GuardedRequest
from serve_app.http.messages import EngineRequest, StreamItem

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs

# Longer documents are parsed and validated on a worker thread, so that the checks of a large
# document (up to max_output_bytes) do not stall the other streams of this replica.
_INLINE_CHECK_CHARS = 65_536


class JsonGuard:
    """Runs a request's attempts against the engine under one policy."""

    def __init__(self, policy: GuardrailPolicy):
        self.policy = policy

    async def run(self, request: EngineRequest, engine: RemoteEngine | LocalEngine) -> AsyncIterator[StreamItem]:
        if make_contract(request.output, request.sampling_params.structured_outputs) is None:  # nothing to check
            async with contextlib.aclosing(engine.stream(request)) as items:
                async for item in items:
                    yield item
            return
        guarded = GuardedRequest(request, self.policy)
        while (attempt := guarded.next_attempt()) is not None:
            # aclosing: leaving early (a rejection, or the caller gone) cancels the engine request.
            async with contextlib.aclosing(engine.stream(attempt)) as items:
                async for item in items:
                    if guarded.finishes_large(item, _INLINE_CHECK_CHARS):  # parse + validate off the loop
                        out = await asyncio.to_thread(guarded.feed, item)
                    else:
                        out = guarded.feed(item)
                    if out is not None:
                        yield out
                    if guarded.done:
                        return


class GuardedEngine:
    """JSON requests through a JsonGuard in this process, in front of `engine` (colocate_ingress)."""

    def __init__(self, guard: JsonGuard, engine: LocalEngine):
        self.guard = guard
        self.engine = engine

    def stream(self, request: EngineRequest) -> AsyncIterator[StreamItem]:
        return self.guard.run(request, self.engine)


@serve.deployment(name="Guardrails")
class Guardrails:
    def __init__(self, engine: DeploymentHandle, policy: dict[str, Any] | None = None):
        self.engine = RemoteEngine(engine)
        self.guard = JsonGuard(GuardrailPolicy.from_args(policy))  # the `guardrails` app arg

    @property
    def policy(self) -> GuardrailPolicy:
        return self.guard.policy

    def reconfigure(self, config: dict[str, Any] | None) -> None:
        """user_config (deployments[Guardrails].user_config): a new policy, live, for the requests
        that start after it; it replaces the `guardrails` app arg as a whole."""
        try:
            policy = GuardrailPolicy.from_args(config)
        except ValueError as e:
            raise ValueError(f"invalid Guardrails user_config: {e}") from None
        self.guard = JsonGuard(policy)
        logger.info("guardrail policy: max_output_bytes=%d max_depth=%d max_retries=%d redact_patterns=%d",
                    policy.max_output_bytes, policy.max_depth, policy.max_retries, len(policy.redact_patterns))

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamItem]:
        # Same interface as EngineDeployment.generate, so the Ingress treats both alike.
        # Cancellation: Serve cancels this generator, `stream_from` cancels the engine call.
        logger.debug("guardrails %s", request.request_id)
        async with contextlib.aclosing(self.guard.run(request, self.engine)) as items:
            async for item in items:
                yield item
