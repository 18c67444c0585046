"""EngineDeployment: one AsyncLLM per replica, streaming compact deltas back to the caller.

    Ingress/Guardrails --EngineRequest--> generate() --StreamItem, StreamItem, ...--> caller

Chunking: every item costs a Ray message here and a hop of work in each process after it,
whatever it carries. So an item carries every token made since the last one: the engine's
output collector merges the steps a busy reader missed, and each stream waits between items
for `stream_interval_ms`, stretched under load so that the replica's streams together send
about `max_stream_messages_per_s` items a second (StreamingConfig.interval_s; both live via
user_config). The last item is never held, nor any before the first with text (so a first
token that is half a character does not delay the first visible text).

Cancellation: when the caller goes away, Serve cancels the task iterating `generate()`,
which closes the engine's iterator, which aborts the request and frees its KV blocks at
the next step boundary.

Stopping: when Serve stops the replica, requests in flight may finish within the deployment's
graceful_shutdown_timeout_s; what is still running then is aborted, so each caller gets a final
error item (SHUTDOWN_MESSAGE) before the replica goes (serve_app/replica/draining.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator

from ray import serve

from engine.entrypoints.async_llm import AsyncLLM
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind
from serve_app.args import AppArgs, StreamingConfig
from serve_app.http.errors import stream_error
from serve_app.http.messages import Delta, EngineRequest, ErrorKind, StreamError, StreamItem
from serve_app.metrics import EngineMetrics, record_engine_metrics
from serve_app.replica.adapters import ReplicaAdapters
from serve_app.replica.draining import DrainPolicy, abort_when_stopping, flush_serve_logs, serve_stop_probe
from serve_app.replica.placement import expose_bundle_gpus, use_cpu_threads

logger = logging.getLogger(f"ray.serve.{__name__}")  # under Serve's logger: in the replica logs

SHUTDOWN_MESSAGE = "The request was aborted: the engine replica is shutting down. Please retry."


@serve.deployment(name="EngineDeployment")
class EngineDeployment:
    def __init__(self, args: AppArgs, device: str):
        self._cpu_threads = None
        if device == "cuda":
            expose_bundle_gpus(args.tensor_parallel_size)
        else:
            self._cpu_threads = use_cpu_threads(args.engine_cpu_threads, args.tensor_parallel_size)
        self.llm = AsyncLLM(args.engine_config(device), engine_process=args.engine_process)
        self._device = device
        self._num_streaming = 0  # requests past their first item: what the stream interval paces
        self._shutting_down = False
        self._request_ids: set[str] = set()  # in flight: what a stopping replica aborts
        self._refusing = False  # the stopping replica's grace is over: new requests get SHUTDOWN_MESSAGE
        self._graceful_shutdown_timeout_s = args.graceful_shutdown_timeout_s
        self._replica = _replica_tag()
        self.streaming = args.streaming()  # reconfigure() replaces it when user_config is set
        cfg = self.llm.engine_config
        self.metrics = EngineMetrics(args.metrics_prefix, args.model_name, cfg.max_model_len)
        self.adapters = ReplicaAdapters(self.llm, args.max_cpu_loras or args.max_loras, self.metrics.count_lora_load)
        self._metrics_task: asyncio.Task | None = None  # started on the replica's loop by the first call
        self._drain_watched = False  # abort_when_stopping started (by the first call, on the replica's loop)
        self._drain_task: asyncio.Task | None = None  # held here: the loop keeps tasks by weak reference only
        logger.info("engine replica %s ready: max_model_len=%d", self._replica, cfg.max_model_len)

    # -- requests -------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamItem]:
        self._start_background()
        if self._refusing:
            yield StreamItem(finished=True, error=StreamError(ErrorKind.UNAVAILABLE, SHUTDOWN_MESSAGE))
            return
        if request.lora_request is not None:
            try:
                await self.adapters.ensure_loaded(request.lora_request)
            except Exception as e:  # noqa: BLE001 - the adapter cannot run here: the request's error
                yield StreamItem(finished=True, error=self.failure(e))
                return
        params = request.sampling_params
        params.output_kind = RequestOutputKind.DELTA
        prompt = {"prompt_token_ids": request.prompt_token_ids, "prompt": request.prompt}
        logger.debug("generate %s batch %s", request.request_id, request.batch_id)
        outputs = self.llm.generate(prompt, params, request.request_id, stream_interval_s=self._interval_s,
                                    lora_request=request.lora_request, priority=request.priority)
        # aclosing: however this generator ends (cancelled, closed at a yield), the chain
        # below is closed now, not at garbage collection, and the engine aborts the request.
        streaming = False  # counted in _num_streaming from its first item (queued requests send nothing)
        self._request_ids.add(request.request_id)
        try:
            async with contextlib.aclosing(_to_items(outputs, self)) as items:
                async for item in items:
                    if not streaming:
                        streaming = True
                        self._num_streaming += 1
                        if self._refusing:  # reached the engine just after abort_all() went by
                            await self.llm.abort(request.request_id)
                    yield item
        finally:
            self._request_ids.discard(request.request_id)
            if streaming:
                self._num_streaming -= 1

    def _interval_s(self) -> float:
        return self.streaming.interval_s(self._num_streaming, self._device)

    def failure(self, e: BaseException) -> StreamError:
        """Map an engine exception to what the client is told (by type: serve_app/http/errors.py)."""
        if self._shutting_down:  # whatever failed, the replica is going away: retry elsewhere
            return StreamError(ErrorKind.UNAVAILABLE, f"The engine is unavailable: {e}")
        error = stream_error(e)
        if error.kind is ErrorKind.INTERNAL:
            logger.exception("request failed in the engine")
        return error

    # -- control ----------------------------------------------------------------------
    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve calls this with the deployment's user_config, at start and on every change."""
        self.streaming = StreamingConfig.model_validate(user_config)
        logger.info("engine replica %s streaming: %s", self._replica, self.streaming)

    async def model_info(self) -> dict[str, Any]:
        cfg, mcfg = self.llm.engine_config, self.llm.model_config
        return {"max_model_len": cfg.max_model_len, "vocab_size": mcfg.vocab_size,
                "eos_token_ids": list(mcfg.eos_token_ids)}

    async def check_lora(self, lora: LoRARequest) -> str | None:
        """Why this engine cannot run the adapter, or None (the Ingress asks before a runtime load)."""
        return await self.adapters.check(lora)

    async def get_stats(self) -> dict[str, Any]:
        return {"replica": self._replica, "time": time.time(), "cpu_threads": self._cpu_threads,
                "streaming": self.streaming.model_dump(), **self.llm.get_stats()}

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes it replace the replica.
        It raises once the step loop died or a TP worker exited (AsyncLLM sets that within a
        moment, from the executor's watcher thread)."""
        self._start_background()  # so an idle replica exports its gauges (and notices a stop) too
        await self.llm.check_health()

    def _start_background(self) -> None:
        loop = asyncio.get_running_loop()
        if self._metrics_task is None or self._metrics_task.done():
            self._metrics_task = loop.create_task(record_engine_metrics(self.metrics, self.llm))
        if not self._drain_watched:
            self._drain_watched = True
            is_stopping = serve_stop_probe()
            if is_stopping is not None:  # in a Serve replica (not a test's bare object)
                policy = DrainPolicy.of_replica(self._graceful_shutdown_timeout_s)
                self._drain_task = loop.create_task(abort_when_stopping(
                    is_stopping, policy, lambda: len(self._request_ids), self.abort_all))

    async def abort_all(self) -> None:
        """Abort every request in flight (each ends with SHUTDOWN_MESSAGE) and refuse new ones, the
        engine left running: what a stopping replica does when its grace is over."""
        self._refusing = True
        for request_id in list(self._request_ids):
            await self.llm.abort(request_id)

    def __del__(self):
        # Serve calls this once the replica has drained (abort_when_stopping aborted what would not
        # end in time); anything still in flight gets finish_reason "abort", reported as SHUTDOWN_MESSAGE.
        self.shutdown()
        flush_serve_logs()

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None and not self._shutting_down:
            self._shutting_down = True
            logger.info("engine replica %s shutting down", self._replica)
            llm.shutdown()


# The replica's class itself, undecorated: what a colocated Ingress holds in its own process
# instead of a handle to an EngineDeployment (LocalEngineFactory in serve_app/replica/client.py).
EngineReplica = EngineDeployment.func_or_class


def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_tag
    except Exception:  # noqa: BLE001 - constructed outside Serve (tests)
        return "local"


async def _to_items(outputs: AsyncIterator[RequestOutput], owner: EngineDeployment) -> AsyncIterator[StreamItem]:
    """RequestOutputs (DELTA) as StreamItems; errors and engine-side aborts end the stream with an error item."""
    try:
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                item = to_stream_item(out)
                if out.finished and any(c.finish_reason == "abort" for c in out.outputs):
                    item.error = StreamError(ErrorKind.UNAVAILABLE, SHUTDOWN_MESSAGE)
                yield item
    except Exception as e:  # noqa: BLE001 - every failure ends the stream with an error item
        yield StreamItem(finished=True, error=owner.failure(e))


def to_stream_item(out: RequestOutput) -> StreamItem:
    deltas = [Delta(index=c.index, text=c.text, token_ids=list(c.token_ids),
                    logprobs=_logprobs(c.logprobs), finish_reason=c.finish_reason, stop_reason=c.stop_reason)
              for c in out.outputs]
    prompt_logprobs = _logprobs(out.prompt_logprobs[1:]) if out.prompt_logprobs is not None else None
    return StreamItem(deltas=deltas, num_prompt_tokens=len(out.prompt_token_ids),
                      num_cached_tokens=out.num_cached_tokens, finished=out.finished, prompt_logprobs=prompt_logprobs)


def _logprobs(entries) -> list | None:
    if entries is None:
        return None
    return [[(tid, lp.logprob, lp.rank, lp.decoded_token or "") for tid, lp in d.items()] for d in entries]
